"""The scikit-learn 8x8 handwritten digits as a fixed, stratified train/test split."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from explain_core.extras import require

__all__ = ["CLASS_NAMES", "NATIVE_SIZE", "DigitsSplit", "load_digits"]

CLASS_NAMES: tuple[str, ...] = tuple(str(d) for d in range(10))
"""Human-readable class names, indexed by label."""

NATIVE_SIZE = 8
"""Side length of the images as shipped by scikit-learn."""

_MAX_PIXEL = 16.0  # sklearn digits store ink as integers 0..16


@dataclass(frozen=True)
class DigitsSplit:
    """A train/test split of the digits data set.

    Attributes:
        train_images: float32 tensor of shape (N_train, 1, S, S) with values in [0, 1].
        train_labels: int64 tensor of shape (N_train,).
        test_images: float32 tensor of shape (N_test, 1, S, S) with values in [0, 1].
        test_labels: int64 tensor of shape (N_test,).
        image_size: The side length S of every image.
    """

    train_images: torch.Tensor
    train_labels: torch.Tensor
    test_images: torch.Tensor
    test_labels: torch.Tensor
    image_size: int

    def train_dataset(self) -> TensorDataset:
        """Wrap the training split for use with a ``DataLoader``.

        Returns:
            A ``TensorDataset`` yielding ``(image, label)`` pairs.
        """
        return TensorDataset(self.train_images, self.train_labels)

    def test_dataset(self) -> TensorDataset:
        """Wrap the test split for use with a ``DataLoader``.

        Returns:
            A ``TensorDataset`` yielding ``(image, label)`` pairs.
        """
        return TensorDataset(self.test_images, self.test_labels)


@functools.lru_cache(maxsize=1)
def _raw_digits() -> tuple[np.ndarray, np.ndarray]:
    """Load and cache the raw sklearn arrays (imported lazily to keep package import light)."""
    datasets = require("sklearn.datasets", "the bundled digits")
    bunch = datasets.load_digits()
    images = np.asarray(bunch.images, dtype=np.float32)
    labels = np.asarray(bunch.target, dtype=np.int64)
    # Read-only so the cached arrays cannot be corrupted through a view.
    images.setflags(write=False)
    labels.setflags(write=False)
    return images, labels


def _validate(image_size: int, test_fraction: float) -> None:
    """Check the arguments of :func:`load_digits`."""
    if isinstance(image_size, bool) or not isinstance(image_size, int):
        raise ValueError(
            f"image_size must be an int >= {NATIVE_SIZE}; got {image_size!r} "
            f"({type(image_size).__name__}). Pass an integer such as 8 or 28."
        )
    if image_size < NATIVE_SIZE:
        raise ValueError(
            f"image_size must be >= {NATIVE_SIZE} (the native digit size; only upsampling is "
            f"supported); got image_size={image_size}. Use {NATIVE_SIZE} or larger."
        )
    if not 0.0 < float(test_fraction) < 1.0:
        raise ValueError(
            f"test_fraction must be strictly between 0 and 1; got test_fraction={test_fraction}. "
            "Use e.g. 0.25 for a 75/25 split."
        )


def _stratified_indices(
    labels: np.ndarray, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Split indices per class with a numpy RNG, so torch's global RNG plays no part.

    Args:
        labels: Integer class labels, shape (N,).
        test_fraction: Fraction of each class assigned to the test split.
        seed: Seed for ``np.random.default_rng``.

    Returns:
        Sorted train indices and sorted test indices.
    """
    rng = np.random.default_rng(seed)
    train_parts: list[np.ndarray] = []
    test_parts: list[np.ndarray] = []
    for cls in np.unique(labels):
        members = np.flatnonzero(labels == cls)
        members = members[rng.permutation(members.size)]
        n_test = round(test_fraction * members.size)
        test_parts.append(members[:n_test])
        train_parts.append(members[n_test:])
    return np.sort(np.concatenate(train_parts)), np.sort(np.concatenate(test_parts))


def _to_tensor(images: np.ndarray, image_size: int) -> torch.Tensor:
    """Convert raw (N, 8, 8) pixel counts to a fresh float32 (N, 1, S, S) tensor in [0, 1]."""
    tensor = torch.from_numpy(images / np.float32(_MAX_PIXEL)).unsqueeze(1).contiguous()
    if image_size != NATIVE_SIZE:
        tensor = F.interpolate(
            tensor, size=(image_size, image_size), mode="bilinear", align_corners=False
        )
        tensor = tensor.clamp_(0.0, 1.0)
    return tensor


def load_digits(
    *, image_size: int = NATIVE_SIZE, test_fraction: float = 0.25, seed: int = 0
) -> DigitsSplit:
    """Load the 1797 scikit-learn digits as a deterministic stratified split.

    For every class, the class's indices are permuted with ``np.random.default_rng(seed)``
    and the first ``round(test_fraction * class_count)`` go to the test split. Both splits
    are then sorted by original index. The returned tensors are fresh copies, so callers
    may modify them freely.

    Args:
        image_size: Side length of the returned images. Values above 8 are produced by
            bilinear upsampling (``align_corners=False``) followed by clamping to [0, 1].
        test_fraction: Fraction of each class placed in the test split, in (0, 1).
        seed: Seed of the split permutation.

    Returns:
        The train/test split.

    Raises:
        ValueError: If ``image_size`` < 8 or ``test_fraction`` is not in (0, 1).
    """
    _validate(image_size, test_fraction)
    raw_images, raw_labels = _raw_digits()
    train_idx, test_idx = _stratified_indices(raw_labels, float(test_fraction), seed)
    return DigitsSplit(
        train_images=_to_tensor(raw_images[train_idx], image_size),
        train_labels=torch.from_numpy(raw_labels[train_idx].copy()),
        test_images=_to_tensor(raw_images[test_idx], image_size),
        test_labels=torch.from_numpy(raw_labels[test_idx].copy()),
        image_size=image_size,
    )
