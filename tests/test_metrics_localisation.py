from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from explain_core.data.grids import MultiImageGrids
from explain_core.metrics import (
    grid_class_pairs,
    localisation_score,
    pixel_removal_curve,
    pointing_game_grids,
    removed_pixel_counts,
)

TOP_ROW = torch.tensor([[True, True], [False, False]])


# --------------------------------------------------------------------------- localisation score


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([[1.0, 2.0], [0.0, 0.0]], 1.0),  # all positive mass inside
        ([[1.0, 0.0], [1.0, 0.0]], 0.5),  # half inside
        ([[2.0, -5.0], [2.0, -1.0]], 0.5),  # negative values are ignored
        ([[-1.0, 0.0], [0.0, 3.0]], 0.0),  # positive mass only outside
        ([[0.0, 0.0], [0.0, 0.0]], 0.0),  # nothing positive: 0, not NaN
        ([[-1.0, -2.0], [-3.0, -4.0]], 0.0),
    ],
)
def test_localisation_score_hand_values(values, expected):
    score = localisation_score(torch.tensor([values]), TOP_ROW[None])
    assert score.shape == (1,)
    assert not torch.isnan(score).any()
    assert score.item() == pytest.approx(expected)


def test_localisation_score_is_batched_and_keeps_dtype():
    maps = torch.tensor([[[1.0, 0.0], [3.0, 0.0]], [[0.0, 0.0], [0.0, 0.0]]], dtype=torch.float64)
    masks = torch.stack([TOP_ROW, ~TOP_ROW])
    score = localisation_score(maps, masks)
    assert score.dtype == torch.float64
    assert torch.allclose(score, torch.tensor([0.25, 0.0], dtype=torch.float64))


@pytest.mark.parametrize(
    ("maps", "masks", "match"),
    [
        (torch.zeros(2, 2), TOP_ROW, "shape"),
        (torch.zeros(1, 2, 2), TOP_ROW[None, :1], "shape"),
        (torch.zeros(1, 2, 2), TOP_ROW[None].float(), "bool"),
        (torch.full((1, 2, 2), float("nan")), TOP_ROW[None], "finite"),
    ],
)
def test_localisation_score_rejects_bad_input(maps, masks, match):
    with pytest.raises(ValueError, match=match):
        localisation_score(maps, masks)


# --------------------------------------------------------------------------- grid selection


def _indexed_images(labels: np.ndarray) -> torch.Tensor:
    """Images (N, 1, 2, 2) whose every pixel holds the image's index, to trace grid sources."""
    return torch.arange(len(labels), dtype=torch.float32).view(-1, 1, 1, 1).expand(-1, 1, 2, 2)


def _sources(grids: MultiImageGrids) -> torch.Tensor:
    """Source image index per cell, (G, n*n) in row-major cell order (top-left pixel)."""
    n, (h, w) = grids.n, grids.cell_size
    corners = grids.images[:, 0, ::h, ::w]  # (G, n, n)
    return corners.reshape(len(corners), n * n).long()


@pytest.fixture
def pool() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(1)
    labels = np.repeat(np.arange(10), 5)
    rng.shuffle(labels)
    confidences = torch.from_numpy(rng.random(len(labels)))
    return _indexed_images(labels), torch.from_numpy(labels), confidences


def test_each_class_at_most_once_and_cells_match_sources(pool):
    images, labels, confidences = pool
    grids = pointing_game_grids(images, labels, confidences, n=3, count=12, seed=3)
    assert grids.images.shape == (12, 1, 6, 6)
    assert grids.cell_size == (2, 2) and grids.n == 3
    for row in grids.cell_labels:
        assert len(set(row.tolist())) == 9
    assert torch.equal(labels[_sources(grids)], grids.cell_labels)


def test_most_confident_unused_image_first_then_wraps_around(pool):
    images, labels, confidences = pool
    count = 12  # 108 cells from 50 images: every class wraps around at least once
    grids = pointing_game_grids(images, labels, confidences, n=3, count=count, seed=0)
    sources = _sources(grids).reshape(-1).tolist()  # in usage order
    for cls in range(10):
        members = torch.nonzero(labels == cls).flatten()
        ranked = members[torch.argsort(confidences[members], descending=True)].tolist()
        used = [s for s in sources if labels[s] == cls]
        assert used == [ranked[i % len(ranked)] for i in range(len(used))]


def test_class_score_matrix_and_ties(pool):
    images, labels, _ = pool
    scores = torch.zeros(len(labels), 10)
    scores[torch.arange(len(labels)), labels] = 1.0  # all tied: keep index order
    grids = pointing_game_grids(images, labels, scores, n=2, count=3, seed=0)
    sources = _sources(grids).reshape(-1).tolist()
    for cls in range(10):
        used = [s for s in sources if labels[s] == cls]
        members = torch.nonzero(labels == cls).flatten().tolist()
        assert used == members[: len(used)]


def test_grid_selection_is_seeded(pool):
    images, labels, confidences = pool
    a = pointing_game_grids(images, labels, confidences, count=4, seed=7)
    b = pointing_game_grids(images, labels, confidences, count=4, seed=7)
    c = pointing_game_grids(images, labels, confidences, count=4, seed=8)
    assert torch.equal(a.images, b.images) and torch.equal(a.cell_labels, b.cell_labels)
    assert not torch.equal(a.cell_labels, c.cell_labels)


def test_grid_selection_rejects_bad_input(pool):
    images, labels, confidences = pool
    with pytest.raises(ValueError, match="distinct classes"):
        pointing_game_grids(images, labels, confidences, n=4)
    with pytest.raises(ValueError, match="confidences"):
        pointing_game_grids(images, labels, confidences[:-1])
    with pytest.raises(ValueError, match="count"):
        pointing_game_grids(images, labels, confidences, count=0)


def test_grid_class_pairs_masks_cover_the_right_cell(pool):
    images, labels, confidences = pool
    grids = pointing_game_grids(images, labels, confidences, n=3, count=2, seed=0)
    grid_index, pair_labels, masks = grid_class_pairs(grids)
    assert grid_index.tolist() == [0] * 9 + [1] * 9
    assert torch.equal(pair_labels, grids.cell_labels.reshape(-1))
    assert masks.shape == (18, 6, 6) and masks.dtype == torch.bool
    assert (masks.sum((1, 2)) == 4).all()
    for p in range(18):
        assert torch.equal(masks[p], grids.class_mask(int(grid_index[p]), int(pair_labels[p])))
    # An attribution map equal to the class's own mask localises perfectly.
    assert torch.equal(localisation_score(masks.float(), masks), torch.ones(18))


# --------------------------------------------------------------------------- pixel removal


def _linear_model(weights: torch.Tensor):
    """Scores = Σ_{c,h,w} weights[k] · x for every class k; weights (K, C, H, W)."""
    return lambda x: torch.einsum("bchw,kchw->bk", x, weights)


# x = [[1, 2], [3, 4]], class-0 weights all one, so the score is the sum of the kept pixels.
X = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]])
IMPORTANCE = torch.tensor([[[4.0, 1.0], [3.0, 2.0]]])  # least → most: pixels 1, 3, 2, 0
ONES = _linear_model(torch.ones(1, 1, 2, 2))


def test_least_important_first_by_hand():
    curve = pixel_removal_curve(ONES, X, IMPORTANCE, 0, fraction=1.0, order="least")
    assert curve.tolist() == [[10.0, 8.0, 4.0, 1.0, 0.0]]


def test_most_important_first_by_hand():
    curve = pixel_removal_curve(ONES, X, IMPORTANCE, 0, fraction=1.0, order="most")
    assert curve.tolist() == [[10.0, 9.0, 6.0, 2.0, 0.0]]


def test_fraction_and_steps_bookkeeping():
    assert removed_pixel_counts(64, 0.25) == list(range(17))
    assert removed_pixel_counts(64, 0.25, 4) == [0, 4, 8, 12, 16]
    assert removed_pixel_counts(10, 0.3) == [0, 1, 2, 3]  # 0.3 * 10 is 2.999... in floats
    assert removed_pixel_counts(10, 0.5, 2) == [0, 2, 5]
    half = pixel_removal_curve(ONES, X, IMPORTANCE, 0, fraction=0.5)
    assert half.tolist() == [[10.0, 8.0, 4.0]]
    one_step = pixel_removal_curve(ONES, X, IMPORTANCE, 0, fraction=0.5, steps=1, order="most")
    assert one_step.tolist() == [[10.0, 6.0]]
    with pytest.raises(ValueError, match="steps"):
        removed_pixel_counts(4, 0.5, 3)
    with pytest.raises(ValueError, match="no pixel"):
        removed_pixel_counts(4, 0.1)


def test_ties_follow_row_major_order_in_both_orders():
    flat = torch.zeros(1, 2, 2)
    for order in ("least", "most"):
        curve = pixel_removal_curve(ONES, X, flat, 0, fraction=1.0, order=order)
        assert curve.tolist() == [[10.0, 9.0, 7.0, 4.0, 0.0]]


def test_all_channels_removed_batched_targets_and_removed_value():
    # Two channels ([x, 1 − x]-like) and two classes with different weights; batch of two.
    x = torch.stack([torch.cat([X[0], 1 - X[0]]), torch.cat([X[0], X[0]])])  # (2, 2, 2, 2)
    weights = torch.stack([torch.ones(2, 2, 2), torch.arange(8.0).view(2, 2, 2)])
    model = _linear_model(weights)
    maps = torch.cat([IMPORTANCE, -IMPORTANCE])
    curve = pixel_removal_curve(model, x, maps, torch.tensor([0, 1]), fraction=0.5, order="least")
    expected = []
    for b, target, pixels in ((0, 0, [1, 3]), (1, 1, [0, 2])):
        kept = x[b].clone()
        scores = [float((weights[target] * kept).sum())]
        for p in pixels:
            kept.view(2, -1)[:, p] = 0.0  # both channels of the pixel
            scores.append(float((weights[target] * kept).sum()))
        expected.append(scores)
    assert torch.allclose(curve, torch.tensor(expected))
    filled = pixel_removal_curve(ONES, X, IMPORTANCE, 0, fraction=0.25, removed_value=0.5)
    assert filled.tolist() == [[10.0, 8.5]]


def test_pixel_removal_rejects_bad_input():
    with pytest.raises(ValueError, match="order"):
        pixel_removal_curve(ONES, X, IMPORTANCE, 0, order="random")
    with pytest.raises(ValueError, match="attribution_maps"):
        pixel_removal_curve(ONES, X, IMPORTANCE[None], 0)
    with pytest.raises(ValueError, match="finite"):
        pixel_removal_curve(ONES, X, IMPORTANCE * float("nan"), 0)


def test_import_stays_light():
    code = (
        "import sys, explain_core.metrics; heavy = ('captum', 'sklearn', 'skimage', "
        "'matplotlib'); sys.exit(any(m.split('.')[0] in heavy for m in sys.modules))"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
