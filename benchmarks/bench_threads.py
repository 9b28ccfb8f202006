"""Throughput of 4 threads explaining one model object against one thread doing the same work.

A threaded server explains one shared model from several request threads. Attribution keeps its
state off the model (``explain_core.scoped``), so the threads need no lock, and torch releases
the GIL inside its kernels: the threads' kernels can overlap. Each case makes the same 16 calls
(batch 8, VGG-style CNN, 3×32×32) once from one thread and once spread over 4 threads, with one
intra-op thread per call so that concurrency, not torch's own parallelism, is measured; medians
of interleaved rounds. Speed-up = one thread's time / four threads' time (at most the number of
cores).

    python benchmarks/bench_threads.py
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import torch
from harness import interleaved_medians, vgg_style_cnn, write_results

from explain_core import explain

CALLS = 16
THREADS = 4
METHODS = ("gradient", "lrp.epsilon_plus", "deeplift.rescale", "guided_bp")


def in_threads(call: Callable[[], object], threads: int) -> Callable[[], None]:
    """``CALLS`` calls of ``call``, spread evenly over ``threads`` threads."""

    def work() -> None:
        for _ in range(CALLS // threads):
            call()

    def run() -> None:
        workers = [threading.Thread(target=work) for _ in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()

    return run


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = vgg_style_cnn().eval()
    x = torch.rand(8, 3, 32, 32)
    rows = []
    for method in METHODS:

        def call(method: str = method) -> object:
            return explain(model, x, method, 3)

        medians = interleaved_medians({"one": in_threads(call, 1), "four": in_threads(call, 4)}, 7)
        rows.append(
            {
                "method": method,
                "1 thread ms": medians["one"] * 1e3,
                "4 threads ms": medians["four"] * 1e3,
                "speed-up": medians["one"] / medians["four"],
            }
        )
    write_results(
        "threads",
        rows,
        title="One model explained from 4 threads at once vs from one thread",
        command="python benchmarks/bench_threads.py",
        notes=f"{CALLS} calls of explain() (batch 8, VGG-style CNN, 3×32×32) from one thread, and "
        f"the same calls spread over {THREADS} threads on the same model object; one intra-op "
        f"thread per call; medians of 7 interleaved rounds; {os.cpu_count()} cores. Every map "
        "equals the sequential one (tests/test_concurrency.py).",
    )


if __name__ == "__main__":
    main()
