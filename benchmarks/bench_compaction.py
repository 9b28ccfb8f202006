"""Compaction of REM-pruned DR-CapsNets: parameters, latency and parity before and after.

Takes the REM-pruned DR-CapsNets trained by ``benchmarks/reproduce_rem.py`` (its cache, digits,
every seed found), removes the first-convolution channels and primary capsule types that pruning
left dead (``explain_capsules.compaction.compact``, torch-pruning with the capsule pruners), and
measures within one run: parameter counts, the largest output difference on the 450 test digits
(class capsule lengths), and median forward latency at batch 1 and 32 (interleaved rounds).

    python benchmarks/reproduce_rem.py        # first: trains and caches the REM models
    python benchmarks/bench_compaction.py
"""

from __future__ import annotations

from pathlib import Path

import torch
from harness import interleaved_medians, write_results

from explain_capsules.compaction import compact, count_parameters
from explain_capsules.models import DRCapsNet
from explain_capsules.pruning import MagnitudePruner
from explain_capsules.training import CHECKPOINT_NAME, load_capsule_checkpoint
from explain_core.data.digits import load_digits

ROOT = Path(__file__).resolve().parent
MODELS = ROOT / ".cache" / "rem" / "full"
ROUNDS = 15


def load_rem_model(folder: Path) -> DRCapsNet:
    """A cached REM model; the pruner registers the mask buffers its checkpoint holds."""
    model = DRCapsNet(image_size=28)
    MagnitudePruner(model, 0.5)  # only creates the ``*_mask`` buffers; target irrelevant here
    load_capsule_checkpoint(folder / CHECKPOINT_NAME, model)
    return model.eval()


def main() -> None:
    folders = sorted(MODELS.glob("digits-rem-seed*"))
    folders = [f for f in folders if (f / CHECKPOINT_NAME).exists()]
    if not folders:
        raise SystemExit(
            f"no REM models in {MODELS}; run `python benchmarks/reproduce_rem.py` first"
        )
    test = load_digits(image_size=28).test_images
    rows = []
    for folder in folders:
        model = load_rem_model(folder)
        compacted, report = compact(model, test[:2])
        with torch.no_grad():
            parity = float((model(test) - compacted(test)).abs().max())
        row = {
            "model": folder.name,
            "params before": count_parameters(model),
            "params after": count_parameters(compacted),
            "dead conv channels": len(report.removed_channels),
            "dead primary types": len(report.removed_types),
            "max |Δ output|": parity,
        }
        for batch in (1, 32):
            inputs = test[:batch]
            with torch.no_grad():
                latency = interleaved_medians(
                    {"before": lambda: model(inputs), "after": lambda: compacted(inputs)},  # noqa: B023
                    ROUNDS,
                )
            row[f"ms b{batch} before"] = 1000 * latency["before"]
            row[f"ms b{batch} after"] = 1000 * latency["after"]
            row[f"speed-up b{batch}"] = latency["before"] / latency["after"]
        rows.append(row)
    write_results(
        "rem_compaction",
        rows,
        title="Compaction of REM-pruned DR-CapsNets (torch-pruning, capsule pruners)",
        command="python benchmarks/reproduce_rem.py && python benchmarks/bench_compaction.py",
        notes=(
            "REM models of benchmarks/reproduce_rem.py (digits, 85% global magnitude sparsity). "
            "'max |Δ output|': largest difference of the class capsule lengths over the 450 "
            f"test digits (goal ≤ 1e-5). Latency: median of {ROUNDS} interleaved forward "
            "passes per batch size, 2 threads."
        ),
    )


if __name__ == "__main__":
    main()
