"""``explain demo``: the HTML report folder, its numbers, the model cache and bad input."""

from __future__ import annotations

import ast
import json
import re
import warnings
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from torch import nn

from explain_core.cli import main
from explain_core.demo import PLANNED_SECTIONS, DemoContext, markdown_to_html


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.sources: list[str] = []  # what the page loads (src): never from the network
        self.headings: list[str] = []
        self._in_h2 = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name in ("src", "href") and value:
                self.links.append(value)
            if name == "src" and value:
                self.sources.append(value)
        self._in_h2 = tag == "h2"

    def handle_endtag(self, tag: str) -> None:
        self._in_h2 = False

    def handle_data(self, data: str) -> None:
        if self._in_h2:
            self.headings.append(data.strip())


@pytest.fixture(scope="module")
def quick_demo(quick_demo_run: tuple[Path, str]) -> tuple[Path, str, dict]:
    """The shared ``explain demo --quick`` run (conftest.py): folder, stdout and summary."""
    out, stdout = quick_demo_run
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    return out, stdout, summary


ABSOLUTE = re.compile(r"^https?://[^\s/]+\.[^\s/]+")
# Folders of the source tree that an installed wheel lacks (the packages themselves are in it).
SOURCE_ONLY = re.compile(r"(?<![\w./-])(?:\.\./)*(docs|benchmarks|examples|scripts|tests)/[\w./-]")


def _check_link(out: Path, link: str) -> None:
    """A link of the report: an anchor, an absolute URL, or a file the demo wrote."""
    if link.startswith("#") or ABSOLUTE.match(link):
        return
    assert ":" not in link and not link.startswith("/"), link  # no file://, no absolute path
    target = (out / link).resolve()
    assert target.is_relative_to(out.resolve()), f"{link} leaves the report's folder"
    assert target.is_file(), f"{link} is not a file the demo wrote"


def test_the_report_links_only_to_its_own_files_and_absolute_urls(quick_demo) -> None:
    out, stdout, _ = quick_demo
    assert f"{out / 'report.html'}" in stdout
    html = (out / "report.html").read_text(encoding="utf-8")
    markdown = (out / "report.md").read_text(encoding="utf-8")
    parser = _Links()
    parser.feed(html)
    files = [link for link in parser.links if not link.startswith("#")]
    assert files, "the report shows no pictures"
    for link in [*files, *re.findall(r"\]\(([^)\s]+)\)", markdown)]:
        _check_link(out, link)
    assert not [src for src in parser.sources if ABSOLUTE.match(src)]  # nothing loads remotely
    assert any(link.endswith(".png") for link in files)
    assert any(link.endswith(".svg") for link in files)  # parse trees (dot is installed)
    anchors = {link[1:] for link in parser.links if link.startswith("#")}
    for anchor in anchors:
        assert f'id="{anchor}"' in html
    # Nor does the text send readers into the source tree (a wheel install has none).
    for text in (html, markdown):
        without_urls = re.sub(r"https?://\S+", "", text)
        assert not SOURCE_ONLY.search(without_urls), SOURCE_ONLY.search(without_urls)


def test_the_link_check_refuses_what_a_wheel_lacks(tmp_path: Path) -> None:
    (tmp_path / "fig.png").write_bytes(b"")
    for good in ("fig.png", "#top", "https://pytorch.org/docs/stable/"):
        _check_link(tmp_path, good)
    for bad in ("../docs/index.md", "missing.png", "/etc/hostname", "file:///etc/hostname"):
        with pytest.raises(AssertionError):
            _check_link(tmp_path, bad)
    for text in ("see `examples/onnx/run.py`", "[docs](../docs/pictures.md)", "benchmarks/x.py"):
        assert SOURCE_ONLY.search(text), text
    for text in ("the `onnx/` folder", "parse_trees/sample-0.svg", "https://x.org/docs/a"):
        assert not SOURCE_ONLY.search(re.sub(r"https?://\S+", "", text)), text


def test_every_section_is_in_both_reports(quick_demo) -> None:
    out, _, summary = quick_demo
    html = (out / "report.html").read_text(encoding="utf-8")
    markdown = (out / "report.md").read_text(encoding="utf-8")
    parser = _Links()
    parser.feed(html)
    for title in summary["sections"]:
        assert title in parser.headings, title
        assert f"## {title}" in markdown
    assert "Model accuracies" in parser.headings
    for needed in ("LRP", "REM", "Parse trees", "ONNX", "CoDA"):
        assert any(needed in title for title in summary["sections"]), needed


def test_nothing_is_listed_as_missing(quick_demo) -> None:
    _, _, summary = quick_demo
    assert len(PLANNED_SECTIONS) == 6
    assert summary["not_yet_available"] == []
    assert summary["unavailable"] == {}
    assert summary["quick"] is True and summary["threads"] == 1


def _section(summary: dict, word: str) -> dict:
    (title,) = [t for t in summary["sections"] if word in t]
    return summary["sections"][title]


def test_summary_numbers_are_sane(quick_demo) -> None:
    _, _, summary = quick_demo
    assert 0 < summary["seconds"] < 300
    assert summary["accuracies"]
    for name, value in summary["accuracies"].items():
        assert 0.1 <= value <= 1.0, name  # quick runs train briefly, but above chance
    cards = _section(summary, "Modified backpropagation")["cards"]
    assert len(cards) >= 5
    for name, card in cards.items():
        for key in ("random_logit_ssim", "randomisation_ssim_top", "randomisation_ssim_all"):
            assert -1.0 <= card[key] <= 1.0, (name, key)
        assert 0.0 <= card["csc_first_layer"] <= 1.0, name
        assert card["first_layer"] == "conv1"
    assert cards["DeepLIFT Rescale"]["completeness"] < 1e-4  # DeepLIFT is complete
    assert cards["Gradient"]["completeness"] == "not defined"
    transformer = _section(summary, "Transformers")
    gaps = transformer["conservation_gap"]
    assert gaps["CP-LRP"]["bias-free"] < 1e-9  # dynamic-linear: conserves
    assert gaps["AttnLRP"]["bias-free"] > 1e-3  # its softmax rule does not
    models = _section(summary, "Capsules and REM")["models"]
    assert models["CapsNet+Q"]["sparsity"] == 0.0
    assert 0.75 <= models["CapsNet+REM"]["sparsity"] <= 0.85
    for row in models.values():
        assert len(row["keys_per_class"]) == 10 and row["mean_entropy_bits"] >= 0
    trees = _section(summary, "Parse trees")
    assert trees["pictures"] >= 2 and trees["dot_missing"] is False
    onnx = _section(summary, "ONNX")["models"]
    assert onnx, "nothing exported"
    for row in onnx.values():
        assert row["parity_passed"] is True
        assert row["torch_ms"] > 0 and row["onnxruntime_ms"] > 0


# --- every section tells its story ---------------------------------------------------------------


def _markdown_sections(out: Path) -> dict[str, str]:
    """Section title → its text in report.md."""
    markdown = (out / "report.md").read_text(encoding="utf-8")
    parts = markdown.split("\n## ")[1:]
    return {part.split("\n", 1)[0]: part.split("\n", 1)[1] for part in parts}


def _own_model(text: str) -> str:
    return text.split("### On your own model\n\n```python\n", 1)[1].split("\n```", 1)[0]


def _ran(summary: dict) -> list[str]:
    """The titles of the sections that ran (not unavailable here, not failed)."""
    skipped = {*summary["unavailable"], *summary["failed"]}
    return [title for title in summary["sections"] if title not in skipped]


def test_every_section_ends_with_its_own_model_lines_and_takeaways(quick_demo) -> None:
    out, _, summary = quick_demo
    sections = _markdown_sections(out)
    for title in _ran(summary):
        text = sections[title]
        assert "### On your own model" in text and "### Takeaways" in text, title
        assert text.index("### On your own model") < text.index("### Takeaways"), title
        closing = text.split("### Takeaways\n\n", 1)[1].strip().splitlines()
        assert 2 <= len(closing) <= 3 and all(line.startswith("- ") for line in closing), title
        assert [line[2:] for line in closing] == summary["takeaways"][title]
        assert all(re.search(r"\d", line) for line in closing), title  # from the numbers
        code = ast.parse(_own_model(text))
        calls = [node for node in code.body if not isinstance(node, ast.Import | ast.ImportFrom)]
        assert 1 <= len(calls) <= 3, title  # three lines after the imports, at most


def _tiny_models() -> dict[str, nn.Module]:
    """A small untrained model of each kind a section's lines need, keyed by a title word."""
    from explain_capsules import MultiLayerCapsNet
    from explain_coda import CoDANet
    from explain_modbp.digits_vit import DigitsViT

    torch.manual_seed(0)
    cnn = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 10)
    ).eval()
    capsules = MultiLayerCapsNet(
        in_features=(1, 8, 8), primary_caps=4, hidden_layers=1, hidden_caps=4, dim=4
    ).eval()
    return {
        "Bundled data": cnn,
        "Gradient": cnn,
        "CoDA": CoDANet.from_preset("digits").eval(),
        "Modified backpropagation": cnn,
        "Transformers": DigitsViT(dim=8, depth=1, heads=2).eval(),
        "Capsules": capsules,
        "Parse trees": capsules,
        "ONNX": cnn,
    }


def test_the_own_model_lines_run_on_a_users_model(
    quick_demo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from explain_core.data import load_digits

    out, _, summary = quick_demo
    digits = load_digits(image_size=8)
    images, labels = digits.test_images[:4], digits.test_labels[:4]
    models = _tiny_models()
    sections = _markdown_sections(out)
    monkeypatch.chdir(tmp_path)  # the lines write their pictures and files here
    for title in _ran(summary):
        (model,) = [m for word, m in models.items() if word in title] or [None]
        assert model is not None, f"no tiny model for the section {title!r}: add one here"
        namespace = {"model": model, "images": images.clone(), "labels": labels.clone()}
        exec(compile(_own_model(sections[title]), f"<{title}>", "exec"), namespace)
    assert (tmp_path / "maps.png").is_file() and (tmp_path / "data.png").is_file()
    assert (tmp_path / "model.onnx").is_file() and (tmp_path / "trees" / "sample-0.svg").is_file()


def test_the_takeaways_follow_the_reports_numbers(quick_demo) -> None:
    _, _, summary = quick_demo
    title = next(t for t in summary["sections"] if "Modified backpropagation" in t)
    ssim = {
        name: card["random_logit_ssim"]
        for name, card in summary["sections"][title]["cards"].items()
        if isinstance(card["random_logit_ssim"], float)
    }
    first = summary["takeaways"][title][0]
    blind = [name for name, value in ssim.items() if value >= 0.5]
    for name in blind:
        assert f"{name} at {ssim[name]:.2f}" in first
    assert ("not class-sensitive" in first) == bool(blind)
    keen = min(ssim, key=ssim.__getitem__)
    assert f"{keen}" in first and f"{ssim[keen]:.2f}" in first
    title = next(t for t in summary["sections"] if "Capsules and REM" in t)
    rows = summary["sections"][title]["models"]
    entropy = [rows[m]["mean_entropy_bits"] for m in ("CapsNet+Q", "CapsNet+REM")]
    assert f"{entropy[0]:.2f} → {entropy[1]:.2f} bits" in summary["takeaways"][title][0]


def test_wrong_predictions_are_marked_and_said_in_words(quick_demo) -> None:
    out, _, summary = quick_demo
    sections = _markdown_sections(out)
    trees = _section(summary, "Parse trees")
    text = sections[next(t for t in summary["sections"] if "Parse trees" in t)]
    assert "parse_trees/inputs.png" in text  # the digits, titled true/predicted
    for index, fact in trees["samples"].items():
        for model, predicted in fact["predicted"].items():
            verdict = "(right)" if predicted == fact["label"] else "(wrong ✗)"
            assert f"{model} predicts {predicted} {verdict}" in text, (index, model)
        if any(p != fact["label"] for p in fact["predicted"].values()):
            assert f"Sample {index}, a {fact['label']}" in text
            assert "explain a wrong prediction" in text or "explains a wrong prediction" in text
    # The maps of the attribution sections say which shown digits are predicted wrongly.
    for word in ("Gradient baselines", "Modified backpropagation", "Transformers", "CoDA"):
        section = sections[next(t for t in summary["sections"] if word in t)]
        assert "shown samples are predicted correctly" in section or "wrongly (marked ✗)" in (
            section
        ), word


def test_methods_are_compared_by_deletion_and_insertion(quick_demo) -> None:
    out, _, summary = quick_demo
    for word, picture in (
        ("Gradient baselines", "gradient_curves.png"),
        ("Modified backpropagation", "modbp_curves.png"),
        ("Transformers", "transformer_curves.png"),
    ):
        curves = _section(summary, word)["curves"]
        assert (out / picture).is_file()
        assert curves["samples"] >= 32 and "random order" in curves["auc"]
        for name, auc in curves["auc"].items():
            assert 0.0 <= auc["deletion_auc"] <= 1.0 and 0.0 <= auc["insertion_auc"] <= 1.0, name
        methods = {n: a for n, a in curves["auc"].items() if n != "random order"}
        best = min(a["deletion_auc"] for a in methods.values())
        assert best < curves["auc"]["random order"]["deletion_auc"], word  # trained: beats chance


def test_the_report_in_headless_chromium(quick_demo) -> None:
    from headless_chromium import open_page, require_chromium

    chromium = require_chromium()
    out, _, _ = quick_demo
    report = open_page(out / "report.html", chromium)
    assert report.title == "explain demo"
    parser = _Links()
    parser.feed((out / "report.html").read_text(encoding="utf-8"))
    assert len(report.images) == len(parser.sources) >= 10
    broken = [image for image in report.images if not (image["complete"] and image["naturalWidth"])]
    assert not broken, broken
    assert report.errors == []


# --- the model cache ----------------------------------------------------------------------------


def _counting_trainer(calls: list[int]):
    def train(model: nn.Module) -> dict:
        calls.append(1)
        with torch.no_grad():
            model.weight.fill_(float(len(calls)))
        return {"note": "trained"}

    return train


def test_cached_model_is_reused_only_for_the_same_settings(tmp_path: Path) -> None:
    context = DemoContext(tmp_path / "out", cache_dir=tmp_path / "cache", log=lambda _: None)
    calls: list[int] = []
    train = _counting_trainer(calls)
    model, info, cached = context.cached_model("lin", {"epochs": 1}, lambda: nn.Linear(2, 2), train)
    assert not cached and calls == [1] and info["note"] == "trained"
    again, info, cached = context.cached_model("lin", {"epochs": 1}, lambda: nn.Linear(2, 2), train)
    assert cached and calls == [1] and info["note"] == "trained"
    assert torch.equal(again.weight, model.weight) and not again.training
    (file,) = (tmp_path / "cache").glob("lin-*.safetensors")  # safetensors, nothing pickled
    # Other settings, another seed or quick flag: trained afresh, the old file is kept.
    context.cached_model("lin", {"epochs": 2}, lambda: nn.Linear(2, 2), train)
    DemoContext(tmp_path, seed=1, cache_dir=tmp_path / "cache").cached_model(
        "lin", {"epochs": 1}, lambda: nn.Linear(2, 2), train
    )
    assert calls == [1, 1, 1]
    assert len(list((tmp_path / "cache").glob("lin-*.safetensors"))) == 3
    # A corrupt file is trained over, with a warning.
    file.write_bytes(b"not a safetensors file")
    with pytest.warns(UserWarning, match="unreadable cached model"):
        _, _, cached = context.cached_model("lin", {"epochs": 1}, lambda: nn.Linear(2, 2), train)
    assert not cached and len(calls) == 4


def test_no_cache_dir_always_trains(tmp_path: Path) -> None:
    context = DemoContext(tmp_path, cache_dir=None, log=lambda _: None)
    calls: list[int] = []
    for _ in range(2):
        context.cached_model("lin", {}, lambda: nn.Linear(2, 2), _counting_trainer(calls))
    assert calls == [1, 1] and not list(tmp_path.iterdir())


def test_unwritable_cache_only_warns(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache folder should be")
    context = DemoContext(tmp_path, cache_dir=blocker / "cache", log=lambda _: None)
    with pytest.warns(UserWarning, match="could not cache"):
        model, _, cached = context.cached_model(
            "lin", {}, lambda: nn.Linear(2, 2), _counting_trainer([])
        )
    assert not cached and isinstance(model, nn.Linear)


# --- HTML rendering and bad input ---------------------------------------------------------------


def test_markdown_subset_to_html() -> None:
    lines = ["Some *text* with `code` and <tags>.", "", "| a | b |", "| --- | --- |"]
    lines += ["| x | 0.5 |", "", "- one", "- two", "", "```", "tree <x>", "```"]
    html = markdown_to_html(lines)
    assert "<code>code</code>" in html and "&lt;tags&gt;" in html
    assert "<th>a</th>" in html and '<td class="num">0.5</td>' in html
    assert "<li>one</li><li>two</li>" in html
    assert "<pre>tree &lt;x&gt;</pre>" in html


@pytest.fixture
def _restore_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)


@pytest.mark.parametrize(
    ("extra", "keywords"),
    [
        (["--threads", "0"], ("--threads",)),
        (["--no-cache", "--cache", "somewhere"], ("--cache", "--no-cache")),
    ],
)
def test_bad_options_are_one_line(
    extra: list[str], keywords: tuple[str, ...], tmp_path: Path, capsys, _restore_warnings
) -> None:
    code = main(["demo", "--quick", "--out", str(tmp_path / "out"), *extra])
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("explain: error:"), err
    assert all(k in err for k in keywords), err
    assert not (tmp_path / "out").exists()


def test_unwritable_output_folder_is_one_line(tmp_path: Path, capsys, _restore_warnings) -> None:
    blocker = tmp_path / "afile"
    blocker.write_text("a file, not a folder")
    code = main(["demo", "--quick", "--no-cache", "--out", str(blocker / "report")])
    _, err = capsys.readouterr()
    assert code == 1
    assert len(err.splitlines()) == 1 and "cannot write the output folder" in err, err
    assert re.search(r"afile", err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


# --- steps that cannot run here say so ----------------------------------------------------------


def test_onnx_step_without_onnxruntime_is_listed_as_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    from explain_core.demo import run_demo
    from explain_onnx.demo import OnnxDemoStep

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "onnxruntime" else real(name)
    )
    result = run_demo(tmp_path / "out", [OnnxDemoStep()], quick=True, log=lambda _: None)
    (section,) = result.sections
    assert "onnxruntime not installed" in section.unavailable
    assert "pip install 'explain-torch[onnx]'" in section.unavailable
    assert PLANNED_SECTIONS["onnx"] in result.missing
    html = (tmp_path / "out" / "report.html").read_text(encoding="utf-8")
    assert "Not available here: onnxruntime not installed" in html
    assert PLANNED_SECTIONS["onnx"] in html


def test_parse_tree_step_without_dot_gives_text_trees(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("networkx")
    pytest.importorskip("graphviz")
    from explain_capsules import MultiLayerCapsNet
    from explain_capsules.demo import TITLES, ParseTreesDemoStep

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no dot program anywhere
    context = DemoContext(tmp_path, quick=True, log=lambda _: None)
    torch.manual_seed(0)
    models = {t: MultiLayerCapsNet(in_features=(1, 8, 8)).eval() for t in TITLES}
    context.artefacts["capsule_models"] = models
    section = ParseTreesDemoStep().run(context)
    assert section.unavailable is None
    assert section.figures == ["parse_trees/inputs.png"]  # the digits (matplotlib), no trees
    assert section.summary["dot_missing"] is True
    text = "\n".join(section.lines)
    assert "```" in text and "L1:" in text  # the trees as text
    assert list((tmp_path / "parse_trees").glob("*.gv"))  # and the sources


# --- a broken section does not take the report with it -----------------------------------------


class _WorkingStep:
    title, order, provides, plugin = "A working section", 1, (), "good_plugin"

    def run(self, context: DemoContext):
        from explain_core.demo import DemoSection

        return DemoSection(self.title, lines=["It ran."], summary={"answer": 42})


class _BrokenStep:
    title, order, provides, plugin = "A broken section", 2, ("onnx",), "bad_plugin"

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def run(self, context: DemoContext):
        raise self.error


@pytest.mark.parametrize(
    ("error", "shown"),
    [
        (RuntimeError("the weights went missing\nsecond line"), "RuntimeError: the weights went"),
        (SystemExit(0), "SystemExit: 0"),  # a plugin calling sys.exit(0) is a failure too
    ],
)
@pytest.mark.parametrize("debug", [False, True])
def test_a_failing_section_is_reported_and_the_others_kept(
    error, shown, debug, tmp_path: Path, capsys, monkeypatch, _restore_warnings
) -> None:
    import explain_core.cli.demo as demo_command

    steps = [_BrokenStep(error), _WorkingStep()]
    monkeypatch.setattr(demo_command, "collect_steps", lambda: steps)
    out = tmp_path / "out"
    code = main(["demo", "--quick", "--no-cache", "--out", str(out), *(["--debug"] * debug)])
    stdout, stderr = capsys.readouterr()
    assert code == 1  # non-zero, though the report was written
    failed_line = f"section 'A broken section' failed: {shown}"
    (error_line,) = [line for line in stderr.splitlines() if line.startswith("explain: error")]
    assert error_line.startswith(f"explain: error: {failed_line}")
    assert error_line.endswith("(a step of plugin 'bad_plugin')")
    assert ("Traceback" in stdout + stderr) is debug  # the traceback only with --debug
    report = (out / "report.md").read_text(encoding="utf-8")
    assert f"**Failed**: {shown}" in report and "It ran." in report
    html = (out / "report.html").read_text(encoding="utf-8")
    assert '<p class="failed"><b>Failed</b>: ' in html and "It ran." in html
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    assert summary["failed"]["A broken section"].startswith(shown)
    assert summary["sections"]["A working section"]["answer"] == 42
    assert PLANNED_SECTIONS["onnx"] in summary["not_yet_available"]  # a failed step provides none
