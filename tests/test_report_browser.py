"""The headless-Chromium check that tests/test_demo.py runs on the demo's report, checked itself.

A page with a missing picture, a file that is not a picture, a ``console.error`` and an uncaught
exception must come back with each of them named; a clean page with a PNG and an SVG with none.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from headless_chromium import open_page, require_chromium
from PIL import Image

SVG = (
    '<svg xmlns="http://www.w3.org/2000/svg" width="12pt" height="8pt">'
    '<rect width="4" height="4"/></svg>'
)


@pytest.fixture(scope="module")
def chromium() -> str:
    return require_chromium()


def _page(folder: Path, body: str) -> Path:
    Image.new("RGB", (7, 5), "red").save(folder / "good.png")
    (folder / "good.svg").write_text(SVG, encoding="utf-8")
    (folder / "not-a-picture.png").write_text("plain text", encoding="utf-8")
    page = folder / "page.html"
    page.write_text(
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>t</title></head>'
        f"<body>{body}</body></html>",
        encoding="utf-8",
    )
    return page


def test_a_clean_page_has_loaded_images_and_no_errors(chromium: str, tmp_path: Path) -> None:
    report = open_page(_page(tmp_path, '<img src="good.png"><img src="good.svg">'), chromium)
    assert report.title == "t" and report.errors == []
    widths = {image["src"]: image["naturalWidth"] for image in report.images}
    assert widths["good.png"] == 7 and widths["good.svg"] == 16  # 12 pt = 16 CSS px
    assert all(image["complete"] for image in report.images)


def test_broken_pictures_and_script_errors_are_all_reported(chromium: str, tmp_path: Path) -> None:
    body = (
        '<img src="good.png"><img src="missing.png"><img src="not-a-picture.png">'
        '<script>console.error("something broke"); undefinedFunction();</script>'
    )
    report = open_page(_page(tmp_path, body), chromium)
    widths = {image["src"]: image["naturalWidth"] for image in report.images}
    assert widths == {"good.png": 7, "missing.png": 0, "not-a-picture.png": 0}
    text = "\n".join(report.errors)
    assert "console.error: something broke" in text
    assert "undefinedFunction is not defined" in text
    assert "missing.png" in text and "ERR_FILE_NOT_FOUND" in text
