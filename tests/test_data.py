from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from explain_core.data import (
    CLASS_NAMES,
    ClutteredDigits,
    DigitsSplit,
    MultiImageGrids,
    load_digits,
    make_cluttered_digits,
    make_multi_image_grids,
)
from explain_core.data import digits as digits_module

TOTAL = 1797


@pytest.fixture(scope="module")
def split() -> DigitsSplit:
    return load_digits()


# --------------------------------------------------------------------------- digits


def test_import_does_not_pull_in_sklearn_eagerly():
    code = (
        "import sys, explain_core.data; "
        "sys.exit(1 if any(m.startswith('sklearn') for m in sys.modules) else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], check=False)
    assert result.returncode == 0


def test_class_names():
    assert tuple(str(d) for d in range(10)) == CLASS_NAMES


def test_shapes_dtypes_ranges(split):
    assert split.image_size == 8
    for images, labels in (
        (split.train_images, split.train_labels),
        (split.test_images, split.test_labels),
    ):
        assert images.dtype == torch.float32
        assert labels.dtype == torch.int64
        assert images.shape[1:] == (1, 8, 8)
        assert labels.shape == (images.shape[0],)
        assert images.min() >= 0 and images.max() <= 1
        assert images.max() == 1.0  # 16/16 occurs
        assert set(labels.tolist()) == set(range(10))
    assert split.train_images.shape[0] + split.test_images.shape[0] == TOTAL


def test_values_match_sklearn(split):
    from sklearn.datasets import load_digits as sk_load

    bunch = sk_load()
    raw = torch.from_numpy(bunch.images.astype(np.float32) / 16)
    _, raw_labels = digits_module._raw_digits()
    train_idx, test_idx = digits_module._stratified_indices(raw_labels, 0.25, 0)
    assert torch.equal(split.train_images[:, 0], raw[train_idx])
    assert torch.equal(split.test_images[:, 0], raw[test_idx])
    assert torch.equal(split.train_labels, torch.from_numpy(bunch.target[train_idx]).long())


def test_split_is_stratified_disjoint_and_sorted():
    fraction, seed = 0.3, 5
    _, raw_labels = digits_module._raw_digits()
    train_idx, test_idx = digits_module._stratified_indices(raw_labels, fraction, seed)
    assert len(np.intersect1d(train_idx, test_idx)) == 0
    assert len(train_idx) + len(test_idx) == TOTAL
    assert np.all(np.diff(train_idx) > 0) and np.all(np.diff(test_idx) > 0)

    result = load_digits(test_fraction=fraction, seed=seed)
    assert torch.equal(result.test_labels, torch.from_numpy(raw_labels[test_idx]))
    for cls in range(10):
        n_class = int((raw_labels == cls).sum())
        assert int((result.test_labels == cls).sum()) == round(fraction * n_class)
        assert int((result.train_labels == cls).sum()) == n_class - round(fraction * n_class)


def test_determinism_and_fresh_tensors():
    a = load_digits(seed=1)
    b = load_digits(seed=1)
    c = load_digits(seed=2)
    assert torch.equal(a.train_images, b.train_images)
    assert torch.equal(a.test_labels, b.test_labels)
    assert not torch.equal(a.test_images, c.test_images)
    # Callers may modify the tensors without affecting later calls.
    a.train_images.zero_()
    a.train_labels.fill_(-1)
    d = load_digits(seed=1)
    assert torch.equal(d.train_images, b.train_images)
    assert torch.equal(d.train_labels, b.train_labels)


def test_split_independent_of_torch_rng():
    torch.manual_seed(0)
    a = load_digits(seed=3)
    torch.manual_seed(123)
    torch.rand(10)
    b = load_digits(seed=3)
    assert torch.equal(a.test_images, b.test_images)


def test_datasets(split):
    train = split.train_dataset()
    test = split.test_dataset()
    assert isinstance(train, TensorDataset)
    assert len(train) == split.train_labels.shape[0]
    assert len(test) == split.test_labels.shape[0]
    image, label = test[0]
    assert torch.equal(image, split.test_images[0])
    assert label == split.test_labels[0]


def test_upsampled_digits(split):
    big = load_digits(image_size=28)
    assert big.image_size == 28
    assert big.train_images.shape == (split.train_images.shape[0], 1, 28, 28)
    assert big.train_images.dtype == torch.float32
    assert big.train_images.min() >= 0 and big.train_images.max() <= 1
    assert torch.equal(big.train_labels, split.train_labels)
    expected = F.interpolate(
        split.test_images[:5], size=(28, 28), mode="bilinear", align_corners=False
    ).clamp(0, 1)
    assert torch.equal(big.test_images[:5], expected)


def test_bilinear_upsampling_of_known_tensor():
    # align_corners=False bilinear on [[0, 1]] -> width 4 gives [0, .25, .75, 1].
    tiny = torch.tensor([[[[0.0, 1.0]]]])
    out = F.interpolate(tiny, size=(1, 4), mode="bilinear", align_corners=False)
    assert torch.allclose(out.flatten(), torch.tensor([0.0, 0.25, 0.75, 1.0]))
    # The loader's own conversion: pixel counts / 16, then bilinear upsampling and clamping.
    ramp = np.tile(np.arange(8, dtype=np.float32) * 2, (1, 8, 1))  # values 0..14
    up = digits_module._to_tensor(ramp, 16)
    expected = F.interpolate(
        torch.from_numpy(ramp / 16).unsqueeze(1), size=(16, 16), mode="bilinear"
    ).clamp(0, 1)
    assert up.shape == (1, 1, 16, 16)
    assert torch.equal(up, expected)
    assert torch.equal(digits_module._to_tensor(ramp, 8)[0, 0], torch.from_numpy(ramp[0] / 16))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"image_size": 7}, "image_size must be >= 8"),
        ({"image_size": 8.0}, "image_size must be an int"),
        ({"test_fraction": 0.0}, "test_fraction"),
        ({"test_fraction": 1.0}, "test_fraction"),
        ({"test_fraction": float("nan")}, "test_fraction"),
    ],
)
def test_load_digits_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        load_digits(**kwargs)


# --------------------------------------------------------------------------- grids


@pytest.fixture(scope="module")
def grids(split) -> MultiImageGrids:
    return make_multi_image_grids(split.test_images, split.test_labels, n=3, count=20, seed=4)


def test_grid_shapes(grids):
    assert grids.images.shape == (20, 1, 24, 24)
    assert grids.images.dtype == torch.float32
    assert grids.cell_labels.shape == (20, 9)
    assert grids.cell_labels.dtype == torch.int64
    assert grids.n == 3
    assert grids.cell_size == (8, 8)


def test_each_class_at_most_once_per_grid(grids):
    for row in grids.cell_labels:
        assert len(set(row.tolist())) == 9


def test_cells_hold_images_of_their_class(grids, split):
    images, labels = split.test_images, split.test_labels
    for g in range(grids.images.shape[0]):
        for k in range(9):
            r, c = divmod(k, 3)
            crop = grids.images[g, :, r * 8 : (r + 1) * 8, c * 8 : (c + 1) * 8]
            label = int(grids.cell_labels[g, k])
            same_class = images[labels == label]
            assert (same_class == crop).flatten(1).all(dim=1).any()


def test_class_mask_and_cell_of_class(grids):
    g = 2
    for k in range(9):
        label = int(grids.cell_labels[g, k])
        assert grids.cell_of_class(g, label) == k
        mask = grids.class_mask(g, label)
        assert mask.dtype == torch.bool and mask.shape == (24, 24)
        r, c = divmod(k, 3)
        expected = torch.zeros(24, 24, dtype=torch.bool)
        expected[r * 8 : (r + 1) * 8, c * 8 : (c + 1) * 8] = True
        assert torch.equal(mask, expected)


def test_class_masks_batch(grids):
    labels = grids.cell_labels[:, 4]
    masks = grids.class_masks(labels)
    assert masks.shape == (20, 24, 24) and masks.dtype == torch.bool
    for g in range(20):
        assert torch.equal(masks[g], grids.class_mask(g, int(labels[g])))
    assert masks[:, 8:16, 8:16].all() and masks.sum() == 20 * 64


def test_grid_absent_class_errors(grids):
    absent = (set(range(10)) - set(grids.cell_labels[0].tolist())).pop()
    with pytest.raises(ValueError, match=f"class {absent} is not in grid 0"):
        grids.cell_of_class(0, absent)
    with pytest.raises(ValueError, match="not in grid 0"):
        grids.class_mask(0, absent)
    labels = grids.cell_labels[:, 0].clone()
    labels[0] = absent
    with pytest.raises(ValueError, match="not in grid 0"):
        grids.class_masks(labels)
    with pytest.raises(ValueError, match="shape"):
        grids.class_masks(labels[:3])
    with pytest.raises(ValueError, match="grid must be an index"):
        grids.cell_of_class(99, 0)


def test_grid_n_too_large(split):
    with pytest.raises(ValueError, match=r"n must be between 1 and 3 for 10 classes.*got n=4"):
        make_multi_image_grids(split.test_images, split.test_labels, n=4)
    few = split.test_labels < 3
    with pytest.raises(ValueError, match="between 1 and 1 for 3 classes"):
        make_multi_image_grids(split.test_images[few], split.test_labels[few], n=2)


def test_grid_determinism(split):
    kw = {"n": 2, "count": 10}
    a = make_multi_image_grids(split.test_images, split.test_labels, seed=1, **kw)
    b = make_multi_image_grids(split.test_images, split.test_labels, seed=1, **kw)
    c = make_multi_image_grids(split.test_images, split.test_labels, seed=2, **kw)
    assert torch.equal(a.images, b.images) and torch.equal(a.cell_labels, b.cell_labels)
    assert not torch.equal(a.images, c.images)


def test_grid_other_errors(split):
    x, y = split.test_images, split.test_labels
    with pytest.raises(ValueError, match="num_classes"):
        make_multi_image_grids(x, y, num_classes=5)
    with pytest.raises(ValueError, match=r"\(N, C, H, W\)"):
        make_multi_image_grids(x[:, 0], y)
    with pytest.raises(ValueError, match="labels must have shape"):
        make_multi_image_grids(x, y[:-1])
    with pytest.raises(ValueError, match="count must be"):
        make_multi_image_grids(x, y, count=0)
    bad = x.clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        make_multi_image_grids(bad, y)


# --------------------------------------------------------------------------- clutter


@pytest.fixture(scope="module")
def cluttered(split) -> ClutteredDigits:
    return make_cluttered_digits(split.train_images, split.train_labels, count=50, seed=7)


def test_clutter_shapes(cluttered):
    assert cluttered.images.shape == (50, 1, 32, 32)
    assert cluttered.images.dtype == torch.float32
    assert cluttered.images.min() >= 0 and cluttered.images.max() <= 1
    assert cluttered.labels.shape == (50,) and cluttered.labels.dtype == torch.int64
    assert cluttered.masks.shape == (50, 32, 32) and cluttered.masks.dtype == torch.bool
    assert cluttered.boxes.shape == (50, 4) and cluttered.boxes.dtype == torch.int64
    top, left, bottom, right = cluttered.boxes.unbind(1)
    assert torch.all(bottom - top == 8) and torch.all(right - left == 8)
    assert torch.all(top >= 0) and torch.all(left >= 0)
    assert torch.all(bottom <= 32) and torch.all(right <= 32)


def _find_source(crop: torch.Tensor, images: torch.Tensor, labels: torch.Tensor, label: int):
    """Indices of images of `label` that the crop dominates (canvas >= digit everywhere)."""
    candidates = torch.nonzero(labels == label).flatten()
    ok = (crop.unsqueeze(0) >= images[candidates, 0]).flatten(1).all(dim=1)
    return candidates[ok]


def test_clutter_digit_pasted_in_box_and_mask(cluttered, split):
    images, labels = split.train_images, split.train_labels
    for i in range(50):
        top, left, bottom, right = cluttered.boxes[i].tolist()
        crop = cluttered.images[i, 0, top:bottom, left:right]
        found = _find_source(crop, images, labels, int(cluttered.labels[i]))
        assert found.numel() > 0
        mask = cluttered.masks[i]
        outside = mask.clone()
        outside[top:bottom, left:right] = False
        assert not outside.any()
        # The mask at the box is exactly the ink of one of the dominated sources.
        inks = images[found, 0] > 0.25
        assert (inks == mask[top:bottom, left:right]).flatten(1).all(dim=1).any()
        assert mask.any()


def test_clutter_without_noise_or_clutter_is_exact(split):
    images, labels = split.train_images, split.train_labels
    data = make_cluttered_digits(
        images, labels, count=10, clutter_pieces=0, noise_std=0.0, canvas_size=12, seed=3
    )
    for i in range(10):
        top, left, bottom, right = data.boxes[i].tolist()
        crop = data.images[i, 0, top:bottom, left:right]
        matches = (images[:, 0] == crop).flatten(1).all(dim=1)
        assert matches.any()
        assert labels[matches][0] == data.labels[i]
        rest = data.images[i, 0].clone()
        rest[top:bottom, left:right] = 0
        assert rest.abs().max() == 0
        assert torch.equal(data.masks[i, top:bottom, left:right], crop > 0.25)


def test_clutter_adds_background(cluttered):
    outside = ~torch.zeros_like(cluttered.masks)
    for i, (top, left, bottom, right) in enumerate(cluttered.boxes.tolist()):
        outside[i, top:bottom, left:right] = False
    assert (cluttered.images[:, 0][outside] > 0.3).any()  # clutter pieces exist off the digit


def test_clutter_determinism(split):
    kw = {"count": 8}
    x, y = split.train_images, split.train_labels
    torch.manual_seed(0)
    a = make_cluttered_digits(x, y, seed=11, **kw)
    torch.manual_seed(99)
    b = make_cluttered_digits(x, y, seed=11, **kw)
    c = make_cluttered_digits(x, y, seed=12, **kw)
    for field in ("images", "labels", "masks", "boxes"):
        assert torch.equal(getattr(a, field), getattr(b, field))
    assert not torch.equal(a.images, c.images)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"canvas_size": 7}, "canvas_size must be >= the digit size 8"),
        ({"piece_size": 9}, "piece_size must be between 1 and the digit size 8"),
        ({"piece_size": 0}, "piece_size must be an int >= 1"),
        ({"noise_std": -0.1}, "noise_std must be"),
        ({"noise_std": float("nan")}, "noise_std must be"),
        ({"ink_threshold": 1.0}, "ink_threshold"),
        ({"count": 0}, "count must be"),
        ({"clutter_pieces": -1}, "clutter_pieces must be"),
    ],
)
def test_clutter_errors(split, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_cluttered_digits(split.train_images, split.train_labels, **kwargs)


def test_clutter_input_errors(split):
    x, y = split.train_images, split.train_labels
    with pytest.raises(ValueError, match=r"values in \[0, 1\]"):
        make_cluttered_digits(x * 2, y)
    with pytest.raises(ValueError, match="one channel"):
        make_cluttered_digits(x.repeat(1, 3, 1, 1), y)
    with pytest.raises(ValueError, match="at least 2 source images"):
        make_cluttered_digits(x[:1], y[:1])
    single = make_cluttered_digits(x[:1], y[:1], clutter_pieces=0, count=2)
    assert torch.equal(single.labels, y[:1].repeat(2))
