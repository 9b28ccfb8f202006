"""Matplotlib figures of attributions: red positive, blue negative, symmetric scale.

matplotlib is imported when a figure is drawn, never on ``import explain_core``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from explain_core.extras import require
from explain_core.viz import attribution_to_rgb, image_to_rgb, patch_relevance

__all__ = [
    "save_attribution_figure",
    "save_overlay",
]


def _pyplot() -> Any:
    matplotlib = require("matplotlib", "plotting")
    matplotlib.use("Agg")  # files only; never needs a display
    plt = require("matplotlib.pyplot", "plotting")

    return plt


def save_attribution_figure(
    rows: Sequence[tuple[str, Sequence[np.ndarray | torch.Tensor]]],
    path: str | Path,
    *,
    column_titles: Sequence[str] | None = None,
    inputs: Sequence[np.ndarray | torch.Tensor] | None = None,
    percentile: float = 99.75,
    title: str | None = None,
) -> Path:
    """A grid of heatmaps: one row per method (or class), one column per sample.

    Each map is coloured on its own symmetric scale ``(−v, v)``, ``v`` the ``percentile`` of
    ``|map|`` (99.75 as in the CoDA-Nets paper), positive red and negative blue.

    Args:
        rows: ``(row title, maps)`` pairs; maps are ``(H, W)`` (sum channels beforehand).
        path: PNG (or any matplotlib format) to write.
        column_titles: Optional title per column.
        inputs: Optional input images ``(C, H, W)`` or ``(H, W)`` shown as the first row.
        percentile: Percentile of ``|map|`` mapped to full colour.
        title: Optional figure title.

    Returns:
        The path written.
    """
    plt = _pyplot()
    table = ([("input", [image_to_rgb(i) for i in inputs])] if inputs is not None else []) + [
        (name, [attribution_to_rgb(m, percentile) for m in maps]) for name, maps in rows
    ]
    n_rows, n_cols = len(table), max(len(pictures) for _, pictures in table)
    figure, axes = plt.subplots(
        n_rows, n_cols, figsize=(1.3 * n_cols + 1.2, 1.3 * n_rows + 0.4), squeeze=False
    )
    for r, (name, pictures) in enumerate(table):
        for c in range(n_cols):
            axis = axes[r][c]
            axis.set_xticks([])
            axis.set_yticks([])
            if c < len(pictures):
                axis.imshow(pictures[c], interpolation="nearest")
            else:
                axis.axis("off")
            if c == 0:
                axis.set_ylabel(name, rotation=0, ha="right", va="center", fontsize=8)
            if r == 0 and column_titles is not None and c < len(column_titles):
                axis.set_title(column_titles[c], fontsize=8)
    if title:
        figure.suptitle(title, fontsize=9)
    return _save(plt, figure, path)


def save_overlay(
    image: np.ndarray | torch.Tensor,
    attribution: np.ndarray | torch.Tensor,
    path: str | Path,
    *,
    patch_size: int | None = None,
    percentile: float = 99.75,
    title: str | None = None,
) -> Path:
    """The input with its explanation laid over it, and a colour bar stating the scale.

    The map is summed over channels (and over each patch, for a ViT's ``patch_size``) and
    coloured on a symmetric scale ``(−v, v)``, ``v`` the ``percentile`` of ``|map|``: positive
    red, negative blue, half transparent over the input shown in grey.

    Args:
        image: The input ``(C, H, W)`` or ``(H, W)``; any value range (shown min to max).
        attribution: Its explanation, ``(C, H, W)`` or ``(H, W)``.
        path: PNG (or any matplotlib format) to write.
        patch_size: Colour each ``p × p`` patch by its summed relevance (a ViT's tokens).
        percentile: Percentile of ``|map|`` mapped to full colour.
        title: Optional title.

    Returns:
        The path written.
    """
    plt = _pyplot()
    picture = image.detach().cpu().double().numpy() if isinstance(image, torch.Tensor) else image
    picture = np.asarray(picture, dtype=np.float64)
    grey = picture.mean(axis=0) if picture.ndim == 3 else picture
    span = grey.max() - grey.min()
    grey = (grey - grey.min()) / span if span > 0 else np.zeros_like(grey)
    values = (
        attribution.detach().cpu().double().numpy()
        if isinstance(attribution, torch.Tensor)
        else np.asarray(attribution, dtype=np.float64)
    )
    heat = (
        patch_relevance(values, patch_size)
        if patch_size
        else (values.sum(axis=0) if values.ndim == 3 else values)
    )
    scale = float(np.percentile(np.abs(heat), percentile)) or 1.0
    height, width = grey.shape
    figure, axis = plt.subplots(figsize=(4.2, 3.6))
    axis.imshow(grey, cmap="gray", interpolation="nearest")
    shown = axis.imshow(
        heat,
        cmap="bwr",
        vmin=-scale,
        vmax=scale,
        alpha=0.55,
        interpolation="nearest",
        extent=(-0.5, width - 0.5, height - 0.5, -0.5),
    )
    axis.set_xticks([])
    axis.set_yticks([])
    bar = figure.colorbar(shown, ax=axis, fraction=0.046, pad=0.04)
    what = f"relevance per {patch_size}×{patch_size} patch" if patch_size else "relevance"
    bar.set_label(f"{what}; ±{scale:.3g} = {percentile:g}th pct of |R|", fontsize=7)
    bar.ax.tick_params(labelsize=7)
    if title:
        axis.set_title(title, fontsize=9)
    return _save(plt, figure, path)


def _save(plt: Any, figure: Any, path: str | Path) -> Path:
    """Lay out, write (creating the folder) and close ``figure``."""
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
