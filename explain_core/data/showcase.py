"""The demo's data section: pictures of every bundled data set, so users see what they get."""

from __future__ import annotations

from explain_core.data.clutter import make_cluttered_digits
from explain_core.data.grids import make_multi_image_grids
from explain_core.demo import DemoContext, DemoSection, DemoStep
from explain_core.plots import grid, save_figure


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
        save_figure(
            grid(inputs=digits.test_images[first_of_class], labels=range(10), tile=1.0),
            context.out_dir / "data_digits.png",
        )
        first_labels = [int(label) for label in grids.cell_labels[:, 0]]
        save_figure(
            grid(
                inputs=grids.images,
                masks=[grids.class_mask(g, label) for g, label in enumerate(first_labels)],
                column_titles=[f"class {label} outlined" for label in first_labels],
            ),
            context.out_dir / "data_grids.png",
        )
        count = cluttered.images.shape[0]
        save_figure(  # each digit twice: as it is, and with its ground-truth mask outlined
            grid(
                inputs=[cluttered.images[i // 2] for i in range(2 * count)],
                masks=[cluttered.masks[i // 2] if i % 2 else None for i in range(2 * count)],
                column_titles=[
                    "mask" if i % 2 else f"digit {int(cluttered.labels[i // 2])}"
                    for i in range(2 * count)
                ],
            ),
            context.out_dir / "data_cluttered.png",
        )
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
