"""The demo's transformer section: a ViT trained on the digits, explained by AttnLRP and CP-LRP.

The ViT (:mod:`.digits_vit`: 2×2 patches, a class token, ``nn.TransformerEncoder``) is trained on
the bundled 8×8 digits; six test digits are explained for their true class by the attention
rules and the gradient family, and conservation is measured: CP-LRP's relevance sums to the
logit on the bias-free copy of the model, AttnLRP's does not (its softmax rule), and on the
trained model biases absorb part of the score in both.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch
from torch import nn

from explain_core.api import explain
from explain_core.demo import DemoContext, DemoSection, DemoStep, prediction_note, word_list
from explain_core.demo_curves import curve_takeaway, deletion_insertion_report
from explain_core.plots import grid, save_figure
from explain_core.training import accuracy
from explain_modbp.digits_vit import DigitsViT, bias_free_copy, train_digits_vit

METHODS: dict[str, str] = {
    "AttnLRP": "lrp.attn",
    "CP-LRP": "lrp.cp",
    "Gradient": "gradient",
    "Input×Gradient": "input_x_gradient",
    "Integrated Gradients": "integrated_gradients",
}
SHOWN = 6
# A relative gap below this is float64 rounding: the relevance sums to the score.
CONSERVED = 1e-9

OWN_MODEL = """\
from explain_core import explain

result = explain(model, images, "lrp.cp", labels)  # CP-LRP; "lrp.attn" for AttnLRP
score = result.output.gather(1, result.target[:, None]).squeeze(1)
gap = (score - result.attribution.flatten(1).sum(1)).abs() / score.abs()  # the table's column
"""


def relative_gap(
    model: nn.Module, images: torch.Tensor, labels: torch.Tensor, method: str
) -> float:
    """Mean ``|score − Σ relevance| / |score|`` of ``method`` over ``images``."""
    result = explain(model, images.double(), method, labels)
    score = result.output.gather(1, result.target[:, None]).squeeze(1)
    gap = (score - result.attribution.flatten(1).sum(1)).abs() / score.abs()
    return float(gap.mean())


class TransformerDemoStep(DemoStep):
    """Train a small ViT on the digits and explain it with the attention rules."""

    title = "Transformers: AttnLRP and CP-LRP on a ViT trained on the digits"
    order = 35
    provides = ("transformers",)

    def run(self, context: DemoContext) -> DemoSection:
        """Train (or load) the ViT, draw the maps, measure conservation."""
        digits = context.digits(8)
        epochs = 8 if context.quick else 40
        settings = {"arch": "digits_vit-v1", "epochs": epochs}

        def train(model: nn.Module) -> None:
            trained, _ = train_digits_vit(seed=context.seed, epochs=epochs)
            model.load_state_dict(trained.state_dict())

        model, _, cached = context.cached_model("digits-vit", settings, DigitsViT, train)
        test_accuracy = accuracy(model, digits.test_images, digits.test_labels)
        images, labels = digits.test_images[:SHOWN], digits.test_labels[:SHOWN]
        with torch.no_grad():
            predicted = model(images).argmax(1)
        rows = {}
        for name in context.progress(METHODS, "maps"):
            result = explain(model, images, METHODS[name], labels)
            rows[name] = result.spatial_map()
        figure = grid(
            rows,
            inputs=images,
            labels=labels,
            predictions=predicted,
            title="A ViT on the digits, true class",
        )
        save_figure(figure, context.out_dir / "transformer_maps.png")

        count = 16 if context.quick else 64
        check, check_labels = digits.test_images[:count], digits.test_labels[:count]
        plain, bias_free = copy.deepcopy(model).double(), bias_free_copy(model).double()
        gaps: dict[str, dict[str, float]] = {
            name: {
                "trained": relative_gap(plain, check, check_labels, METHODS[name]),
                "bias-free": relative_gap(bias_free, check, check_labels, METHODS[name]),
            }
            for name in context.progress(("AttnLRP", "CP-LRP"), "conservation")
        }
        curve_count = 64 if context.quick else 256
        curve_images = digits.test_images[:curve_count]
        curve_labels = digits.test_labels[:curve_count]
        curve_maps = {
            name: explain(model, curve_images, METHODS[name], curve_labels).spatial_map()
            for name in context.progress(METHODS, "maps for the curves")
        }
        curves = deletion_insertion_report(
            context, model, curve_images, curve_labels, curve_maps, "transformer_curves.png"
        )
        table = [
            "| method | mean \\|score − ΣR\\| / \\|score\\|, trained | the same, bias-free copy |",
            "| --- | --- | --- |",
            *(
                f"| {name} | {gap['trained']:.3g} | {gap['bias-free']:.3g} |"
                for name, gap in gaps.items()
            ),
        ]
        summary = {
            "test_accuracy": test_accuracy,
            "cached": cached,
            "samples": count,
            "conservation_gap": gaps,
            "curves": curves.summary(),
        }
        return DemoSection(
            self.title,
            lines=[
                "A vision transformer (2×2 patches, a class token, 3 pre-norm blocks of "
                "`nn.TransformerEncoderLayer`, 4 heads, width 32) reaches "
                f"{test_accuracy:.1%} test accuracy on the 8×8 digits"
                f"{' (weights from the cache)' if cached else ''}. The picture explains "
                f"{SHOWN} test digits for their true class with AttnLRP, CP-LRP and the "
                "gradient family; the model's own attention code runs unchanged "
                "(`nn.MultiheadAttention` in its math form inside the engine). "
                + prediction_note(labels, predicted),
                "",
                f"Conservation on {count} test digits, in float64. CP-LRP holds the attention "
                "weights and normalisation scales constant, so the bias-free copy (biases, "
                "LayerNorm shifts, position embeddings and class token zeroed) is "
                "dynamic-linear and its relevance sums to the logit; AttnLRP's softmax rule "
                "does not conserve, so its gap stays on the bias-free copy too (the papers' "
                "own finding). On the trained model biases absorb part of the score in both.",
                "",
                *table,
                "",
                *curves.lines(),
            ],
            figures=["transformer_maps.png", curves.figure],
            captions={
                "transformer_maps.png": "The ViT's maps of six test digits for their true class "
                "by five methods; each column is titled with its true label and the prediction "
                "(✗: wrong).",
                curves.figure: curves.caption,
            },
            accuracies={"ViT, 8×8 digits": test_accuracy},
            summary=summary,
            own_model=OWN_MODEL,
            takeaways=takeaways(summary),
        )


def takeaways(summary: Mapping) -> list[str]:
    """The section's takeaways, from its numbers (``summary`` as the step returns it).

    Args:
        summary: ``conservation_gap`` (method → gap on the trained model and the bias-free
            copy) and ``curves`` (see :meth:`~explain_core.demo_curves.CurveReport.summary`).

    Returns:
        Three sentences: which rules conserve on the bias-free copy, how much the biases absorb
        on the trained model, and the most faithful pixel order by deletion and insertion.
    """
    gaps = summary["conservation_gap"]
    conserving = [name for name, gap in gaps.items() if gap["bias-free"] < CONSERVED]
    leaking = [name for name, gap in gaps.items() if gap["bias-free"] >= CONSERVED]
    parts = []
    if conserving:
        largest = max(gaps[name]["bias-free"] for name in conserving)
        verb = "conserves" if len(conserving) == 1 else "conserve"
        parts.append(
            f"on the bias-free copy {word_list(conserving)} {verb} relevance (gap {largest:.1e})"
        )
    parts += [
        f"{name} misses the score by {gaps[name]['bias-free']:.0%} even there" for name in leaking
    ]
    first = "; ".join(parts)
    first = first[0].upper() + first[1:]
    growing = [name for name, gap in gaps.items() if gap["trained"] > gap["bias-free"]]
    if growing:
        second = (
            "On the trained model the gap grows for "
            + word_list([f"{name} (to {gaps[name]['trained']:.0%})" for name in growing])
            + ": biases, LayerNorm shifts and position embeddings take part of the score."
        )
    else:
        second = "The trained model's biases do not widen the gap of any rule here."
    return [first + ".", second, curve_takeaway(summary["curves"]["auc"])]
