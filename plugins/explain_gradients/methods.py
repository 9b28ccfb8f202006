"""Gradient-based attribution methods that work on any differentiable model."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from explain_core.composites import resolve_composite
from explain_core.interfaces.dynamic_linear import dynamic_linear_contributions, explanation_mode
from explain_core.interfaces.relevance import ModifiedGradient
from explain_core.metrics.csc import AutogradPropagator
from explain_core.registry import Method, MethodResult
from explain_core.targets import select_target
from explain_core.validation import (
    check_output_finite,
    check_reference_output_finite,
    check_scores,
    input_gradient,
)
from explain_gradients.dynamic_paths import checking_dynamic_linear

Composite = str | ModifiedGradient | None


def _output_and_gradient(
    model: nn.Module,
    inputs: torch.Tensor,
    target: torch.Tensor | None,
    composite: Composite = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Model output, explained target and ``d output[target] / d inputs`` per sample.

    With a ``composite`` the gradient is its modified gradient (e.g. an LRP composite's signal,
    whose product with the input is the composite's relevance).
    """
    if composite is not None:
        chosen: list[torch.Tensor] = []

        def select(output: torch.Tensor) -> torch.Tensor:
            chosen.append(select_target(output, target))
            return torch.zeros_like(output).scatter_(1, chosen[0][:, None], 1.0)

        output, gradient = resolve_composite(composite).gradient(model, inputs, select)
        return output, chosen[0], gradient
    x = inputs.detach().requires_grad_(True)
    with torch.enable_grad():
        output = model(x)
        chosen_now = select_target(output, target)
        gradient = input_gradient(output.gather(1, chosen_now[:, None]).sum(), x)
    return output.detach(), chosen_now, gradient


def _check_composite(composite: Composite) -> None:
    if composite is not None:
        resolve_composite(composite)  # an unknown name fails when the method is created


class ExplanationMode(ModifiedGradient):
    """The gradient with every dynamic-linear layer's weights detached (``dynamic.contributions``).

    As a composite (``composite="explanation_mode"``) it makes Input×Gradient the exact
    contributions ``W_{0→L}(x) ⊙ x`` of a dynamic-linear model, and lets SmoothGrad and
    Integrated Gradients run over them.
    """

    def gradient(  # noqa: D102
        self,
        model: nn.Module,
        inputs: torch.Tensor,
        select: Callable[[torch.Tensor], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = inputs.detach().requires_grad_(True)
        with explanation_mode(model), torch.enable_grad():
            output = checking_dynamic_linear(model)(x)
            signal = input_gradient((output * select(output.detach())).sum(), x)
        return output.detach(), signal


def _per_sample_sum(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(tensor.shape[0], -1).sum(dim=1)


def _passes(samples: int, rows_per_pass: int) -> tuple[int, list[slice]]:
    """Copies of each sample per pass and the samples' slices, at most ``rows_per_pass`` rows.

    A batch that fits is evaluated whole, with as many copies (path points, noisy inputs) per
    pass as fit; a larger batch is split into slices of ``rows_per_pass`` samples, one copy each.
    """
    if samples <= rows_per_pass:
        return rows_per_pass // samples, [slice(0, samples)]
    return 1, [slice(start, start + rows_per_pass) for start in range(0, samples, rows_per_pass)]


def _outputs(model: nn.Module, inputs: torch.Tensor, rows_per_pass: int) -> torch.Tensor:
    """The model's outputs without gradients, ``rows_per_pass`` samples per pass."""
    with torch.no_grad():
        parts = [check_scores(model(part)) for part in inputs.split(rows_per_pass)]
    return torch.cat(parts)


@dataclass
class Gradient(Method):
    """The gradient of the explained output with respect to the input (a saliency map).

    Attributes:
        composite: A composite's name or object: its modified gradient instead (see
            :class:`~explain_core.interfaces.relevance.ModifiedGradient`).
    """

    composite: Composite = None

    def __post_init__(self) -> None:
        _check_composite(self.composite)

    def attribute(self, model, inputs, target, baselines) -> MethodResult:  # noqa: D102
        output, chosen, gradient = _output_and_gradient(model, inputs, target, self.composite)
        return MethodResult(gradient, output, chosen)

    def layer_propagator(self, model, inputs, baselines) -> AutogradPropagator:
        """The gradient from any Linear/Conv layer (for the CSC metric)."""
        return AutogradPropagator(model, inputs, times_input=False)


@dataclass
class InputXGradient(Method):
    """Input times gradient; the delta is the output minus the summed attribution.

    Attributes:
        composite: A composite's name or object: its modified gradient instead, which makes
            this the composite's relevance (``composite="epsilon_plus"`` is
            ``lrp.epsilon_plus``; ``"explanation_mode"`` is ``dynamic.contributions``).
    """

    composite: Composite = None
    convergence_delta = True
    multiplies_by_inputs = True

    def __post_init__(self) -> None:
        _check_composite(self.composite)

    def attribute(self, model, inputs, target, baselines) -> MethodResult:  # noqa: D102
        output, chosen, gradient = _output_and_gradient(model, inputs, target, self.composite)
        attribution = inputs * gradient
        explained = output.gather(1, chosen[:, None])[:, 0]
        return MethodResult(attribution, output, chosen, explained - _per_sample_sum(attribution))

    def layer_propagator(self, model, inputs, baselines) -> AutogradPropagator:
        """Input×Gradient from any Linear/Conv layer (for the CSC metric)."""
        return AutogradPropagator(model, inputs, times_input=True)


@dataclass
class IntegratedGradients(Method):
    """Integrated Gradients (Sundararajan et al., 2017) with the midpoint rule.

    Attributes:
        steps: Number of points on the straight path from the baseline to the input.
        internal_batch_size: Rows per forward pass (path points × samples; bounds memory,
            also for batches larger than it, which are split).
        composite: A composite's name or object: its modified gradient is integrated instead.
    """

    steps: int = 20
    internal_batch_size: int = 64
    composite: Composite = None
    uses_baselines = True
    memory_option = "internal_batch_size"
    convergence_delta = True
    multiplies_by_inputs = True
    quadrature = "riemann_middle"

    def __post_init__(self) -> None:
        _check_composite(self.composite)
        if self.steps < 1 or self.internal_batch_size < 1:
            raise ValueError(
                f"steps and internal_batch_size must be >= 1; got {self.steps} and "
                f"{self.internal_batch_size}"
            )

    def attribute(self, model, inputs, target, baselines) -> MethodResult:  # noqa: D102
        reference = torch.zeros_like(inputs) if baselines is None else baselines
        output = _outputs(model, inputs, self.internal_batch_size)
        reference_output = _outputs(model, reference, self.internal_batch_size)
        check_output_finite(output)  # said first: NaN at the input is the model's own
        check_reference_output_finite(reference_output, "integrated gradients")
        chosen = select_target(output, target)
        difference = inputs - reference
        alphas = torch.arange(self.steps, dtype=inputs.dtype, device=inputs.device) + 0.5
        alphas = alphas / self.steps
        total = torch.zeros_like(inputs)
        points_per_pass, parts = _passes(inputs.shape[0], self.internal_batch_size)
        shape = (-1,) + (1,) * inputs.dim()
        for part in parts:
            for chunk in alphas.split(points_per_pass):
                # Several path points per pass: (k * samples, ...) stacked along the batch axis.
                path = reference[part][None] + chunk.reshape(shape) * difference[part][None]
                _, _, gradient = _output_and_gradient(
                    model, path.flatten(0, 1), chosen[part].repeat(len(chunk)), self.composite
                )
                total[part] += gradient.reshape(len(chunk), *total[part].shape).sum(dim=0)
        attribution = difference * total / self.steps
        gain = (
            output.gather(1, chosen[:, None])[:, 0]
            - reference_output.gather(1, chosen[:, None])[:, 0]
        )
        return MethodResult(
            attribution,
            output,
            chosen,
            gain - _per_sample_sum(attribution),
            {"baselines": reference},
        )


@dataclass
class SmoothGrad(Method):
    """SmoothGrad (Smilkov et al., 2017): the gradient averaged over noisy copies of the input.

    Each of ``samples`` copies gets Gaussian noise with standard deviation ``noise_level ×
    (max − min)`` of its own sample (the paper's σ / (x_max − x_min), 10–20% recommended). The
    noise comes from a generator seeded with ``seed``, so a call is reproducible and leaves the
    global random state alone; every sample gets the same draws (scaled by its own σ), so its map
    does not depend on the other samples of the batch.

    Attributes:
        samples: Noisy copies per input.
        noise_level: Noise standard deviation relative to each sample's value range.
        times_input: Multiply the averaged gradient by the input.
        seed: Seed of the noise.
        internal_batch_size: Rows per forward pass (noisy copies × samples; bounds memory,
            also for batches larger than it, which are split).
        composite: A composite's name or object: its modified gradient is averaged instead.
    """

    samples: int = 25
    noise_level: float = 0.15
    times_input: bool = False
    seed: int = 0
    internal_batch_size: int = 64
    composite: Composite = None
    memory_option = "internal_batch_size"

    @property
    def multiplies_by_inputs(self) -> bool:  # type: ignore[override]
        """Whether the result is multiplied by the input: the ``times_input`` option."""
        return self.times_input

    def __post_init__(self) -> None:
        _check_composite(self.composite)
        if self.samples < 1 or self.internal_batch_size < 1:
            raise ValueError(
                f"samples and internal_batch_size must be >= 1; got {self.samples} and "
                f"{self.internal_batch_size}"
            )
        if not self.noise_level >= 0:  # also refuses NaN
            raise ValueError(f"noise_level must be >= 0; got {self.noise_level}")

    def attribute(self, model, inputs, target, baselines) -> MethodResult:  # noqa: D102
        output = _outputs(model, inputs, self.internal_batch_size)
        chosen = select_target(output, target)
        flat = inputs.reshape(inputs.shape[0], -1)
        spread = (flat.amax(1) - flat.amin(1)).reshape((-1,) + (1,) * (inputs.dim() - 1))
        sigma = self.noise_level * spread
        generator = torch.Generator(device=inputs.device).manual_seed(self.seed)
        total = torch.zeros_like(inputs)
        copies_per_pass, parts = _passes(inputs.shape[0], self.internal_batch_size)
        for start in range(0, self.samples, copies_per_pass):
            copies = min(copies_per_pass, self.samples - start)
            # One draw per copy, the same for every sample (scaled by its own σ): a sample's
            # map depends neither on the rest of the batch nor on the batching.
            # (drawn copy by copy: the generator's stream depends on the size of a draw)
            noise = torch.stack(
                [
                    torch.randn(
                        (1, *inputs.shape[1:]),
                        generator=generator,
                        dtype=inputs.dtype,
                        device=inputs.device,
                    )
                    for _ in range(copies)
                ]
            )
            for part in parts:
                noisy = (inputs[part][None] + sigma[part][None] * noise).flatten(0, 1)
                _, _, gradient = _output_and_gradient(
                    model, noisy, chosen[part].repeat(copies), self.composite
                )
                total[part] += gradient.reshape(copies, *total[part].shape).sum(dim=0)
        attribution = total / self.samples
        if self.times_input:
            attribution = attribution * inputs
        return MethodResult(attribution, output, chosen, None, {"sigma": sigma.flatten()})


@dataclass
class DynamicLinearContributions(Method):
    """Exact contributions ``W_{0→L}(x)_j ⊙ x`` of a dynamic-linear model (e.g. a ReLU net).

    The model's dynamic-linear layers are put into explanation mode; plain ReLU networks are
    piecewise linear and need nothing. The delta is what the bias terms add to the output
    (zero for bias-free models).
    """

    convergence_delta = True
    multiplies_by_inputs = True

    def attribute(self, model, inputs, target, baselines) -> MethodResult:  # noqa: D102
        if target is None:
            with torch.no_grad():
                target = select_target(model(inputs), None)
        held = explanation_mode(model) if isinstance(model, nn.Module) else contextlib.nullcontext()
        with held:  # the check runs the model as a function, which the core takes as it is
            result = dynamic_linear_contributions(checking_dynamic_linear(model), inputs, target)
        explained = result.output.gather(1, target[:, None])[:, 0]
        delta = explained - _per_sample_sum(result.contributions)
        return MethodResult(result.contributions, result.output, target, delta)
