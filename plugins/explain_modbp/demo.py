"""The demo's modified-backpropagation section: LRP rules side by side, and faithfulness checks.

A small ReLU CNN with biases and max-pooling is trained on the digits at 16×16; six test digits are
explained by several LRP rules and the other method families, and every method gets a
faithfulness card (Sixt et al. 2020): completeness, CSC at the first layer, random-logit SSIM and
cascading parameter randomisation.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from explain_core.api import explain
from explain_core.demo import DemoContext, DemoSection, DemoStep, prediction_note, word_list
from explain_core.demo_curves import curve_takeaway, deletion_insertion_report
from explain_core.metrics import faithfulness_card, format_value
from explain_core.plots import grid, save_figure
from explain_core.training import accuracy, train_classifier

# Display name → (registered method, options). The LRP rules first, then other families.
METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "LRP-0 (z)": ("lrp.z", {}),
    "LRP-ε (ε = 0.25)": ("lrp.epsilon", {"epsilon": 0.25}),
    "LRP-z⁺ (α1β0)": ("lrp.zplus", {}),
    "LRP-α2β1": ("lrp.alpha2beta1", {}),
    "LRP-γ": ("lrp.gamma", {}),
    "LRP ε+z⁺": ("lrp.epsilon_plus", {}),
    "DTD w²": ("lrp.w2", {}),
    "Gradient": ("gradient", {}),
    "Input×Gradient": ("input_x_gradient", {}),
    "Guided BP": ("guided_bp", {}),
    "Excitation BP": ("excitation_bp", {}),
    "DeepLIFT Rescale": ("deeplift.rescale", {}),
}
QUICK_METHODS = (
    "LRP-0 (z)",
    "LRP-ε (ε = 0.25)",
    "LRP-z⁺ (α1β0)",
    "LRP-α2β1",
    "Gradient",
    "DeepLIFT Rescale",
)
SHOWN = 6
# 16×16 digits (upsampled): SSIM's 7×7 window stays local, unlike on 8×8 maps.
IMAGE_SIZE = 16
# SSIM at or above this: the maps look alike (Sixt et al. read ≈ 1 as "not sensitive").
ALIKE = 0.5

OWN_MODEL = """\
from explain_core import explain
from explain_core.metrics import faithfulness_card
from explain_core.metrics import deletion_insertion

card = faithfulness_card(model, images, labels, "lrp.epsilon", epsilon=0.25)  # the table's columns
maps = explain(model, images, "lrp.epsilon", labels, epsilon=0.25).spatial_map()
curves = deletion_insertion(model, images, maps, labels)  # .deletion_auc, .insertion_auc
"""


def digits_cnn(size: int = IMAGE_SIZE) -> nn.Sequential:
    """A small ReLU CNN for 1×size×size digits with named layers (conv1 … fc2)."""
    return nn.Sequential(
        OrderedDict(
            [
                ("conv1", nn.Conv2d(1, 16, 3, padding=1)),
                ("relu1", nn.ReLU()),
                ("conv2", nn.Conv2d(16, 32, 3, padding=1)),
                ("relu2", nn.ReLU()),
                ("pool", nn.MaxPool2d(2)),
                ("flatten", nn.Flatten()),
                ("fc1", nn.Linear(32 * (size // 2) ** 2, 64)),
                ("relu3", nn.ReLU()),
                ("fc2", nn.Linear(64, 10)),
            ]
        )
    )


class ModifiedBackpropDemoStep(DemoStep):
    """Train a small CNN and compare LRP rules and other methods, with faithfulness cards."""

    title = "Modified backpropagation: LRP rules and faithfulness checks"
    order = 30
    provides = ("modified-bp",)

    def run(self, context: DemoContext) -> DemoSection:
        """Train (or load) the CNN, draw the maps, compute a faithfulness card per method."""
        digits = context.digits(IMAGE_SIZE)
        epochs = 3 if context.quick else 12
        settings = {
            "arch": f"digits_cnn-v1-{IMAGE_SIZE}px",
            "epochs": epochs,
            "lr": 2e-3,
            "batch": 32,
        }

        def train(model: nn.Module) -> None:
            train_classifier(
                model,
                digits.train_images,
                digits.train_labels,
                epochs=epochs,
                batch_size=32,
                lr=2e-3,
                seed=context.seed,
                description="modified-bp CNN",
            )

        model, _, cached = context.cached_model("modbp-cnn", settings, digits_cnn, train)
        test_accuracy = accuracy(model, digits.test_images, digits.test_labels)
        context.artefacts["modbp_model"] = (model, IMAGE_SIZE)

        names = [n for n in METHODS if not context.quick or n in QUICK_METHODS]
        images, labels = digits.test_images[:SHOWN], digits.test_labels[:SHOWN]
        with torch.no_grad():
            predicted = model(images).argmax(1)
        rows = {}
        for name in context.progress(names, "maps"):
            method, options = METHODS[name]
            result = explain(model, images, method, labels, **options)
            rows[name] = result.spatial_map()
        figure = grid(
            rows,
            inputs=images,
            labels=labels,
            predictions=predicted,
            title="Modified backpropagation and gradients, true class",
        )
        save_figure(figure, context.out_dir / "modbp_maps.png")

        count = 8 if context.quick else 32
        check_images, check_labels = digits.test_images[:count], digits.test_labels[:count]
        cards = {}
        for name in context.progress(names, "faithfulness cards"):
            method, options = METHODS[name]
            cards[name] = faithfulness_card(
                model,
                check_images,
                check_labels,
                method,
                seed=context.seed,
                n_vectors=3 if context.quick else 5,
                **options,
            )
        curve_count = 64 if context.quick else 256
        curve_images = digits.test_images[:curve_count]
        curve_labels = digits.test_labels[:curve_count]
        curve_maps = {}
        for name in context.progress(names, "maps for the curves"):
            method, options = METHODS[name]
            curve_maps[name] = explain(
                model, curve_images, method, curve_labels, **options
            ).spatial_map()
        curves = deletion_insertion_report(
            context, model, curve_images, curve_labels, curve_maps, "modbp_curves.png"
        )
        table = [
            "| method | completeness error | CSC at first layer | random-logit SSIM | "
            "SSIM, output layer randomised | SSIM, all layers randomised |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for name, card in cards.items():
            table.append(
                f"| {name} | {format_value(card['completeness'])} | "
                f"{format_value(card['csc_first_layer'])} | "
                f"{format_value(card['random_logit_ssim'])} | "
                f"{format_value(card['randomisation_ssim_top'])} | "
                f"{format_value(card['randomisation_ssim_all'])} |"
            )
        summary = {
            "test_accuracy": test_accuracy,
            "cached": cached,
            "samples": count,
            "cards": {name: _jsonable(card) for name, card in cards.items()},
            "curves": curves.summary(),
        }
        return DemoSection(
            self.title,
            lines=[
                "A small ReLU CNN (conv16, conv32, max-pool, dense64, dense10, with biases) "
                f"reaches {test_accuracy:.1%} test accuracy on the digits upsampled to "
                f"{IMAGE_SIZE}×{IMAGE_SIZE}"
                f"{' (weights from the cache)' if cached else ''}. The picture shows the same "
                f"{SHOWN} test digits explained by {len(names)} methods for their true class; "
                "each map is coloured on its own symmetric scale (red for, blue against). "
                + prediction_note(labels, predicted),
                "",
                f"Faithfulness card per method, on {count} test digits (Sixt et al. 2020, "
                "*When explanations lie*). **Completeness error**: mean |logit − Σ map| / "
                "|logit| (0 = the map sums to the logit; biases and the ε rule absorb some). "
                "**CSC**: random relevance vectors set at the logits and propagated down; the "
                "median |cosine| between them at the input of the first layer — near 1 means "
                "the explanation no longer depends on what was explained. **Random-logit "
                "SSIM**: maps for the true class vs. a random other class (1 = not class "
                "sensitive). **Randomisation SSIM**: maps of the trained network vs. the same "
                "network with the output layer, then every layer re-initialised "
                "(max of SSIM(s), SSIM(−s); 1 = ignores the weights). Lower is better in the "
                "last four columns (SSIM with a 7×7 window on the 16×16 maps).",
                "",
                *table,
                "",
                *curves.lines(),
            ],
            figures=["modbp_maps.png", curves.figure],
            captions={
                "modbp_maps.png": f"{len(names)} methods' maps of six test digits for their true "
                "class; each column is titled with its true label and the prediction (✗: "
                "wrong).",
                curves.figure: curves.caption,
            },
            accuracies={f"ReLU CNN, {IMAGE_SIZE}×{IMAGE_SIZE} digits": test_accuracy},
            summary=summary,
            own_model=OWN_MODEL,
            takeaways=takeaways(summary),
        )


def _numbers(cards: Mapping[str, Mapping[str, Any]], key: str) -> dict[str, float]:
    """Each method's ``key`` where it is a number (texts say why it is not defined)."""
    return {
        name: float(card[key])
        for name, card in cards.items()
        if isinstance(card[key], int | float) and not isinstance(card[key], bool)
    }


def _listing(values: dict[str, float]) -> str:
    return word_list([f"{name} at {value:.2f}" for name, value in values.items()])


def takeaways(summary: Mapping) -> list[str]:
    """The section's takeaways, from its numbers (``summary`` as the step returns it).

    Args:
        summary: ``cards`` (method → faithfulness card) and ``curves`` (see
            :meth:`~explain_core.demo_curves.CurveReport.summary`).

    Returns:
        Three sentences: class sensitivity by random-logit SSIM, dependence on the weights by
        cascading randomisation, and the most faithful pixel order by deletion and insertion.
    """
    cards = summary["cards"]
    logit = _numbers(cards, "random_logit_ssim")
    blind = {name: value for name, value in logit.items() if value >= ALIKE}
    keen = min(logit, key=logit.__getitem__)
    if blind:
        first = (
            f"By random-logit SSIM, {_listing(blind)} "
            f"{'is' if len(blind) == 1 else 'are'} not class-sensitive: the maps for the true "
            f"class and for a random other class look alike (SSIM ≥ {ALIKE}); {keen} is the "
            f"most class-sensitive ({logit[keen]:.2f})."
        )
    else:
        top = max(logit, key=logit.__getitem__)
        first = (
            f"Every method is class-sensitive by random-logit SSIM (all below {ALIKE}; the "
            f"highest is {top} at {logit[top]:.2f}, the lowest {keen} at {logit[keen]:.2f})."
        )
    weights = _numbers(cards, "randomisation_ssim_all")
    ignoring = {name: value for name, value in weights.items() if value >= ALIKE}
    if ignoring:
        second = (
            f"With every layer re-initialised, the maps of {_listing(ignoring)} still look like "
            "the trained network's, so they show the input more than what the network learned."
        )
    else:
        top = max(weights, key=weights.__getitem__)
        second = (
            "Every method's maps change when the layers are re-initialised (SSIM below "
            f"{ALIKE}; the most alike, {top}, at {weights[top]:.2f}): all depend on the "
            "learned weights."
        )
    return [first, second, curve_takeaway(summary["curves"]["auc"])]


def _jsonable(card: dict[str, Any]) -> dict[str, Any]:
    return {k: (float(v) if isinstance(v, np.floating | float) else v) for k, v in card.items()}
