"""Reading inputs for the CLI: NumPy arrays and image files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from explain_core.errors import InvalidInputError
from explain_core.extras import require

__all__ = [
    "IMAGE_SUFFIXES",
    "load_input",
    "stack_inputs",
]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff")


def load_input(path: str | Path, channels: int | None = None) -> torch.Tensor:
    """Load one input as a float32 ``(C, H, W)`` (or ``(F,)``) tensor.

    ``.npy`` files are used as they are (``(H, W)`` gains a channel axis). Images become values
    in [0, 1] with ``channels`` channels (1: grayscale, 3: RGB; default: as stored).

    Raises:
        InvalidInputError: If the file is missing, unreadable, of an unknown type, or not finite.
    """
    path = Path(path)
    if path.is_dir():
        raise InvalidInputError(
            f"input {path} is a folder, not a file; give the image or .npy files themselves "
            f"(e.g. {path / '*.png'})"
        )
    if not path.is_file():
        raise InvalidInputError(f"input file {path} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".npy":
        try:
            array = np.load(path, allow_pickle=False)
        except ValueError as error:
            raise InvalidInputError(f"{path} is not a plain numeric .npy array: {error}") from error
        if array.ndim == 2:
            array = array[None]
    elif suffix in IMAGE_SUFFIXES:
        array = _read_image(path, channels)
    else:
        raise InvalidInputError(
            f"cannot read {path.name}: inputs must be .npy arrays or images "
            f"({', '.join(IMAGE_SUFFIXES)})"
        )
    real = np.issubdtype(array.dtype, np.integer) or np.issubdtype(array.dtype, np.floating)
    if not real or not np.isfinite(array).all():
        raise InvalidInputError(f"{path} must hold finite numbers; got dtype {array.dtype}")
    tensor = torch.as_tensor(np.ascontiguousarray(array), dtype=torch.float32)
    if channels is not None and tensor.dim() == 3 and tensor.shape[0] != channels:
        raise InvalidInputError(
            f"{path.name} has {tensor.shape[0]} channels but the model expects {channels}"
        )
    return tensor


def _read_image(path: Path, channels: int | None) -> np.ndarray:
    pil_image = require("PIL.Image", "reading image files")
    try:
        with pil_image.open(path) as image:
            if image.mode.startswith(("I", "F")):
                raise InvalidInputError(
                    f"{path} has more than 8 bits per channel ({image.mode}); save it as an "
                    "8-bit image or as a .npy array"
                )
            grayscale = image.mode in ("L", "LA", "1")
            mode = {1: "L", 3: "RGB"}.get(channels or 0, "L" if grayscale else "RGB")
            array = np.asarray(image.convert(mode), dtype=np.float32) / 255.0
    except (pil_image.UnidentifiedImageError, OSError) as error:
        raise InvalidInputError(f"{path} is not a readable image: {error}") from error
    return array[None] if array.ndim == 2 else np.moveaxis(array, -1, 0)


def stack_inputs(tensors: list[torch.Tensor], names: list[str]) -> torch.Tensor:
    """Stack per-file inputs into one batch.

    Raises:
        InvalidInputError: If the inputs differ in shape (naming the first that differs).
    """
    first = tensors[0].shape
    for tensor, name in zip(tensors, names, strict=False):
        if tensor.shape != first:
            raise InvalidInputError(
                f"all inputs must have one shape; {names[0]} is {tuple(first)} but {name} is "
                f"{tuple(tensor.shape)}"
            )
    return torch.stack(tensors)
