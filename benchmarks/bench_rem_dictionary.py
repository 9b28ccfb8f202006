"""Cost of building REM's per-class parse-tree dictionary.

Times, within one run (medians), ``ParseTreeDictionary.update`` over 10 000 samples × 1152 lower
capsules × 10 classes in batches of 1000 (K = 11), against the naive approach of the public
code's style: the same vectorised gather and ``np.digitize`` quantisation per batch, then one
","-joined string key per sample counted in a ``collections.Counter`` per class. Two data cases:
"peaky" random softmax couplings (almost every key distinct) and "prototypes" (each sample is
one of 5 one-hot prototypes per class plus noise, so only a few keys exist). Both approaches
are checked to give identical counts.

    python benchmarks/bench_rem_dictionary.py [--quick]
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import numpy as np
import torch
from harness import format_table, median_seconds, write_results

from explain_capsules.rem import ParseTreeDictionary

N_LOWER, N_CLASSES, LEVELS, BATCH = 1152, 10, 11, 1000


def make_batches(case: str, samples: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Couplings ``(BATCH, N_LOWER, N_CLASSES)`` and predicted classes, batch by batch."""
    gen = torch.Generator().manual_seed(seed)
    if case == "prototypes":
        # One-hot prototype logits (margin 10, couplings ≈ 0 or 1): noise cannot move a level.
        parents = torch.randint(0, N_CLASSES, (N_CLASSES, 5, N_LOWER), generator=gen)
        protos = 10.0 * torch.nn.functional.one_hot(parents, N_CLASSES).float()
    batches = []
    for _ in range(samples // BATCH):
        if case == "peaky":
            logits = 5.0 * torch.randn(BATCH, N_LOWER, N_CLASSES, generator=gen)
            predicted = torch.randint(0, N_CLASSES, (BATCH,), generator=gen)
        else:
            predicted = torch.randint(0, N_CLASSES, (BATCH,), generator=gen)
            which = torch.randint(0, 5, (BATCH,), generator=gen)
            logits = protos[predicted, which] + 0.1 * torch.randn(
                BATCH, N_LOWER, N_CLASSES, generator=gen
            )
        batches.append((torch.softmax(logits, dim=2), predicted))
    return batches


def vectorised(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> ParseTreeDictionary:
    d = ParseTreeDictionary(n_classes=N_CLASSES)
    for couplings, predicted in batches:
        d.update(couplings, predicted, LEVELS)
    return d


BINS = np.linspace(-0.05, 1.05, LEVELS + 1)


def naive(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[Counter]:
    counters = [Counter() for _ in range(N_CLASSES)]
    for couplings, predicted in batches:
        columns = couplings.gather(2, predicted.view(-1, 1, 1).expand(-1, N_LOWER, 1)).squeeze(2)
        levels = np.digitize(np.clip(columns.double().numpy(), 0.0, 1.0), BINS) - 1
        for row, cls in zip(levels, predicted.tolist(), strict=True):
            counters[cls][",".join(map(str, row.tolist()))] += 1
    return counters


def measure(case: str, samples: int, repeats: int) -> dict[str, object]:
    batches = make_batches(case, samples)
    d = vectorised(batches)
    counters = naive(batches)
    for j in range(N_CLASSES):
        ours = Counter({",".join(map(str, k)): n for k, n in d.counts_dict(j).items()})
        assert ours == counters[j], f"counts differ for class {j}"
    ours_s = median_seconds(lambda: vectorised(batches), repeats=repeats)
    naive_s = median_seconds(lambda: naive(batches), repeats=max(3, repeats // 2))
    return {
        "case": case,
        "samples": samples,
        "keys (all classes)": int(d.keys_per_class().sum()),
        "mean entropy bits": round(d.mean_entropy(), 3),
        "vectorised ms": ours_s * 1e3,
        "naive strings ms": naive_s * 1e3,
        "naive / vectorised": naive_s / ours_s,
        "vectorised µs/sample": ours_s / samples * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2000 samples, fewer repeats")
    args = parser.parse_args()
    samples, repeats = (2000, 3) if args.quick else (10_000, 5)
    start = time.perf_counter()
    rows = [measure(case, samples, repeats) for case in ("peaky", "prototypes")]
    print(f"total {time.perf_counter() - start:.1f} s")
    if args.quick:
        print(format_table(rows))
        return
    write_results(
        "rem_dictionary",
        rows,
        title="REM parse-tree dictionary: vectorised update vs per-sample string keys",
        command="python benchmarks/bench_rem_dictionary.py",
        notes=(
            f"{samples} samples × {N_LOWER} lower capsules × {N_CLASSES} classes, K={LEVELS}, "
            f"batches of {BATCH}; both columns include gathering the predicted column and "
            "quantising it, the naive one then joins one string per sample into a Counter "
            "(the whole data set, no extrapolation). 'peaky': softmax(5·randn) couplings, "
            "nearly every key distinct; 'prototypes': 5 one-hot prototypes per class plus "
            "noise, few keys. Counts are checked identical between the two."
        ),
    )


if __name__ == "__main__":
    main()
