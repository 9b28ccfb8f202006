"""The demo's CoDA-Nets section: train the digits preset, show exact contribution maps."""

from __future__ import annotations

from collections.abc import Mapping

from explain_coda.contributions import coda_contributions
from explain_coda.model import CoDANet, encode_input
from explain_coda.training import TrainConfig, train_coda
from explain_core.demo import DemoContext, DemoSection, DemoStep, prediction_note
from explain_core.plots import grid, save_figure
from explain_core.training import accuracy

# A relative completeness error below this is float32 rounding: the decomposition is exact.
ROUNDING = 1e-4

OWN_MODEL = """\
from explain_coda import coda_contributions, encode_input

every = coda_contributions(model, encode_input(images), classes="all")  # (N, classes, 2C, H, W)
gap = every.contributions.flatten(2).sum(2) - (every.output - model.logit_bias)  # ≈ 0: exact
maps = every.contributions.sum(2)  # one map per class: plots.grid({f"class {c}": maps[:, c]})
"""


class CoDADemoStep(DemoStep):
    """Train a small CoDA-Net on digits and decompose its decisions exactly."""

    title = "CoDA-Nets: exact contribution maps"
    order = 20
    provides = ("coda",)

    def run(self, context: DemoContext) -> DemoSection:
        """Train, check completeness on the test set, draw per-class contribution grids."""
        digits = context.digits()
        train, test = encode_input(digits.train_images), encode_input(digits.test_images)
        temperature = 8.0
        config = TrainConfig(epochs=2 if context.quick else 8, seed=context.seed)
        model, _, _ = context.cached_model(
            "coda-digits",
            {"preset": "digits", "temperature": temperature, "config": repr(config)},
            lambda: CoDANet.from_preset("digits", temperature=temperature),
            lambda m: train_coda(m, train, digits.train_labels, config),
        )
        test_accuracy = accuracy(model, test, digits.test_labels)
        context.artefacts["coda_model"] = model

        every = coda_contributions(model, test, classes="all")
        explained = every.output - model.logit_bias
        # Norm-wise per sample: a single logit can sit arbitrarily close to b₀.
        error = (every.contributions.flatten(2).sum(2) - explained).norm(dim=1)
        relative = float((error / explained.norm(dim=1)).max())

        shown = list(range(6))
        predicted = every.output.argmax(1)
        top_two = every.output.topk(2, dim=1).values
        margin = float((top_two[:, 0] - top_two[:, 1]).mean())
        maps = every.contributions[shown].sum(dim=2)  # (6, classes, H, W)
        rows = {f"class {c}": maps[:, c] for c in range(10)}
        # One scale per digit: its ten class maps compare (the paper's per-class pictures).
        figure = grid(
            rows,
            inputs=digits.test_images[shown],
            labels=digits.test_labels[shown],
            predictions=predicted[shown],
            scale="column",
            title="CoDA-Net contributions per class",
        )
        save_figure(figure, context.out_dir / "coda_contributions.png")
        summary = {
            "test_accuracy": test_accuracy,
            "temperature": temperature,
            "max_relative_completeness_error": relative,
            "mean_margin": margin,
            "test_digits": len(test),
            "wrong": int((predicted != digits.test_labels).sum()),
        }
        return DemoSection(
            self.title,
            lines=[
                f"A {len(model.layers)}-layer CoDA-Net (digits preset, T = {temperature:g}) "
                f"reaches {test_accuracy:.1%} test accuracy. Its contributions "
                "W_{0→L}(x)⊙x explain every class exactly: summed over the encoded input "
                "[x, 1 − x] they equal the logit minus b₀, here to "
                f"{relative:.1e} (norm-wise relative, float32) over all {len(test)} test "
                "digits × 10 classes, computed in one batched call. The picture shows every "
                "class's map for six test digits, one scale per digit. "
                + prediction_note(
                    digits.test_labels[shown], predicted[shown], "every class, the true one too"
                ),
            ],
            figures=["coda_contributions.png"],
            captions={
                "coda_contributions.png": "Contribution maps of all ten classes for six test "
                "digits; each column is titled with its true label and the prediction (✗: "
                "wrong)."
            },
            summary=summary,
            own_model=OWN_MODEL,
            takeaways=takeaways(summary),
        )


def takeaways(summary: Mapping) -> list[str]:
    """The section's takeaways, from its numbers (``summary`` as the step returns it).

    Args:
        summary: ``max_relative_completeness_error``, ``test_accuracy``, ``temperature``,
            ``mean_margin`` and ``wrong``/``test_digits``.

    Returns:
        Two sentences: whether the maps are exact here, and how decided the decisions are.
    """
    relative = summary["max_relative_completeness_error"]
    if relative < ROUNDING:
        first = (
            f"The contribution maps are exact decompositions, not approximations: summed, they "
            f"match the logits to {relative:.1e}, which is float32 rounding."
        )
    else:
        first = (
            f"The summed contributions miss the logits by up to {relative:.1e} (relative), "
            "more than float32 rounding: this model is not explained exactly."
        )
    second = (
        f"At T = {summary['temperature']:g} the network gets {summary['wrong']} of "
        f"{summary['test_digits']} test digits wrong ({summary['test_accuracy']:.1%} accuracy); "
        f"its top class leads the runner-up by {summary['mean_margin']:.2f} logits on average, "
        "which is how much more contribution the winning class's map collects."
    )
    return [first, second]
