"""The demo's data section: pictures of every bundled data set, so users see what they get."""

from __future__ import annotations

import numpy as np

from explain_core.data.clutter import make_cluttered_digits
from explain_core.data.grids import make_multi_image_grids
from explain_core.demo import DemoContext, DemoSection, DemoStep
from explain_core.viz import image_to_rgb, save_grid


class BundledDataStep(DemoStep):
    """Digits, 3×3 multi-image grids and cluttered digits with their ground truth."""

    title = "Bundled data"
    order = 0

    def run(self, context: DemoContext) -> DemoSection:
        """Draw samples of each data set and count them."""
        digits = context.digits()
        grids = make_multi_image_grids(
            digits.test_images, digits.test_labels, n=3, count=4, seed=context.seed
        )
        cluttered = make_cluttered_digits(
            digits.test_images, digits.test_labels, canvas_size=24, count=4, seed=context.seed
        )
        first_of_class = [int((digits.test_labels == c).nonzero()[0]) for c in range(10)]
        save_grid(
            [[image_to_rgb(digits.test_images[i]) for i in first_of_class]],
            context.out_dir / "data_digits.png",
            scale=6,
        )
        grid_tiles, clutter_tiles = [], []
        for g in range(grids.images.shape[0]):
            label = int(grids.cell_labels[g, 0])
            picture = image_to_rgb(grids.images[g])
            mask = grids.class_mask(g, label).numpy()
            grid_tiles.append(_outline(picture, mask))
        for i in range(cluttered.images.shape[0]):
            picture = image_to_rgb(cluttered.images[i])
            clutter_tiles += [picture, _outline(picture, cluttered.masks[i].numpy())]
        save_grid([grid_tiles], context.out_dir / "data_grids.png", scale=4)
        save_grid([clutter_tiles], context.out_dir / "data_cluttered.png", scale=4)
        return DemoSection(
            self.title,
            lines=[
                f"- scikit-learn digits, 8×8: {len(digits.train_labels)} train / "
                f"{len(digits.test_labels)} test (fixed stratified split, seed {context.seed}).",
                "- 3×3 multi-image grids, each class at most once; the cell of the first class "
                "is outlined in green (ground truth for localisation).",
                "- Cluttered digits on noisy backgrounds, each shown beside its ground-truth "
                "digit mask (green).",
            ],
            figures=["data_digits.png", "data_grids.png", "data_cluttered.png"],
            summary={
                "train": len(digits.train_labels),
                "test": len(digits.test_labels),
                "grid_cells_per_image": grids.n**2,
                "mean_mask_fraction": float(cluttered.masks.double().mean()),
            },
        )


def _outline(picture: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Tint the masked pixels green so the ground truth is visible next to the image."""
    tinted = picture.copy()
    tinted[mask] = (0.5 * tinted[mask] + 0.5 * np.array([0, 200, 0])).astype(np.uint8)
    return tinted
