"""The demo's transformer section: a ViT trained on the digits, explained by AttnLRP and CP-LRP.

The ViT (:mod:`.digits_vit`: 2×2 patches, a class token, ``nn.TransformerEncoder``) is trained on
the bundled 8×8 digits; six test digits are explained for their true class by the attention
rules and the gradient family, and conservation is measured: CP-LRP's relevance sums to the
logit on the bias-free copy of the model, AttnLRP's does not (its softmax rule), and on the
trained model biases absorb part of the score in both.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from explain_core.api import explain
from explain_core.demo import DemoContext, DemoSection, DemoStep
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
        for name, method in METHODS.items():
            result = explain(model, images, method, labels)
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
            for name in ("AttnLRP", "CP-LRP")
        }
        table = [
            "| method | mean \\|score − ΣR\\| / \\|score\\|, trained | the same, bias-free copy |",
            "| --- | --- | --- |",
            *(
                f"| {name} | {gap['trained']:.3g} | {gap['bias-free']:.3g} |"
                for name, gap in gaps.items()
            ),
        ]
        wrong = int((predicted != labels).sum())
        return DemoSection(
            self.title,
            lines=[
                "A vision transformer (2×2 patches, a class token, 3 pre-norm blocks of "
                "`nn.TransformerEncoderLayer`, 4 heads, width 32) reaches "
                f"{test_accuracy:.1%} test accuracy on the 8×8 digits"
                f"{' (weights from the cache)' if cached else ''}. The picture explains "
                f"{SHOWN} test digits for their true class ({wrong} of them predicted "
                "otherwise, marked ✗) with AttnLRP, CP-LRP and the gradient family; the "
                "model's own attention code runs unchanged (`nn.MultiheadAttention` in its "
                "math form inside the engine).",
                "",
                f"Conservation on {count} test digits, in float64. CP-LRP holds the attention "
                "weights and normalisation scales constant, so the bias-free copy (biases, "
                "LayerNorm shifts, position embeddings and class token zeroed) is "
                "dynamic-linear and its relevance sums to the logit; AttnLRP's softmax rule "
                "does not conserve, so its gap stays on the bias-free copy too (the papers' "
                "own finding). On the trained model biases absorb part of the score in both.",
                "",
                *table,
            ],
            figures=["transformer_maps.png"],
            accuracies={"ViT, 8×8 digits": test_accuracy},
            summary={
                "test_accuracy": test_accuracy,
                "cached": cached,
                "samples": count,
                "conservation_gap": gaps,
            },
        )
