"""An example third-party plugin, using every kind of extension the built-ins use.

- a method, ``sign.gradient_sign``;
- a subcommand, ``explain sign-count``: how many input entries push the explained class up or
  down, for a model built from ``package.module:factory``;
- an evaluation job, ``sign-balance`` (``explain evaluate --job sign-balance``): the fraction of
  positive entries in each sample's attribution, merged over all samples (and ranks);
- an explained-export form for ``sign.gradient_sign``, so that
  ``explain export --explain sign.gradient_sign`` writes one ONNX graph returning the logits and
  the sign map.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from explain_core import Method, MethodResult, MethodSpec, explain, hookimpl
from explain_core.cli.command import Command
from explain_core.cli.common import add_model_arguments, load_model
from explain_core.distributed.jobs import (
    Job,
    JobArgument,
    JobConfig,
    attribute_batch,
    concat_ordered,
)
from explain_core.export_forms import ExportForm
from explain_core.targets import select_target


@dataclass
class GradientSign(Method):
    """The sign (-1, 0 or +1) of the gradient of the explained output w.r.t. the input."""

    def attribute(
        self,
        model: nn.Module,
        inputs: torch.Tensor,
        target: torch.Tensor | None,
        baselines: torch.Tensor | None,
    ) -> MethodResult:
        """Explain ``model`` at ``inputs``; see :meth:`explain_core.Method.attribute`."""
        x = inputs.detach().requires_grad_(True)
        with torch.enable_grad():
            output = model(x)
            chosen = select_target(output, target)  # None -> the predicted class
            explained = output.gather(1, chosen[:, None]).sum()
            (gradient,) = torch.autograd.grad(explained, x)
        return MethodResult(attribution=gradient.sign(), output=output.detach(), target=chosen)


@hookimpl
def explain_register_methods() -> list[MethodSpec]:
    """Tell explain_core which methods this plugin provides."""
    summary = "Sign of the gradient of the target output"
    return [MethodSpec("sign.gradient_sign", GradientSign, "gradient", summary)]


# --- a subcommand --------------------------------------------------------------------------


def _add_count_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--input-shape", required=True, help="one input's shape, e.g. 1,8,8")
    parser.add_argument("--samples", type=int, default=4, help="random inputs (seeded)")


def _count(args: argparse.Namespace) -> int:
    model = load_model(args)
    shape = tuple(int(size) for size in args.input_shape.split(","))
    inputs = torch.rand(args.samples, *shape, generator=torch.Generator().manual_seed(0))
    signs = explain(model, inputs, "sign.gradient_sign").attribution
    up, down = int((signs > 0).sum()), int((signs < 0).sum())
    print(f"up {up} down {down} zero {signs.numel() - up - down}")
    return 0


@hookimpl
def explain_register_commands() -> list[Command]:
    """``explain sign-count``."""
    return [
        Command(
            "sign-count",
            "count the input entries that push the explained class up or down",
            "Explain random inputs with sign.gradient_sign and count +1, -1 and 0 entries.",
            _add_count_arguments,
            _count,
        )
    ]


# --- an evaluation job ---------------------------------------------------------------------


class SignBalanceJob(Job):
    """Fraction of positive entries in each sample's attribution, and their mean."""

    name = "sign-balance"
    summary = "fraction of positive attribution entries per sample"
    arguments = (JobArgument("above", "--above", "count entries above this value (0)", float, 0.0),)

    def compute_batch(self, model, batch, part, config: JobConfig) -> dict[str, Any]:
        """Per-sample fractions of one batch."""
        result = attribute_batch(model, batch, config)
        above = config.extra.get("above", 0.0)
        flat = result.attribution.detach().flatten(1)
        return {"fraction": (flat > above).double().mean(1).cpu(), "_range": part}

    def merge(self, parts: Sequence[tuple[range, dict[str, Any]]], config: JobConfig):
        """The mean over every sample."""
        fraction = concat_ordered(self.batch_parts(parts), "fraction")
        return {"mean_fraction": float(fraction.mean())}, {"fraction": fraction}, None


@hookimpl
def explain_register_jobs() -> list[Job]:
    """``sign-balance``."""
    return [SignBalanceJob()]


# --- an explained-export form --------------------------------------------------------------


class _SignGraph(nn.Module):
    """``(x[, target]) -> (logits, sign of the gradient)`` from a traced gradient graph."""

    def __init__(self, gradient_graph: nn.Module) -> None:
        super().__init__()
        self.gradient_graph = gradient_graph

    def forward(self, x: torch.Tensor, *target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, gradient = self.gradient_graph(x, *target)
        return logits, gradient.sign()


def _build_sign(model: nn.Module, example: torch.Tensor, target_input: bool, **options: Any):
    from explain_onnx.gradtrace import input_gradient_graph  # the exporter is optional

    graph = input_gradient_graph(model, example, target_input=target_input, multiply_by_input=False)
    return _SignGraph(graph)


def _reference_sign(model: nn.Module, x: torch.Tensor, target: Any, **options: Any):
    result = explain(model, x, "sign.gradient_sign", target)
    return result.output, result.attribution


@hookimpl
def explain_register_export_forms() -> list[ExportForm]:
    """``sign.gradient_sign`` exported with the model."""
    return [ExportForm("sign.gradient_sign", _build_sign, _reference_sign, "gradient sign")]
