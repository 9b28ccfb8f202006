"""The result of an attribution: maps plus the metadata needed to judge them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Attribution:
    """Attribution maps for a batch, with the context they were computed in.

    Every tensor is detached from autograd's graph (``explain()`` detaches what a method returns).

    Attributes:
        attribution: Relevance of every input element, same shape as the inputs.
        method: Registered name of the method that produced it.
        target: Explained output index per sample, int64 of shape ``(batch,)``.
        output: Model output for the inputs, detached, shape ``(batch, classes)``.
        delta: Completeness (or convergence) delta per sample, shape ``(batch,)``: what the
            explained output minus the reference output leaves unexplained after summing the
            attribution. ``None`` where the method defines no such quantity.
        extras: Method-specific tensors or values (e.g. a baseline used), never required.
    """

    attribution: torch.Tensor
    method: str
    target: torch.Tensor
    output: torch.Tensor
    delta: torch.Tensor | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def target_output(self) -> torch.Tensor:
        """The explained output value of each sample, shape ``(batch,)``."""
        return self.output.gather(1, self.target[:, None])[:, 0]

    def spatial_map(self) -> torch.Tensor:
        """Sum over the channel axis: one ``(batch, H, W)`` map per image input.

        Raises:
            ValueError: If the attribution is not image shaped ``(batch, C, H, W)``.
        """
        if self.attribution.dim() != 4:
            raise ValueError(
                "spatial_map() needs image attributions of shape (batch, C, H, W); "
                f"got shape {tuple(self.attribution.shape)}"
            )
        return self.attribution.sum(dim=1)

    def numpy(self) -> Any:
        """The attribution as a NumPy array (on the CPU)."""
        return self.attribution.detach().cpu().numpy()
