from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from explain_core.errors import InvalidInputError
from explain_core.inputs import load_input, stack_inputs


def test_npy_2d_gains_channel_axis(tmp_path: Path) -> None:
    array = np.arange(12, dtype=np.float64).reshape(3, 4) / 7
    np.save(tmp_path / "x.npy", array)
    tensor = load_input(tmp_path / "x.npy")
    assert tensor.dtype == torch.float32
    assert tensor.shape == (1, 3, 4)
    assert torch.equal(tensor[0], torch.tensor(array, dtype=torch.float32))


def test_npy_3d_and_1d_kept(tmp_path: Path) -> None:
    np.save(tmp_path / "c.npy", np.ones((3, 2, 2), dtype=np.float32) * 0.25)
    np.save(tmp_path / "f.npy", np.array([1, 2, 3], dtype=np.int64))
    assert load_input(tmp_path / "c.npy").shape == (3, 2, 2)
    assert float(load_input(tmp_path / "c.npy").sum()) == pytest.approx(3.0)
    features = load_input(str(tmp_path / "f.npy"))
    assert features.dtype == torch.float32
    assert features.tolist() == [1.0, 2.0, 3.0]


def test_npy_channels_check(tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.zeros((3, 4, 4), dtype=np.float32))
    assert load_input(tmp_path / "x.npy", channels=3).shape == (3, 4, 4)
    with pytest.raises(InvalidInputError) as info:
        load_input(tmp_path / "x.npy", channels=1)
    message = str(info.value)
    assert "x.npy" in message and "3 channels" in message and "expects 1" in message


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_npy_not_finite(tmp_path: Path, bad: float) -> None:
    array = np.zeros((4, 4), dtype=np.float32)
    array[1, 2] = bad
    np.save(tmp_path / "x.npy", array)
    with pytest.raises(InvalidInputError, match="finite"):
        load_input(tmp_path / "x.npy")


def test_npy_object_dtype_refused(tmp_path: Path) -> None:
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    with pytest.raises(InvalidInputError) as info:
        load_input(tmp_path / "obj.npy")
    assert "not a plain numeric .npy array" in str(info.value)


def test_npy_non_numeric_dtype_refused(tmp_path: Path) -> None:
    np.save(tmp_path / "s.npy", np.array(["a", "b"]))
    with pytest.raises(InvalidInputError, match="finite numbers"):
        load_input(tmp_path / "s.npy")


def test_npy_garbage_refused(tmp_path: Path) -> None:
    (tmp_path / "bad.npy").write_bytes(b"definitely not numpy")
    with pytest.raises(InvalidInputError, match=r"bad\.npy"):
        load_input(tmp_path / "bad.npy")


def test_grayscale_png_exact_values(tmp_path: Path) -> None:
    pixels = (np.arange(64, dtype=np.uint8) * 4).reshape(8, 8)
    pixels[7, 7] = 255
    Image.fromarray(pixels, mode="L").save(tmp_path / "g.png")
    tensor = load_input(tmp_path / "g.png")
    assert tensor.shape == (1, 8, 8)
    assert tensor.dtype == torch.float32
    expected = torch.tensor(pixels, dtype=torch.float32) / 255.0
    assert torch.allclose(tensor[0], expected, atol=1e-7, rtol=0)
    assert float(tensor.min()) == 0.0 and float(tensor.max()) == 1.0
    assert float(tensor[0, 0, 1]) == pytest.approx(4 / 255)


def test_rgb_png_channels_first(tmp_path: Path) -> None:
    pixels = np.zeros((5, 6, 3), dtype=np.uint8)
    pixels[..., 0] = 255  # red everywhere
    pixels[2, 3] = (10, 20, 30)
    Image.fromarray(pixels, mode="RGB").save(tmp_path / "c.png")
    tensor = load_input(tmp_path / "c.png")
    assert tensor.shape == (3, 5, 6)
    assert torch.allclose(tensor[:, 2, 3], torch.tensor([10, 20, 30]) / 255.0)
    assert float(tensor[0, 0, 0]) == 1.0 and float(tensor[1, 0, 0]) == 0.0
    assert load_input(tmp_path / "c.png", channels=3).shape == (3, 5, 6)


def test_channels_1_converts_rgb_to_gray(tmp_path: Path) -> None:
    pixels = np.full((4, 4, 3), 200, dtype=np.uint8)  # gray: all channels equal → L == 200
    Image.fromarray(pixels, mode="RGB").save(tmp_path / "c.png")
    tensor = load_input(tmp_path / "c.png", channels=1)
    assert tensor.shape == (1, 4, 4)
    assert torch.allclose(tensor, torch.full((1, 4, 4), 200 / 255.0))


def test_channels_3_converts_gray_to_rgb(tmp_path: Path) -> None:
    Image.fromarray(np.full((4, 4), 51, dtype=np.uint8), mode="L").save(tmp_path / "g.png")
    tensor = load_input(tmp_path / "g.png", channels=3)
    assert tensor.shape == (3, 4, 4)
    assert torch.allclose(tensor, torch.full((3, 4, 4), 0.2))


def test_corrupt_image(tmp_path: Path) -> None:
    (tmp_path / "broken.png").write_bytes(b"\x89PNG not really")
    with pytest.raises(InvalidInputError, match="not a readable image"):
        load_input(tmp_path / "broken.png")


def test_unknown_suffix(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("1 2 3")
    with pytest.raises(InvalidInputError) as info:
        load_input(tmp_path / "notes.txt")
    message = str(info.value)
    assert "notes.txt" in message and ".npy" in message and ".png" in message


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="does not exist"):
        load_input(tmp_path / "missing.npy")


def test_folder_is_not_a_file(tmp_path: Path) -> None:
    (tmp_path / "dir.npy").mkdir()
    with pytest.raises(InvalidInputError, match="is a folder, not a file; give the image or"):
        load_input(tmp_path / "dir.npy")


def test_stack_inputs() -> None:
    a, b = torch.zeros(1, 2, 2), torch.ones(1, 2, 2)
    batch = stack_inputs([a, b], ["a.npy", "b.npy"])
    assert batch.shape == (2, 1, 2, 2)
    assert torch.equal(batch[1], b)


def test_stack_shape_mismatch_names_both_files() -> None:
    tensors = [torch.zeros(1, 8, 8), torch.zeros(1, 8, 8), torch.zeros(3, 8, 8)]
    with pytest.raises(InvalidInputError) as info:
        stack_inputs(tensors, ["first.npy", "second.png", "third.png"])
    message = str(info.value)
    assert "first.npy" in message and "(1, 8, 8)" in message
    assert "third.png" in message and "(3, 8, 8)" in message
    assert "second.png" not in message
