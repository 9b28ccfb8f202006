"""``explain demo``: the main job. Every plugin contributes steps; the report grows with them.

The output folder is built under a temporary name and moved into place only when every step has
finished, so a folder that exists is always complete. It holds ``report.html`` (self-contained:
inline style, pictures as files beside it), the same report as ``report.md`` and the numbers as
``summary.json``. Each section ends with the lines of Python that do the same on the reader's own
model and with two or three takeaways its step computed from its own numbers. The report links
only to the files it wrote and to absolute URLs: nothing in it points into the source tree, which
an installed wheel lacks.

Trained models are cached as safetensors files (see :meth:`DemoContext.cached_model`) in
``$EXPLAIN_CACHE_DIR``, else ``$XDG_CACHE_HOME/explain-torch/demo``, else
``~/.cache/explain-torch/demo``; the file name holds a hash of everything that decides the weights
(step settings, seed, torch and package versions), so changed settings never reuse a stale model.
"""

from __future__ import annotations

import hashlib
import html
import json
import os
import platform
import re
import shutil
import tempfile
import time
import traceback
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from explain_core.errors import InvalidInputError
from explain_core.files import give_default_permissions, temporary_beside

__all__ = [
    "CACHE_FORMAT",
    "PLANNED_SECTIONS",
    "REPORT_MARKER",
    "DemoContext",
    "DemoResult",
    "DemoSection",
    "DemoStep",
    "default_cache_dir",
    "markdown_to_html",
    "prediction_note",
    "run_demo",
    "word_list",
]

REPORT_MARKER = "summary.json"
CACHE_FORMAT = 1

# Sections the finished product will have; a section disappears from this list when a plugin
# provides it, so the report always says honestly what it does not cover yet.
PLANNED_SECTIONS: dict[str, str] = {
    "coda": "CoDA-Nets: dynamic alignment units and exact contribution maps",
    "capsules": "Capsules and REM: routing entropy, pruning, parse-tree dictionaries",
    "parse-trees": "Parse-tree diagrams with and without REM",
    "modified-bp": "Modified backpropagation (LRP family, DeepLIFT, …) and faithfulness checks",
    "transformers": "Transformers: AttnLRP and CP-LRP on a ViT trained on the digits",
    "onnx": "ONNX export of models and explanations, parity and latency",
}


def default_cache_dir() -> Path:
    """Where the demo caches trained models (see the module docstring)."""
    if os.environ.get("EXPLAIN_CACHE_DIR"):
        return Path(os.environ["EXPLAIN_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "explain-torch" / "demo"


def word_list(words: Sequence[str], conjunction: str = "and") -> str:
    """``"a"``, ``"a and b"``, ``"a, b and c"``: names in a sentence."""
    words = [str(w) for w in words]
    if len(words) <= 1:
        return "".join(words)
    return f"{', '.join(words[:-1])} {conjunction} {words[-1]}"


def prediction_note(
    labels: Sequence[int] | torch.Tensor,
    predictions: Sequence[int] | torch.Tensor,
    explained: str = "the true class",
) -> str:
    """One sentence on the shown samples' wrong predictions (the columns marked ✗).

    Args:
        labels: True class of each shown sample, left to right.
        predictions: The model's prediction for each.
        explained: What the maps explain, e.g. ``"the true class"``.

    Returns:
        E.g. ``"1 of the 6 shown samples is predicted wrongly (marked ✗): sample 2 (a 5) as 9;
        its maps explain the true class, not the prediction."``, or a sentence saying every
        prediction is right.
    """
    pairs = [(int(t), int(p)) for t, p in zip(labels, predictions, strict=True)]
    wrong = [(i, t, p) for i, (t, p) in enumerate(pairs, 1) if t != p]
    if not wrong:
        return f"All {len(pairs)} shown samples are predicted correctly."
    cases = word_list([f"sample {i} (a {t}) as {p}" for i, t, p in wrong])
    one = len(wrong) == 1
    return (
        f"{len(wrong)} of the {len(pairs)} shown samples {'is' if one else 'are'} predicted "
        f"wrongly (marked ✗): {cases}; {'its' if one else 'their'} maps explain {explained}, "
        "not the prediction."
    )


@dataclass
class DemoSection:
    """What one step reports.

    Attributes:
        title: Section heading.
        lines: Markdown lines for the report: paragraphs, ``- `` lists, ``|`` tables and fenced
            code blocks (the HTML report understands exactly these).
        figures: Paths of pictures (PNG or SVG) relative to the output folder.
        summary: JSON-serialisable numbers for ``summary.json``.
        accuracies: Model name → test accuracy, for the report's overview table (a summary key
            ``test_accuracy`` counts too).
        unavailable: Why the step could not provide its sections here (e.g. a missing optional
            dependency); its ``provides`` keys are then listed as not available.
        failed: The one-line error of a step that raised (its plugin named); the report shows
            the section as failed and the run's exit status is non-zero.
        captions: Figure path → caption (what the picture shows; default: its file name).
        own_model: Python lines doing what the section did on the reader's own ``model``,
            ``images`` and ``labels`` (a batch as the model takes it and its integer classes);
            shown under "On your own model". Real calls: the tests run them on tiny models.
        takeaways: Two or three sentences the step computed from this section's numbers (never
            fixed text: a changed number changes them); the section ends with them.
    """

    title: str
    lines: list[str] = field(default_factory=list)
    figures: list[str] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    accuracies: dict[str, float] = field(default_factory=dict)
    unavailable: str | None = None
    failed: str | None = None
    captions: dict[str, str] = field(default_factory=dict)
    own_model: str | None = None
    takeaways: list[str] = field(default_factory=list)


@dataclass
class DemoContext:
    """Shared state of one demo run.

    Attributes:
        out_dir: Folder the steps write into (a temporary folder until the run succeeds).
        quick: Small, fast settings (used by tests).
        seed: Seed of every random choice.
        cache_dir: Folder of cached trained models; ``None`` trains every model afresh.
        artefacts: Objects steps share with later steps (e.g. trained models).
        log: Prints one progress line.
    """

    out_dir: Path
    quick: bool = False
    seed: int = 0
    cache_dir: Path | None = None
    artefacts: dict[str, Any] = field(default_factory=dict)
    log: Callable[[str], Any] = print

    def progress(
        self, items: Iterable[Any], description: str, total: int | None = None
    ) -> Iterable[Any]:
        """``items`` with a progress bar inside the current section (a tqdm bar on stderr).

        As for training, the bar shows only when stderr is a terminal and is removed when done,
        so logs and captured output get nothing from it.
        """
        from tqdm.auto import tqdm

        return tqdm(items, desc=f"    {description}", total=total, leave=False, disable=None)

    def digits(self, image_size: int = 8) -> Any:
        """The bundled digits at ``image_size``, loaded once per run."""
        from explain_core.data import load_digits

        key = f"digits-{image_size}"
        if key not in self.artefacts:
            self.artefacts[key] = load_digits(image_size=image_size, seed=self.seed)
        return self.artefacts[key]

    def cached_model(
        self,
        name: str,
        settings: dict[str, Any],
        build: Callable[[], torch.nn.Module],
        train: Callable[[torch.nn.Module], dict[str, Any] | None],
    ) -> tuple[torch.nn.Module, dict[str, Any], bool]:
        """A trained model from the cache, or trained now and stored there.

        ``build()`` must create the untrained model (with every buffer the trained one has, e.g.
        pruning masks) under the seed; its state dict is then loaded from a safetensors file
        (``strict``, never unpickled). The cache key hashes ``name``, ``settings``, the seed, the
        quick flag and the torch and package versions.

        Args:
            name: Model name (file-name safe).
            settings: Everything that decides the trained weights (JSON-serialisable).
            build: Creates the untrained model.
            train: Trains the model in place; may return a dict of JSON-serialisable facts to
                store with the weights (anything else it returns is ignored).

        Returns:
            ``(model in eval mode, stored facts, whether it came from the cache)``.
        """
        torch.manual_seed(self.seed)
        model = build()
        path = self._cache_path(name, settings)
        if path is not None and path.exists():
            try:
                state, info = _load_cached(path)
                model.load_state_dict(state, strict=True)
                self.log(f"    {name}: trained weights from the cache ({path.name})")
                return model.eval(), info, True
            except Exception as error:  # a corrupt or foreign file: train again
                warnings.warn(f"ignoring unreadable cached model {path}: {error}", stacklevel=2)
                torch.manual_seed(self.seed)
                model = build()
        start = time.perf_counter()
        torch.manual_seed(self.seed)
        trained = train(model)
        info = dict(trained) if isinstance(trained, dict) else {}
        info["train_seconds"] = round(time.perf_counter() - start, 2)
        model.eval()
        if path is not None:
            _store_cached(path, model, settings, info)
        return model, info, False

    def _cache_path(self, name: str, settings: dict[str, Any]) -> Path | None:
        if self.cache_dir is None:
            return None
        from explain_core.plugin_manager import package_version

        key = json.dumps(
            {
                "name": name,
                "settings": settings,
                "seed": self.seed,
                "quick": self.quick,
                "torch": torch.__version__,
                "package": package_version(),
                "format": CACHE_FORMAT,
            },
            sort_keys=True,
            default=str,
        )
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        return self.cache_dir / f"{name}-{digest}.safetensors"


def _load_cached(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    return load_file(str(path)), json.loads(metadata.get("info", "{}"))


def _store_cached(
    path: Path, model: torch.nn.Module, settings: dict[str, Any], info: dict[str, Any]
) -> None:
    from safetensors.torch import save_file

    state = {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}
    metadata = {"settings": json.dumps(settings, default=str), "info": json.dumps(info)}
    try:
        with temporary_beside(path) as temporary:
            save_file(state, str(temporary), metadata=metadata)
            os.replace(temporary, path)
    except OSError as error:  # a read-only cache only costs time
        warnings.warn(f"could not cache the trained model in {path.parent}: {error}", stacklevel=3)


class DemoStep(ABC):
    """One section of the demo, contributed by a plugin through ``explain_demo_steps``.

    Attributes:
        title: Shown in progress output and as the section heading.
        order: Steps run in increasing order.
        provides: Keys of :data:`PLANNED_SECTIONS` this step covers.
        plugin: Filled in by the plugin manager.
    """

    title: str = "untitled"
    order: int = 100
    provides: tuple[str, ...] = ()
    plugin: str = ""

    @abstractmethod
    def run(self, context: DemoContext) -> DemoSection:
        """Run the step, writing its files under ``context.out_dir``."""


@dataclass
class DemoResult:
    """The finished run: where it went and what it covered."""

    out_dir: Path
    sections: list[DemoSection]
    missing: list[str]
    seconds: float

    @property
    def failed(self) -> list[DemoSection]:
        """The sections whose step raised."""
        return [section for section in self.sections if section.failed is not None]


def run_demo(
    out_dir: Path,
    steps: list[DemoStep],
    *,
    quick: bool = False,
    seed: int = 0,
    cache_dir: Path | None = None,
    log: Any = print,
    debug: bool = False,
) -> DemoResult:
    """Run ``steps`` and move the finished folder to ``out_dir``.

    A step that raises (a third-party section, say) does not end the run: its section is kept
    as failed, with the error in one line (``debug`` logs the traceback too), and the other
    sections are written; :attr:`DemoResult.failed` lists it. ``KeyboardInterrupt`` ends the run.

    Raises:
        InvalidInputError: If ``out_dir`` exists and is not an earlier demo output, or cannot be
            created.
    """
    out_dir = Path(out_dir).resolve()  # "." has parent "."; staging must sit beside the folder
    _check_replaceable(out_dir)
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
        give_default_permissions(staging, folder=True)
    except OSError as error:
        raise InvalidInputError(
            f"cannot write the output folder {out_dir}: {error.strerror or error}"
        ) from None
    start = time.perf_counter()
    try:
        context = DemoContext(staging, quick=quick, seed=seed, cache_dir=cache_dir, log=log)
        sections = []
        provided: set[str] = set()
        for index, step in enumerate(steps, 1):
            log(f"[{index}/{len(steps)}] {step.title} ({step.plugin or 'core'})")
            begun = time.perf_counter()
            torch.manual_seed(seed)
            section = _run_step(step, context, debug)
            section.summary.setdefault("seconds", round(time.perf_counter() - begun, 2))
            if section.failed is None:
                log(f"    done in {time.perf_counter() - begun:.1f} s")
            else:
                log(f"    FAILED: {section.failed}")
            sections.append(section)
            if section.unavailable is None and section.failed is None:
                provided.update(step.provides)
        missing = [text for key, text in PLANNED_SECTIONS.items() if key not in provided]
        seconds = time.perf_counter() - start
        _write_report(staging, sections, missing, seconds, quick)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return DemoResult(out_dir, sections, missing, seconds)


def _run_step(step: DemoStep, context: DemoContext, debug: bool) -> DemoSection:
    """The step's section, or a failed section holding its error in one line.

    The files a failed step wrote are removed: the report shows none of them.
    """
    before = set(context.out_dir.rglob("*"))
    try:
        return step.run(context)
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # SystemExit from a plugin must not end the report either
        for path in sorted(set(context.out_dir.rglob("*")) - before, reverse=True):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        if debug:
            context.log("".join(traceback.format_exception(error)).rstrip())
        first = (str(error).strip().splitlines() or [""])[0]
        origin = f"plugin {step.plugin!r}" if step.plugin else "the core"
        return DemoSection(
            step.title, failed=f"{type(error).__name__}: {first} (a step of {origin})"
        )


def _check_replaceable(out_dir: Path) -> None:
    if out_dir.exists() and (
        not out_dir.is_dir() or (any(out_dir.iterdir()) and not (out_dir / REPORT_MARKER).exists())
    ):
        raise InvalidInputError(
            f"{out_dir} exists and is not an earlier demo output; choose another --out folder "
            "or remove it"
        )


def _accuracy_rows(sections: list[DemoSection]) -> list[tuple[str, str, float]]:
    rows = []
    for section in sections:
        accuracies = dict(section.accuracies)
        if not accuracies and isinstance(section.summary.get("test_accuracy"), float):
            accuracies = {"the section's model": section.summary["test_accuracy"]}
        rows += [(section.title, name, value) for name, value in accuracies.items()]
    return rows


def _caption(section: DemoSection, path: str) -> str:
    return section.captions.get(path) or Path(path).stem.replace("_", " ")


def _markdown_figure(path: str, caption: str) -> list[str]:
    # PNGs inline; other pictures (SVG parse trees) as links, which every viewer opens.
    if path.lower().endswith(".png"):
        return [f"![{caption}]({path})", ""]
    return [f"- [{caption} ({Path(path).suffix[1:].upper()})]({path})"]


def _closing_lines(section: DemoSection) -> list[str]:
    """What every section ends with: the same on your own model, then the takeaways."""
    lines = []
    if section.own_model:
        lines += ["### On your own model", "", "```python", *section.own_model.splitlines()]
        lines += ["```", ""]
    if section.takeaways:
        lines += ["### Takeaways", "", *[f"- {text}" for text in section.takeaways], ""]
    return lines


def _write_report(
    folder: Path, sections: list[DemoSection], missing: list[str], seconds: float, quick: bool
) -> None:
    intro = (
        f"Run on {platform.node() or 'this machine'} ({platform.machine()}, torch "
        f"{torch.__version__}, {torch.get_num_threads()} thread(s)) in {seconds:.1f} s"
        f"{' with --quick settings (small, fast, less accurate)' if quick else ''}."
    )
    accuracies = _accuracy_rows(sections)
    overview = ["| section | model | test accuracy |", "| --- | --- | --- |"]
    overview += [f"| {title} | {name} | {value:.1%} |" for title, name, value in accuracies]
    lines = ["# explain demo", "", intro, ""]
    if accuracies:
        lines += ["## Model accuracies", "", *overview, ""]
    for section in sections:
        lines += [f"## {section.title}", "", *section.lines, ""]
        if section.unavailable:
            lines += [f"Not available here: {section.unavailable}", ""]
        if section.failed:
            lines += [f"**Failed**: {section.failed}", ""]
        for path in section.figures:
            lines += _markdown_figure(path, _caption(section, path))
        lines += ["", *_closing_lines(section)]
    if missing:
        lines += ["## Not yet available", "", *[f"- {text}" for text in missing], ""]
    (folder / "report.md").write_text("\n".join(lines), encoding="utf-8")
    (folder / "report.html").write_text(
        _html_report(intro, sections, overview if accuracies else [], missing), encoding="utf-8"
    )
    summary = {
        "seconds": round(seconds, 2),
        "quick": quick,
        "threads": torch.get_num_threads(),
        "accuracies": {f"{t}: {n}": v for t, n, v in accuracies},
        "sections": {s.title: s.summary for s in sections},
        "takeaways": {s.title: s.takeaways for s in sections if s.takeaways},
        "unavailable": {s.title: s.unavailable for s in sections if s.unavailable},
        "failed": {s.title: s.failed for s in sections if s.failed},
        "not_yet_available": missing,
    }
    (folder / REPORT_MARKER).write_text(json.dumps(summary, indent=2), encoding="utf-8")


# --- HTML ----------------------------------------------------------------------------------------

_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; max-width: 1100px;
  margin: 2em auto; padding: 0 1em; line-height: 1.5; color: #1d1d1f; }
h1 { border-bottom: 2px solid #ddd; padding-bottom: .2em; }
h2 { margin-top: 2em; border-bottom: 1px solid #eee; padding-bottom: .2em; }
table { border-collapse: collapse; margin: 1em 0; font-size: .92em; }
th, td { border: 1px solid #ccc; padding: .25em .6em; text-align: left; }
th { background: #f4f4f6; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
figure { margin: 1em 0; }
figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #666; font-size: .85em; }
pre { background: #f6f8fa; padding: .8em; overflow-x: auto; font-size: .85em; }
code { background: #f6f8fa; padding: 0 .2em; }
nav ol { columns: 2; }
.unavailable { background: #fff4e5; border-left: 4px solid #f0a030; padding: .5em 1em; }
.failed { background: #fdecea; border-left: 4px solid #d93025; padding: .5em 1em; }
"""


def _slug(text: str, used: set[str]) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "section"
    candidate, n = slug, 1
    while candidate in used:
        n += 1
        candidate = f"{slug}-{n}"
    used.add(candidate)
    return candidate


def _inline(text: str) -> str:
    """Escape, then render `code` and **bold** spans."""
    parts = re.split(r"(`[^`]+`)", text)
    out = []
    for part in parts:
        if part.startswith("`") and part.endswith("`") and len(part) > 1:
            out.append(f"<code>{html.escape(part[1:-1])}</code>")
        else:
            escaped = html.escape(part)
            out.append(re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", escaped))
    return "".join(out)


_NUMBER = re.compile(r"^[−+-]?[\d.,]+(e[−+-]?\d+)?\s*%?$|^1−\S+$")


def _table(rows: list[str]) -> str:
    cells = [[c.strip() for c in row.strip().strip("|").split("|")] for row in rows]
    header, body = cells[0], [r for r in cells[1:] if not all(set(c) <= set("-: ") for c in r)]
    out = ["<table>", "<thead><tr>" + "".join(f"<th>{_inline(c)}</th>" for c in header) + "</tr>"]
    out.append("</thead><tbody>")
    for row in body:
        tds = "".join(
            f'<td class="num">{_inline(c)}</td>' if _NUMBER.match(c) else f"<td>{_inline(c)}</td>"
            for c in row
        )
        out.append(f"<tr>{tds}</tr>")
    out.append("</tbody></table>")
    return "\n".join(out)


def markdown_to_html(lines: list[str]) -> str:
    """The report's small markdown subset (paragraphs, lists, tables, code blocks) as HTML."""
    out: list[str] = []
    paragraph: list[str] = []
    index = 0

    def flush() -> None:
        if paragraph:
            out.append(f"<p>{_inline(' '.join(paragraph))}</p>")
            paragraph.clear()

    while index < len(lines):
        line = lines[index]
        stripped = line.strip()
        if stripped.startswith("```"):
            flush()
            block = []
            index += 1
            while index < len(lines) and not lines[index].strip().startswith("```"):
                block.append(lines[index])
                index += 1
            out.append(f"<pre>{html.escape(chr(10).join(block))}</pre>")
        elif stripped.startswith("|"):
            flush()
            rows = []
            while index < len(lines) and lines[index].strip().startswith("|"):
                rows.append(lines[index])
                index += 1
            out.append(_table(rows))
            continue
        elif stripped.startswith("- "):
            flush()
            items = []
            while index < len(lines) and lines[index].strip().startswith("- "):
                items.append(f"<li>{_inline(lines[index].strip()[2:])}</li>")
                index += 1
            out.append("<ul>" + "".join(items) + "</ul>")
            continue
        elif stripped.startswith("### "):
            flush()
            out.append(f"<h3>{_inline(stripped[4:])}</h3>")
        elif not stripped:
            flush()
        else:
            paragraph.append(stripped)
        index += 1
    flush()
    return "\n".join(out)


def _figure(path: str, caption: str) -> str:
    text = html.escape(caption)
    source = html.escape(path, quote=True)
    return (
        f'<figure><a href="{source}"><img src="{source}" alt="{text}"></a>'
        f"<figcaption>{_inline(caption)}</figcaption></figure>"
    )


def _html_report(
    intro: str, sections: list[DemoSection], overview: list[str], missing: list[str]
) -> str:
    used: set[str] = set()
    blocks, toc = [], []
    if overview:
        anchor = _slug("Model accuracies", used)
        toc.append(f'<li><a href="#{anchor}">Model accuracies</a></li>')
        blocks.append(f'<h2 id="{anchor}">Model accuracies</h2>\n{_table(overview)}')
    for section in sections:
        anchor = _slug(section.title, used)
        title = html.escape(section.title)
        toc.append(f'<li><a href="#{anchor}">{title}</a></li>')
        parts = [f'<section><h2 id="{anchor}">{title}</h2>', markdown_to_html(section.lines)]
        if section.unavailable:
            text = _inline(section.unavailable)
            parts.append(f'<p class="unavailable">Not available here: {text}</p>')
        if section.failed:
            parts.append(f'<p class="failed"><b>Failed</b>: {_inline(section.failed)}</p>')
        parts += [_figure(f, _caption(section, f)) for f in section.figures]
        parts.append(markdown_to_html(_closing_lines(section)))
        parts.append("</section>")
        blocks.append("\n".join(parts))
    if missing:
        anchor = _slug("Not yet available", used)
        toc.append(f'<li><a href="#{anchor}">Not yet available</a></li>')
        items = "".join(f"<li>{html.escape(m)}</li>" for m in missing)
        blocks.append(f'<h2 id="{anchor}">Not yet available</h2><ul>{items}</ul>')
    return "\n".join(
        [
            "<!DOCTYPE html>",
            '<html lang="en"><head><meta charset="utf-8">',
            '<meta name="viewport" content="width=device-width, initial-scale=1">',
            f"<title>explain demo</title><style>{_STYLE}</style></head><body>",
            "<h1>explain demo</h1>",
            f"<p>{html.escape(intro)} Red marks evidence for the explained class, blue evidence "
            "against it. Every picture is a file in this folder.</p>",
            f"<nav><ol>{''.join(toc)}</ol></nav>",
            *blocks,
            "</body></html>",
            "",
        ]
    )
