"""What explain() costs on top of the raw autograd computation it wraps.

explain() validates inputs, resolves the method through the plugin registry and guards the
model's state. This script times a plain `torch.autograd.grad` Input×Gradient against
`explain(..., "input_x_gradient")` on a VGG-style CNN (3×32×32, batch 32), and Integrated
Gradients (20 steps) against 20 plain gradients, as ratios of medians within one run.

    python benchmarks/bench_explain_overhead.py
"""

from __future__ import annotations

import torch
from harness import median_seconds, vgg_style_cnn, write_results
from torch import nn

from explain_core import explain


def raw_input_x_gradient(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    x = x.detach().requires_grad_(True)
    (grad,) = torch.autograd.grad(model(x).gather(1, target[:, None]).sum(), x)
    return grad * x


def main() -> None:
    torch.manual_seed(0)
    model = vgg_style_cnn().eval()
    x = torch.rand(32, 3, 32, 32)
    target = torch.randint(0, 10, (32,))
    repeats = 15
    raw = median_seconds(lambda: raw_input_x_gradient(model, x, target), repeats=repeats)
    wrapped = median_seconds(lambda: explain(model, x, "input_x_gradient", target), repeats=repeats)
    raw_ig = median_seconds(
        lambda: [raw_input_x_gradient(model, x, target) for _ in range(20)], repeats=5
    )
    ig = median_seconds(
        lambda: explain(model, x, "integrated_gradients", target, steps=20), repeats=5
    )
    rows = [
        {
            "case": "input_x_gradient",
            "raw autograd ms": raw * 1e3,
            "explain() ms": wrapped * 1e3,
            "ratio": wrapped / raw,
        },
        {
            "case": "integrated_gradients (20 steps)",
            "raw autograd ms": raw_ig * 1e3,
            "explain() ms": ig * 1e3,
            "ratio": ig / raw_ig,
        },
    ]
    write_results(
        "explain_overhead",
        rows,
        title="explain() overhead over raw autograd",
        command="python benchmarks/bench_explain_overhead.py",
        notes="VGG-style CNN, 3×32×32, batch 32, medians of 15 (IG: 5) runs; ratio = explain() / "
        "raw. IG's raw reference is 20 separate gradient passes; explain() batches path points.",
    )


if __name__ == "__main__":
    main()
