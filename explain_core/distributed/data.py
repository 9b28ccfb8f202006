"""The data an evaluation runs over: inputs, labels and (for localisation) masks.

:class:`EvaluationData` holds tensors; :func:`as_evaluation_data` also accepts a tuple of tensors,
a ``TensorDataset``, :class:`~explain_core.data.ClutteredDigits` or any map-style ``Dataset``
whose items are ``(input, label[, mask])`` (read lazily: each rank only touches its own samples).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset, TensorDataset

from explain_core.errors import InvalidInputError

__all__ = ["DATASETS", "EvaluationData", "as_evaluation_data", "load_dataset"]


@dataclass(frozen=True)
class EvaluationData:
    """Samples to evaluate, indexed globally ``0 … N-1``.

    Attributes:
        inputs: ``(N, ...)`` model inputs.
        labels: ``(N,)`` integer labels, or ``None``.
        masks: ``(N, H, W)`` bool ground-truth regions (localisation), or ``None``.
        name: Name used in messages and output files.
    """

    inputs: torch.Tensor
    labels: torch.Tensor | None = None
    masks: torch.Tensor | None = None
    name: str = "data"

    def __post_init__(self) -> None:
        n = self.inputs.shape[0] if self.inputs.dim() else -1
        for what, tensor in (("labels", self.labels), ("masks", self.masks)):
            if tensor is not None and tensor.shape[0] != n:
                raise InvalidInputError(
                    f"{what} hold {tensor.shape[0]} samples but inputs hold {n}; they must match"
                )

    def __len__(self) -> int:
        return int(self.inputs.shape[0])

    def slice(self, start: int, stop: int) -> EvaluationData:
        """Samples ``start … stop-1``."""

        def part(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor[start:stop]

        return EvaluationData(part(self.inputs), part(self.labels), part(self.masks), self.name)


class _LazyData:
    """A map-style ``Dataset`` read item by item, only where a rank needs it."""

    def __init__(self, dataset: Any, name: str) -> None:
        self.dataset = dataset
        self.name = name

    def __len__(self) -> int:
        return len(self.dataset)

    def slice(self, start: int, stop: int) -> EvaluationData:
        items = [self.dataset[i] for i in range(start, stop)]
        if not items:
            raise InvalidInputError(f"no samples in {start}..{stop - 1}")
        if isinstance(items[0], torch.Tensor):
            items = [(item,) for item in items]
        columns = list(zip(*items, strict=True))
        tensors = [torch.stack([torch.as_tensor(v) for v in column]) for column in columns]
        tensors += [None] * (3 - len(tensors))
        inputs, labels, masks = tensors[:3]
        return EvaluationData(inputs, labels, None if masks is None else masks.bool(), self.name)


def as_evaluation_data(dataset: Any, name: str | None = None) -> Any:
    """Wrap ``dataset`` for :func:`~explain_core.distributed.evaluate`.

    Args:
        dataset: :class:`EvaluationData`; a tensor of inputs; a tuple ``(inputs, labels[,
            masks])``; a ``TensorDataset``; an object with ``images``/``labels``(/``masks``)
            tensors (e.g. ``ClutteredDigits``); a map-style ``Dataset`` yielding such tuples; or
            any object with ``len()`` and ``slice(start, stop)`` returning
            :class:`EvaluationData` (to load chunks lazily).
        name: Name in messages and files.

    Raises:
        InvalidInputError: If the data set cannot be read this way.
    """
    if isinstance(dataset, (EvaluationData, _LazyData)) or (
        callable(getattr(dataset, "slice", None)) and hasattr(dataset, "__len__")
    ):
        return dataset  # anything with len() and slice(start, stop) -> EvaluationData
    name = name or "data"
    if isinstance(dataset, torch.Tensor):
        return EvaluationData(dataset, name=name)
    if isinstance(dataset, TensorDataset):
        dataset = tuple(dataset.tensors)
    if isinstance(dataset, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in dataset):
        if not 1 <= len(dataset) <= 3:
            raise InvalidInputError(
                f"a tuple data set must be (inputs, labels[, masks]); got {len(dataset)} tensors"
            )
        inputs, labels, masks = (*dataset, None, None)[:3]
        return EvaluationData(inputs, labels, None if masks is None else masks.bool(), name)
    images = getattr(dataset, "images", None)
    if isinstance(images, torch.Tensor):
        masks = getattr(dataset, "masks", None)
        return EvaluationData(images, getattr(dataset, "labels", None), masks, name)
    if isinstance(dataset, Dataset) or (
        hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")
    ):
        return _LazyData(dataset, name)
    raise InvalidInputError(
        f"cannot evaluate on a {type(dataset).__name__}: pass a tensor, a tuple (inputs, labels"
        "[, masks]), a TensorDataset or a map-style Dataset"
    )


def _digits(image_size: int = 8, **_: Any) -> EvaluationData:
    from explain_core.data import load_digits

    split = load_digits(image_size=image_size)
    return EvaluationData(split.test_images, split.test_labels, None, "digits")


def _cluttered(canvas_size: int = 32, count: int = 200, seed: int = 0, **_: Any) -> EvaluationData:
    from explain_core.data import load_digits, make_cluttered_digits

    split = load_digits()
    data = make_cluttered_digits(
        split.test_images, split.test_labels, canvas_size=canvas_size, count=count, seed=seed
    )
    return EvaluationData(data.images, data.labels, data.masks, "cluttered")


DATASETS: dict[str, Callable[..., EvaluationData]] = {"digits": _digits, "cluttered": _cluttered}
"""Bundled data sets by name: ``digits`` (the test split, 450 images, 8×8 unless resized) and
``cluttered`` (digits pasted on cluttered 32×32 canvases, with ink masks)."""


def load_dataset(name: str, **options: Any) -> EvaluationData:
    """A bundled data set by name (see :data:`DATASETS`).

    Raises:
        InvalidInputError: For an unknown name.
    """
    if name not in DATASETS:
        raise InvalidInputError(f"unknown data set {name!r}; choose from {', '.join(DATASETS)}")
    return DATASETS[name](**options)
