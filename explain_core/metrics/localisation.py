"""Localisation metric: the adapted pointing game on multi-image grids.

An attribution map for one class of an ``n × n`` grid of images from distinct classes should put
its positive mass inside that class's cell. The score is the fraction of positive attribution that
falls inside the cell; a method that spreads mass uniformly scores ``1 / n²``.
"""

from __future__ import annotations

import numpy as np
import torch

from explain_core.data.grids import MultiImageGrids, check_images_and_labels
from explain_core.errors import InvalidInputError
from explain_core.metrics._checks import as_tensor, check_int, check_maps

__all__ = ["grid_class_pairs", "localisation_score", "pointing_game_grids"]


def localisation_score(
    attribution_maps: torch.Tensor | np.ndarray, masks: torch.Tensor | np.ndarray
) -> torch.Tensor:
    """Fraction of positive attribution inside a mask, per map.

    ``score = Σ relu(a)·mask / Σ relu(a)``. Negative values are ignored. A map without any
    positive value scores 0 (it points nowhere), so the result is never NaN.

    Args:
        attribution_maps: Spatial maps, shape (N, H, W); a tensor or NumPy array.
        masks: Bool tensor or array of shape (N, H, W); True inside the correct region.

    Returns:
        Float tensor of shape (N,) with values in [0, 1] (float64 for NumPy float64 maps).

    Raises:
        InvalidInputError: If the shapes differ or are not 3-d, the masks are not bool, or a map
            holds NaN or inf values.
    """
    attribution_maps = as_tensor(attribution_maps, "attribution_maps")
    masks = as_tensor(masks, "masks")
    if attribution_maps.dim() != 3 or masks.shape != attribution_maps.shape:
        raise InvalidInputError(
            "attribution_maps and masks must both have shape (N, H, W); got "
            f"{tuple(attribution_maps.shape)} and {tuple(masks.shape)}. Sum maps over channels "
            "first."
        )
    if masks.dtype != torch.bool:
        raise InvalidInputError(
            f"masks must be a bool tensor; got {masks.dtype}. Use masks.bool()."
        )
    attribution_maps = check_maps(attribution_maps, "attribution_maps")
    masks = masks.to(attribution_maps.device)
    positive = attribution_maps.detach().clamp(min=0).flatten(1)
    inside = (positive * masks.flatten(1)).sum(1)
    total = positive.sum(1)
    return torch.where(total > 0, inside / total.clamp(min=torch.finfo(total.dtype).tiny), 0.0)


def pointing_game_grids(
    images: torch.Tensor,
    labels: torch.Tensor,
    confidences: torch.Tensor,
    *,
    n: int = 3,
    count: int = 100,
    seed: int = 0,
) -> MultiImageGrids:
    """Build ``n × n`` multi-images by confidence-sorted selection (CoDA-Nets supplement, C.4).

    The images of each class are sorted by confidence, most confident first. For every grid a
    random set of ``n²`` distinct classes is drawn (its random order is the cell placement), and
    each class contributes its most confident image not used yet. When every image of a class has
    been used, that class starts again from its most confident image, so small test sets can
    still give many grids (the images of a class are then reused in turn).

    Args:
        images: Source images, shape (N, C, H, W).
        labels: Integer labels, shape (N,).
        confidences: Confidence of each image for its own class, shape (N,), or class scores of
            shape (N, K) from which the entry of each image's label is taken. Higher is more
            confident; ties keep the original image order.
        n: Cells per side; needs at least ``n²`` classes.
        count: Number of grids.
        seed: Seed of ``np.random.default_rng`` that draws the classes.

    Returns:
        The grids, on the device of ``images``; ``cell_labels`` holds each cell's class.

    Raises:
        ValueError: On malformed images or labels.
        InvalidInputError: On malformed ``n``, ``count`` or confidences, or too few classes.
    """
    label_array = check_images_and_labels(images, labels)
    n = check_int(n, "n", 1)
    count = check_int(count, "count", 1)
    scores = torch.as_tensor(confidences).detach().cpu().double()
    if scores.dim() == 2 and scores.shape[0] == len(label_array):
        scores = scores[torch.arange(len(label_array)), torch.from_numpy(label_array)]
    if scores.shape != (len(label_array),) or not bool(torch.isfinite(scores).all()):
        raise InvalidInputError(
            f"confidences must be finite with shape ({len(label_array)},) or "
            f"({len(label_array)}, num_classes); got shape {tuple(scores.shape)}."
        )
    classes = np.unique(label_array)
    if n * n > classes.size:
        raise InvalidInputError(
            f"n*n = {n * n} cells need as many distinct classes; only {classes.size} present."
        )
    score_array = scores.numpy()
    # Per class: image indices, most confident first; a stable sort keeps ties in index order.
    ranked = {
        int(c): members[np.argsort(-score_array[members], kind="stable")]
        for c in classes
        for members in [np.flatnonzero(label_array == c)]
    }
    used = dict.fromkeys(ranked, 0)
    rng = np.random.default_rng(seed)
    cell_labels = np.empty((count, n * n), dtype=np.int64)
    sources = np.empty((count, n * n), dtype=np.int64)
    for g in range(count):
        # Without replacement the draw is already in random order: it also sets the placement.
        cell_labels[g] = rng.choice(classes, size=n * n, replace=False)
        for k, cls in enumerate(cell_labels[g]):
            pool = ranked[int(cls)]
            sources[g, k] = pool[used[int(cls)] % pool.size]
            used[int(cls)] += 1

    _, channels, height, width = images.shape
    picked = images.detach()[torch.from_numpy(sources).to(images.device)].to(torch.float32)
    # (G, n, n, C, H, W) -> (G, C, n, H, n, W): rows of cells stack along the height.
    picked = picked.reshape(count, n, n, channels, height, width).permute(0, 3, 1, 4, 2, 5)
    return MultiImageGrids(
        images=picked.reshape(count, channels, n * height, n * width).contiguous(),
        cell_labels=torch.from_numpy(cell_labels).to(images.device),
        n=n,
        cell_size=(height, width),
    )


def grid_class_pairs(
    grids: MultiImageGrids,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every (grid, class shown in it) pair with the class's cell mask.

    Args:
        grids: Multi-image grids.

    Returns:
        ``(grid_index, labels, masks)``: int64 (P,), int64 (P,) and bool (P, n*H, n*W) with
        ``P = G * n²``, pairs in grid order and, within a grid, in row-major cell order.
    """
    cells = grids.n * grids.n
    grid_index = torch.arange(grids.cell_labels.shape[0], device=grids.cell_labels.device)
    grid_index = grid_index.repeat_interleave(cells)
    labels = grids.cell_labels.reshape(-1)
    expanded = MultiImageGrids(
        images=grids.images[:0],  # masks only need labels and geometry
        cell_labels=grids.cell_labels.repeat_interleave(cells, dim=0),
        n=grids.n,
        cell_size=grids.cell_size,
    )
    return grid_index, labels, expanded.class_masks(labels)
