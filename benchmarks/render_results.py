"""Render benchmarks/results/ into the results pages of the documentation site (docs/results/).

python benchmarks/render_results.py            # say which pages are out of date
python benchmarks/render_results.py --update   # rewrite docs/results/

Every results file lands on the page of its family, chosen by the start of its name (PAGES,
in the order of its prefixes there); a file no prefix claims lands on the last page.
``<name>.json`` files (written by ``harness.write_results``) become a table with its notes and
command, ``<name>.md`` files (the zoo checks write Markdown themselves) are included as they
are, and each figure of ``results/figures/`` is shown under the results file whose name its own
name starts with (the site serves the figures from where they are: docs/hooks/figures.py). Safe
to run again: the pages depend on the results files only.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from harness import render_result

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGES_DIR = ROOT / "docs" / "results"
GENERATED = "<!-- Written by benchmarks/render_results.py from benchmarks/results/: do not edit -->"

# (page, title, the prefixes of the results files it shows); the last page takes the rest.
PAGES = (
    ("coda", "CoDA-Nets", ("coda_", "dau_")),
    ("capsules", "Capsules and REM", ("rem_",)),
    (
        "modified-bp",
        "Modified backpropagation",
        ("modbp_", "cnn_", "resnet50_", "zennit_", "torchvision_"),
    ),
    ("transformers", "Transformers", ("transformers_", "lxt_", "hf_")),
    ("onnx", "ONNX export", ("onnx_",)),
    ("gpu", "On a CUDA GPU", ("cuda_",)),
    ("core", "The core: overhead, threads and the rest", ()),
)

INDEX_INTRO = """\
Benchmarks are scripts in `benchmarks/`; each prints a table and writes
`benchmarks/results/<name>.json` with the machine it ran on. Timings are medians and goals are
ratios measured within one run: the machines are shared and noisy, so absolute times are only
context. Every table says when and where it was measured and the command that reproduces it.
These pages are generated from those files by `python benchmarks/render_results.py --update`,
and a test checks that they match them. What the numbers mean for each family is on the
family's own page."""


def place(stem: str) -> tuple[int, int]:
    """Where a results file (or figure) named ``stem`` goes: its page and its prefix's rank."""
    for number, (_, _, prefixes) in enumerate(PAGES):
        for rank, prefix in enumerate(prefixes):
            if stem.startswith(prefix):
                return number, rank
    return len(PAGES) - 1, 0


def page_of(stem: str) -> str:
    """The page a results file (or figure) named ``stem`` lands on."""
    return PAGES[place(stem)[0]][0]


def owner(figure: str, stems: list[str]) -> str | None:
    """The results file a figure belongs to: the longest name its own name starts with."""
    owners = [stem for stem in stems if figure.startswith(stem)]
    return max(owners, key=len) if owners else None


def figure_markdown(figure: Path) -> str:
    return f"![{figure.stem.replace('_', ' ')}](figures/{figure.name})\n"


def included_markdown(path: Path) -> str:
    """A Markdown results file, its headings one level down (its title becomes a section)."""
    text = re.sub(r"^(#+) ", r"#\1 ", path.read_text(encoding="utf-8"), flags=re.M)
    return text.rstrip() + "\n"


def render_pages(results: Path = RESULTS) -> dict[str, str]:
    """File name under docs/results/ → its content, for every page (the index included)."""
    files = sorted(
        (p for p in results.iterdir() if p.suffix in (".json", ".md")),
        key=lambda p: (place(p.stem), p.stem),
    )
    figures = sorted((results / "figures").glob("*.png"))
    stems = [p.stem for p in files]
    sections: dict[str, list[str]] = {page: [] for page, _, _ in PAGES}
    titles: dict[str, list[str]] = {page: [] for page, _, _ in PAGES}
    for path in files:
        text = render_result(path) if path.suffix == ".json" else included_markdown(path)
        own = [figure_markdown(f) for f in figures if owner(f.stem, stems) == path.stem]
        sections[page_of(path.stem)].append("\n".join([text, *own]))
        titles[page_of(path.stem)].append(text.splitlines()[0].lstrip("# "))
    for figure in figures:
        if owner(figure.stem, stems) is None:
            sections[page_of(figure.stem)].append(
                f"## Figure: {figure.stem.replace('_', ' ')}\n\n{figure_markdown(figure)}"
            )
            titles[page_of(figure.stem)].append(f"Figure: {figure.stem.replace('_', ' ')}")
    pages = {}
    index = [GENERATED, "", "# Results", "", INDEX_INTRO, ""]
    for page, title, _ in PAGES:
        if not sections[page]:
            sections[page].append("No results yet.\n")
        body = "\n".join(sections[page])
        pages[f"{page}.md"] = f"{GENERATED}\n\n# Results: {title}\n\n{body}"
        index += [f"- [{title}]({page}.md): " + "; ".join(titles[page]) + "."]
    pages["index.md"] = "\n".join(index) + "\n"
    return pages


def stale_pages(pages: dict[str, str], folder: Path = PAGES_DIR) -> list[str]:
    """The pages under ``folder`` that differ from ``pages``, are missing, or are left over."""
    on_disk = {p.name for p in folder.glob("*.md")} if folder.is_dir() else set()
    stale = [
        name
        for name, text in pages.items()
        if name not in on_disk or (folder / name).read_text(encoding="utf-8") != text
    ]
    return sorted(stale + list(on_disk - set(pages)))


def write_pages(pages: dict[str, str], folder: Path = PAGES_DIR) -> None:
    """Write ``pages`` into ``folder`` and remove the Markdown files it no longer has."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in pages.items():
        path = folder / name
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
    for left in set(p.name for p in folder.glob("*.md")) - set(pages):
        (folder / left).unlink()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--update", action="store_true", help="rewrite docs/results/")
    args = parser.parse_args()
    pages = render_pages()
    stale = stale_pages(pages)
    if args.update:
        write_pages(pages)
        print(f"updated {PAGES_DIR.relative_to(ROOT)}/: {', '.join(stale) or 'nothing changed'}")
    elif stale:
        raise SystemExit(f"out of date: {', '.join(stale)}; run with --update")
    else:
        print(f"{PAGES_DIR.relative_to(ROOT)}/ matches {RESULTS.relative_to(ROOT)}/")


if __name__ == "__main__":
    main()
