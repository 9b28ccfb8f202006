"""Every Python block of the documentation pages in ``docs/`` runs (their asserts included)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
BLOCKS = [
    (page, index, block)
    for page in sorted(DOCS.glob("*.md"))
    for index, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S))
]


@pytest.mark.parametrize(
    ("page", "index", "block"), BLOCKS, ids=[f"{page.name}-{index}" for page, index, _ in BLOCKS]
)
def test_python_blocks_of_the_docs_run(page: Path, index: int, block: str) -> None:
    namespace: dict = {"__name__": f"{page.stem}_block_{index}"}
    exec(compile(block, f"{page.name} python block {index}", "exec"), namespace)


def test_every_docs_page_has_runnable_examples() -> None:
    pages = {page for page, _, _ in BLOCKS}
    assert pages == set(DOCS.glob("*.md"))
