"""Cosine similarity convergence (CSC, Sixt et al. 2020): do later layers still matter?

Set the relevance at layer ``k``'s output to random vectors ``v₁, v₂, … ~ N(0, I)``, propagate
each with the method down to every lower layer and compare the results by cosine similarity. If
the method's backward pass is a chain of matrices that converges to rank 1 (non-negative chains
do), every ``v`` gives the same direction below ``k`` and the similarity is 1: the explanation
cannot depend on what layer ``k`` and the layers above it computed. For tensors with a spatial
layout (the inputs of convolutions) the similarity is taken per spatial location over the
channels; the summary is the median over samples, vector pairs and locations. A rank-1 chain maps
every vector to ``±c`` (the sign follows ``γᵀv``), so the absolute cosine is used by default.

**Protocol.** A method supports CSC when it can "propagate this relevance from layer ``k``":
it has a ``layer_propagator(model, inputs, baselines)`` method returning a
:class:`LayerPropagator` (the modified-backpropagation plugin implements it for all its
methods). Gradient-like methods registered as ``gradient`` and ``input_x_gradient`` use the
generic :class:`AutogradPropagator`. Any other method raises :class:`UnsupportedMethodError`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn

from explain_core.eager import eager_mode, uncompiled
from explain_core.errors import InvalidInputError, UnsupportedMethodError
from explain_core.metrics._checks import check_int
from explain_core.scoped import ModuleListener, listening
from explain_core.validation import check_inputs, clear_model_errors, refuse_inference_mode
from explain_core.vjp import vjp

__all__ = [
    "AutogradPropagator",
    "CSCResult",
    "LayerPropagator",
    "SupportsLayerPropagation",
    "UnsupportedMethodError",
    "cosine_similarity_convergence",
    "layer_propagator",
    "relevance_cosines",
]


@runtime_checkable
class LayerPropagator(Protocol):
    """One forward pass of a model that can propagate relevance from any recorded layer.

    Attributes:
        layers: Names of the layers relevance can be set at, input side first.
    """

    layers: Sequence[str]

    def output_shape(self, start: str) -> torch.Size:
        """Shape (batch first) of the relevance that :meth:`propagate` takes at ``start``."""
        ...

    def propagate(self, start: str, relevance: torch.Tensor) -> dict[str, torch.Tensor]:
        """Set ``relevance`` at ``start``'s output and propagate it with the method.

        Returns:
            Layer name → the method's relevance at that layer's input, for ``start`` and every
            layer below it (``layers[0]``'s input is the model input). May be called repeatedly.
        """
        ...


@runtime_checkable
class SupportsLayerPropagation(Protocol):
    """A :class:`~explain_core.registry.Method` that can build a :class:`LayerPropagator`."""

    def layer_propagator(
        self, model: nn.Module, inputs: torch.Tensor, baselines: torch.Tensor | None
    ) -> LayerPropagator:
        """Run the forward pass and return the propagator."""
        ...


WEIGHTED_TYPES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


class AutogradPropagator:
    """The gradient (or input × gradient) through the Linear/Conv layers of any model.

    The relevance set at a layer's output is the gradient there (the paper's
    ``∂h_k/∂h_l · v``); the relevance at a lower layer is the gradient at its input, times that
    input with ``times_input``.

    Args:
        model: The model (its calls are seen in this context only; nothing is registered).
        inputs: Model inputs.
        times_input: Multiply by the layer input (Input×Gradient, = LRP-0 on ReLU nets).
    """

    def __init__(self, model: nn.Module, inputs: torch.Tensor, *, times_input: bool) -> None:
        self.times_input = times_input
        self._records: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        weighted = {id(m): n for n, m in model.named_modules() if isinstance(m, WEIGHTED_TYPES)}
        records = self._records

        class Recorder(ModuleListener):
            def after(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
                name = weighted.get(id(module))
                if name is None:
                    return
                if name in records:
                    raise InvalidInputError(
                        f"module {name!r} is called more than once; CSC needs one call per layer"
                    )
                records[name] = (args[0], output)

        with listening(Recorder()), torch.enable_grad():
            self.input = inputs.detach().requires_grad_(True)
            model(self.input)
        self.layers = list(self._records)

    def output_shape(self, start: str) -> torch.Size:  # noqa: D102
        return self._records[start][1].shape

    def propagate(self, start: str, relevance: torch.Tensor) -> dict[str, torch.Tensor]:  # noqa: D102
        if start not in self._records:
            raise KeyError(f"no layer {start!r}; layers: {', '.join(self.layers)}")
        below = self.layers[: self.layers.index(start) + 1]
        tensors = [self._records[name][0] for name in below]
        grads = vjp(
            self._records[start][1], tensors, relevance, retain_graph=True, allow_unused=True
        )
        result = {}
        for name, tensor, grad in zip(below, tensors, grads, strict=True):
            grad = torch.zeros_like(tensor) if grad is None else grad
            result[name] = tensor.detach() * grad if self.times_input else grad
        return result


@eager_mode()  # the forward pass runs the method's hooks as written
def layer_propagator(
    model: nn.Module,
    inputs: torch.Tensor,
    method: str | Any,
    *,
    baselines: torch.Tensor | None = None,
    **options: Any,
) -> LayerPropagator:
    """The :class:`LayerPropagator` of a registered method (name) or a method object.

    Raises:
        UnsupportedMethodError: If the method cannot propagate relevance from a layer.
    """
    name = method if isinstance(method, str) else type(method).__name__
    model = uncompiled(model)
    if isinstance(method, str):
        from explain_core.plugin_manager import get_registry

        method = get_registry()[method].create(**options)
    elif options:
        raise InvalidInputError("options only apply to a method given by name")
    if isinstance(method, SupportsLayerPropagation):
        return method.layer_propagator(model, inputs, baselines)
    raise UnsupportedMethodError(
        f"method {name!r} cannot propagate a given relevance from an intermediate layer, so "
        "CSC cannot be computed for it: give its Method class a "
        "layer_propagator(model, inputs, baselines) method returning a LayerPropagator (e.g. "
        "explain_core.metrics.AutogradPropagator for gradient-like methods)"
    )


def relevance_cosines(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Cosine similarity per sample, and per spatial location for ``(N, C, *spatial)`` tensors.

    Tensors with a spatial layout and more than one channel are compared over the channels at
    every location, shape ``(N, locations)``; others (dense layers, one-channel inputs) over all
    their values, shape ``(N, 1)``. Where either vector is zero the cosine is NaN (undefined).
    """
    if first.dim() > 2 and first.shape[1] > 1:
        a = first.flatten(2).transpose(1, 2).double()  # (N, locations, C)
        b = second.flatten(2).transpose(1, 2).double()
    else:
        a = first.reshape(first.shape[0], 1, -1).double()
        b = second.reshape(second.shape[0], 1, -1).double()
    norms = a.norm(dim=2) * b.norm(dim=2)
    dot = (a * b).sum(dim=2)
    return torch.where(norms > 0, dot / norms.clamp(min=1e-300), torch.nan)


@dataclass(frozen=True)
class CSCResult:
    """Cosine similarities of relevance propagated from random vectors set at ``start``.

    Attributes:
        start: Layer whose output relevance was randomised.
        layers: Layers whose input relevance was compared, output side first (``start`` first).
        cosines: Layer → all defined (absolute) cosines (samples × vector pairs × locations),
            flattened.
        undefined: Layer → fraction of cosines left out because a relevance vector was zero.
    """

    start: str
    layers: tuple[str, ...]
    cosines: dict[str, np.ndarray]
    undefined: dict[str, float]

    @property
    def median(self) -> dict[str, float]:
        """Median cosine similarity per layer (NaN where none was defined)."""
        return {
            name: float(np.median(v)) if v.size else float("nan")
            for name, v in self.cosines.items()
        }


def cosine_similarity_convergence(
    model: nn.Module,
    inputs: torch.Tensor,
    method: str | Any,
    *,
    start: str | None = None,
    n_vectors: int = 5,
    seed: int = 0,
    baselines: torch.Tensor | None = None,
    propagator: LayerPropagator | None = None,
    absolute: bool = True,
    layouts: dict[str, Sequence[int]] | None = None,
    **options: Any,
) -> CSCResult:
    """CSC of a method at every layer below ``start`` (default: the output layer).

    Args:
        model: The model, in eval mode (it is left unchanged).
        inputs: Samples ``(N, ...)``.
        method: Registered method name or a method object (see the module docstring).
        start: Layer whose output relevance is set to random vectors.
        n_vectors: Random vectors per sample; every pair of them is compared.
        seed: Seed of the random vectors.
        baselines: Reference input for methods that use one.
        propagator: An already built propagator (``method`` is then only used in messages).
        absolute: Compare ``|cos|`` (a converged chain only flips the sign); ``False`` keeps the
            sign.
        layouts: Layer → per-sample shape to view its input relevance as before comparing, e.g.
            ``{"fc": (128, 4, 4)}`` for a dense layer reading flattened feature maps (compared per
            location then).
        **options: Method options.

    Raises:
        UnsupportedMethodError: If the method cannot propagate from an intermediate layer.
        InvalidInputError: For inputs that are not a finite floating-point batch fitting the
            model (also inputs it cannot run on), ``n_vectors < 2``, an unknown ``start``,
            ``layouts`` that do not fit, or a call inside ``torch.inference_mode()``.
        ModelStateError: If the model is in training mode.
    """
    from explain_core.model_guard import ModelGuard, require_eval_mode

    n_vectors = check_int(n_vectors, "n_vectors", 2)
    seed = check_int(seed, "seed", 0)
    model = uncompiled(model)
    refuse_inference_mode("cosine_similarity_convergence()", model)
    # Non-finite inputs would give NaN relevance, counted as "undefined" cosines: refuse them.
    inputs = check_inputs(inputs, model)
    layouts = _check_layouts(layouts)
    require_eval_mode(model)
    # Raw torch errors (inputs that do not fit the model) get explain()'s messages.
    with ModelGuard(model), eager_mode(), clear_model_errors(model, inputs):
        if propagator is None:
            propagator = layer_propagator(model, inputs, method, baselines=baselines, **options)
        layers = list(propagator.layers)
        start = layers[-1] if start is None else start
        if start not in layers:
            raise InvalidInputError(f"no layer {start!r}; layers: {', '.join(layers)}")
        generator = torch.Generator().manual_seed(seed)
        shape = propagator.output_shape(start)
        results = []
        for _ in range(n_vectors):
            vector = torch.randn(shape, generator=generator, dtype=torch.float64)
            vector = vector.to(dtype=inputs.dtype, device=inputs.device)
            results.append(propagator.propagate(start, vector))
    compared = tuple(reversed(layers[: layers.index(start) + 1]))
    for name, layout in layouts.items():
        _check_layout_fits(name, layout, compared, results[0])
    cosines, undefined = {}, {}
    for name in compared:
        per_vector = [r[name] for r in results]
        if name in layouts:
            per_vector = [t.reshape(t.shape[0], *layouts[name]) for t in per_vector]
        values = (
            torch.stack(
                [
                    relevance_cosines(per_vector[i], per_vector[j])
                    for i, j in itertools.combinations(range(n_vectors), 2)
                ],
                dim=1,
            )
            .cpu()
            .numpy()
        )
        if absolute:
            values = np.abs(values)
        defined = values[~np.isnan(values)]
        cosines[name] = defined
        undefined[name] = 1.0 - defined.size / max(values.size, 1)
    return CSCResult(start, compared, cosines, undefined)


def _check_layouts(layouts: Any) -> dict[str, tuple[int, ...]]:
    """``layouts`` as layer name → shape of positive ints (empty for ``None``)."""
    if layouts is None:
        return {}
    if not isinstance(layouts, Mapping):
        raise InvalidInputError(
            "layouts must map layer names to per-sample shapes, e.g. {'fc': (128, 4, 4)}; "
            f"got {type(layouts).__name__}"
        )
    checked = {}
    for name, shape in layouts.items():
        if (
            isinstance(shape, (str, bytes))
            or not isinstance(shape, Sequence)
            or not shape
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in shape)
        ):
            raise InvalidInputError(
                f"layouts[{name!r}] must be a per-sample shape of positive ints such as "
                f"(128, 4, 4); got {shape!r}"
            )
        checked[name] = tuple(shape)
    return checked


def _check_layout_fits(
    name: str, layout: tuple[int, ...], compared: Sequence[str], relevance: dict[str, Any]
) -> None:
    """Refuse a layout for a layer that is not compared or whose size differs."""
    if name not in compared:
        raise InvalidInputError(
            f"layouts names layer {name!r}, which is not compared; give layouts for "
            f"{', '.join(compared)}"
        )
    shape = tuple(relevance[name].shape[1:])
    if math.prod(layout) != math.prod(shape):
        raise InvalidInputError(
            f"layouts[{name!r}] = {layout} holds {math.prod(layout)} values per sample, but the "
            f"relevance at layer {name!r}'s input has shape {shape} ({math.prod(shape)} values); "
            "give a shape with as many values"
        )
