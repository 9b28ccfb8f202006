"""n x n grids of digits from distinct classes, for localisation metrics.

Each grid shows ``n * n`` images of pairwise different classes. An attribution map for one
class should then concentrate inside that class's cell, which is the adapted pointing game
used to evaluate CoDA-Nets.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["MultiImageGrids", "make_multi_image_grids"]


@dataclass(frozen=True)
class MultiImageGrids:
    """A batch of multi-image grids with per-cell class labels.

    Attributes:
        images: float32 tensor of shape (G, C, n*H, n*W).
        cell_labels: int64 tensor of shape (G, n*n); the class shown in each cell, in
            row-major cell order.
        n: Number of cells along each side of a grid.
        cell_size: ``(H, W)`` of a single cell.
    """

    images: torch.Tensor
    cell_labels: torch.Tensor
    n: int
    cell_size: tuple[int, int]

    def _check_grid(self, grid: int) -> None:
        """Raise if ``grid`` is not a valid grid index."""
        count = self.cell_labels.shape[0]
        if not 0 <= grid < count:
            raise ValueError(
                f"grid must be an index between 0 and {count - 1}; got grid={grid}. "
                f"This batch holds {count} grids."
            )

    def cell_of_class(self, grid: int, label: int) -> int:
        """Return the row-major cell index holding ``label`` in one grid.

        Args:
            grid: Index of the grid in the batch.
            label: Class label to look up.

        Returns:
            The cell index in ``[0, n*n)``.

        Raises:
            ValueError: If ``grid`` is out of range or ``label`` is not shown in that grid.
        """
        self._check_grid(grid)
        row = self.cell_labels[grid]
        hits = torch.nonzero(row == label).flatten()
        if hits.numel() == 0:
            raise ValueError(
                f"class {label} is not in grid {grid}; that grid shows classes "
                f"{row.tolist()}. Ask only for a class present in the grid."
            )
        return int(hits[0])

    def _cell_masks(self, cells: torch.Tensor) -> torch.Tensor:
        """Build boolean masks (K, n*H, n*W) that are True inside the given cells (K,)."""
        height, width = self.cell_size
        device = self.cell_labels.device
        rows = torch.arange(self.n * height, device=device) // height
        cols = torch.arange(self.n * width, device=device) // width
        in_row = rows.unsqueeze(0) == (cells // self.n).unsqueeze(1)
        in_col = cols.unsqueeze(0) == (cells % self.n).unsqueeze(1)
        return in_row.unsqueeze(2) & in_col.unsqueeze(1)

    def class_mask(self, grid: int, label: int) -> torch.Tensor:
        """Return the region of one grid occupied by a class.

        Args:
            grid: Index of the grid in the batch.
            label: Class label to locate.

        Returns:
            Bool tensor of shape (n*H, n*W), True exactly inside the class's cell.

        Raises:
            ValueError: If ``grid`` is out of range or ``label`` is not shown in that grid.
        """
        cell = self.cell_of_class(grid, label)
        cells = torch.tensor([cell], device=self.cell_labels.device)
        return self._cell_masks(cells)[0]

    def class_masks(self, labels: torch.Tensor) -> torch.Tensor:
        """Return, for every grid, the region occupied by one requested class.

        Args:
            labels: Integer tensor of shape (G,); the class to locate in each grid.

        Returns:
            Bool tensor of shape (G, n*H, n*W).

        Raises:
            ValueError: If ``labels`` has the wrong shape or a label is absent from its grid.
        """
        count = self.cell_labels.shape[0]
        labels = torch.as_tensor(labels, device=self.cell_labels.device)
        if labels.shape != (count,):
            raise ValueError(
                f"labels must have shape ({count},), one label per grid; "
                f"got shape {tuple(labels.shape)}."
            )
        matches = self.cell_labels == labels.unsqueeze(1)
        present = matches.any(dim=1)
        if not bool(present.all()):
            grid = int(torch.nonzero(~present).flatten()[0])
            raise ValueError(
                f"class {int(labels[grid])} is not in grid {grid}; that grid shows classes "
                f"{self.cell_labels[grid].tolist()}. Pass one label present in each grid."
            )
        return self._cell_masks(matches.to(torch.int8).argmax(dim=1))


def check_images_and_labels(images: torch.Tensor, labels: torch.Tensor) -> np.ndarray:
    """Validate an image batch (N, C, H, W) and its labels (N,).

    Args:
        images: Floating-point image tensor of shape (N, C, H, W), N >= 1.
        labels: Integer label tensor of shape (N,).

    Returns:
        The labels as an int64 numpy array.

    Raises:
        ValueError: If shapes, dtypes or values do not fit.
    """
    if not isinstance(images, torch.Tensor) or images.dim() != 4:
        got = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(
            f"images must be a tensor of shape (N, C, H, W); got {got}. "
            "Add a channel dimension with images.unsqueeze(1) if needed."
        )
    if not images.is_floating_point():
        raise ValueError(
            f"images must have a floating dtype; got {images.dtype}. Convert with images.float()."
        )
    if images.shape[0] == 0:
        raise ValueError("images must hold at least one image; got an empty batch.")
    if not bool(torch.isfinite(images).all()):
        raise ValueError("images must be finite; got NaN or inf values. Clean the input first.")
    labels = torch.as_tensor(labels)
    if labels.shape != (images.shape[0],):
        raise ValueError(
            f"labels must have shape ({images.shape[0]},) to match images; "
            f"got shape {tuple(labels.shape)}."
        )
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise ValueError(
            f"labels must have an integer dtype; got {labels.dtype}. Convert with labels.long()."
        )
    return labels.detach().cpu().numpy().astype(np.int64)


def _check_count(name: str, value: int, minimum: int) -> None:
    """Raise unless ``value`` is an int >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}; got {name}={value!r}.")


def _present_classes(label_array: np.ndarray, num_classes: int | None) -> np.ndarray:
    """Return the sorted distinct labels, checking them against ``num_classes`` if given."""
    classes = np.unique(label_array)
    if num_classes is not None:
        _check_count("num_classes", num_classes, 1)
        if classes[0] < 0 or classes[-1] >= num_classes:
            raise ValueError(
                f"labels must lie in [0, {num_classes - 1}] for num_classes={num_classes}; "
                f"got labels from {classes[0]} to {classes[-1]}. Fix num_classes or the labels."
            )
    return classes


def _sample_cells(
    rng: np.random.Generator, label_array: np.ndarray, classes: np.ndarray, cells: int, count: int
) -> tuple[np.ndarray, np.ndarray]:
    """Draw distinct classes per grid (in random cell order) and one source image for each.

    Returns:
        Cell labels and source image indices, both int64 arrays of shape (count, cells).
    """
    members = {int(c): np.flatnonzero(label_array == c) for c in classes}
    cell_labels = np.empty((count, cells), dtype=np.int64)
    sources = np.empty((count, cells), dtype=np.int64)
    for g in range(count):
        # choice without replacement is already in random order, so it also sets the placement.
        cell_labels[g] = rng.choice(classes, size=cells, replace=False)
        for k, cls in enumerate(cell_labels[g]):
            pool = members[int(cls)]
            sources[g, k] = pool[rng.integers(pool.size)]
    return cell_labels, sources


def make_multi_image_grids(
    images: torch.Tensor,
    labels: torch.Tensor,
    *,
    n: int = 3,
    count: int = 100,
    seed: int = 0,
    num_classes: int | None = None,
) -> MultiImageGrids:
    """Tile random images of distinct classes into n x n grids.

    Every grid holds ``n * n`` pairwise different classes; for each class a random image of
    that class is drawn from ``images`` and placed in a random cell. All randomness comes
    from ``np.random.default_rng(seed)``.

    Args:
        images: Source images, shape (N, C, H, W).
        labels: Integer class labels of the source images, shape (N,).
        n: Cells per side; ``n * n`` must not exceed the number of classes present.
        count: Number of grids to build.
        seed: Seed of the numpy random generator.
        num_classes: Optional total class count; if given, labels must lie in
            ``[0, num_classes)``.

    Returns:
        The grids, on the device of ``images``.

    Raises:
        ValueError: On malformed inputs, ``n`` or ``count`` < 1, or too few classes present.
    """
    label_array = check_images_and_labels(images, labels)
    _check_count("n", n, 1)
    _check_count("count", count, 1)
    classes = _present_classes(label_array, num_classes)
    max_n = int(np.floor(np.sqrt(classes.size)))
    if n * n > classes.size:
        raise ValueError(
            f"n must be between 1 and {max_n} for {classes.size} classes "
            f"(each class at most once per grid); got n={n}."
        )
    rng = np.random.default_rng(seed)
    cell_labels, sources = _sample_cells(rng, label_array, classes, n * n, count)

    _, channels, height, width = images.shape
    picked = images.detach()[torch.from_numpy(sources).to(images.device)].to(torch.float32)
    # (G, n, n, C, H, W) -> (G, C, n, H, n, W) so that rows of cells stack along the height.
    picked = picked.reshape(count, n, n, channels, height, width).permute(0, 3, 1, 4, 2, 5)
    grid_images = picked.reshape(count, channels, n * height, n * width).contiguous()
    return MultiImageGrids(
        images=grid_images,
        cell_labels=torch.from_numpy(cell_labels).to(images.device),
        n=n,
        cell_size=(height, width),
    )
