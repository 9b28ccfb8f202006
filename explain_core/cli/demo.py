"""``explain demo``: the main job on bundled data, writing a report folder."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_parser(subparsers: Any) -> None:
    """Register the subcommand."""
    parser = subparsers.add_parser(
        "demo",
        help="run every available section on bundled data and write a report folder",
        description="Run the demo on bundled digits: each installed plugin contributes "
        "sections. The folder is written only when everything succeeded; sections not yet "
        "available are listed in the report.",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("demo-output"), help="output folder (default: %(default)s)"
    )
    parser.add_argument("--quick", action="store_true", help="small, fast settings")
    parser.add_argument("--seed", type=int, default=0, help="seed of all randomness")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run the demo and print where the report went."""
    from explain_core.data.showcase import BundledDataStep
    from explain_core.demo import run_demo
    from explain_core.plugin_manager import get_plugin_manager

    steps = [BundledDataStep(), *get_plugin_manager().demo_steps()]
    result = run_demo(args.out, steps, quick=args.quick, seed=args.seed)
    print(
        f"wrote {result.out_dir / 'report.md'} ({len(result.sections)} sections, "
        f"{result.seconds:.1f} s)"
    )
    if result.missing:
        print("not yet available: " + "; ".join(result.missing))
    return 0
