"""The paper's matrix-chain simulation (Sixt et al. 2020, appendix B, Fig. 7).

Products of random matrices ``M_n = A_1 A_2 ⋯ A_n`` (the backward pass, starting from the output
side) are tracked by the median cosine similarity between the columns of ``M_n``: 1 means the
product is rank 1, every vector is mapped to the same direction. Non-negative matrices converge
exponentially fast; Gaussian matrices do not; ``αW⁺ + βW⁻`` (LRP-αβ's matrices) converge for
small enough β.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np

from explain_core.errors import InvalidInputError
from explain_core.metrics._checks import check_int, check_number

__all__ = ["MatrixChainCurve", "matrix_chain_convergence"]

Kind = Literal["vanilla", "relu", "nonnegative", "positive", "stochastic", "alpha_beta"]
KINDS: tuple[str, ...] = get_args(Kind)

# VGG-16's convolution widths from the output side, its kernels taken as 1×1 (as in the paper).
VGG16_WIDTHS = (512, 512, 512, 512, 512, 512, 256, 256, 256, 128, 128, 64, 64)


@dataclass(frozen=True)
class MatrixChainCurve:
    """Median column cosine similarity of ``A_1⋯A_n`` for ``n = 1 … len``.

    Attributes:
        kind: The matrix family.
        lengths: Chain lengths ``n``.
        median_cosine: Median over column pairs (and repeats) of the cosine similarity.
    """

    kind: str
    lengths: np.ndarray
    median_cosine: np.ndarray


def _matrix(
    kind: Kind, rows: int, cols: int, rng: np.random.Generator, alpha: float, beta: float
) -> np.ndarray:
    w = rng.standard_normal((rows, cols))
    if kind in ("vanilla", "relu"):
        return w
    if kind == "nonnegative":  # about half zeros
        return np.maximum(w, 0.0)
    if kind == "positive":
        return np.abs(w)
    if kind == "stochastic":
        w = np.abs(w)
        return w / w.sum(axis=0, keepdims=True)
    # kind was checked by matrix_chain_convergence: the rest is "alpha_beta".
    return alpha * np.maximum(w, 0.0) + beta * np.minimum(w, 0.0)


def _median_column_cosine(m: np.ndarray) -> float:
    norms = np.linalg.norm(m, axis=0)
    keep = norms > 0
    if keep.sum() < 2:
        return float("nan")
    unit = m[:, keep] / norms[keep]
    gram = unit.T @ unit
    upper = gram[np.triu_indices(len(gram), k=1)]
    return float(np.median(np.clip(upper, -1.0, 1.0)))


def matrix_chain_convergence(
    kind: Kind = "nonnegative",
    widths: Iterable[int] = VGG16_WIDTHS,
    *,
    alpha: float | None = None,
    beta: float = 1.0,
    repeats: int = 3,
    seed: int = 0,
) -> MatrixChainCurve:
    """Simulate the convergence of a chain of random matrices to rank 1.

    Args:
        kind: ``"vanilla"`` (Gaussian), ``"relu"`` (Gaussian with a ReLU after each product),
            ``"nonnegative"`` (Gaussian clipped at 0), ``"positive"`` (absolute values),
            ``"stochastic"`` (positive, columns summing to 1) or ``"alpha_beta"``
            (``αW⁺ + βW⁻``, ``W⁻ = min(0, W)``).
        widths: Ints (a sequence, NumPy array or any iterable); ``A_i`` has shape
            ``(widths[i-1], widths[i])``; the chain has
            ``len(widths) − 1`` matrices, the columns live in ``R^{widths[0]}``.
        alpha: For ``"alpha_beta"``; default ``1 + beta`` (LRP's α − β = 1).
        beta: For ``"alpha_beta"``.
        repeats: Independent chains; the median is taken over all of them.
        seed: Seed.

    Returns:
        The curve over chain lengths ``1 … len(widths) − 1``. Where every repeat's product had
        fewer than two non-zero columns (possible for ``"relu"`` and ``"nonnegative"`` with
        narrow widths) the cosine is undefined: that entry is NaN and a warning says so.

    Raises:
        InvalidInputError: For an unknown ``kind``, fewer than two widths, a width below 2 (a
            product needs two columns to compare, and in one dimension every cosine is ±1),
            ``repeats < 1`` or non-finite ``alpha``/``beta``.
    """
    if kind not in KINDS:
        raise InvalidInputError(f"kind must be one of {', '.join(KINDS)}; got {kind!r}")
    # Any iterable of ints: a list, a tuple, a NumPy array, a range.
    given = widths
    if not isinstance(widths, (str, bytes)) and isinstance(widths, Iterable):
        with contextlib.suppress(TypeError):  # a 0-d NumPy array claims to be iterable
            widths = list(widths)
    if not isinstance(widths, list) or len(widths) < 2:
        raise InvalidInputError(
            f"widths must be a sequence of at least two ints (one matrix), e.g. (64, 64, 64); "
            f"got {given!r}"
        )
    widths = [check_int(width, f"widths[{i}]", 2) for i, width in enumerate(widths)]
    beta = check_number(beta, "beta")
    alpha = 1.0 + beta if alpha is None else check_number(alpha, "alpha")
    repeats = check_int(repeats, "repeats", 1)
    seed = check_int(seed, "seed", 0)
    rng = np.random.default_rng(seed)
    values = np.empty((repeats, len(widths) - 1))
    for r in range(repeats):
        product = None
        for i in range(1, len(widths)):
            a = _matrix(kind, widths[i - 1], widths[i], rng, alpha, beta)
            product = a if product is None else product @ a
            if kind == "relu":
                product = np.maximum(product, 0.0)
            product = product / max(float(np.abs(product).max()), 1e-300)  # no overflow
            values[r, i - 1] = _median_column_cosine(product)
    undefined = np.isnan(values).all(axis=0)
    if undefined.any():
        warnings.warn(
            f"matrix chain ({kind}): the cosine is undefined at lengths "
            f"{(np.flatnonzero(undefined) + 1).tolist()} (fewer than two non-zero columns in "
            "every repeat), so they are NaN; use wider layers or more repeats",
            RuntimeWarning,
            stacklevel=2,
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy's all-NaN warning: said above
        median = np.nanmedian(values, axis=0)
    return MatrixChainCurve(kind, np.arange(1, len(widths)), median)
