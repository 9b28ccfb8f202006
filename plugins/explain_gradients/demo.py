"""The demo's gradient-baselines section: a bias-free ReLU CNN explained four ways."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from explain_core.api import explain
from explain_core.demo import DemoContext, DemoSection, DemoStep, prediction_note, word_list
from explain_core.demo_curves import curve_takeaway, deletion_insertion_report
from explain_core.plots import grid, save_figure
from explain_core.training import accuracy, train_classifier

METHODS = ("gradient", "input_x_gradient", "integrated_gradients", "dynamic.contributions")
# Deltas this small (relative to the largest logit) are float rounding: the map is complete.
EXACT = 1e-5

OWN_MODEL = """\
from explain_core import explain, plots

maps = {m: explain(model, images, m, labels).attribution for m in ("gradient", "input_x_gradient")}
predicted = model(images).argmax(1)  # explain(...).delta: output minus summed map, per sample
plots.save_attribution_figure(maps, "maps.png", inputs=images, labels=labels, predictions=predicted)
"""


def bias_free_digits_cnn() -> nn.Sequential:
    """A small ReLU CNN without biases: piecewise linear *and* homogeneous, f(x) = W(x)·x."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1, bias=False),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1, bias=False),
        nn.ReLU(),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 10, bias=False),
    )


class GradientBaselinesStep(DemoStep):
    """Train the CNN on digits and compare the gradient family's maps and deltas."""

    title = "Gradient baselines on a dynamic-linear ReLU CNN"
    order = 10

    def run(self, context: DemoContext) -> DemoSection:
        """Train, explain six test digits with every method, and tabulate deltas."""
        digits = context.digits()
        model = train_classifier(
            bias_free_digits_cnn(),
            digits.train_images,
            digits.train_labels,
            epochs=3 if context.quick else 15,
            seed=context.seed,
            description="gradient CNN",
        )
        test_accuracy = accuracy(model, digits.test_images, digits.test_labels)
        images, labels = digits.test_images[:6], digits.test_labels[:6]
        count = 64 if context.quick else 256
        checked, checked_labels = digits.test_images[:count], digits.test_labels[:count]
        with torch.no_grad():
            predicted = model(images).argmax(1)
            largest_logit = float(model(digits.test_images).abs().max())
        rows, curve_maps = {}, {}
        table = ["| method | max abs delta |", "| --- | --- |"]
        deltas = {}
        for method in context.progress(METHODS, "maps and deltas"):
            result = explain(model, images, method, target=labels)
            rows[method] = result.spatial_map()
            # Deltas over the whole test set; IG (20 passes each) over the curves' digits only.
            full = explain(
                model,
                checked if method == "integrated_gradients" else digits.test_images,
                method,
                target=checked_labels if method == "integrated_gradients" else digits.test_labels,
            )
            curve_maps[method] = full.spatial_map()[:count]
            if full.delta is not None:
                deltas[method] = float(full.delta.abs().max())
            table.append(f"| {method} | {_format(deltas.get(method))} |")
        curves = deletion_insertion_report(
            context, model, checked, checked_labels, curve_maps, "gradient_curves.png"
        )
        figure = grid(
            rows,
            inputs=images,
            labels=labels,
            predictions=predicted,
            title="Gradient baselines, true class",
        )
        save_figure(figure, context.out_dir / "gradient_maps.png")
        summary = {
            "test_accuracy": test_accuracy,
            "max_abs_delta": deltas,
            "largest_logit": largest_logit,
            "curves": curves.summary(),
        }
        return DemoSection(
            self.title,
            lines=[
                f"A bias-free ReLU CNN reaches {test_accuracy:.1%} test accuracy. Such a network "
                "computes f(x) = W(x)·x, so Input×Gradient and the dynamic-linear contributions "
                "are exact: their delta (output minus summed attribution) is zero up to float "
                "rounding. Red is positive evidence, blue negative. The maps explain the true "
                f"class. {prediction_note(labels, predicted)}",
                "",
                *table,
                "",
                *curves.lines(),
            ],
            figures=["gradient_maps.png", curves.figure],
            captions={
                "gradient_maps.png": "Four gradient-family maps of six test digits for their "
                "true class; each column is titled with its true label and the prediction "
                "(✗: wrong).",
                curves.figure: curves.caption,
            },
            summary=summary,
            own_model=OWN_MODEL,
            takeaways=takeaways(summary),
        )


def takeaways(summary: Mapping) -> list[str]:
    """The section's takeaways, from its numbers (``summary`` as the step returns it).

    Args:
        summary: ``max_abs_delta`` (method → largest |delta|), ``largest_logit`` (the scale the
            deltas are judged against) and ``curves`` (see :class:`CurveReport.summary`).

    Returns:
        Two sentences: which methods are complete here, and which pixel order is most faithful.
    """
    deltas, scale = summary["max_abs_delta"], summary["largest_logit"]
    exact = [m for m, delta in deltas.items() if delta <= EXACT * scale]
    off = [m for m, delta in deltas.items() if delta > EXACT * scale]
    undefined = [m for m in METHODS if m not in deltas]
    first = (
        f"{word_list(exact)} {'sums' if len(exact) == 1 else 'sum'} to the logit up to float "
        "rounding (largest |delta| "
        f"{max(deltas[m] for m in exact):.1e}, logits up to {scale:.1f})"
        if exact
        else f"No method sums to the logit here (smallest |delta| {min(deltas.values()):.1e})"
    )
    if off:
        first += f"; {word_list(off)} {'misses' if len(off) == 1 else 'miss'} by up to "
        first += f"{max(deltas[m] for m in off):.1e}"
    if undefined:
        first += f"; {word_list(undefined)} {'has' if len(undefined) == 1 else 'have'} no delta"
    return [first + ".", curve_takeaway(summary["curves"]["auc"])]


def _format(value: float | None) -> str:
    return "not defined" if value is None else f"{value:.2e}"
