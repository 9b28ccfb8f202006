"""Deletion and insertion curves per method for the demo's sections that compare methods.

One figure (drawn with :func:`explain_core.plots.curves`), one table and one takeaway sentence,
all from the same numbers: the mean probability of the true class as the most relevant pixels
are removed (deletion) or put back into an empty input (insertion), per method, with a random
pixel order as the reference every method should beat.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from explain_core.demo import DemoContext, word_list
from explain_core.metrics.deletion_insertion import STEPS, deletion_insertion
from explain_core.plots import curves, save_figure

__all__ = ["RANDOM", "CurveReport", "curve_takeaway", "deletion_insertion_report"]

RANDOM = "random order"
TIE = 0.005  # areas closer than this to the best count as tied (the report shows two decimals)


@dataclass
class CurveReport:
    """What a section shows of its deletion and insertion curves.

    Attributes:
        figure: The picture's path relative to the output folder.
        caption: What the picture shows.
        table: Markdown table rows: each method's areas under the curves.
        aucs: Method (and :data:`RANDOM`) → ``{"deletion_auc", "insertion_auc"}``.
        samples: Number of inputs the curves average over.
        wrong: How many of them the model predicts wrongly.
    """

    figure: str
    caption: str
    table: list[str]
    aucs: dict[str, dict[str, float]] = field(default_factory=dict)
    samples: int = 0
    wrong: int = 0

    def lines(self) -> list[str]:
        """The report's paragraph on the curves, followed by the table."""
        return [
            f"Deletion and insertion (Petsiuk et al. 2018) on {self.samples} test digits: "
            "the probability of the true class as the pixels a method ranks highest are "
            "removed first (set to the background, 0), or put back first into an empty "
            "image. A faithful ranking makes deletion fall fast and insertion rise fast.",
            "",
            *self.table,
        ]

    def summary(self) -> dict[str, object]:
        """The numbers for ``summary.json``."""
        return {"samples": self.samples, "wrong": self.wrong, "steps": STEPS, "auc": self.aucs}


def deletion_insertion_report(
    context: DemoContext,
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    maps: Mapping[str, torch.Tensor],
    file_name: str,
) -> CurveReport:
    """Compute every method's curves (and random order's), draw them and tabulate their areas.

    Args:
        context: The demo run (its output folder, seed and progress bars).
        model: The model the maps explain, in eval mode.
        images: The inputs ``(N, C, H, W)``.
        labels: Their true classes: the curves track each true class's probability.
        maps: Method name → its maps ``(N, H, W)`` of the true classes.
        file_name: The picture's file name in the output folder.

    Returns:
        The figure's path, caption, table and numbers.
    """
    generator = torch.Generator().manual_seed(context.seed)
    shuffled = torch.rand(images.shape[0], *images.shape[-2:], generator=generator)
    results = {}
    for name, values in context.progress(
        [*maps.items(), (RANDOM, shuffled)], "deletion and insertion curves", total=len(maps) + 1
    ):
        results[name] = deletion_insertion(model, images, values, labels, steps=STEPS)
    aucs = {
        name: {"deletion_auc": result.deletion_auc, "insertion_auc": result.insertion_auc}
        for name, result in results.items()
    }
    with torch.no_grad():
        wrong = int((model(images).argmax(1) != labels).sum())
    deleted = {
        f"{name} ({aucs[name]['deletion_auc']:.2f})": (r.removed, r.deletion.mean(0))
        for name, r in results.items()
    }
    inserted = {
        f"{name} ({aucs[name]['insertion_auc']:.2f})": (r.inserted, r.insertion.mean(0))
        for name, r in results.items()
    }
    count = images.shape[0]
    figure = curves(
        {
            "deletion: most relevant pixels removed first": deleted,
            "insertion: most relevant pixels put back first": inserted,
        },
        xlabel="fraction of pixels removed / present",
        ylabel="probability of the true class",
        title=f"Deletion and insertion on {count} test digits, true class "
        f"({wrong} of them predicted wrongly)",
        note="mean over the digits; in brackets the area under the curve "
        "(deletion: lower is better, insertion: higher is better)",
        ylim=(-0.02, 1.02),
    )
    save_figure(figure, context.out_dir / file_name)
    table = [
        "| method | deletion AUC (lower is better) | insertion AUC (higher is better) |",
        "| --- | --- | --- |",
        *(
            f"| {name} | {auc['deletion_auc']:.3f} | {auc['insertion_auc']:.3f} |"
            for name, auc in aucs.items()
        ),
    ]
    caption = (
        f"Deletion and insertion curves per method: mean probability of the true class over "
        f"{count} test digits ({wrong} predicted wrongly) in {STEPS} steps, with a random pixel "
        "order for reference."
    )
    return CurveReport(file_name, caption, table, aucs, count, wrong)


def curve_takeaway(aucs: Mapping[str, Mapping[str, float]]) -> str:
    """One or two sentences on which method's pixel order is most faithful, from the areas.

    Args:
        aucs: Method → ``{"deletion_auc", "insertion_auc"}``, with :data:`RANDOM` among them.

    Returns:
        The sentence(s), naming the best method by each curve against random order, and the
        methods that do not beat random order.
    """
    methods = {name: auc for name, auc in aucs.items() if name != RANDOM}
    reference = aucs[RANDOM]
    deletion = {name: auc["deletion_auc"] for name, auc in methods.items()}
    insertion = {name: -auc["insertion_auc"] for name, auc in methods.items()}
    text = (
        f"Removing pixels in {_best(deletion)} lowers the true class's probability "
        f"fastest (deletion AUC {min(deletion.values()):.2f} against "
        f"{reference['deletion_auc']:.2f} for random order), and putting them back in "
        f"{_best(insertion)} raises it fastest (insertion AUC "
        f"{-min(insertion.values()):.2f} against {reference['insertion_auc']:.2f})."
    )
    losing = [
        name
        for name, auc in methods.items()
        if auc["deletion_auc"] >= reference["deletion_auc"]
        or auc["insertion_auc"] <= reference["insertion_auc"]
    ]
    if losing:
        verb = "does" if len(losing) == 1 else "do"
        text += f" {word_list(losing)} {verb} no better than random order on one of the two."
    return text


def _best(values: Mapping[str, float]) -> str:
    """``"the order of m"`` for the method with the smallest value, and of those tied with it."""
    lowest = min(values.values())
    tied = [name for name, value in values.items() if value - lowest < TIE]
    return f"the order of {word_list(tied)}" + (f" (tied within {TIE})" if len(tied) > 1 else "")
