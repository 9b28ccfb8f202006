"""The demo's data section: pictures of every bundled data set, so users see what they get."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from explain_core.data.clutter import make_cluttered_digits
from explain_core.data.grids import make_multi_image_grids
from explain_core.demo import DemoContext, DemoSection, DemoStep
from explain_core.plots import grid, save_figure

OWN_MODEL = """\
from explain_core import plots

predicted = model(images).argmax(1)
plots.save_figure(plots.grid(inputs=images, labels=labels, predictions=predicted), "data.png")
"""


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
            grid(
                inputs=digits.test_images[first_of_class],
                labels=range(10),
                tile=1.0,
                title="One test digit per class, with its true label (no model has seen it yet)",
            ),
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
        summary = {
            "train": len(digits.train_labels),
            "test": len(digits.test_labels),
            "test_per_class": torch.bincount(digits.test_labels, minlength=10).tolist(),
            "grid_cells_per_image": grids.n**2,
            "mean_mask_fraction": float(cluttered.masks.double().mean()),
        }
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
            captions={
                "data_digits.png": "The first test digit of each class, titled with its true "
                "label; no model has predicted anything yet.",
                "data_grids.png": "3×3 grids of test digits; the outlined cell holds the class "
                "named above it.",
                "data_cluttered.png": "Cluttered digits, each titled with its true label and "
                "shown again with its ground-truth mask.",
            },
            summary=summary,
            own_model=OWN_MODEL,
            takeaways=takeaways(summary),
        )


def takeaways(summary: Mapping) -> list[str]:
    """The section's takeaways, from its numbers (``summary`` as the step returns it).

    Args:
        summary: ``test_per_class`` (digits per class in the test split),
            ``grid_cells_per_image`` and ``mean_mask_fraction`` (of the cluttered canvases).

    Returns:
        Three sentences: the class balance (chance accuracy) and the chance levels of the two
        localisation data sets.
    """
    counts = summary["test_per_class"]
    classes = len(counts)
    first = (
        f"The test split holds {min(counts)} to {max(counts)} digits per class, so guessing "
        f"scores about {1 / classes:.0%} and no class dominates the accuracies below."
    )
    cells = summary["grid_cells_per_image"]
    second = (
        f"A grid has {cells} cells, so a map that points at a random cell hits the outlined "
        f"class {1 / cells:.0%} of the time: the pointing game's chance level."
    )
    fraction = summary["mean_mask_fraction"]
    third = (
        f"The digit masks cover {fraction:.0%} of a cluttered canvas on average: a map that "
        "spreads its relevance at random puts about that share inside the mask, the floor a "
        "localisation score must beat."
    )
    return [first, second, third]
