"""The demo's story: takeaways computed from each section's numbers, the "on your own model" lines
and the takeaways at the end of every section, wrong predictions said in words, progress bars.

Every section's takeaway function is fed made-up numbers twice: the sentences must carry those
numbers and change when they change (nothing in them is fixed text about this run).
"""

from __future__ import annotations

import copy
import io
import json
import sys
from pathlib import Path

import pytest
import torch

from explain_core.demo import (
    DemoContext,
    DemoSection,
    markdown_to_html,
    prediction_note,
    run_demo,
    word_list,
)
from explain_core.demo_curves import RANDOM, curve_takeaway


def _curves(aucs: dict[str, tuple[float, float]]) -> dict:
    return {"auc": {name: {"deletion_auc": d, "insertion_auc": i} for name, (d, i) in aucs.items()}}


def _random(d: float, i: float) -> dict:
    return {RANDOM: {"deletion_auc": d, "insertion_auc": i}}


# --- shared pieces ------------------------------------------------------------------------------


def test_word_list_and_prediction_note() -> None:
    assert word_list([]) == "" and word_list(["a"]) == "a"
    assert word_list(["a", "b"]) == "a and b" and word_list(["a", "b", "c"], "or") == "a, b or c"
    assert prediction_note([1, 2], torch.tensor([1, 2])) == (
        "All 2 shown samples are predicted correctly."
    )
    one = prediction_note([1, 5, 3], [1, 9, 3])
    assert "1 of the 3 shown samples is predicted wrongly (marked ✗): sample 2 (a 5) as 9" in one
    assert "its maps explain the true class" in one
    two = prediction_note(torch.tensor([4, 5]), torch.tensor([7, 3]), "every class")
    assert "2 of the 2 shown samples are" in two and "sample 1 (a 4) as 7 and sample 2" in two
    assert "their maps explain every class" in two
    with pytest.raises(ValueError):
        prediction_note([1, 2], [1])


def test_curve_takeaway_names_the_best_orders_and_those_random_beats() -> None:
    aucs = {
        "A": {"deletion_auc": 0.10, "insertion_auc": 0.70},
        "B": {"deletion_auc": 0.30, "insertion_auc": 0.90},
        "C": {"deletion_auc": 0.50, "insertion_auc": 0.20},
        **_random(0.45, 0.40),
    }
    text = curve_takeaway(aucs)
    assert "the order of A lowers" in text and "(deletion AUC 0.10 against 0.45" in text
    assert "back in the order of B raises" in text and "(insertion AUC 0.90 against 0.40)" in text
    assert "C does no better than random order" in text
    # Change the numbers: the sentence follows them, ties are named together.
    aucs["B"]["deletion_auc"] = 0.102
    aucs["C"] = {"deletion_auc": 0.2, "insertion_auc": 0.6}
    text = curve_takeaway(aucs)
    assert "the order of A and B (tied within 0.005) lowers" in text
    assert "no better than random" not in text


# --- each section's takeaways, from made-up numbers ---------------------------------------------


def test_bundled_data_takeaways() -> None:
    from explain_core.data.showcase import takeaways

    summary = {
        "test_per_class": [40, 45, 50, 44, 46, 45, 45, 45, 45, 45],
        "grid_cells_per_image": 9,
        "mean_mask_fraction": 0.137,
    }
    first, second, third = takeaways(summary)
    assert "40 to 50 digits per class" in first and "about 10%" in first
    assert "9 cells" in second and "11%" in second
    assert "cover 14%" in third
    summary.update(test_per_class=[10, 30, 20, 30], grid_cells_per_image=4, mean_mask_fraction=0.5)
    first, second, third = takeaways(summary)
    assert "10 to 30 digits" in first and "about 25%" in first
    assert "4 cells" in second and "25%" in second and "cover 50%" in third


def test_gradient_takeaways() -> None:
    from explain_gradients.demo import takeaways

    summary = {
        "max_abs_delta": {"input_x_gradient": 1e-6, "integrated_gradients": 0.3},
        "largest_logit": 10.0,
        "curves": _curves({"gradient": (0.2, 0.6), "input_x_gradient": (0.1, 0.7)}),
    }
    summary["curves"]["auc"].update(_random(0.4, 0.3))
    first, second = takeaways(summary)
    assert first.startswith("input_x_gradient sums to the logit up to float rounding")
    assert "(largest |delta| 1.0e-06, logits up to 10.0)" in first
    assert "integrated_gradients misses by up to 3.0e-01" in first
    assert "gradient and dynamic.contributions have no delta" in first
    assert "the order of input_x_gradient lowers" in second
    summary["max_abs_delta"] = {"input_x_gradient": 0.5, "integrated_gradients": 1e-7}
    summary["largest_logit"] = 1000.0  # the same delta is rounding on a larger scale
    first, _ = takeaways(summary)
    assert first.startswith("integrated_gradients sums to the logit")
    assert "input_x_gradient misses by up to 5.0e-01" in first
    summary["max_abs_delta"]["input_x_gradient"] = 1e-3
    first, _ = takeaways(summary)
    assert first.startswith("input_x_gradient and integrated_gradients sum to the logit")


def test_coda_takeaways() -> None:
    from explain_coda.demo import takeaways

    summary = {
        "max_relative_completeness_error": 5e-7,
        "temperature": 8.0,
        "test_accuracy": 0.98,
        "test_digits": 450,
        "wrong": 9,
        "mean_margin": 3.25,
    }
    first, second = takeaways(summary)
    assert "exact decompositions" in first and "5.0e-07" in first
    assert "T = 8" in second and "9 of 450" in second and "98.0%" in second and "3.25" in second
    summary.update(max_relative_completeness_error=0.02, wrong=40, mean_margin=1.5)
    first, second = takeaways(summary)
    assert "miss the logits by up to 2.0e-02" in first and "not explained exactly" in first
    assert "40 of 450" in second and "1.50" in second


def _cards(ssim: dict[str, float], randomised: dict[str, float]) -> dict:
    return {
        name: {"random_logit_ssim": ssim[name], "randomisation_ssim_all": randomised[name]}
        for name in ssim
    }


def test_modified_backprop_takeaways_name_the_methods_that_are_not_class_sensitive() -> None:
    from explain_modbp.demo import takeaways

    curves = _curves({"LRP-0": (0.05, 0.9), "Gradient": (0.07, 0.95)})
    curves["auc"].update(_random(0.5, 0.5))
    summary = {
        "cards": _cards(
            {"LRP-0": 0.07, "LRP-z⁺": 0.77, "Gradient": 0.01, "Guided BP": "not defined: x"},
            {"LRP-0": 0.03, "LRP-z⁺": 0.8, "Gradient": 0.006, "Guided BP": 0.9},
        ),
        "curves": curves,
    }
    first, second, third = takeaways(summary)
    assert "LRP-z⁺ at 0.77 is not class-sensitive" in first
    assert "Gradient is the most class-sensitive (0.01)" in first
    assert "LRP-z⁺ at 0.80 and Guided BP at 0.90 still look like" in second
    assert "the order of LRP-0 lowers" in third and "the order of Gradient raises" in third
    # Other numbers, other sentences: now nothing is class-blind or weight-blind.
    summary["cards"] = _cards(
        {"LRP-0": 0.2, "LRP-z⁺": 0.3, "Gradient": 0.1},
        {"LRP-0": 0.1, "LRP-z⁺": 0.4, "Gradient": 0.05},
    )
    first, second, _ = takeaways(summary)
    assert "Every method is class-sensitive" in first and "LRP-z⁺ at 0.30" in first
    assert "Gradient at 0.10" in first
    assert "Every method's maps change" in second and "LRP-z⁺, at 0.40" in second


def test_transformer_takeaways() -> None:
    from explain_modbp.demo_transformer import takeaways

    curves = _curves({"AttnLRP": (0.05, 0.25), "CP-LRP": (0.06, 0.2)})
    curves["auc"].update(_random(0.15, 0.14))
    summary = {
        "conservation_gap": {
            "AttnLRP": {"trained": 1.19, "bias-free": 0.773},
            "CP-LRP": {"trained": 0.9, "bias-free": 4.8e-16},
        },
        "curves": curves,
    }
    first, second, third = takeaways(summary)
    assert "CP-LRP conserves relevance (gap 4.8e-16)" in first
    assert "AttnLRP misses the score by 77% even there" in first
    assert "AttnLRP (to 119%) and CP-LRP (to 90%)" in second
    assert "the order of AttnLRP raises" in third
    summary["conservation_gap"]["CP-LRP"]["bias-free"] = 0.01
    summary["conservation_gap"]["AttnLRP"]["trained"] = 0.5
    first, second, _ = takeaways(summary)
    assert "conserves" not in first and "CP-LRP misses the score by 1% even there" in first
    assert second.startswith("On the trained model the gap grows for CP-LRP (to 90%)")


def _rem_row(accuracy: float, sparsity: float, entropy: list[float], keys: float) -> dict:
    return {
        "accuracy_k11": accuracy,
        "sparsity": sparsity,
        "mean_entropy_bits": sum(entropy) / len(entropy),
        "mean_keys_per_class": keys,
        "entropy_per_class": entropy,
    }


def test_capsule_takeaways() -> None:
    from explain_capsules.demo import rem_takeaways

    summary = {
        "levels": 11,
        "models": {
            "CapsNet+Q": _rem_row(0.95, 0.0, [3.0, 5.0, 4.0], 37.0),
            "CapsNet+REM": _rem_row(0.88, 0.8, [3.5, 4.0, 2.0], 19.7),
        },
    }
    first, second, third = rem_takeaways(summary)
    assert "REM lowers the mean parse-tree entropy: 4.00 → 3.17 bits" in first
    assert "37.0 → 19.7" in first
    assert (
        "Pruning 80% of the weights costs 7.0 percentage points of test accuracy (95.0% → 88.0%"
        in second
    )
    assert "does not fall with REM for class 0 (3.00 → 3.50)" in third
    summary["models"]["CapsNet+REM"] = _rem_row(0.96, 0.5, [3.5, 6.0, 4.5], 40.0)
    first, second, third = rem_takeaways(summary)
    assert "REM does not lower" in first and "4.00 → 4.67" in first
    assert "costs no test accuracy (it changes by +1.0 points)" in second
    assert third.startswith("Every class follows the mean: the entropy does not fall")


def test_parse_tree_takeaways_say_which_trees_explain_wrong_predictions() -> None:
    from explain_capsules.demo import tree_takeaways

    summary = {
        "trees": {"sample-0": {"CapsNet+Q": 60, "CapsNet+REM": 50}},
        "samples": {
            "0": {"label": 1, "predicted": {"CapsNet+Q": 1, "CapsNet+REM": 1}},
            "7": {"label": 5, "predicted": {"CapsNet+Q": 9, "CapsNet+REM": 3}},
        },
        "classes": {"1": {"CapsNet+Q": {"predicted": 10, "truly": 10}}},
    }
    first, second, third = tree_takeaways(summary)
    assert "CapsNet+REM's trees are the smaller ones: 60.0 edges for CapsNet+Q" in first
    assert "1 of the 2 sample pictures shows trees of wrong predictions" in second
    assert "sample 7 (a 5, predicted 9 by CapsNet+Q and 3 by CapsNet+REM)" in second
    assert third.startswith("No class tree mixes in other classes: all 10 digits they average")
    summary["samples"]["7"]["predicted"]["CapsNet+Q"] = 5
    summary["classes"]["1"]["CapsNet+REM"] = {"predicted": 7, "truly": 5}
    _, second, third = tree_takeaways(summary)
    assert "(a 5, predicted 3 by CapsNet+REM)" in second
    assert "CapsNet+REM's class-1 tree holds 2 of 7 digits of other classes" in third


def test_onnx_takeaways() -> None:
    from explain_onnx.demo import takeaways

    row = {
        "parity_passed": True,
        "test_batch_explanation_max_rel": 2.4e-6,
        "torch_ms": 80.0,
        "onnxruntime_ms": 40.0,
        "size_kb": 2246.0,
    }
    summary = {"batch": 64, "models": {"CoDA-Net": row}}
    first, second = takeaways(summary)
    assert "Every exported graph matches PyTorch" in first and "2.4e-06" in first
    assert "CoDA-Net with its explanation runs 2.0× as fast as PyTorch (40.0 vs 80.0 ms" in second
    assert "2246 kB" in second
    changed = copy.deepcopy(summary)
    changed["models"]["CoDA-Net"].update(parity_passed=False, onnxruntime_ms=120.0)
    first, second = takeaways(changed)
    assert "CoDA-Net does NOT match PyTorch" in first and "1.5× slower than" in second


# --- the report: own-model lines and takeaways close every section ------------------------------


class _NumbersStep:
    title, order, provides, plugin = "A numbers section", 1, (), "fake"

    def __init__(self, value: float) -> None:
        self.value = value

    def run(self, context: DemoContext) -> DemoSection:
        numbers = {"value": self.value}
        return DemoSection(
            self.title,
            lines=["Some text."],
            summary=numbers,
            own_model="from explain_core import explain\n\nresult = explain(model, images)",
            takeaways=[f"The value is {numbers['value']:.2f}.", "A second sentence."],
        )


@pytest.mark.parametrize("value", [1.0, 2.5])
def test_own_model_and_takeaways_end_the_section_in_both_reports(
    value: float, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    run_demo(out, [_NumbersStep(value)], log=lambda _: None)
    markdown = (out / "report.md").read_text(encoding="utf-8")
    section = markdown.split("## A numbers section", 1)[1].split("\n## ", 1)[0]
    assert section.index("Some text.") < section.index("### On your own model")
    assert section.index("### On your own model") < section.index("### Takeaways")
    assert (
        "```python\nfrom explain_core import explain\n\nresult = explain(model, images)\n```"
        in (section)
    )
    assert section.rstrip().endswith(f"- The value is {value:.2f}.\n- A second sentence.")
    html = (out / "report.html").read_text(encoding="utf-8")
    body = html.split('id="a-numbers-section"', 1)[1].split("</section>", 1)[0]
    assert "<h3>On your own model</h3>" in body and "<h3>Takeaways</h3>" in body
    closing = f"<li>The value is {value:.2f}.</li><li>A second sentence.</li></ul>"
    assert body.rstrip().endswith(closing)
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    assert summary["takeaways"]["A numbers section"][0] == f"The value is {value:.2f}."


class _PictureStep:
    title, order, provides, plugin = "A picture section", 1, (), "fake"

    def run(self, context: DemoContext) -> DemoSection:
        from PIL import Image

        Image.new("RGB", (4, 4), "white").save(context.out_dir / "fig.png")
        Image.new("RGB", (4, 4), "white").save(context.out_dir / "plain.png")
        return DemoSection(
            self.title,
            figures=["fig.png", "plain.png"],
            captions={"fig.png": "Sample 1, a 5: predicted 9 (wrong ✗)."},
        )


def test_captions_say_what_a_picture_shows(tmp_path: Path) -> None:
    run_demo(tmp_path / "out", [_PictureStep()], log=lambda _: None)
    markdown = (tmp_path / "out" / "report.md").read_text(encoding="utf-8")
    assert "![Sample 1, a 5: predicted 9 (wrong ✗).](fig.png)" in markdown
    assert "![plain](plain.png)" in markdown  # no caption: the file's name
    html = (tmp_path / "out" / "report.html").read_text(encoding="utf-8")
    assert 'alt="Sample 1, a 5: predicted 9 (wrong ✗)."' in html
    assert "<figcaption>Sample 1, a 5: predicted 9 (wrong ✗).</figcaption>" in html


def test_the_closing_lines_render_as_html() -> None:
    html = markdown_to_html(["### Takeaways", "", "- one", "- two"])
    assert html == "<h3>Takeaways</h3>\n<ul><li>one</li><li>two</li></ul>"


# --- progress inside sections -------------------------------------------------------------------


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_shows_on_a_terminal_only(tmp_path: Path, monkeypatch) -> None:
    context = DemoContext(tmp_path, log=lambda _: None)
    quiet = io.StringIO()
    monkeypatch.setattr(sys, "stderr", quiet)
    assert list(context.progress(range(3), "counting")) == [0, 1, 2]
    assert quiet.getvalue() == ""  # logs and captured output get nothing
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert list(context.progress(iter("ab"), "letters", total=2)) == ["a", "b"]
    assert "    letters:" in terminal.getvalue() and "0/2" in terminal.getvalue()
