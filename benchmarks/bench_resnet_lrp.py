"""LRP composites on ResNet-50 at 224×224, batch 16: time and peak memory against one gradient.

The model is the test suite's re-creation of torchvision's resnet50 (``tests/zoo.py``: the same
module structure, full width and depth; random weights, trained-looking BatchNorms, eval mode).
Within one run the script times (in pairs, below):

- one plain gradient of the target logits w.r.t. the input;
- ``explain(model, x, "lrp.epsilon_plus", target)`` (z⁺ on convolutions, ε on the dense layer);
- ``explain(model, x, "lrp.epsilon_gamma_box", target, low=0, high=1)`` (γ on convolutions);
- each composite's lower bound on torch's kernels: one gradient plus the convolutions its rule
  adds — z⁺: ``W⁺∗a`` in the forward pass (as ``bench_modbp_speed.py`` measures on the VGG-style
  net); generalised γ: ``(W + γW⁺)∗a`` (its ``(W + γW⁻)∗a`` follows from the two adding up to
  ``(2 + γ) z``) and one more transposed convolution in the backward pass (its falling
  outputs' part), except on the convolutions only a ReLU reads (the engine's trace finds them:
  the first two of each bottleneck and the stem), where no signal reaches falling outputs;
- Captum's LRP with its default rules (ε on every layer), for scale, where it runs;
- with ``--torchvision`` (torchvision's own resnet50, in the throw-away environment of
  ``benchmarks/check_torchvision_zoo.py`` with Zennit added): Zennit's EpsilonPlus and
  EpsilonGammaBox with its ResNet canonizer, the same rules as the two composites.

Each ratio comes from its two candidates timed alternately (ABBA…, nothing else between them),
the median over rounds of their times' ratio within a round: a slow spell of the shared machine
cancels out, and no third candidate decides which of the two finds the heap grown (at these sizes
a new tensor costs more in page faults than a pass over it, and in a fixed rotation over all
candidates each always follows the same neighbour: one after Captum's 4 GB, another after the
gradient). Which heap a process grows still moves these ratios by a few hundredths from one
process to the next, so the pairs run in several fresh processes (``--processes``, 3): the table
gives the median over processes and the range of the ratio to the bound.

Peak memory: each candidate in a fresh process (nothing else run before it, glibc's mmap
threshold at 64 KiB so that the resident set follows live memory), the largest resident set
above the built model, sampled every millisecond. Goals (issue 21): time ≤ 1.05× the lower
bound, peak memory ≤ 2× the gradient's.

    PYTHONPATH=.:plugins:exporters:tests python benchmarks/bench_resnet_lrp.py  # ~25 min, 2 cores
    PYTHONPATH=.:plugins:exporters:tests /tmp/tv-env/bin/python benchmarks/bench_resnet_lrp.py \
        --torchvision  # with torchvision, zennit and captum installed there
    PYTHONPATH=.:plugins:exporters:tests python benchmarks/bench_resnet_lrp.py --batch 1  # 1 image

Another ``--batch`` or ``--side`` writes its own results file (``…_batch1_side224.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch
from harness import (
    alternated_times,
    counting_page_faults,
    gamma_weights,
    gradient_plus_rule_convolutions,
    median_ratio,
    memory_worker_output,
    plain_gradient,
    print_peak_extra_bytes,
    write_results,
    z_plus_weights,
)
from torch import nn
from zoo import ResNet, randomise_batchnorm

from explain_core import explain
from explain_core.engine.tracing import trace
from explain_modbp.composites import lrp_epsilon_gamma_box

Z_PLUS_BOUND = "gradient + z⁺ convolutions (lower bound)"
GAMMA_BOUND = "gradient + γ convolutions (lower bound)"
BOUNDS = {
    "lrp.epsilon_plus": Z_PLUS_BOUND,
    "lrp.epsilon_gamma_box": GAMMA_BOUND,
    "zennit EpsilonPlus": Z_PLUS_BOUND,
    "zennit EpsilonGammaBox": GAMMA_BOUND,
}
"""Each composite's lower bound: one gradient plus the convolutions its rules add."""


def build(
    batch: int, side: int, torchvision: bool = False
) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The model (the re-creation, or torchvision's own), the inputs and the targets."""
    torch.manual_seed(0)
    if torchvision:
        from torchvision.models import resnet50

        model = randomise_batchnorm(resnet50(weights=None)).eval()
    else:
        model = randomise_batchnorm(ResNet(depths=(3, 4, 6, 3), width=1.0, classes=1000)).eval()
    x = torch.rand(batch, 3, side, side, generator=torch.Generator().manual_seed(1))
    target = torch.arange(batch) * 7 % 1000
    return model, x, target


def candidates(
    model: nn.Module, x: torch.Tensor, target: torch.Tensor, probe: bool = True
) -> dict[str, Callable]:
    """The timed candidates; ``probe`` runs Captum once to see whether it runs here."""
    rectified = trace(model, x, lrp_epsilon_gamma_box(0.0, 1.0)).rectified
    runs: dict[str, Callable] = {
        "gradient": lambda: plain_gradient(model, x, target),
        Z_PLUS_BOUND: lambda: gradient_plus_rule_convolutions(model, x, target, z_plus_weights),
        GAMMA_BOUND: lambda: gradient_plus_rule_convolutions(
            model, x, target, gamma_weights, extra_transposed=1, rectified=rectified
        ),
        "lrp.epsilon_plus": lambda: explain(model, x, "lrp.epsilon_plus", target),
        "lrp.epsilon_gamma_box": lambda: explain(
            model, x, "lrp.epsilon_gamma_box", target, low=0.0, high=1.0
        ),
    }
    try:
        from captum.attr import LRP

        def captum_lrp() -> torch.Tensor:
            return LRP(model).attribute(x, target=target)

        if probe:
            captum_lrp()
        runs["captum LRP"] = captum_lrp
    except Exception as error:  # Captum missing or refusing a layer: said, not timed
        print(f"captum LRP does not run: {type(error).__name__}: {error}", file=sys.stderr)
    runs.update(zennit_candidates(model, x, target))
    return runs


def zennit_candidates(
    model: nn.Module, x: torch.Tensor, target: torch.Tensor
) -> dict[str, Callable]:
    """Zennit's EpsilonPlus and EpsilonGammaBox with its ResNet canonizer, where it runs.

    The canonizer knows torchvision's Bottleneck only: on the re-creation (another class) it
    would leave the BatchNorms unmerged and compute something else, so it runs on the real model
    (``--torchvision``, in the throw-away environment that has torchvision and Zennit).
    """
    try:
        from torchvision.models.resnet import Bottleneck
        from zennit.attribution import Gradient
        from zennit.composites import EpsilonGammaBox, EpsilonPlus
        from zennit.torchvision import ResNetCanonizer
    except ImportError as error:
        print(f"zennit does not run here: {error}", file=sys.stderr)
        return {}
    if not any(isinstance(module, Bottleneck) for module in model.modules()):
        return {}
    one_hot = torch.zeros(x.shape[0], 1000, device=x.device).scatter_(1, target[:, None], 1.0)

    def run(composite: Any) -> Callable[[], torch.Tensor]:
        def attribute() -> torch.Tensor:
            with Gradient(model=model, composite=composite) as attributor:
                return attributor(x, one_hot)[1]

        return attribute

    return {
        "zennit EpsilonPlus": run(EpsilonPlus(canonizers=[ResNetCanonizer()])),
        "zennit EpsilonGammaBox": run(
            EpsilonGammaBox(low=0.0, high=1.0, canonizers=[ResNetCanonizer()])
        ),
    }


def memory_worker(candidate: str, batch: int, side: int, torchvision: bool) -> None:
    """Print the peak resident set above the built model of one candidate, in this process."""
    torch.set_num_threads(2)
    model, x, target = build(batch, side, torchvision)
    print_peak_extra_bytes(candidates(model, x, target, probe=False)[candidate])  # nothing before


def peak_memory(candidate: str, batch: int, side: int, torchvision: bool) -> int:
    command = [sys.executable, __file__, "--memory-worker", candidate]
    command += ["--batch", str(batch), "--side", str(side)]
    command += ["--torchvision"] * torchvision
    return json.loads(memory_worker_output(command))["extra_bytes"]


def time_pairs(batch: int, side: int, torchvision: bool, rounds: int) -> dict[str, Any]:
    """Each candidate against the gradient, each composite against its lower bound (one process).

    Returns the seconds of every candidate, the two ratios, each the median over rounds of the
    ratio within a round of the pair timed alternately, and each candidate's median page faults
    per call.
    """
    torch.set_num_threads(2)
    model, x, target = build(batch, side, torchvision)
    plain = candidates(model, x, target)
    counted = {name: counting_page_faults(run) for name, run in plain.items()}
    runs = {name: run for name, (run, _) in counted.items()}
    times: dict[str, list[float]] = {}
    to_gradient: dict[str, float] = {"gradient": 1.0}
    to_bound: dict[str, float] = {}
    for candidate in runs:
        if candidate == "gradient":
            continue
        mine, gradient = alternated_times(runs[candidate], runs["gradient"], rounds)
        times[candidate] = mine
        times.setdefault("gradient", []).extend(gradient)
        to_gradient[candidate] = median_ratio(mine, gradient)
        if candidate in BOUNDS:
            mine, bound = alternated_times(runs[candidate], runs[BOUNDS[candidate]], rounds)
            to_bound[candidate] = median_ratio(mine, bound)
        print(candidate, to_gradient[candidate], to_bound.get(candidate), file=sys.stderr)
    faults = {name: statistics.median(calls) for name, (_, calls) in counted.items()}
    return {"times": times, "to_gradient": to_gradient, "to_bound": to_bound, "faults": faults}


def timing_process(batch: int, side: int, torchvision: bool, rounds: int) -> dict[str, Any]:
    """:func:`time_pairs` in a fresh process (its heap grown by nothing else)."""
    command = [sys.executable, __file__, "--timing-worker", "--rounds", str(rounds)]
    command += ["--batch", str(batch), "--side", str(side)]
    command += ["--torchvision"] * torchvision
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--side", type=int, default=224)
    parser.add_argument(
        "--torchvision",
        action="store_true",
        help="torchvision's own resnet50, and Zennit where installed (a throw-away environment)",
    )
    parser.add_argument("--memory-worker", help=argparse.SUPPRESS)
    parser.add_argument("--timing-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_worker:
        memory_worker(args.memory_worker, args.batch, args.side, args.torchvision)
        return
    if args.timing_worker:
        print(json.dumps(time_pairs(args.batch, args.side, args.torchvision, args.rounds)))
        return
    processes = []
    for index in range(args.processes):
        processes.append(timing_process(args.batch, args.side, args.torchvision, args.rounds))
        print(f"process {index + 1}: {processes[-1]['to_bound']}", flush=True)
    runs = list(processes[0]["to_gradient"])
    times = {c: [t for p in processes for t in p["times"][c]] for c in runs}
    to_gradient = {c: statistics.median(p["to_gradient"][c] for p in processes) for c in runs}
    bound_ratios = {c: [p["to_bound"][c] for p in processes] for c in processes[0]["to_bound"]}
    memory = {
        candidate: peak_memory(candidate, args.batch, args.side, args.torchvision)
        for candidate in runs
    }
    rows = [
        {
            "candidate": candidate,
            "median s": statistics.median(times[candidate]),
            "× gradient time": to_gradient[candidate],
            "× its lower bound": (
                statistics.median(bound_ratios[candidate]) if candidate in bound_ratios else None
            ),
            "range over processes": (
                f"{min(bound_ratios[candidate]):.3f}–{max(bound_ratios[candidate]):.3f}"
                if candidate in bound_ratios
                else None
            ),
            "page faults per call": statistics.median(p["faults"][candidate] for p in processes),
            "peak MiB above model": memory[candidate] / 2**20,
            "× gradient memory": memory[candidate] / memory["gradient"],
        }
        for candidate in runs
    ]
    for row in rows:
        print(row, flush=True)
    if args.torchvision:
        model_said = "torchvision's own resnet50, in the throw-away environment"
        zennit = "Zennit with its ResNet canonizer on the same model"
    else:
        model_said = "the re-creation of torchvision's resnet50 (tests/zoo.py)"
        zennit = "Zennit needs torchvision: --torchvision times it in the throw-away environment"
    script = "PYTHONPATH=.:plugins:exporters:tests python benchmarks/bench_resnet_lrp.py"
    sized = (args.batch, args.side) != (16, 224)  # another size: its own results file
    options = " --torchvision" * args.torchvision
    options += f" --batch {args.batch} --side {args.side}" * sized
    name = "resnet50_lrp" + "_torchvision" * args.torchvision
    write_results(
        name + f"_batch{args.batch}_side{args.side}" * sized,
        title=f"LRP composites on ResNet-50 ({args.side}×{args.side}, batch {args.batch}) "
        "against one gradient" + (", torchvision's model and Zennit" if args.torchvision else ""),
        command=script + options,
        notes=(
            f"{model_said[0].upper()}{model_said[1:]}, random weights, 2 threads, "
            f"{args.processes} fresh processes, {args.rounds} rounds per pair in each; times: "
            "medians, ratios: each candidate timed alternately (ABBA…) with the gradient and each "
            "composite with its lower bound, the median of the ratios within a round, then the "
            "median over processes (and their range); page faults: the median per call over "
            "all of a candidate's timed calls (pages of memory touched for the first time: what "
            "glibc costs a call when it has handed freed heap memory back to the system), then "
            "over processes; peak memory: the largest resident set "
            "above the built model, one fresh process per candidate. Goals: ≤ 1.05× the lower "
            "bound (one gradient plus the convolutions the composite's rule adds: W⁺∗a for z⁺; "
            "(W + γW⁺)∗a for γ, whose (W + γW⁻)∗a follows from the two adding up to (2 + γ)z, "
            "and one more transposed convolution for its falling outputs where more than a ReLU "
            "reads the output), ≤ 2× the "
            f"gradient's memory. {zennit}."
        ),
        rows=rows,
    )


if __name__ == "__main__":
    main()
