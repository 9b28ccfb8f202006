"""The norm-only non-linearities of Dynamic Alignment Units, written on squared norms.

Both scale a vector ``u`` by a factor depending on ``q = ‖u‖²`` only. The norm is taken as
``sqrt(q + EPS)`` so that nothing is NaN or infinite at ``u = 0``, forward or backward.
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = [
    "EPS",
    "NONLINEARITIES",
    "Nonlinearity",
    "check_nonlinearity",
    "scale_from_squared_norm",
]

Nonlinearity = Literal["l2", "squash"]
NONLINEARITIES: tuple[str, ...] = ("l2", "squash")
EPS = 1e-12


def scale_from_squared_norm(q: torch.Tensor, nonlinearity: Nonlinearity) -> torch.Tensor:
    """The factor ``α`` with ``g(u) = α·u``, from ``q = ‖u‖²``.

    ``l2``: ``α = 1/‖u‖`` (unit vectors); ``squash``: ``α = ‖u‖/(1 + ‖u‖²)``, i.e.
    ``g(u) = L2(u)·‖u‖²/(1 + ‖u‖²)``.
    """
    if nonlinearity == "l2":
        return torch.rsqrt(q + EPS)
    if nonlinearity == "squash":
        return torch.sqrt(q + EPS) / (1 + q)
    raise ValueError(f"nonlinearity must be one of {NONLINEARITIES}; got {nonlinearity!r}")


def check_nonlinearity(nonlinearity: str) -> Nonlinearity:
    """Validate a non-linearity name.

    Raises:
        ValueError: If it is not ``"l2"`` or ``"squash"``.
    """
    if nonlinearity not in NONLINEARITIES:
        raise ValueError(
            f"nonlinearity must be one of {', '.join(NONLINEARITIES)}; got {nonlinearity!r}"
        )
    return nonlinearity  # type: ignore[return-value]
