"""The plotting API (heatmap, overlay, grid, save_figure) and the pictures of ``explain attribute``.

Figures are checked by what they hold — the drawn arrays, colour limits, colour-bar labels and
titles — against values computed here by hand, and PNGs by their pixels.
"""

from __future__ import annotations

import subprocess
import sys
from io import BytesIO
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import run_cli, write_user_module
from matplotlib.collections import LineCollection
from matplotlib.figure import Figure
from PIL import Image

from explain_core import plots
from explain_core.errors import InvalidInputError
from explain_core.loading import load_model
from explain_core.plots import (
    grid,
    heatmap,
    overlay,
    save_attribution_figure,
    save_figure,
    save_overlay,
)

pytestmark = pytest.mark.usefixtures("restore_showwarning")

WRONG_RGB = (0xC0 / 255, 0.0, 0.0, 1.0)


def barred(figure: Figure) -> list[Any]:
    """The pictures of ``figure`` that have a colour bar, in drawing order."""
    return [im for axis in figure.axes for im in axis.images if im.colorbar is not None]


def rng_map(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=shape)


# --- heatmap ----------------------------------------------------------------------------------


def test_heatmap_colour_bar_is_symmetric_at_the_largest_value_and_says_so() -> None:
    values = np.array([[0.5, -2.0], [1.0, 0.25]])
    figure = heatmap(values, percentile=100, title="t")
    (shown,) = barred(figure)
    assert shown.get_clim() == (-2.0, 2.0)  # ±max|map|, although the largest value is 1
    assert shown.colorbar.ax.get_ylim() == (-2.0, 2.0)
    label = shown.colorbar.ax.get_ylabel()
    assert "symmetric" in label and "±2 = max |R|" in label
    np.testing.assert_array_equal(shown.get_array(), values)
    assert shown.get_cmap().name == "bwr"  # blue − … white 0 … red +


def test_heatmap_sums_channels_and_uses_the_percentile() -> None:
    values = rng_map(3, 10, 10)
    figure = heatmap(torch.tensor(values, requires_grad=True))
    (shown,) = barred(figure)
    summed = values.sum(axis=0)
    np.testing.assert_allclose(shown.get_array(), summed)
    v = float(np.percentile(np.abs(summed), 99.75))
    assert v < np.abs(summed).max()
    np.testing.assert_allclose(shown.get_clim(), (-v, v))
    assert f"±{v:.3g} = 99.75th percentile of |R|" in shown.colorbar.ax.get_ylabel()


def test_heatmap_of_a_vector_is_one_row_and_a_zero_map_has_a_scale() -> None:
    (shown,) = barred(heatmap(np.array([1.0, -3.0, 2.0]), percentile=100))
    np.testing.assert_array_equal(shown.get_array(), [[1.0, -3.0, 2.0]])
    (blank,) = barred(heatmap(np.zeros((4, 4))))
    assert blank.get_clim() == (-1.0, 1.0)  # all white, not a division by zero


def test_heatmap_draws_into_given_axes_without_a_colour_bar() -> None:
    figure = Figure()
    axis = figure.add_subplot()
    assert heatmap(np.ones((2, 2)), ax=axis, colorbar=False) is figure
    assert len(axis.images) == 1 and axis.images[0].colorbar is None
    assert len(figure.axes) == 1


# --- overlay ----------------------------------------------------------------------------------


def test_overlay_shows_the_input_under_the_map_with_the_stated_scale() -> None:
    image = np.random.default_rng(1).uniform(0, 1, size=(1, 6, 6))
    attribution = rng_map(1, 6, 6, seed=2)
    figure = overlay(torch.tensor(image), attribution, percentile=100, alpha=0.8)
    axis = figure.axes[0]
    base, heat = axis.images
    np.testing.assert_allclose(base.get_array(), image[0])  # in [0, 1]: shown as it is
    assert base.get_clim() == (0.0, 1.0) and base.get_cmap().name == "gray"
    v = np.abs(attribution).max()
    np.testing.assert_allclose(heat.get_array(), attribution[0])
    np.testing.assert_allclose(heat.get_clim(), (-v, v))
    # Opaque in proportion to |R|: the input shows where the map is near 0.
    np.testing.assert_allclose(heat.get_alpha(), 0.8 * np.abs(attribution[0]) / v)
    assert heat.colorbar is not None
    assert f"±{v:.3g} = max |R|" in heat.colorbar.ax.get_ylabel()


def test_overlay_normalises_an_input_outside_0_1_and_greys_rgb() -> None:
    image = np.random.default_rng(3).normal(size=(3, 4, 5)) * 2.0  # a normalised input
    figure = overlay(image, rng_map(3, 4, 5))
    base = figure.axes[0].images[0]
    shown = (image - image.min()) / (image.max() - image.min())  # min → 0, max → 1
    np.testing.assert_allclose(base.get_array(), shown.mean(axis=0))  # grey: mean of R, G, B
    uint8 = np.array([[0, 255], [51, 102]], dtype=np.uint8)
    np.testing.assert_allclose(
        overlay(uint8, np.ones((2, 2))).axes[0].images[0].get_array(), uint8 / 255.0
    )
    two = np.stack([np.full((2, 2), 0.25), np.full((2, 2), 0.75)])  # [x, 1 − x]: first channel
    np.testing.assert_allclose(overlay(two, np.ones((2, 2))).axes[0].images[0].get_array(), 0.25)


def test_overlay_per_patch_covers_the_image() -> None:
    attribution = rng_map(3, 8, 12, seed=4)
    figure = overlay(np.zeros((3, 8, 12)), attribution, patch_size=4)
    heat = figure.axes[0].images[1]
    expected = attribution.sum(0).reshape(2, 4, 3, 4).sum(axis=(1, 3))
    np.testing.assert_allclose(heat.get_array(), expected)
    assert heat.get_extent() == [-0.5, 11.5, 7.5, -0.5]
    assert "per 4×4 patch" in heat.colorbar.ax.get_ylabel()


@pytest.mark.parametrize(
    ("image", "attribution", "options", "words"),
    [
        (np.zeros((1, 8, 8)), np.zeros((1, 3, 8)), {}, ("3×8", "8×8")),
        (np.zeros((8, 8)), np.zeros((2, 1, 8, 8)), {}, ("(2, 1, 8, 8)", "attribution[0]")),
        (np.zeros((8, 8)), np.full((8, 8), np.nan), {}, ("NaN",)),
        (np.zeros((2, 1, 8, 8)), np.zeros((8, 8)), {}, ("image", "(2, 1, 8, 8)")),
        (np.zeros((8, 8)), np.zeros((8, 8)), {"percentile": 0}, ("percentile", "(0, 100]")),
        (np.zeros((8, 8)), np.zeros((8, 8)), {"alpha": 1.5}, ("alpha",)),
        (np.zeros((6, 6)), np.zeros((6, 6)), {"patch_size": 4}, ("4×4 patches",)),
        (np.zeros((8, 8)), "not a map", {}, ("NumPy array", "str")),
    ],
)
def test_overlay_refuses_bad_input_clearly(image, attribution, options, words) -> None:
    with pytest.raises(InvalidInputError) as error:
        overlay(image, attribution, **options)
    for word in words:
        assert word in str(error.value)


# --- grid -------------------------------------------------------------------------------------


def test_grid_titles_carry_true_and_predicted_labels_and_mark_wrong_ones() -> None:
    inputs = torch.rand(3, 1, 4, 4)
    maps = {"gradient": torch.randn(3, 1, 4, 4), "lrp": [rng_map(4, 4, seed=s) for s in range(3)]}
    figure = grid(
        maps,
        inputs=inputs,
        labels=torch.tensor([0, 1, 2]),
        predictions=[0, 2, 2],
        class_names=["cat", "dog", "emu"],
    )
    tiles = [axis for axis in figure.axes if axis.images]  # colour bars hold no images
    top = tiles[:3]
    assert [axis.get_title() for axis in top] == [
        "true cat, pred cat",
        "true dog, pred emu ✗",
        "true emu, pred emu",
    ]
    assert top[1].title.get_color() == "#c00000"
    assert top[0].title.get_color() == "black"
    assert all(s.get_edgecolor() == WRONG_RGB for s in top[1].spines.values())
    assert not any(s.get_edgecolor() == WRONG_RGB for s in top[0].spines.values())
    assert [tiles[i].get_ylabel() for i in (0, 3, 6)] == ["input", "gradient", "lrp"]
    np.testing.assert_allclose(top[2].images[0].get_array(), inputs[2, 0].numpy())


def test_grid_scale_map_draws_each_map_in_units_of_its_own_scale() -> None:
    maps = [rng_map(5, 5, seed=s) * (s + 1) for s in range(3)]
    figure = grid({"m": maps}, scale="map", percentile=100)
    (bar_owner,) = barred(figure)
    tiles = [axis.images[0] for axis in figure.axes if axis.images]
    for tile, values in zip(tiles, maps, strict=True):
        np.testing.assert_allclose(tile.get_array(), values / np.abs(values).max())
        assert tile.get_clim() == (-1.0, 1.0)
    labels = [t.get_text() for t in bar_owner.colorbar.ax.get_yticklabels()]
    assert labels == ["−v", "0", "+v"]
    assert "each map on its own symmetric scale" in figure.get_supxlabel()


@pytest.mark.parametrize("scale", ["row", "column", "all"])
def test_grid_shared_scales_equal_the_percentile_of_what_shares_them(scale: str) -> None:
    rows = {"a": np.stack([rng_map(4, 4, seed=s) for s in range(3)]), "b": rng_map(3, 4, 4) * 5}
    figure = grid(rows, scale=scale, percentile=100)
    tiles = [axis.images[0] for axis in figure.axes if axis.images][:6]  # row-major, a then b
    for index, tile in enumerate(tiles):
        r, c = divmod(index, 3)
        name = "ab"[r]
        if scale == "row":
            v = np.abs(rows[name]).max()
        elif scale == "column":
            v = max(np.abs(rows["a"][c]).max(), np.abs(rows["b"][c]).max())
        else:
            v = max(np.abs(rows["a"]).max(), np.abs(rows["b"]).max())
        np.testing.assert_allclose(tile.get_array(), rows[name][c])
        np.testing.assert_allclose(tile.get_clim(), (-v, v))
    bars = barred(figure)
    assert len(bars) == {"row": 2, "column": 3, "all": 1}[scale]
    for shown in bars:
        low, high = shown.get_clim()
        assert low == -high
        axis = shown.colorbar.ax
        assert f"±{high:.3g}" in axis.get_ylabel() + axis.get_xlabel()


def test_grid_outlines_masks_along_pixel_edges() -> None:
    mask = np.zeros((4, 4), dtype=bool)
    mask[0:2, 0:2] = True  # a 2×2 square in the corner: 8 unit edges
    figure = grid(inputs=np.zeros((2, 1, 4, 4)), masks=[mask, None], labels=[3, 4])
    first, second = figure.axes
    (lines,) = [c for c in first.collections if isinstance(c, LineCollection)]
    edges = {tuple(map(tuple, np.round(segment, 6))) for segment in lines.get_segments()}
    expected = {
        ((-0.5, -0.5), (-0.5, 0.5)),
        ((-0.5, 0.5), (-0.5, 1.5)),
        ((1.5, -0.5), (1.5, 0.5)),
        ((1.5, 0.5), (1.5, 1.5)),
        ((-0.5, -0.5), (0.5, -0.5)),
        ((0.5, -0.5), (1.5, -0.5)),
        ((-0.5, 1.5), (0.5, 1.5)),
        ((0.5, 1.5), (1.5, 1.5)),
    }
    assert edges == expected
    assert not second.collections
    assert [first.get_title(), second.get_title()] == ["label 3", "label 4"]
    assert first.get_ylabel() == ""  # no map rows: no "input" row title


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda: grid({"a": np.zeros((3, 4, 4))}, inputs=np.zeros((2, 1, 4, 4))), ("inputs: 2",)),
        (lambda: grid({"a": np.zeros((2, 4, 4))}, labels=[1, 2, 3]), ("2 samples", "3 labels")),
        (lambda: grid({"a": np.zeros((2, 4, 4))}, scale="rows"), ("map, row, column, all",)),
        (lambda: grid(), ("maps or inputs",)),
        (lambda: grid({"a": np.zeros((2, 4, 4))}, masks=[None, None]), ("give inputs",)),
        (lambda: grid([("a", np.zeros(4))]), ("batch",)),
    ],
)
def test_grid_refuses_inconsistent_rows_clearly(call, words) -> None:
    with pytest.raises(InvalidInputError) as error:
        call()
    for word in words:
        assert word in str(error.value)


# --- writing ----------------------------------------------------------------------------------


def pixels(path_or_bytes: Path | bytes) -> np.ndarray:
    source = BytesIO(path_or_bytes) if isinstance(path_or_bytes, bytes) else path_or_bytes
    with Image.open(source) as image:
        assert image.format == "PNG"
        return np.asarray(image.convert("RGB"), dtype=np.int64)


def test_save_figure_writes_a_png_with_red_and_blue_where_the_map_is(tmp_path: Path) -> None:
    values = np.array([[1.0, -1.0]])
    figure = heatmap(values)
    path = save_figure(figure, tmp_path / "sub" / "h.png", dpi=100)
    assert path == tmp_path / "sub" / "h.png"
    rgb = pixels(path)
    width, height = figure.get_size_inches() * 100
    assert rgb.shape == (round(height), round(width), 3)
    red = (rgb[..., 0] > 240) & (rgb[..., 1] < 15) & (rgb[..., 2] < 15)
    blue = (rgb[..., 2] > 240) & (rgb[..., 0] < 15) & (rgb[..., 1] < 15)
    assert red.sum() > 1000 and blue.sum() > 1000  # the two cells, not only the colour bar
    handle = BytesIO()
    save_figure(heatmap(values), handle)
    assert handle.getvalue()[:8] == b"\x89PNG\r\n\x1a\n"


def test_save_shortcuts_write_what_the_functions_draw(tmp_path: Path) -> None:
    image, attribution = np.random.default_rng(0).uniform(size=(8, 8)), rng_map(8, 8)
    one = save_overlay(image, attribution, tmp_path / "o.png", title="x")
    two = save_figure(overlay(image, attribution, title="x"), tmp_path / "o2.png")
    np.testing.assert_array_equal(pixels(one), pixels(two))
    rows = [("a", [rng_map(4, 4)])]
    three = save_attribution_figure(rows, tmp_path / "g.png", labels=[1], predictions=[2])
    four = save_figure(grid(rows, labels=[1], predictions=[2]), tmp_path / "g2.png")
    np.testing.assert_array_equal(pixels(three), pixels(four))


def test_plots_import_no_matplotlib_and_draw_without_pyplot() -> None:
    code = (
        "import sys, numpy as np\n"
        "import explain_core.plots as p\n"
        "assert 'matplotlib' not in sys.modules\n"
        "p.save_figure(p.grid({'a': np.ones((2, 3, 3))}), sys.argv[1])\n"
        "print('matplotlib.pyplot' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).parent / "does-not-matter.png")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parent,
    )
    (Path(__file__).parent / "does-not-matter.png").unlink(missing_ok=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"  # no backend chosen, nothing global changed


# --- explain attribute ------------------------------------------------------------------------


MODELS = """
import torch
from torch import nn


def _linear(features):
    layer = nn.Linear(features, 4)
    generator = torch.Generator().manual_seed(features)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(4, features, generator=generator))
        layer.bias.copy_(torch.randn(4, generator=generator) * 0.1)
    return nn.Sequential(nn.Flatten(), layer)


def grey():
    return _linear(16)


def rgb():
    return _linear(48)


def declared():
    return _linear(16)


declared.explain_preprocessing = {"resize": (4, 4), "mean": 0.5, "std": 0.25}


def on_the_model():
    model = _linear(48)
    model.explain_preprocessing = {"mean": [0.1, 0.2, 0.3], "std": [0.5, 0.25, 2.0]}
    return model


def badly_declared():
    return _linear(16)


badly_declared.explain_preprocessing = {"resize": (4, 4), "mean": 0.5, "std": -1.0}
"""

UP = np.array([[1.0, 0.0], [0.75, 0.25], [0.25, 0.75], [0.0, 1.0]])
"""Bilinear 2 → 4 (half-pixel centres: 4 outputs at −0.25, 0.25, 0.75, 1.25, clamped)."""


@pytest.fixture
def models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    return write_user_module(tmp_path, monkeypatch, "plotmodels", MODELS)


def linear_parts(reference: str) -> tuple[np.ndarray, np.ndarray]:
    model = load_model(reference)
    return model[1].weight.detach().double().numpy(), model[1].bias.detach().double().numpy()


def input_x_gradient(reference: str, x: np.ndarray) -> tuple[np.ndarray, int]:
    """What the model is given (``x``) times the gradient of its top logit: ``x · W[t]``."""
    weight, bias = linear_parts(reference)
    target = int(np.argmax(weight @ x.ravel() + bias))
    return x * weight[target].reshape(x.shape), target


@pytest.fixture
def drawn(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Record every overlay the command draws: its arguments and the figure."""
    calls: list[dict[str, Any]] = []
    real = plots.overlay

    def recording(image: Any, attribution: Any, **options: Any) -> Any:
        figure = real(image, attribution, **options)
        calls.append({"image": np.array(image), "map": np.array(attribution), "figure": figure})
        return figure

    monkeypatch.setattr(plots, "overlay", recording)
    return calls


def attribute(models: str, factory: str, *args: str) -> list[str]:
    return ["attribute", *args, "--model", f"{models}:{factory}", "--method", "input_x_gradient"]


def test_attribute_writes_the_overlay_with_its_colour_bar_and_the_raw_map(
    models: str, tmp_path: Path, drawn: list, capsys: pytest.CaptureFixture[str]
) -> None:
    x = np.random.default_rng(0).uniform(size=(1, 4, 4)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    code, out, err = run_cli([*attribute(models, "grey", "x.npy"), "--out", "maps"], capsys)
    assert code == 0, err
    expected, target = input_x_gradient(f"{models}:grey", x.astype(np.float64))
    raw = np.load(tmp_path / "maps" / "x.npy")
    assert raw.shape == (1, 4, 4)
    np.testing.assert_allclose(raw, expected, atol=1e-6)
    (call,) = drawn
    np.testing.assert_array_equal(call["image"], x)  # the input under the map
    np.testing.assert_array_equal(call["map"], raw)
    base, heat = call["figure"].axes[0].images
    np.testing.assert_allclose(base.get_array(), x[0])
    v = float(np.percentile(np.abs(raw[0]), 99.75))
    np.testing.assert_allclose(heat.get_clim(), (-v, v), rtol=1e-6)
    assert f"±{v:.3g}" in heat.colorbar.ax.get_ylabel()
    assert (
        call["figure"].axes[0].get_title() == f"x.npy: input_x_gradient, class {target} (predicted)"
    )
    rgb = pixels(tmp_path / "maps" / "x.png")
    width, height = call["figure"].get_size_inches() * 150
    assert rgb.shape == (round(height), round(width), 3)
    assert len(np.unique(rgb.reshape(-1, 3), axis=0)) > 100  # a drawn figure, not a blank
    assert f"x.npy: input_x_gradient for class {target} " in out


def test_attribute_explains_a_whole_batch_npy(
    models: str, tmp_path: Path, drawn: list, capsys: pytest.CaptureFixture[str]
) -> None:
    batch = np.random.default_rng(1).uniform(size=(3, 1, 4, 4)).astype(np.float32)
    single = np.random.default_rng(2).uniform(size=(4, 4)).astype(np.float32)
    np.save(tmp_path / "b.npy", batch)
    np.save(tmp_path / "b-1.npy", single)  # its stem is one of the batch's pictures
    code, out, err = run_cli(
        [*attribute(models, "grey", "b.npy", "b-1.npy"), "--out", "maps"], capsys
    )
    assert code == 0, err
    names = sorted(p.name for p in (tmp_path / "maps").iterdir())
    assert names == ["b-0.png", "b-1-2.npy", "b-1-2.png", "b-1.png", "b-2.png", "b.npy"]
    raw = np.load(tmp_path / "maps" / "b.npy")
    assert raw.shape == batch.shape  # the batch's maps in the batch's layout
    lines = out.splitlines()
    assert len(lines) == 4
    for j in range(3):
        expected, target = input_x_gradient(f"{models}:grey", batch[j].astype(np.float64))
        np.testing.assert_allclose(raw[j], expected, atol=1e-6)
        assert lines[j].startswith(f"b.npy[{j}]: input_x_gradient for class {target} ")
        assert lines[j].endswith(f"maps/b-{j}.png, maps/b.npy")
        np.testing.assert_array_equal(drawn[j]["image"], batch[j])
    expected, _ = input_x_gradient(f"{models}:grey", single[None].astype(np.float64))
    np.testing.assert_allclose(np.load(tmp_path / "maps" / "b-1-2.npy"), expected, atol=1e-6)


def test_attribute_resize_is_bilinear_and_the_picture_shows_the_resized_input(
    models: str, tmp_path: Path, drawn: list, capsys: pytest.CaptureFixture[str]
) -> None:
    x = np.array([[[0.0, 1.0], [0.5, 0.25]]], dtype=np.float32)
    np.save(tmp_path / "x.npy", x)
    argv = [*attribute(models, "grey", "x.npy"), "--resize", "4,4", "--out", "maps"]
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    resized = (UP @ x[0].astype(np.float64) @ UP.T)[None]  # worked out by hand above
    expected, _ = input_x_gradient(f"{models}:grey", resized)
    np.testing.assert_allclose(np.load(tmp_path / "maps" / "x.npy"), expected, atol=1e-6)
    np.testing.assert_allclose(drawn[0]["image"], resized, atol=1e-6)


def test_attribute_normalize_scalar_and_per_channel(
    models: str, tmp_path: Path, drawn: list, capsys: pytest.CaptureFixture[str]
) -> None:
    x = np.random.default_rng(3).uniform(size=(1, 4, 4)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    argv = [*attribute(models, "grey", "x.npy"), "--normalize", "0.5,0.25", "--out", "one"]
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    expected, _ = input_x_gradient(f"{models}:grey", (x.astype(np.float64) - 0.5) / 0.25)
    np.testing.assert_allclose(np.load(tmp_path / "one" / "x.npy"), expected, atol=1e-5)
    np.testing.assert_array_equal(drawn[0]["image"], x)  # shown before normalisation

    rgb = np.random.default_rng(4).uniform(size=(3, 4, 4)).astype(np.float32)
    np.save(tmp_path / "rgb.npy", rgb)
    per_channel = "0.1,0.2,0.3,0.5,0.25,2"
    argv = [*attribute(models, "rgb", "rgb.npy"), "--normalize", per_channel, "--out", "three"]
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    mean, std = np.array([0.1, 0.2, 0.3])[:, None, None], np.array([0.5, 0.25, 2.0])[:, None, None]
    expected, _ = input_x_gradient(f"{models}:rgb", (rgb.astype(np.float64) - mean) / std)
    np.testing.assert_allclose(np.load(tmp_path / "three" / "rgb.npy"), expected, atol=1e-5)


def test_attribute_reads_the_factory_s_declaration_and_the_options_replace_it(
    models: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    x = np.array([[[0.0, 1.0], [0.5, 0.25]]], dtype=np.float32)
    np.save(tmp_path / "x.npy", x)
    code, _, err = run_cli([*attribute(models, "declared", "x.npy"), "--out", "a"], capsys)
    assert code == 0, err
    assert "resized to 4×4, normalised with mean 0.5 and std 0.25" in err
    assert f"{models}:declared.explain_preprocessing" in err
    resized = (UP @ x[0].astype(np.float64) @ UP.T)[None]
    expected, _ = input_x_gradient(f"{models}:declared", (resized - 0.5) / 0.25)
    np.testing.assert_allclose(np.load(tmp_path / "a" / "x.npy"), expected, atol=1e-5)

    argv = [*attribute(models, "declared", "x.npy"), "--normalize", "none", "--out", "b"]
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    expected, _ = input_x_gradient(f"{models}:declared", resized)  # resized, not normalised
    np.testing.assert_allclose(np.load(tmp_path / "b" / "x.npy"), expected, atol=1e-5)

    np.save(tmp_path / "y.npy", np.ones((1, 4, 4), np.float32))
    argv = [*attribute(models, "declared", "y.npy"), "--resize", "none", "--normalize", "1,2"]
    code, _, err = run_cli([*argv, "--out", "c"], capsys)
    assert code == 0, err
    assert "explain_preprocessing" not in err  # nothing of the declaration is used
    expected, _ = input_x_gradient(f"{models}:declared", np.zeros((1, 4, 4)))
    np.testing.assert_allclose(np.load(tmp_path / "c" / "y.npy"), expected, atol=1e-6)


def test_attribute_reads_the_declaration_on_the_model(
    models: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rgb = np.random.default_rng(5).uniform(size=(3, 4, 4)).astype(np.float32)
    np.save(tmp_path / "rgb.npy", rgb)
    code, _, err = run_cli([*attribute(models, "on_the_model", "rgb.npy"), "--out", "m"], capsys)
    assert code == 0, err
    assert "the model's explain_preprocessing" in err
    mean, std = np.array([0.1, 0.2, 0.3])[:, None, None], np.array([0.5, 0.25, 2.0])[:, None, None]
    expected, _ = input_x_gradient(f"{models}:on_the_model", (rgb.astype(np.float64) - mean) / std)
    np.testing.assert_allclose(np.load(tmp_path / "m" / "rgb.npy"), expected, atol=1e-5)


@pytest.mark.parametrize(
    ("options", "words"),
    [
        (["--resize", "0,4"], ("--resize", "H,W", "positive", "'0,4'")),
        (["--resize", "4"], ("--resize", "H,W", "'4'")),
        (["--resize", "a,b"], ("--resize", "H,W")),
        (["--normalize", "1,2,3"], ("--normalize", "as many means as stds", "3 value(s)")),
        (["--normalize", "0.5,0"], ("--normalize", "standard deviations must be positive")),
        (["--normalize", "x,y"], ("--normalize", "MEAN,STD")),
        (["--normalize", "nan,1"], ("--normalize", "finite")),
    ],
)
def test_attribute_bad_option_values_are_one_line_usage_errors(
    options: list[str], words: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["attribute", "x.npy", "--model", "m:f", "--method", "gradient", "--out", "o"]
    code, out, err = run_cli([*argv, *options], capsys)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("explain attribute: error:")
    for word in words:
        assert word in err


def test_attribute_preprocessing_that_does_not_fit_is_one_clear_error(
    models: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    np.save(tmp_path / "x.npy", np.zeros((1, 4, 4), np.float32))
    np.save(tmp_path / "v.npy", np.zeros(16, np.float32))
    cases = [
        (
            [*attribute(models, "grey", "x.npy"), "--normalize", "0,0,0,1,1,1"],
            ("3 per-channel means", "1 channel(s)", "MEAN,STD"),
        ),
        ([*attribute(models, "grey", "v.npy"), "--resize", "4,4"], ("--resize", "(16,)")),
        (
            [*attribute(models, "badly_declared", "x.npy")],
            ("badly_declared.explain_preprocessing", "positive"),
        ),
        (
            ["attribute", "x.npy", "--hf", "folder", "--method", "lrp.cp", "--resize", "4,4"],
            ("--resize and --normalize are for --model", "preprocessor_config.json"),
        ),
    ]
    for argv, words in cases:
        code, _, err = run_cli([*argv, "--out", "never"], capsys)
        assert code == 1, err
        assert len(err.strip().splitlines()) == 1 or "note:" in err, err
        line = [line for line in err.splitlines() if line.startswith("explain: error:")]
        assert len(line) == 1 and "Traceback" not in err, err
        for word in words:
            assert word in line[0], line[0]
        assert not (tmp_path / "never").exists()


def test_attribute_help_documents_the_picture_options(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["attribute", "--help"], capsys)
    assert code == 0
    text = " ".join(out.split())
    for words in ("--resize H,W", "--normalize MEAN,STD", "explain_preprocessing", "(N, C, H, W)"):
        assert words in text, words


def test_attribute_vector_inputs_get_a_heatmap(
    models: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    np.save(tmp_path / "v.npy", np.linspace(-1, 1, 16, dtype=np.float32))
    code, _, err = run_cli([*attribute(models, "grey", "v.npy"), "--out", "maps"], capsys)
    assert code == 0, err
    assert np.load(tmp_path / "maps" / "v.npy").shape == (16,)
    assert pixels(tmp_path / "maps" / "v.png").shape[1] > 300
