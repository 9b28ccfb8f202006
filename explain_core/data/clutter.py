"""Cluttered digits: one digit pasted on a noisy background with ground-truth ink mask.

The background holds fragments of other digits, so an explanation that highlights the
pasted digit's ink (and not the clutter) can be checked against the returned mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from explain_core.data.grids import check_images_and_labels

__all__ = ["ClutteredDigits", "make_cluttered_digits"]


@dataclass(frozen=True)
class ClutteredDigits:
    """A batch of cluttered-digit images with ground truth.

    Attributes:
        images: float32 tensor of shape (N, 1, canvas, canvas) with values in [0, 1].
        labels: int64 tensor of shape (N,); the class of the pasted digit.
        masks: bool tensor of shape (N, canvas, canvas); the pasted digit's ink
            (digit pixel > ink_threshold) at its pasted place.
        boxes: int64 tensor of shape (N, 4); top, left, bottom, right (exclusive) of the
            pasted digit.
    """

    images: torch.Tensor
    labels: torch.Tensor
    masks: torch.Tensor
    boxes: torch.Tensor


@dataclass(frozen=True)
class _Settings:
    """Validated generation parameters shared by the per-sample helpers."""

    canvas: int
    pieces: int
    piece: int
    noise_std: float
    ink_threshold: float


def _check_int(name: str, value: int, minimum: int) -> None:
    """Raise unless ``value`` is an int >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}; got {name}={value!r}.")


def _validate(images: torch.Tensor, count: int, settings: _Settings) -> None:
    """Check sizes and ranges against the source digits."""
    _, channels, height, width = images.shape
    if channels != 1:
        raise ValueError(
            f"images must have one channel, shape (N, 1, H, W); got {channels} channels. "
            "Convert to greyscale first."
        )
    if float(images.min()) < 0.0 or float(images.max()) > 1.0:
        raise ValueError(
            f"images must have values in [0, 1]; got range [{float(images.min()):.3g}, "
            f"{float(images.max()):.3g}]. Rescale or clamp them first."
        )
    _check_int("count", count, 1)
    _check_int("canvas_size", settings.canvas, 1)
    _check_int("clutter_pieces", settings.pieces, 0)
    _check_int("piece_size", settings.piece, 1)
    if settings.canvas < max(height, width):
        raise ValueError(
            f"canvas_size must be >= the digit size {max(height, width)} so the digit fits; "
            f"got canvas_size={settings.canvas}."
        )
    if settings.piece > min(height, width):
        raise ValueError(
            f"piece_size must be between 1 and the digit size {min(height, width)}; "
            f"got piece_size={settings.piece}."
        )
    if not settings.noise_std >= 0.0 or not np.isfinite(settings.noise_std):
        raise ValueError(
            f"noise_std must be a finite number >= 0; got noise_std={settings.noise_std}."
        )
    if not 0.0 <= settings.ink_threshold < 1.0:
        raise ValueError(
            f"ink_threshold must be in [0, 1) so ink can exceed it; "
            f"got ink_threshold={settings.ink_threshold}."
        )
    if settings.pieces > 0 and images.shape[0] < 2:
        raise ValueError(
            "clutter needs at least 2 source images (pieces come from digits other than the "
            f"pasted one); got {images.shape[0]}. Pass more images or clutter_pieces=0."
        )


def _other_index(rng: np.random.Generator, total: int, exclude: int) -> int:
    """Draw an index in [0, total) other than ``exclude``, uniformly."""
    index = int(rng.integers(total - 1))
    return index + 1 if index >= exclude else index


def _background(
    rng: np.random.Generator, digits: np.ndarray, source: int, settings: _Settings
) -> np.ndarray:
    """Max-combine random crops of other digits, then add Gaussian noise."""
    _, height, width = digits.shape
    size, piece = settings.canvas, settings.piece
    canvas = np.zeros((size, size), dtype=np.float32)
    for _ in range(settings.pieces):
        other = digits[_other_index(rng, digits.shape[0], source)]
        top, left = rng.integers(height - piece + 1), rng.integers(width - piece + 1)
        crop = other[top : top + piece, left : left + piece]
        y, x = rng.integers(size - piece + 1), rng.integers(size - piece + 1)
        region = canvas[y : y + piece, x : x + piece]
        np.maximum(region, crop, out=region)
    noise = rng.normal(0.0, settings.noise_std, size=(size, size)).astype(np.float32)
    return canvas + noise


def make_cluttered_digits(
    images: torch.Tensor,
    labels: torch.Tensor,
    *,
    canvas_size: int = 32,
    count: int = 200,
    clutter_pieces: int = 4,
    piece_size: int = 4,
    noise_std: float = 0.05,
    ink_threshold: float = 0.25,
    seed: int = 0,
) -> ClutteredDigits:
    """Paste random digits at random places on noisy, cluttered canvases.

    For each sample a source digit is drawn from ``images``. The background is built from
    ``clutter_pieces`` random ``piece_size`` x ``piece_size`` crops of other digits placed at
    random (combined by max) plus Gaussian noise ``N(0, noise_std)``. The digit is then
    max-combined at a random position where it fits, and the result is clamped to [0, 1].
    All randomness, the noise included, comes from ``np.random.default_rng(seed)``.

    Args:
        images: Source digits, shape (N, 1, H, W), values in [0, 1].
        labels: Integer labels of the source digits, shape (N,).
        canvas_size: Side length of the output canvas; at least the digit size.
        count: Number of samples to generate.
        clutter_pieces: Number of clutter crops per background (0 for none).
        piece_size: Side length of each clutter crop; at most the digit size.
        noise_std: Standard deviation of the background noise; >= 0.
        ink_threshold: Digit pixels above this value form the ground-truth mask.
        seed: Seed of the numpy random generator.

    Returns:
        The generated samples (CPU tensors).

    Raises:
        ValueError: On malformed inputs or out-of-range parameters.
    """
    label_array = check_images_and_labels(images, labels)
    settings = _Settings(
        canvas_size, clutter_pieces, piece_size, float(noise_std), float(ink_threshold)
    )
    _validate(images, count, settings)
    digits = images.detach().cpu().to(torch.float32)[:, 0].numpy()
    _, height, width = digits.shape
    rng = np.random.default_rng(seed)

    out = np.empty((count, 1, canvas_size, canvas_size), dtype=np.float32)
    masks = np.zeros((count, canvas_size, canvas_size), dtype=bool)
    boxes = np.empty((count, 4), dtype=np.int64)
    sources = np.empty(count, dtype=np.int64)
    for i in range(count):
        source = int(rng.integers(digits.shape[0]))
        canvas = _background(rng, digits, source, settings)
        top = int(rng.integers(canvas_size - height + 1))
        left = int(rng.integers(canvas_size - width + 1))
        region = canvas[top : top + height, left : left + width]
        np.maximum(region, digits[source], out=region)
        out[i, 0] = np.clip(canvas, 0.0, 1.0)
        masks[i, top : top + height, left : left + width] = digits[source] > ink_threshold
        boxes[i] = (top, left, top + height, left + width)
        sources[i] = source
    return ClutteredDigits(
        images=torch.from_numpy(out),
        labels=torch.from_numpy(label_array[sources]),
        masks=torch.from_numpy(masks),
        boxes=torch.from_numpy(boxes),
    )
