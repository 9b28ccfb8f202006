"""Every Python block of the documentation site (every page under ``docs/``) runs, asserts included.

Blocks in other languages are not run: ``bash`` for what needs a shell, ``torchrun`` or a GPU,
``toml`` for packaging files, ``text`` for output. Every page written by hand has at least one
runnable Python example.
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
# Pages generated from other sources have nothing to run: the API reference renders the
# docstrings (their examples are the modules' own), and the results pages are tables that
# benchmarks/render_results.py writes from benchmarks/results/*.json.
GENERATED = ("api", "results")
FENCE = re.compile(r"^```(\S*)\n(.*?)^```", re.S | re.M)
LANGUAGES = {"python", "bash", "toml", "text", ""}
BLOCKS = [
    (page, index, block)
    for page in PAGES
    for index, block in enumerate(
        code for language, code in FENCE.findall(page.read_text()) if language == "python"
    )
]


def name(page: Path) -> str:
    return page.relative_to(DOCS).as_posix()


@pytest.mark.parametrize(
    ("page", "index", "block"), BLOCKS, ids=[f"{name(page)}-{index}" for page, index, _ in BLOCKS]
)
def test_python_blocks_of_the_docs_run(page: Path, index: int, block: str) -> None:
    # Each block runs as a module of its own, as a reader's script would (dataclasses need it).
    module = types.ModuleType(f"docs_{page.stem.replace('-', '_')}_block_{index}")
    sys.modules[module.__name__] = module
    try:
        exec(compile(block, f"{name(page)} python block {index}", "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]


def test_every_page_written_by_hand_has_runnable_examples() -> None:
    written = {page for page in PAGES if page.relative_to(DOCS).parts[0] not in GENERATED}
    assert written, "no pages found"
    without = written - {page for page, _, _ in BLOCKS}
    assert not without, f"pages without a python block: {sorted(map(name, without))}"


def test_code_blocks_are_python_or_say_why_they_are_not_run() -> None:
    # A block marked `py` or `pycon` would be skipped by the runner above without anyone noticing.
    odd = {
        f"{name(page)}: ```{language}"
        for page in PAGES
        for language, _ in FENCE.findall(page.read_text())
        if language not in LANGUAGES
    }
    assert not odd, f"code blocks in no known language: {sorted(odd)}"
