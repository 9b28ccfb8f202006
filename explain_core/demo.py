"""``explain demo``: the main job. Every plugin contributes steps; the report grows with them.

The output folder is built under a temporary name and moved into place only when every step has
finished, so a folder that exists is always complete.
"""

from __future__ import annotations

import json
import platform
import shutil
import tempfile
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from explain_core.errors import InvalidInputError

REPORT_MARKER = "summary.json"

# Sections the finished product will have; a section disappears from this list when a plugin
# provides it, so the report always says honestly what it does not cover yet.
PLANNED_SECTIONS: dict[str, str] = {
    "coda": "CoDA-Nets: dynamic alignment units and exact contribution maps",
    "capsules": "Capsules and REM: routing entropy, pruning, parse-tree dictionaries",
    "parse-trees": "Parse-tree diagrams with and without REM",
    "modified-bp": "Modified backpropagation (LRP family, DeepLIFT, …) and faithfulness checks",
    "onnx": "ONNX export of models and explanations, parity and latency",
}


@dataclass
class DemoSection:
    """What one step reports.

    Attributes:
        title: Section heading.
        lines: Markdown lines for the report (tables, findings).
        figures: Paths of pictures relative to the output folder.
        summary: JSON-serialisable numbers for ``summary.json``.
    """

    title: str
    lines: list[str] = field(default_factory=list)
    figures: list[str] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)


@dataclass
class DemoContext:
    """Shared state of one demo run.

    Attributes:
        out_dir: Folder the steps write into (a temporary folder until the run succeeds).
        quick: Small, fast settings (used by tests).
        seed: Seed of every random choice.
        artefacts: Objects steps share with later steps (e.g. trained models).
    """

    out_dir: Path
    quick: bool = False
    seed: int = 0
    artefacts: dict[str, Any] = field(default_factory=dict)

    def digits(self, image_size: int = 8) -> Any:
        """The bundled digits at ``image_size``, loaded once per run."""
        from explain_core.data import load_digits

        key = f"digits-{image_size}"
        if key not in self.artefacts:
            self.artefacts[key] = load_digits(image_size=image_size, seed=self.seed)
        return self.artefacts[key]


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


def run_demo(
    out_dir: Path, steps: list[DemoStep], *, quick: bool = False, seed: int = 0, log: Any = print
) -> DemoResult:
    """Run ``steps`` and move the finished folder to ``out_dir``.

    Raises:
        InvalidInputError: If ``out_dir`` exists and is not an earlier demo output.
    """
    out_dir = Path(out_dir).resolve()  # "." has parent "."; staging must sit beside the folder
    _check_replaceable(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        context = DemoContext(staging, quick=quick, seed=seed)
        sections = []
        for index, step in enumerate(steps, 1):
            log(f"[{index}/{len(steps)}] {step.title} ({step.plugin or 'core'})")
            torch.manual_seed(seed)
            sections.append(step.run(context))
        provided = {key for step in steps for key in step.provides}
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


def _check_replaceable(out_dir: Path) -> None:
    if out_dir.exists() and (
        not out_dir.is_dir() or (any(out_dir.iterdir()) and not (out_dir / REPORT_MARKER).exists())
    ):
        raise InvalidInputError(
            f"{out_dir} exists and is not an earlier demo output; choose another --out folder "
            "or remove it"
        )


def _write_report(
    folder: Path, sections: list[DemoSection], missing: list[str], seconds: float, quick: bool
) -> None:
    lines = [
        "# explain demo",
        "",
        f"Run on {platform.node() or 'this machine'} ({platform.machine()}, torch "
        f"{torch.__version__}) in {seconds:.1f} s{' with --quick settings' if quick else ''}.",
        "",
    ]
    for section in sections:
        lines += [f"## {section.title}", "", *section.lines, ""]
        lines += [f"![{Path(f).stem}]({f})" for f in section.figures] + [""]
    if missing:
        lines += ["## Not yet available", "", *[f"- {text}" for text in missing], ""]
    (folder / "report.md").write_text("\n".join(lines), encoding="utf-8")
    summary = {
        "seconds": round(seconds, 2),
        "quick": quick,
        "sections": {s.title: s.summary for s in sections},
        "not_yet_available": missing,
    }
    (folder / REPORT_MARKER).write_text(json.dumps(summary, indent=2), encoding="utf-8")
