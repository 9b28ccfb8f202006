"""Speed of the ε+z⁺ LRP composite against one plain gradient, on a VGG-style CNN.

The model has eight 3×3 convolutions with ReLU (max pooling after every second one), two dense
layers, 3×32×32 inputs and batch 32. Within one run the script times, interleaved round by round
(so load from other processes hits every candidate alike):

- one plain gradient: ``torch.autograd.grad`` of the target logits w.r.t. the input;
- ``explain(model, x, "lrp.epsilon_plus", target)`` (z⁺ on convolutions, ε on dense layers);
- the same rules written out by hand for this one architecture, without autograd or hooks (an
  independent check of the map, and the cost of the textbook implementation);
- one gradient plus the convolutions ``W⁺∗a`` that z⁺ adds, nothing else: a lower bound for any
  z⁺ implementation on torch's kernels (its backward costs as much as the gradient's);
- Captum's LRP with the same rules (if it runs) and Captum's DeepLift, for scale;
- Zennit's EpsilonPlus, where installed (the throw-away environment of
  ``check_torchvision_zoo.py``: Zennit needs torchvision).

It reports medians and their ratios to the gradient (goal for ε+z⁺: ≤ 1.3×). Each ratio is taken
within one process, in several fresh processes, and the table gives their median and range. Each
process first times ε+z⁺ and the gradient alone: how a fresh process that runs nothing else sees
it (glibc hands memory freed at the top of its heap back after a call and faults it in again in
the next, until something has grown the heap; ``MALLOC_TOP_PAD_`` changes that), and then ε+z⁺
and its lower bound alternately (ABBA…, the ratio ``bench_resnet_lrp.py`` reports; goal of issue
21: ≤ 1.05×), counting each one's page faults per call; then that pair alone (nothing else run
before it) in as many more fresh processes with glibc's defaults, and in as many again with glibc
keeping freed memory in its heap (``harness.KEEP_FREED_MEMORY``), which takes the page faults out
of the ratio.
Peak memory: each candidate in a fresh process, as ``bench_resnet_lrp.py`` measures it (goal:
≤ 2× the gradient's).

    python benchmarks/bench_modbp_speed.py            # ~8 min on 2 loaded cores
    python benchmarks/bench_modbp_speed.py --profile  # one process, printing the top operators
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F
from harness import (
    KEEP_FREED_MEMORY,
    alternated_times,
    counting_page_faults,
    gradient_plus_rule_convolutions,
    interleaved_medians,
    median_ratio,
    memory_worker_output,
    plain_gradient,
    print_peak_extra_bytes,
    write_results,
    z_plus_weights,
)
from torch import nn

from explain_core import explain

LOWER_BOUND = "gradient + W⁺∗a convolutions (lower bound)"
BY_HAND = "ε+z⁺ by hand"
CAPTUM_LRP = "captum LRP ε+z⁺"
ZENNIT = "zennit EpsilonPlus"
GRADIENT_ALONE = "gradient, first in its process"
ALONE = "lrp.epsilon_plus, first in its process"


class VGGStyle(nn.Module):
    """Eight 3×3 convolutions (64, 64, 128, 128, 256, 256, 512, 512), four poolings, 2 dense."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for width in (64, 128, 256, 512):
            for _ in range(2):
                layers += [nn.Conv2d(channels, width, 3, padding=1), nn.ReLU()]
                channels = width
            layers.append(nn.MaxPool2d(2))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Linear(512 * 2 * 2, 512), nn.ReLU(), nn.Linear(512, classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


def _safe_divide(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    zero = denominator == 0
    return numerator / denominator.masked_fill(zero, 1.0) * ~zero


def _z_plus_step(
    relevance: torch.Tensor, conv: nn.Conv2d, a: torch.Tensor, positive: torch.Tensor
) -> torch.Tensor:
    """``a ⊙ W⁺ᵀ(R / z⁺)`` with ``z⁺ = W⁺∗a`` (computed here: as costly as in the forward)."""
    z_plus = F.conv2d(a, positive, None, conv.stride, conv.padding)
    back, _, _ = torch.ops.aten.convolution_backward(
        _safe_divide(relevance, z_plus), a, positive, None, conv.stride, conv.padding,
        conv.dilation, False, [0, 0], 1, [True, False, False],
    )  # fmt: skip
    return a * back


@torch.no_grad()
def handwritten_epsilon_plus(
    model: VGGStyle, x: torch.Tensor, target: torch.Tensor, epsilon: float = 1e-6
) -> torch.Tensor:
    """ε+z⁺ for :class:`VGGStyle` alone, in relevance form (Bach et al. 2015; Montavon 2019).

    The model's layers run once; then, from the output down: ``R ← a ⊙ Wᵀ(R / (z + ε·sign z))``
    per dense layer, ``R ← a ⊙ W⁺ᵀ(R / W⁺∗a)`` per convolution, ReLU passes ``R`` on and max
    pooling sends it to the winning input.
    """
    backward: list[Callable[[torch.Tensor], torch.Tensor]] = []
    a = x
    for module in model.features:
        if isinstance(module, nn.Conv2d):
            positive = module.weight.clamp(min=0)
            backward.append(partial(_z_plus_step, conv=module, a=a, positive=positive))
            a = module(a)
        elif isinstance(module, nn.ReLU):
            a = torch.relu(a)
        else:
            size = a.shape[-2:]
            a, winners = F.max_pool2d(a, module.kernel_size, return_indices=True)
            backward.append(
                partial(
                    F.max_unpool2d,
                    indices=winners,
                    kernel_size=module.kernel_size,
                    output_size=size,
                )
            )
    backward.append(partial(torch.reshape, shape=a.shape))
    a = a.flatten(1)
    for module in model.classifier:
        if isinstance(module, nn.Linear):
            z = module(a)
            stabilised = torch.where(z >= 0, z + epsilon, z - epsilon)
            backward.append(
                lambda r, a=a, s=stabilised, w=module.weight: a * (_safe_divide(r, s) @ w)
            )
            a = z
        else:
            a = torch.relu(a)
    relevance = torch.zeros_like(a).scatter_(1, target[:, None], a.gather(1, target[:, None]))
    for step in reversed(backward):
        relevance = step(relevance)
    return relevance


def captum_candidates(model: nn.Module) -> dict[str, Callable[..., object]]:
    """Captum's LRP (z⁺ on convolutions, ε on dense) and DeepLift, where they run.

    Captum's z⁺ keeps the whole bias ``b`` in its denominator unless ``set_bias_to_zero``; with
    it, its rules are ours (the paper's Eq. 5). Captum sets its rules as attributes on the
    modules: give it a copy of the model.
    """
    candidates: dict[str, Callable[..., object]] = {}
    try:
        from captum.attr import LRP, DeepLift
        from captum.attr._utils.lrp_rules import Alpha1_Beta0_Rule, EpsilonRule
    except ImportError:  # pragma: no cover
        return candidates
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            module.rule = Alpha1_Beta0_Rule(set_bias_to_zero=True)
        elif isinstance(module, nn.Linear):
            module.rule = EpsilonRule(epsilon=1e-6)
    lrp, deeplift = LRP(model), DeepLift(model)
    candidates[CAPTUM_LRP] = lambda x, t: lrp.attribute(x, target=t)
    candidates["captum DeepLift"] = lambda x, t: deeplift.attribute(x, target=t)
    return candidates


def zennit_candidates(model: nn.Module) -> dict[str, Callable[..., object]]:
    """Zennit's EpsilonPlus (z⁺ on convolutions, ε on dense layers), where it is installed.

    Zennit needs torchvision, which this project's environment must not have: it runs in the
    throw-away environment of ``benchmarks/check_torchvision_zoo.py``. Its z⁺ counts ``b⁺`` in
    the denominator (ours ignores the bias, as the paper's Eq. 5): the same work.
    """
    try:
        from zennit.attribution import Gradient
        from zennit.composites import EpsilonPlus
    except ImportError:
        return {}

    def attribute(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        one_hot = torch.zeros(x.shape[0], 10).scatter_(1, target[:, None], 1.0)
        with Gradient(model=model, composite=EpsilonPlus()) as attributor:
            return attributor(x, one_hot)[1]

    return {ZENNIT: attribute}


def build() -> tuple[VGGStyle, torch.Tensor, torch.Tensor]:
    """The model (random weights, eval mode), a batch of 32 inputs and their targets."""
    torch.manual_seed(0)
    model = VGGStyle().eval()
    x = torch.rand(32, 3, 32, 32)
    target = torch.randint(0, 10, (32,))
    return model, x, target


def candidates(
    model: VGGStyle, x: torch.Tensor, target: torch.Tensor
) -> dict[str, Callable[[], object]]:
    """Every timed candidate, by name (Captum and Zennit on copies of the model)."""
    runs: dict[str, Callable[[], object]] = {
        "gradient": lambda: plain_gradient(model, x, target),
        "lrp.epsilon_plus": lambda: explain(model, x, "lrp.epsilon_plus", target),
        BY_HAND: lambda: handwritten_epsilon_plus(model, x, target),
        LOWER_BOUND: lambda: gradient_plus_rule_convolutions(model, x, target, z_plus_weights),
    }
    for make in (captum_candidates, zennit_candidates):
        copy = VGGStyle().eval()
        copy.load_state_dict(model.state_dict())
        for name, fn in make(copy).items():
            runs[name] = lambda fn=fn: fn(x, target)
    return runs


def measure(rounds: int, threads: int, profile: bool = False) -> dict[str, object]:
    """Medians (seconds) of every candidate in this process, and the maps' agreement.

    Also the ratio of ε+z⁺ to its lower bound from the two timed alternately (as
    ``bench_resnet_lrp.py`` measures it): each call of either follows one of the other.
    """
    torch.set_num_threads(threads)
    model, x, target = build()

    # First the pair alone, before any other candidate has grown this process's heap: glibc hands
    # memory freed at its top back after each call and faults it in again, which the other
    # candidates' allocations (Captum's) can hide.
    alone = interleaved_medians(
        {
            GRADIENT_ALONE: lambda: plain_gradient(model, x, target),
            ALONE: lambda: explain(model, x, "lrp.epsilon_plus", target),
        },
        rounds,
    )
    runs = candidates(model, x, target)
    pair = alternated_pair(runs["lrp.epsilon_plus"], runs[LOWER_BOUND], rounds)
    reference = explain(model, x, "lrp.epsilon_plus", target).attribution
    by_hand_gap = float(
        (handwritten_epsilon_plus(model, x, target) - reference).abs().max() / reference.abs().max()
    )
    notes_captum = ""
    for name in (CAPTUM_LRP, "captum DeepLift"):
        if name not in runs:
            continue
        try:
            result = runs[name]()
        except Exception as error:
            notes_captum += f" {name} failed: {type(error).__name__}: {error}."
            del runs[name]
            continue
        if name == CAPTUM_LRP:
            gap = float((result.detach() - reference).abs().max() / reference.abs().max())
            notes_captum += (
                f" Captum LRP (z⁺ with set_bias_to_zero=True, the paper's Eq. 5 as ours; by "
                f"default Captum keeps the whole bias b in z⁺) gives our map to {gap:.1e} "
                "(max, relative)."
            )

    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as profiler

        with profiler(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                explain(model, x, "lrp.epsilon_plus", target)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))

    return {
        "medians": {**interleaved_medians(runs, rounds), **alone},
        **pair,
        "by_hand_gap": by_hand_gap,
        "notes_captum": notes_captum,
    }


def alternated_pair(
    explain_run: Callable[[], object], bound_run: Callable[[], object], rounds: int
) -> dict[str, float]:
    """ε+z⁺ and its lower bound timed alternately: the median ratio, and each one's median
    count of page faults per call."""
    explain_counted, explain_faults = counting_page_faults(explain_run)
    bound_counted, bound_faults = counting_page_faults(bound_run)
    mine, bound = alternated_times(explain_counted, bound_counted, rounds)
    return {
        "to_bound": median_ratio(mine, bound),
        "faults": statistics.median(explain_faults),
        "bound_faults": statistics.median(bound_faults),
    }


def measure_pair(rounds: int, threads: int) -> dict[str, float]:
    """:func:`alternated_pair` alone in this process (nothing else run before it)."""
    torch.set_num_threads(threads)
    model, x, target = build()
    return alternated_pair(
        lambda: explain(model, x, "lrp.epsilon_plus", target),
        lambda: gradient_plus_rule_convolutions(model, x, target, z_plus_weights),
        rounds,
    )


def memory_worker(candidate: str) -> None:
    """Print the peak resident set above the built model of one candidate, in this process."""
    torch.set_num_threads(1)
    model, x, target = build()
    print_peak_extra_bytes(candidates(model, x, target)[candidate])  # nothing ran before it


def peak_memory(candidate: str) -> int:
    """:func:`memory_worker` in a fresh process (glibc's mmap threshold at 64 KiB)."""
    command = [sys.executable, __file__, "--memory-worker", candidate]
    return json.loads(memory_worker_output(command))["extra_bytes"]


def child_result(mode: str, rounds: int, threads: int, environment: dict[str, str]) -> dict:
    """What this script prints as ``--child`` or ``--pair`` in a fresh interpreter, with
    ``environment`` added to this one's."""
    command = [sys.executable, __file__, mode, f"--rounds={rounds}", f"--threads={threads}"]
    env = dict(os.environ, **environment)
    done = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_in_fresh_processes(processes: int, rounds: int, threads: int) -> list[dict]:
    """:func:`measure` once per fresh interpreter."""
    runs = []
    for index in range(processes):
        runs.append(child_result("--child", rounds, threads, {}))
        ratio = runs[-1]["medians"]["lrp.epsilon_plus"] / runs[-1]["medians"]["gradient"]
        print(f"process {index + 1}/{processes}: ε+z⁺ {ratio:.2f}× gradient", flush=True)
    return runs


def pairs_in_fresh_processes(
    processes: int, rounds: int, threads: int, environment: dict[str, str]
) -> list[dict]:
    """:func:`measure_pair` once per fresh interpreter, with ``environment`` added to its own."""
    said = " ".join(environment) or "glibc's defaults"
    runs = []
    for index in range(processes):
        runs.append(child_result("--pair", rounds, threads, environment))
        print(f"pair alone {index + 1}/{processes} ({said}): ε+z⁺ {runs[-1]['to_bound']:.3f}× "
              f"its bound", flush=True)  # fmt: skip
    return runs


def pair_summary(runs: Sequence[dict]) -> str:
    """The median and range of the ratio to the bound, and the median page faults of each."""
    ratios = [run["to_bound"] for run in runs]
    faults = statistics.median(run["faults"] for run in runs)
    bound_faults = statistics.median(run["bound_faults"] for run in runs)
    return (
        f"{statistics.median(ratios):.3f}× its bound ({min(ratios):.3f}–{max(ratios):.3f}; page "
        f"faults per call {faults:.0f} against the bound's {bound_faults:.0f})"
    )


def summary_rows(runs: Sequence[dict], memory: dict[str, int]) -> list[dict[str, object]]:
    """Per candidate: median time, the median and range of its per-process ratio (to the
    gradient timed beside it), and its peak memory (own fresh process) against the gradient's."""
    rows = []
    for name in runs[0]["medians"]:
        base = GRADIENT_ALONE if name in (ALONE, GRADIENT_ALONE) else "gradient"
        ratios = [run["medians"][name] / run["medians"][base] for run in runs]
        rows.append(
            {
                "method": name,
                "median ms": statistics.median(run["medians"][name] for run in runs) * 1e3,
                "× gradient": statistics.median(ratios),
                "range over processes": f"{min(ratios):.2f}–{max(ratios):.2f}",
                "peak MiB": memory[name] / 2**20 if name in memory else None,
                "× gradient memory": memory[name] / memory["gradient"] if name in memory else None,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=int, default=5, help="fresh processes to measure in")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds per process")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--pair", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--memory-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_worker:
        memory_worker(args.memory_worker)
        return
    if args.pair:
        print(json.dumps(measure_pair(args.rounds, args.threads)))
        return
    if args.child or args.profile:
        result = measure(args.rounds, args.threads, args.profile)
        print(json.dumps(result))
        return

    runs = measure_in_fresh_processes(args.processes, args.rounds, args.threads)
    alone = pairs_in_fresh_processes(args.processes, args.rounds, args.threads, {})
    kept = pairs_in_fresh_processes(args.processes, args.rounds, args.threads, KEEP_FREED_MEMORY)
    memory = {
        name: peak_memory(name)
        for name in runs[0]["medians"]
        if name not in (ALONE, GRADIENT_ALONE, "captum DeepLift")
    }
    rows = summary_rows(runs, memory)
    ratio = {row["method"]: row["× gradient"] for row in rows}
    spread = {row["method"]: row["range over processes"] for row in rows}
    in_memory = {row["method"]: row["× gradient memory"] for row in rows}
    others = "; ".join(
        f"{name} {in_memory[name]:.2f}×" for name in (CAPTUM_LRP, ZENNIT) if name in in_memory
    )
    write_results(
        "modbp_speed",
        rows,
        title="Modified BP: ε+z⁺ composite vs one gradient (VGG-style CNN, batch 32)",
        command="python benchmarks/bench_modbp_speed.py",
        notes=(
            f"{args.processes} fresh processes, each timing {args.rounds} interleaved rounds with "
            f"{args.threads} thread(s); a ratio is taken within each process, the table gives "
            f"their median and range. 3×32×32 inputs, eight 3×3 convolutions, two dense layers. "
            f"ε+z⁺ costs {ratio['lrp.epsilon_plus']:.2f}× one gradient "
            f"(processes: {spread['lrp.epsilon_plus']}); the goal was ≤ 1.3×. "
            f"Against its lower bound (one gradient plus only the z⁺ convolutions W⁺∗a, no rule "
            f"at all: no z⁺ implementation on torch's kernels can cost less), the two timed "
            f"alternately in each process as bench_resnet_lrp.py times them, ε+z⁺ costs "
            f"{pair_summary(runs)}; from the rotation's medians "
            f"{ratio['lrp.epsilon_plus'] / ratio[LOWER_BOUND]:.2f}× (goal of issue 21: ≤ "
            f"1.05×). Timed alone in "
            f"{len(alone)} more fresh processes (nothing else run before them): "
            f"{pair_summary(alone)}. glibc hands the top of its heap back to the system whenever "
            f"more than its trim threshold is free there (twice the largest block it has "
            f"unmapped so far), and the next call that needs the memory faults its pages in "
            f"again; how often that happens in a call depends on what the process ran before "
            f"and on the sizes and order of each candidate's allocations (the engine makes z⁺ = "
            f"W⁺∗a in backward, the bound in forward). In {len(kept)} more fresh processes with "
            f"glibc keeping freed memory "
            f"({' '.join(f'{k}={v}' for k, v in KEEP_FREED_MEMORY.items())}, what a "
            f"long-running service may set): "
            f"{pair_summary(kept)}. "
            f"Peak memory (each candidate in a fresh process, glibc's mmap threshold at 64 KiB, "
            f"the largest resident set above the built model): ε+z⁺ "
            f"{in_memory['lrp.epsilon_plus']:.2f}× the gradient's (goal ≤ 2×){'; ' + others}. "
            f"Timed first in its "
            f"process, before the other candidates ran, ε+z⁺ costs {ratio[ALONE]:.2f}× "
            f"({spread[ALONE]}) the gradient timed beside it. "
            f"The same rules written out by hand for this one network (no autograd, no hooks; "
            f"its map equals ours to {max(run['by_hand_gap'] for run in runs):.1e} relative) "
            f"cost {ratio[BY_HAND]:.2f}×. {NOTES}{runs[0]['notes_captum']}"
        ),
    )


NOTES = (
    "Why the goal is out of reach: z⁺ needs z⁺ = W⁺∗a for every convolution, a forward "
    "convolution the gradient does not compute (z⁺ cannot be derived from the layer's output), "
    "and its backward is one transposed convolution with W⁺, as costly as the gradient's. Per "
    "convolution that is three convolutions against the gradient's two, and forward and backward "
    "convolutions cost about the same here (the lower-bound row measures what that leaves). "
    "What the engine adds beyond it: per convolution, in backward, the ratio max(z, 0)/z⁺ of "
    "the ReLU's output to z⁺ = W⁺∗a (made there from the layer's input: the bound's convolution, "
    "moved; a division written into z⁺'s buffer and a NaN fix; 0 where z ≤ 0, the ReLU's "
    "gradient, so that the ReLU's own backward pass is skipped) and one multiplication. The rule "
    "keeps nothing from forward but the layer's input and the ReLU's output, which the gradient "
    "keeps too (until 2026-11-27 it kept the ratio, made in forward: 1.45× the gradient's memory "
    "and 1.06–1.14× the bound; before 2026-11-26 also the layer's input and output: 2.35× and "
    "≈ 1.10×); per call the model "
    "guard reads every parameter once before and once after (sums that detect in-place "
    "changes; a copy of the weights instead cost ≈ 1.61×). Changes made to "
    "get close to it: the one-sample trace is cached per model, composite shape and input "
    "signature and validated on every call (same submodules, parameters and their versions, "
    "buffers, hooks, modes, plain attributes, and the affine modules the real pass ran; anything "
    "else drops the plan and re-runs "
    "with a fresh trace, so no rule is ever skipped); z⁺ no longer builds W⁻ (before: ≈ 1.67×). "
    "Fusing W and W⁺ into one convolution of twice the channels was slower (measured per layer)."
)


if __name__ == "__main__":
    main()
