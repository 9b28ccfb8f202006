"""Render benchmarks/results/*.json into the README's results section.

python benchmarks/render_results.py            # print the section
python benchmarks/render_results.py --update   # rewrite it in README.md
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from harness import render_results

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- results:start -->", "<!-- results:end -->"


def readme_with_results(readme: str, results: str) -> str:
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.S)
    if not pattern.search(readme):
        raise SystemExit(f"README.md has no {START} ... {END} block")
    return pattern.sub(lambda _: f"{START}\n{results}{END}", readme)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--update", action="store_true", help="rewrite README.md in place")
    args = parser.parse_args()
    results = render_results(ROOT / "benchmarks" / "results")
    if args.update:
        readme = ROOT / "README.md"
        readme.write_text(readme_with_results(readme.read_text(), results))
        print(f"updated {readme}")
    else:
        print(results)


if __name__ == "__main__":
    main()
