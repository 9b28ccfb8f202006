"""Speed and peak memory of AttnLRP and CP-LRP against one plain input gradient, at real sizes.

Models (random weights from their configs; ``transformers``' defaults are the base sizes): a
BERT-base encoder (``BertForSequenceClassification``, 12 layers, hidden 768, sequence 128,
batch 8, explained at its input embeddings) and ViT-B/16 (``ViTForImageClassification``,
224×224, batch 4), float32, sdpa attention. Candidates, timed interleaved round by round in one
process (so load from other processes hits every candidate alike), one torch thread:

- one plain gradient: ``torch.autograd.grad`` of the target logits w.r.t. the input;
- ``explain(model, x, "input_x_gradient", target)``: the library's own overhead;
- ``explain(model, x, "lrp.attn", target)`` and ``"lrp.cp"``.

Peak memory: each candidate runs once in a fresh process (after the model is built and has run
one forward pass, glibc's mmap threshold at 64 KiB so that the resident set follows live
memory); a thread samples the resident set every millisecond, and the peak above the resident
set before the call is what the candidate needed. Goals (issue 20): ≤ 1.2× the
gradient's time and ≤ 1.3× its peak memory.

    python benchmarks/bench_transformers_speed.py             # ~10 min on 2 cores
    python benchmarks/bench_transformers_speed.py --quick     # small sizes, a smoke run

With ``--lxt`` (in lxt's throw-away environment, see ``crosscheck_lxt.py``) it times lxt 2.1's
AttnLRP and CP-LRP on BERT-base beside the plain gradient of the same model in the same process
and writes ``transformers_speed_lxt.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

import torch
from harness import (
    interleaved_medians,
    memory_worker_output,
    print_peak_extra_bytes,
    write_results,
)
from torch import nn

METHODS = ("input_x_gradient", "lrp.attn", "lrp.cp")


class Logits(nn.Module):
    """A Hugging Face model's logits from one tensor input (``inputs_embeds``, ``pixel_values``)."""

    def __init__(self, model: nn.Module, key: str) -> None:
        super().__init__()
        self.model, self.key = model, key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(**{self.key: x}).logits


def build(name: str, quick: bool) -> tuple[nn.Module, torch.Tensor]:
    """The model (in eval mode) and its input batch."""
    import transformers

    torch.manual_seed(0)
    small = {"num_hidden_layers": 2, "hidden_size": 96, "intermediate_size": 192} if quick else {}
    if name == "bert-base":
        config = transformers.BertConfig(num_labels=2, attn_implementation="sdpa", **small)
        model = Logits(transformers.BertForSequenceClassification(config), "inputs_embeds")
        x = torch.randn(8, 32 if quick else 128, config.hidden_size)
    else:
        config = transformers.ViTConfig(num_labels=10, attn_implementation="sdpa", **small)
        model = Logits(transformers.ViTForImageClassification(config), "pixel_values")
        x = torch.randn(4, 3, 224, 224)
    return model.eval(), x


def candidates(model: nn.Module, x: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """Name → one explanation of the batch ``x`` (its first predicted classes)."""
    from explain_core import explain

    with torch.no_grad():
        target = model(x).argmax(1)

    def gradient() -> torch.Tensor:
        inputs = x.detach().requires_grad_(True)
        scores = model(inputs).gather(1, target[:, None]).sum()
        return torch.autograd.grad(scores, inputs)[0]

    runs: dict[str, Callable[[], Any]] = {"gradient": gradient}
    for method in METHODS:
        runs[method] = lambda method=method: explain(model, x, method, target)
    return runs


def memory_worker(name: str, candidate: str, quick: bool) -> None:
    """Print the peak memory (bytes above the start) of one candidate, in this fresh process."""
    torch.set_num_threads(1)
    model, x = build(name, quick)
    run = candidates(model, x)[candidate]  # (runs one forward pass for the targets)
    print_peak_extra_bytes(run)


def peak_memory(name: str, candidate: str, quick: bool) -> int:
    """Bytes a candidate needs above the built model, in a fresh process."""
    command = [sys.executable, __file__, "--memory-worker", name, candidate]
    if quick:
        command.append("--quick")
    return json.loads(memory_worker_output(command))["extra_bytes"]


def measure(name: str, rounds: int, quick: bool) -> list[dict[str, Any]]:
    """Rows for one model: median seconds and peak memory, with ratios to the gradient."""
    model, x = build(name, quick)
    runs = candidates(model, x)
    seconds = interleaved_medians(runs, rounds)
    memory = {candidate: peak_memory(name, candidate, quick) for candidate in runs}
    rows = []
    for candidate in runs:
        rows.append(
            {
                "model": name,
                "input": "×".join(map(str, x.shape)),
                "candidate": candidate,
                "median s": seconds[candidate],
                "× gradient time": seconds[candidate] / seconds["gradient"],
                "peak MiB above model": memory[candidate] / 2**20,
                "× gradient memory": memory[candidate] / memory["gradient"],
            }
        )
        print(rows[-1], flush=True)
    return rows


def lxt_rows(rounds: int) -> list[dict[str, Any]]:
    """lxt's AttnLRP on BERT-base beside the plain gradient of the same weights, one process.

    lxt 2.1 has AttnLRP for BERT (its CP-LRP maps cover GPT-2 and Llama only). It replaces the
    classes of ``transformers``' BERT module by its own copy, so the gradient is timed first.
    """
    import transformers
    from transformers.models.bert import modeling_bert

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = transformers.BertConfig(num_labels=2, attn_implementation="eager")
    weights = modeling_bert.BertForSequenceClassification(config).eval().state_dict()
    x = torch.randn(8, 128, config.hidden_size)

    def seconds(model: nn.Module) -> float:
        model.load_state_dict(weights)
        model.eval()
        with torch.no_grad():
            target = model(inputs_embeds=x).logits.argmax(1)

        def run() -> None:  # Gradient×Input at the embeddings: lxt's relevance
            inputs = x.detach().requires_grad_(True)
            scores = model(inputs_embeds=inputs).logits.gather(1, target[:, None]).sum()
            torch.autograd.grad(scores, inputs)

        return interleaved_medians({"run": run}, rounds)["run"]

    gradient = seconds(modeling_bert.BertForSequenceClassification(config))
    from crosscheck_lxt import _allow_lxt_import_without_torchvision

    _allow_lxt_import_without_torchvision()  # a stand-in: torchvision is never installed
    import lxt.efficient.models.bert as lxt_bert
    from lxt.efficient import monkey_patch

    monkey_patch(modeling_bert, lxt_bert.attnLRP)
    attn = seconds(modeling_bert.BertForSequenceClassification(config))
    return [
        {
            "model": "bert-base",
            "input": "8×128×768",
            "candidate": "lxt AttnLRP",
            "median s": attn,
            "gradient median s (same weights, before patching)": gradient,
            "× gradient time": attn / gradient,
        }
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small models, a smoke run")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lxt", action="store_true", help="time lxt (its environment only)")
    parser.add_argument("--memory-worker", nargs=2, metavar=("MODEL", "CANDIDATE"))
    args = parser.parse_args()
    if args.memory_worker:
        memory_worker(*args.memory_worker, args.quick)
        return
    torch.set_num_threads(1)
    if args.lxt:
        rows = lxt_rows(args.rounds)
        write_results(
            "transformers_speed_lxt",
            rows,
            title="lxt 2.1's AttnLRP and CP-LRP on BERT-base against one plain gradient",
            command="HF_HUB_OFFLINE=1 PYTHONPATH=.:plugins:exporters /tmp/lxt_env/bin/python "
            "benchmarks/bench_transformers_speed.py --lxt",
            notes=LXT_NOTES,
        )
        return
    rows = [
        row for name in ("bert-base", "vit-b16") for row in measure(name, args.rounds, args.quick)
    ]
    if args.quick:
        return
    write_results(
        "transformers_speed",
        rows,
        title="AttnLRP and CP-LRP at real sizes against one plain input gradient",
        command="python benchmarks/bench_transformers_speed.py",
        notes=NOTES,
    )


NOTES = (
    "Medians of 5 interleaved rounds, one torch thread, float32, sdpa attention, random weights "
    "(BERT-base: batch 8, sequence 128, at the input embeddings; ViT-B/16: batch 4, 224×224). "
    "peak MiB above model: the largest resident set during one call in a fresh process, minus "
    "the resident set before it (the model built and run once), glibc's mmap threshold at 64 KiB "
    "so that the resident set follows live memory. Goal (issue 20): ≤ 1.2× the "
    "gradient's time and ≤ 1.3× its peak memory."
)
LXT_NOTES = (
    "lxt 2.1 in its own environment (transformers 4.53, eager attention; see crosscheck_lxt.py): "
    "the plain gradient of BERT-base (batch 8, sequence 128, one torch thread) timed first, then "
    "the same weights after lxt's monkey_patch with its BERT AttnLRP map (lxt 2.1 has no CP-LRP "
    "map for BERT): one forward and backward each, medians of 5 rounds."
)


if __name__ == "__main__":
    main()
