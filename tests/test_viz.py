from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from explain_core.viz import attribution_to_rgb, image_to_rgb, save_grid

RED, BLUE, WHITE = (255, 0, 0), (0, 0, 255), (255, 255, 255)


def _pixel(rgb: np.ndarray, row: int, col: int) -> tuple[int, ...]:
    return tuple(int(v) for v in rgb[row, col])


def test_colours_of_max_min_and_zero() -> None:
    rgb = attribution_to_rgb(np.array([[2.0, -2.0], [0.0, 0.0]]))
    assert rgb.shape == (2, 2, 3) and rgb.dtype == np.uint8
    assert _pixel(rgb, 0, 0) == RED
    assert _pixel(rgb, 0, 1) == BLUE
    assert _pixel(rgb, 1, 0) == WHITE
    assert _pixel(rgb, 1, 1) == WHITE


def test_symmetric_scale_and_linear_intensity() -> None:
    # percentile 100: the scale is max |value| = 4, so ±2 sit halfway to full colour.
    rgb = attribution_to_rgb(np.array([[2.0, -2.0], [4.0, -1.0]]), percentile=100)
    half = 128  # 255 * 0.5 = 127.5, rounded half to even
    assert _pixel(rgb, 0, 0) == (255, half, half)
    assert _pixel(rgb, 0, 1) == (half, half, 255)
    assert _pixel(rgb, 1, 0) == RED
    assert _pixel(rgb, 1, 1) == (191, 191, 255)  # 255 * 0.75 = 191.25


def test_negative_max_gives_blue_only_map() -> None:
    rgb = attribution_to_rgb(torch.tensor([[-3.0, -1.5], [0.0, -3.0]]))
    assert _pixel(rgb, 0, 0) == BLUE
    assert _pixel(rgb, 1, 1) == BLUE
    assert _pixel(rgb, 0, 1) == (128, 128, 255)
    assert _pixel(rgb, 1, 0) == WHITE


def test_percentile_saturation() -> None:
    values = np.array([[1.0, 2.0], [3.0, 4.0]])
    # The 50th percentile of 1, 2, 3, 4 is 2.5: 3 and 4 saturate, 1 is 1/2.5 = 0.4 of full.
    rgb = attribution_to_rgb(values, percentile=50)
    assert _pixel(rgb, 1, 0) == RED
    assert _pixel(rgb, 1, 1) == RED
    assert _pixel(rgb, 0, 0) == (255, 153, 153)  # 255 * (1 - 0.4)
    assert _pixel(rgb, 0, 1) == (255, 51, 51)  # 255 * (1 - 0.8)
    # With percentile 100 only the maximum is full colour.
    rgb = attribution_to_rgb(values, percentile=100)
    assert _pixel(rgb, 1, 1) == RED
    assert _pixel(rgb, 1, 0) == (255, 64, 64)  # 255 * 0.25 = 63.75 → 64


def test_outlier_saturates_with_default_percentile() -> None:
    values = np.ones((40, 40))
    values[0, 0] = 1000.0  # one outlier in 1600 values lies above the 99.75th percentile
    rgb = attribution_to_rgb(values)
    assert _pixel(rgb, 0, 0) == RED
    assert _pixel(rgb, 5, 5) == RED  # the scale is set by the bulk, not the outlier


def test_all_zero_map_is_white() -> None:
    rgb = attribution_to_rgb(np.zeros((3, 5)))
    assert rgb.shape == (3, 5, 3)
    assert (rgb == 255).all()


def test_torch_input_matches_numpy() -> None:
    values = np.random.default_rng(0).normal(size=(6, 7))
    assert np.array_equal(
        attribution_to_rgb(values), attribution_to_rgb(torch.tensor(values, dtype=torch.float64))
    )


@pytest.mark.parametrize("shape", [(4,), (1, 4, 4), (2, 1, 4, 4)])
def test_wrong_ndim(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="2-D"):
        attribution_to_rgb(np.zeros(shape))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_not_finite(bad: float) -> None:
    values = np.zeros((3, 3))
    values[1, 1] = bad
    with pytest.raises(ValueError, match="NaN or infinite"):
        attribution_to_rgb(values)


def test_image_to_rgb_single_channel() -> None:
    image = torch.tensor([[[0.0, 0.5], [1.0, 2.0]]])  # (1, 2, 2); 2.0 is clipped
    rgb = image_to_rgb(image)
    assert rgb.shape == (2, 2, 3) and rgb.dtype == np.uint8
    assert _pixel(rgb, 0, 0) == (0, 0, 0)
    assert _pixel(rgb, 0, 1) == (128, 128, 128)
    assert _pixel(rgb, 1, 0) == WHITE
    assert _pixel(rgb, 1, 1) == WHITE


def test_image_to_rgb_three_channels() -> None:
    image = np.zeros((3, 2, 3))
    image[0, 0, 0] = 1.0  # red pixel at (0, 0)
    image[2, 1, 2] = 1.0  # blue pixel at (1, 2)
    image[1, 0, 1] = -1.0  # clipped to 0
    rgb = image_to_rgb(image)
    assert rgb.shape == (2, 3, 3)
    assert _pixel(rgb, 0, 0) == RED
    assert _pixel(rgb, 1, 2) == BLUE
    assert _pixel(rgb, 0, 1) == (0, 0, 0)


def test_image_to_rgb_two_dimensional() -> None:
    rgb = image_to_rgb(np.array([[0.2, 0.8]]))
    assert rgb.shape == (1, 2, 3)
    assert _pixel(rgb, 0, 0) == (51, 51, 51)
    assert _pixel(rgb, 0, 1) == (204, 204, 204)


def test_save_grid_size_and_content(tmp_path: Path) -> None:
    red = np.zeros((4, 5, 3), dtype=np.uint8)
    red[..., 0] = 255
    blue = np.zeros((4, 5, 3), dtype=np.uint8)
    blue[..., 2] = 255
    rows = [[red, blue, red], [blue, red, blue]]
    path = save_grid(rows, tmp_path / "sub" / "grid.png", scale=2)
    assert path == tmp_path / "sub" / "grid.png"
    with Image.open(path) as image:
        assert image.format == "PNG"
        # left margin 8, no titles: width 8 + 3 * (5*2 + 4), height 2 * (4*2 + 4)
        assert image.size == (8 + 3 * 14, 2 * 12)
        pixels = np.asarray(image.convert("RGB"))
    assert tuple(pixels[0, 8]) == RED  # first tile, top-left pixel
    assert tuple(pixels[7, 8 + 9]) == RED  # first tile, bottom-right pixel (scaled 10×8)
    assert tuple(pixels[0, 8 + 14]) == BLUE  # second tile
    assert tuple(pixels[12, 8]) == BLUE  # second row, first tile
    assert tuple(pixels[0, 0]) == WHITE  # margin
    assert tuple(pixels[8, 8]) == WHITE  # gap below the first row


def test_save_grid_with_titles(tmp_path: Path) -> None:
    tile = np.zeros((8, 8, 3), dtype=np.uint8)
    path = save_grid(
        [[tile, tile], [tile, tile]],
        tmp_path / "grid.png",
        row_titles=["ab", "abcd"],
        column_titles=["input", "map"],
    )
    with Image.open(path) as image:
        # left = 8 + 7 * 4 (longest row title), top = 16; default scale 8 → 64-px tiles
        assert image.size == (36 + 2 * (64 + 4), 16 + 2 * (64 + 4))
        pixels = np.asarray(image.convert("RGB"))
    assert tuple(pixels[16, 36]) == (0, 0, 0)  # first tile starts below and right of the titles
    assert tuple(pixels[15, 35]) != (0, 0, 0) or tuple(pixels[15, 36]) != (0, 0, 0)
