"""Canonizers: rewrites of how rules see a model's layers, for one attribution.

A canonizer never changes the model. It rewrites the engine's view of the traced layers (e.g.
"this BatchNorm is part of the convolution before it"), and the engine realises the rewrite in
the layer views it hands to rules (``call.layer``). So there is nothing to restore afterwards,
also when an attribution raises, and other threads using the same model are unaffected.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from torch import nn

from explain_core.affine import BATCHNORM_TYPES, LINEAR_TYPES

__all__ = ["Canonizer", "MergeBatchNorm", "TracedLayers"]


@dataclass
class TracedLayers:
    """The affine layers of one traced forward pass, as canonizers see and rewrite them.

    Attributes:
        order: Qualified names of the Linear/Conv/BatchNorm modules the pass ran, in order.
        modules: Name → module.
        reads: Layer name → the layer whose output it reads, where it reads that output
            unchanged and nothing else reads it (for a layer called more than once: at every
            call, an output of its own call of that layer).
        input_dims: Layer name → number of dimensions of the input it read (the same at every
            call).
        merged: Linear/Conv name → the BatchNorm folded into it (what canonizers write).
    """

    order: list[str]
    modules: dict[str, nn.Module]
    reads: dict[str, str] = field(default_factory=dict)
    input_dims: dict[str, int] = field(default_factory=dict)
    merged: dict[str, str] = field(default_factory=dict)


class Canonizer(ABC):
    """A rewrite of the traced layers that makes rules applicable (e.g. merging BatchNorm)."""

    @abstractmethod
    def apply(self, layers: TracedLayers) -> None:
        """Rewrite ``layers`` in place (the model itself is never changed)."""


class MergeBatchNorm(Canonizer):
    """Fold each BatchNorm into the Linear/Conv whose output it alone reads.

    In eval mode ``BN(Wx + b) = (s·W)x + s·(b − μ) + β`` with ``s = γ/√(σ² + ε)``: the pair is one
    affine layer, which its rule sees as ``call.layer`` under the Linear/Conv's name. Folded only
    where the BatchNorm's channels are the layer's output features (a Linear's features are the
    last dimension: the same only for ``(batch, features)`` inputs). A BatchNorm that cannot be
    folded (after a ReLU or an addition, as in pre-activation ResNets) stays a layer of its own.
    """

    def apply(self, layers: TracedLayers) -> None:  # noqa: D102
        for name in layers.order:
            source = layers.reads.get(name)
            if (
                source is None
                or not isinstance(layers.modules[name], BATCHNORM_TYPES)
                or source in layers.merged
            ):
                continue
            module = layers.modules[source]
            if isinstance(module, nn.Linear) and layers.input_dims.get(name) != 2:
                continue
            if isinstance(module, LINEAR_TYPES):
                layers.merged[source] = name
