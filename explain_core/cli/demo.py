"""``explain demo``: the main job on bundled data, writing a report folder."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from explain_core.cli.common import output_path
from explain_core.errors import InvalidInputError

NAME = "demo"
HELP = "run every available section on bundled data and write a report folder"
DESCRIPTION = (
    "Run the demo on bundled digits: each installed plugin contributes sections. The folder "
    "(report.html with its pictures, report.md, summary.json) replaces the previous one when "
    "the run ends; sections not available are listed in the report, and a section that fails "
    "is shown as failed with its error (the exit status is then 1; --debug prints the "
    "traceback). Trained models are cached, so a second run is fast."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The subcommand's arguments."""
    parser.add_argument(
        "--out",
        type=output_path,
        default=Path("demo-output"),
        help="output folder (default: %(default)s)",
    )
    parser.add_argument("--quick", action="store_true", help="small, fast settings")
    parser.add_argument("--seed", type=int, default=0, help="seed of all randomness")
    parser.add_argument(
        "--cache",
        type=Path,
        help="folder of cached trained models (default: $EXPLAIN_CACHE_DIR, else "
        "$XDG_CACHE_HOME/explain-torch/demo, else ~/.cache/explain-torch/demo)",
    )
    parser.add_argument(
        "--no-cache", action="store_true", help="train every model afresh, cache nothing"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default: %(default)s; the demo's models are small, and more "
        "threads mostly add overhead on a busy machine)",
    )


def collect_steps() -> list[Any]:
    """Every plugin's demo steps (the core's data step too), in their declared order."""
    from explain_core.plugin_manager import get_plugin_manager

    return get_plugin_manager().demo_steps()


def run(args: argparse.Namespace) -> int:
    """Run the demo and print where the report went; 1 if a section failed (it is reported)."""
    import torch

    from explain_core.demo import default_cache_dir, run_demo

    if args.threads < 1:
        raise InvalidInputError(f"--threads must be at least 1; got {args.threads}")
    if args.cache is not None and args.no_cache:
        raise InvalidInputError("give --cache or --no-cache, not both")
    cache = None if args.no_cache else (args.cache or default_cache_dir())
    previous = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        steps = collect_steps()
        result = run_demo(
            args.out,
            steps,
            quick=args.quick,
            seed=args.seed,
            cache_dir=cache,
            debug=getattr(args, "debug", False),
        )
    finally:  # main() may run inside another program (tests): leave it as it was
        torch.set_num_threads(previous)
    print(
        f"wrote {result.out_dir / 'report.md'} and {result.out_dir / 'report.html'} (open it "
        f"in a browser; {len(result.sections)} sections, {result.seconds:.1f} s)"
    )
    if result.missing:
        print("not yet available: " + "; ".join(result.missing))
    for section in result.failed:
        message = f"section {section.title!r} failed: {section.failed}"
        print(f"explain: error: {message}", file=sys.stderr)
    return 1 if result.failed else 0
