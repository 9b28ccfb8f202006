"""Conventions shared by the scripts in ``benchmarks/``.

Each script times its candidates within one run, reports medians and ratios (the machines are
shared and noisy, so absolute times are only context), prints a table and writes
``benchmarks/results/<name>.json`` with the machine it ran on. ``benchmarks/render_results.py``
turns those files into the results pages of the documentation site (``docs/results/``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def vgg_style_cnn() -> nn.Sequential:
    """The benchmarks' small VGG-style CNN: 3×32×32 inputs, three conv blocks, two dense layers."""

    def block(c_in: int, c_out: int) -> list[nn.Module]:
        return [nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]

    return nn.Sequential(
        *block(3, 32),
        *block(32, 64),
        *block(64, 128),
        nn.Flatten(),
        nn.Linear(128 * 4 * 4, 256),
        nn.ReLU(),
        nn.Linear(256, 10),
    )


def machine_info() -> dict[str, Any]:
    """The machine and software a result was measured on."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    # Versions of the compared libraries the benchmark imported (never imported here).
    for name in ("onnx", "onnxruntime", "captum", "zennit"):
        module = sys.modules.get(name)
        if module is not None:
            info[name] = getattr(module, "__version__", "unknown")
    return info


def registered_methods() -> list[str]:
    """Every registered method's name, sorted.

    Raises:
        SystemExit: If none is: the project is not installed in this environment (its built-in
            plugins are found through its metadata), and a table of no methods would pass.
    """
    from explain_core.plugin_manager import get_registry

    methods = sorted(get_registry())
    if not methods:
        raise SystemExit(
            "no methods are registered: install the project in this environment "
            "(pip install --no-deps -e .) and run again"
        )
    return methods


def median_seconds(fn: Callable[[], Any], *, repeats: int = 7, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs after ``warmup`` untimed runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved_times(
    candidates: dict[str, Callable[[], Any]], rounds: int, *, warmup: int = 1
) -> dict[str, list[float]]:
    """Seconds per candidate and round, each candidate timed once per round in turn.

    Interleaving spreads a shared machine's slow spells over all candidates alike, where timing
    one candidate's repeats after another's would charge them to whichever ran then; the order
    rotates from round to round, so that no candidate always follows the same one (a large
    allocation, say).
    """
    for fn in candidates.values():
        for _ in range(warmup):
            fn()
    names = list(candidates)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            candidates[name]()
            times[name].append(time.perf_counter() - start)
    return times


def interleaved_medians(
    candidates: dict[str, Callable[[], Any]], rounds: int, *, warmup: int = 1
) -> dict[str, float]:
    """Median seconds per candidate over :func:`interleaved_times`' rounds."""
    times = interleaved_times(candidates, rounds, warmup=warmup)
    return {name: statistics.median(values) for name, values in times.items()}


def alternated_times(
    first: Callable[[], Any], second: Callable[[], Any], rounds: int, *, warmup: int = 1
) -> tuple[list[float], list[float]]:
    """Seconds of two candidates timed alternately, round by round (ABBA ABBA …).

    Within a round each follows the other half of the time, and nothing else runs between
    them: a third candidate's allocations (a method that takes gigabytes and frees them) cannot
    decide which of the two pays the page faults of a regrown heap, as in a fixed rotation over
    many candidates, where each always follows the same neighbour.
    """
    for fn in (first, second):
        for _ in range(warmup):
            fn()
    times: tuple[list[float], list[float]] = ([], [])
    for round_ in range(rounds):
        order = (0, 1) if round_ % 2 == 0 else (1, 0)
        for index in order:
            start = time.perf_counter()
            (first, second)[index]()
            times[index].append(time.perf_counter() - start)
    return times


def counting_page_faults(run: Callable[[], Any]) -> tuple[Callable[[], Any], list[int]]:
    """``run`` wrapped to record the minor page faults of each call, and the list they go to.

    A minor fault is a page of fresh memory touched for the first time: what glibc costs a call
    whose working memory it handed back to the system after the previous one (it trims the top of
    its heap once more than its trim threshold is free there) and must fault in again.
    """
    faults: list[int] = []

    def counted() -> Any:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        try:
            return run()
        finally:
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

    return counted, faults


# glibc told to keep freed memory in its heap: no trimming, and 512 MiB of headroom on each growth.
KEEP_FREED_MEMORY = {"MALLOC_TRIM_THRESHOLD_": str(2**40), "MALLOC_TOP_PAD_": str(2**29)}


def median_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> float:
    """Median over rounds of the ratio of two candidates' times in the same round.

    Both ran in the same round, seconds apart: a slow spell that spans the round cancels out,
    where a ratio of two medians would compare different rounds.
    """
    return statistics.median(a / b for a, b in zip(numerator, denominator, strict=True))


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """A Markdown table of ``rows`` (dicts with the same keys); floats get 4 significant digits."""
    if not rows:
        return "(no rows)"
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for row in rows:
        cells = [f"{v:.4g}" if isinstance(v, float) else str(v) for v in row.values()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_results(
    name: str,
    rows: Sequence[dict[str, Any]],
    *,
    title: str,
    command: str,
    notes: str = "",
    folder: Path | None = None,
) -> Path:
    """Print the table and write ``<folder>/<name>.json`` (default ``benchmarks/results``).

    Args:
        name: File stem, e.g. ``"explain_overhead"``.
        rows: Table rows, one dict per measured case.
        title: Heading of its table on the results pages.
        command: The command that reproduces the result.
        notes: What the numbers mean (goal, caveats).
        folder: Results folder.

    Returns:
        The JSON path.
    """
    folder = folder or Path(__file__).resolve().parent / "results"
    folder.mkdir(parents=True, exist_ok=True)
    payload = {
        "title": title,
        "command": command,
        "notes": notes,
        "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "rows": list(rows),
    }
    path = folder / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    print(f"## {title}\n\n{format_table(rows)}\n\nwritten to {path}")
    return path


def render_result(path: Path, level: int = 2) -> str:
    """Markdown for one results file: a heading of ``level``, the table, what it means and how
    it was measured (date, machine, the command that reproduces it)."""
    payload = json.loads(path.read_text(encoding="utf-8"))
    machine = payload["machine"]
    return "\n".join(
        [
            f"{'#' * level} {payload['title']}",
            "",
            format_table(payload["rows"]),
            "",
            f"{payload['notes']} Measured {payload['measured_at'][:10]} on "
            f"{machine['cpu_count']} CPU cores (torch {machine['torch']}"
            f"{', ' + machine['cuda'] if machine.get('cuda') else ''}); reproduce with "
            f"`{payload['command']}`.".strip(),
            "",
        ]
    )


def memory_worker_output(command: list[str]) -> str:
    """The last line a memory-measuring worker printed, run with glibc's mmap threshold at 64 KiB.

    Blocks above it are mmapped and unmapped on free, so the resident set follows live memory
    (else freed tensors stay in the heap and a peak depends on what ran before).
    """
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return done.stdout.strip().splitlines()[-1]


def print_peak_extra_bytes(run: Callable[[], Any]) -> None:
    """Run ``run`` once and print (JSON) the peak resident set above the live memory before it.

    What a memory worker prints for :func:`memory_worker_output` to read. Memory freed before
    the run (building the model, importing) can stay resident in glibc's heap and be reused by
    the run, hiding that much of its peak, and how much depends on the process's history (47
    MB of the VGG net's 140 for ε+z⁺, from one commit to the next): it is handed back first.
    """
    gc.collect()
    _trim_heap()
    before = PeakResidentSet().now()
    with PeakResidentSet() as peak:
        run()
    print(json.dumps({"extra_bytes": peak.peak - before}))


def _trim_heap() -> None:
    """Hand glibc's free heap memory back to the system (``malloc_trim``); elsewhere a no-op."""
    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if trim is not None:
        trim(0)


class PeakResidentSet:
    """The largest resident set seen by a thread sampling ``/proc/self/statm`` every 1 ms."""

    def __init__(self) -> None:
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.peak = self.now()
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def now(self) -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * self.page

    def _sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, self.now())
            time.sleep(0.001)

    def __enter__(self) -> PeakResidentSet:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, self.now())


def plain_gradient(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    x = x.detach().requires_grad_(True)
    (grad,) = torch.autograd.grad(model(x).gather(1, target[:, None]).sum(), x)
    return grad


class _ExtraTransposedConvolution(torch.autograd.Function):
    """The identity, whose backward also runs the convolution's transposed product once more."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, x: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
        ctx.conv, ctx.shape = conv, x.shape
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        conv = ctx.conv
        torch.nn.grad.conv2d_input(
            ctx.shape, conv.weight, grad, conv.stride, conv.padding, conv.dilation, conv.groups
        )
        return grad, None, None


def gradient_plus_rule_convolutions(
    model: nn.Module,
    x: torch.Tensor,
    target: torch.Tensor,
    weights: Callable[[torch.Tensor], list[torch.Tensor]],
    extra_transposed: int = 0,
    rectified: Collection[str] = (),
) -> torch.Tensor:
    """One plain gradient plus the convolutions a rule adds: the lower bound of its cost.

    Every convolution also computes ``W'∗a`` for each modified weight ``W'`` in
    ``weights(W)`` in the forward pass, and ``extra_transposed`` more transposed products in
    the backward pass (z⁺: ``[W⁺]`` and none; γ: ``[W + γW⁺]`` and one, for its falling
    outputs), except the convolutions named in ``rectified``: only a ReLU reads them, so no
    signal reaches their falling outputs.
    """
    names = {id(module): name for name, module in model.named_modules()}

    def hook(conv: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> Any:
        with torch.no_grad():
            for weight in weights(conv.weight):
                F.conv2d(
                    args[0], weight, None, conv.stride, conv.padding, conv.dilation, conv.groups
                )
        for _ in range(0 if names[id(conv)] in rectified else extra_transposed):
            output = _ExtraTransposedConvolution.apply(output, args[0], conv)
        return output

    convs = [module for module in model.modules() if isinstance(module, nn.Conv2d)]
    handles = [conv.register_forward_hook(hook) for conv in convs]
    try:
        return plain_gradient(model, x, target)
    finally:
        for handle in handles:
            handle.remove()


def z_plus_weights(weight: torch.Tensor) -> list[torch.Tensor]:
    """z⁺'s modified weight ``W⁺``."""
    return [weight.clamp(min=0)]


def gamma_weights(weight: torch.Tensor, gamma: float = 0.25) -> list[torch.Tensor]:
    """The generalised γ rule's one modified weight ``W + γW⁺``.

    Its other denominator, ``(W + γW⁻)∗a``, needs no convolution: the two add up to
    ``(2 + γ) z`` (the amplified parts of all contributions add up to ``γz``).
    """
    return [weight + gamma * weight.clamp(min=0)]
