"""Cost of explaining every class of a CoDA-Net at once.

Times, within one run (medians), on the S-CoDA preset (6×32×32, batch 8) and the digits preset
(2×8×8, batch 64): contributions for one class, for all classes in one batched call, a loop of
one call per class, and a loop of Input×Gradient calls through `explain()` (one per class).

    python benchmarks/bench_coda_contributions.py [--quick]
"""

from __future__ import annotations

import argparse

import torch
from harness import median_seconds, write_results

from explain_coda import CoDANet, coda_contributions
from explain_core import explain


def measure(preset: str, batch: int, repeats: int) -> dict[str, object]:
    torch.manual_seed(0)
    model = CoDANet.from_preset(preset, temperature=10.0).eval()
    x = torch.rand(batch, *model.input_shape)
    classes = range(model.num_classes)
    one = median_seconds(lambda: coda_contributions(model, x, 0), repeats=repeats)
    every = median_seconds(lambda: coda_contributions(model, x, classes="all"), repeats=repeats)
    loop = median_seconds(
        lambda: [coda_contributions(model, x, k) for k in classes], repeats=repeats
    )
    ixg = median_seconds(
        lambda: [explain(model, x, "input_x_gradient", k) for k in classes], repeats=repeats
    )
    return {
        "preset": preset,
        "batch": batch,
        "classes": model.num_classes,
        "one class ms": one * 1e3,
        "all classes ms": every * 1e3,
        "all / one": every / one,
        "all / loop of one-class calls": every / loop,
        "all / loop of Input×Gradient": every / ixg,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    repeats = 2 if args.quick else 5
    rows = [measure("digits", 64, repeats), measure("S", 4 if args.quick else 8, repeats)]
    write_results(
        "coda_contributions",
        rows,
        title="CoDA contributions: all classes in one call",
        command="python benchmarks/bench_coda_contributions.py",
        notes="Medians within one run; ratios < classes mean the batched all-classes call costs "
        "less than one call per class (forward shared, one batched vector-Jacobian product).",
    )


if __name__ == "__main__":
    main()
