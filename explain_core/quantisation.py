"""Coupling quantisation into ``K`` uniform levels, exactly as REM's public code bins couplings.

REM (Renzulli et al.) quantises the couplings of the last routing iteration into ``K`` levels ``k /
(K-1)``: values are clamped to ``[0, 1]`` and binned with ``np.digitize(c, np.linspace(-h, 1 + h, K
+ 1)) - 1``, ``h = 0.5 / (K - 1)`` (its code writes ``linspace(-0.05, 1.05, 12)`` for ``K = 11``).
The bin edges are float64 numbers as ``linspace`` computes them, so a value on a nominal half-way
point ``(k + 0.5) / (K - 1)`` goes to whichever side of the computed edge it lies on: ``0.25`` goes
to level 2 of 11 (the edge is ``0.25000000000000006``), ``0.5`` to level 2 of 6 (the edge is
``0.5000000000000001``); a value equal to a computed edge goes above it, as ``np.digitize`` puts it.
This module is the one implementation: parse-tree recorders, capsule saliency and its ONNX graph all
call it.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np
import torch
from torch import Tensor

from explain_core.errors import InvalidInputError

__all__ = [
    "check_levels",
    "level_index_dtype",
    "quantise_couplings",
    "quantise_to_levels",
]


def check_levels(levels: Any, *, optional: bool = False) -> None:
    """Refuse a number of levels ``K`` that is not an int ≥ 2 (nor ``None``, if ``optional``).

    Raises:
        InvalidInputError: Naming the value got.
    """
    if optional and levels is None:
        return
    if isinstance(levels, bool) or not isinstance(levels, int) or levels < 2:
        allowed = "None or an int ≥ 2" if optional else "an int ≥ 2"
        raise InvalidInputError(
            f"levels must be {allowed} (K must be ≥ 2 quantisation levels); got {levels!r}"
        )


@lru_cache(maxsize=64)
def _edges(levels: int) -> tuple[float, ...]:
    half = 0.5 / (levels - 1)
    # float64 edges computed by numpy's linspace, as REM's code builds them. Numbers are cached,
    # not a tensor: one made while torch.export traces would be a fake tensor, kept for later.
    return tuple(np.linspace(-half, 1 + half, levels + 1).tolist())


def quantise_to_levels(couplings: Tensor, levels: int, *, validate: bool = True) -> Tensor:
    """Level index ``0 … K-1`` of each coupling: REM's ``np.digitize`` binning.

    Values are clamped to ``[0, 1]`` first (the softmax keeps couplings there up to rounding;
    anything else, e.g. after pruning masks, saturates to the end levels), then compared in float64
    with REM's edges ``linspace(-h, 1 + h, K + 1)``, ``h = 0.5 / (K - 1)``: the index is the number
    of edges at or below the value, minus one — what ``np.digitize`` (``right=False``) returns,
    written with comparisons so that it also exports to ONNX.

    Args:
        couplings: Coupling coefficients of any shape and floating dtype.
        levels: Number of levels ``K ≥ 2``.
        validate: Refuse NaN couplings; ``False`` inside traced graphs (ONNX export), which
            cannot branch on values.

    Returns:
        Level indices with the shape of ``couplings``; ``uint8`` for ``K ≤ 256``, else ``int32``.

    Raises:
        InvalidInputError: If ``levels`` is not an int ≥ 2 or ``couplings`` contains NaN.
    """
    check_levels(levels)
    values = couplings.to(torch.float64)
    if validate and bool(torch.isnan(values).any()):
        raise InvalidInputError("couplings contain NaN; cannot quantise")
    edges = torch.tensor(_edges(levels), dtype=torch.float64, device=values.device)
    below = values.clamp(0.0, 1.0).unsqueeze(-1) >= edges
    return (below.sum(-1) - 1).to(level_index_dtype(levels))


def level_index_dtype(levels: int) -> torch.dtype:
    """The dtype of level indices: ``uint8`` for ``K ≤ 256``, else ``int32``.

    uint8 keeps keys 1 byte per lower capsule for every practical K (the paper uses K ≤ 20).
    """
    return torch.uint8 if levels <= 256 else torch.int32


def quantise_couplings(couplings: Tensor, levels: int, *, validate: bool = True) -> Tensor:
    """Couplings replaced by their level's value ``k / (K-1)`` (REM's ``c̃``).

    Binning (and ``validate``) as :func:`quantise_to_levels`; ``K = 11`` gives exactly
    ``0, 0.1, …, 1.0`` (each ``k / 10`` computed in float64, then cast).

    Returns:
        Quantised couplings, same shape and dtype as ``couplings`` (float32 if it was integer).

    Raises:
        InvalidInputError: If ``levels`` is not an int ≥ 2 or ``couplings`` contains NaN.
    """
    indices = quantise_to_levels(couplings, levels, validate=validate)
    dtype = couplings.dtype if torch.is_floating_point(couplings) else torch.float32
    return (indices.to(torch.float64) / (levels - 1)).to(dtype)
