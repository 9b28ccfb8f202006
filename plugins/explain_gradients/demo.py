"""The demo's gradient-baselines section: a bias-free ReLU CNN explained four ways."""

from __future__ import annotations

import torch
from torch import nn

from explain_core.api import explain
from explain_core.demo import DemoContext, DemoSection, DemoStep
from explain_core.plots import grid, save_figure
from explain_core.training import accuracy, train_classifier

METHODS = ("gradient", "input_x_gradient", "integrated_gradients", "dynamic.contributions")


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
        with torch.no_grad():
            predicted = model(images).argmax(1)
        rows = {}
        table = ["| method | max abs delta |", "| --- | --- |"]
        deltas = {}
        for method in METHODS:
            result = explain(model, images, method, target=labels)
            rows[method] = result.spatial_map()
            # Deltas over the whole test set; IG (20 passes each) only over the six shown digits.
            full = (
                result
                if method == "integrated_gradients"
                else explain(model, digits.test_images, method, target=digits.test_labels)
            )
            if full.delta is not None:
                deltas[method] = float(full.delta.abs().max())
            table.append(f"| {method} | {_format(deltas.get(method))} |")
        figure = grid(
            rows,
            inputs=images,
            labels=labels,
            predictions=predicted,
            title="Gradient baselines, true class",
        )
        save_figure(figure, context.out_dir / "gradient_maps.png")
        return DemoSection(
            self.title,
            lines=[
                f"A bias-free ReLU CNN reaches {test_accuracy:.1%} test accuracy. Such a network "
                "computes f(x) = W(x)·x, so Input×Gradient and the dynamic-linear contributions "
                "are exact: their delta (output minus summed attribution) is zero up to float "
                "rounding. Red is positive evidence, blue negative.",
                "",
                *table,
            ],
            figures=["gradient_maps.png"],
            summary={"test_accuracy": test_accuracy, "max_abs_delta": deltas},
        )


def _format(value: float | None) -> str:
    return "not defined" if value is None else f"{value:.2e}"
