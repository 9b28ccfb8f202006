"""DeepLIFT (Shrikumar et al. 2017): Rescale, RevealCancel and the decoupled "ablation".

The model runs once on the inputs and the reference stacked along the batch axis; the signal is
DeepLIFT's multiplier ``m`` with contributions ``Δx ⊙ m``, ``Δx = x − x⁰``.

- **Rescale**: an activation's multiplier is ``Δy / Δx`` (the gradient where ``|Δx| < 1e-10``), for
  ReLU and every element-wise activation of :data:`~explain_core.engine.ops.ACTIVATION_OPS`; affine
  layers, average pooling and additions pass the gradient. Max pooling (``max_pool``, adaptive
  max pooling, a maximum over dimensions) uses the rule written in Captum's source by default
  (``maxpool="rescale"``: each window's ``Δy`` split between the input's and the reference's
  winners); ``maxpool="gradient"`` passes the gradient. ``deeplift.rescale``
  equals ``captum.attr.DeepLift`` on models without max pooling; with max pooling Captum 0.9's
  output equals ``maxpool="gradient"`` (its max-pool hook runs, but the result it returns is not
  what reaches the inputs; measured in ``tests/test_modbp_activations.py``).
- **RevealCancel**: every affine layer's difference-from-reference is split into its positive and
  negative parts ``Δz⁺ = W⁺Δx⁺ + W⁻Δx⁻``, ``Δz⁻ = W⁻Δx⁺ + W⁺Δx⁻`` (the masks ``M_{>0}``,
  ``M_{<0}`` select inputs by the sign of ``Δx``; residual additions add the parts), and a ReLU
  gives them separate multipliers (any activation ``f``)
  ``Δy⁺ = ½(f(x⁰+Δz⁺) − f(x⁰)) + ½(f(x⁰+Δz⁻+Δz⁺) − f(x⁰+Δz⁻))`` (and likewise ``Δy⁻``).
  Backwards that is the paper's Eq. 13: ``r⁺ = M_{>0} ⊙ (W⁺ᵀ r⁺ + W⁻ᵀ r⁻)`` and
  ``r⁻ = M_{<0} ⊙ (W⁺ᵀ r⁻ + W⁻ᵀ r⁺)``.
- **Ablation** (the paper's decoupled chains): RevealCancel without the mixing terms,
  ``r⁺ = M_{>0} ⊙ W⁺ᵀ r⁺`` and ``r⁻ = M_{<0} ⊙ W⁻ᵀ r⁻``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F

from explain_core.affine import AffineLayer, functional_linear
from explain_core.engine import ModifiedBackprop
from explain_core.engine.attach import LayerRecord
from explain_core.engine.ops import (
    ACTIVATION_OPS,
    ADD_OPS,
    MAX_REDUCTIONS,
    PACKING_OPS,
    RELU_OPS,
    RESHAPE_COPIES,
    OpHandler,
)
from explain_core.errors import InvalidInputError, UnsupportedModelError
from explain_core.registry import Method, MethodResult, MethodSpec
from explain_core.targets import select_target
from explain_core.validation import check_output_finite, check_reference_output_finite
from explain_core.vjp import vjp
from explain_modbp.activations import Activation, secant_slope
from explain_modbp.batch_axes import MOVING_OPS, BatchAxes
from explain_modbp.composites import gradient_composite
from explain_modbp.methods import one_hot, per_sample_sum

EPS = 1e-10
# The dense layers DeepLIFT takes as functions (gradient_composite's).
_FUNCTIONAL_LAYERS = frozenset({"linear", "addmm"})
# Max pooling by operation name: the pooling function and its parameters after the input.
_POOLS: dict[str, tuple[Callable[..., Any], tuple[str, ...]]] = {
    f"{kind}{d}d{suffix}": (getattr(F, f"{kind}{d}d"), parameters)
    for kind, parameters in (
        ("max_pool", ("kernel_size", "stride", "padding", "dilation", "ceil_mode")),
        ("adaptive_max_pool", ("output_size",)),
    )
    for d in (1, 2, 3)
    for suffix in ("", "_with_indices")
}


class _RescaleActivation(torch.autograd.Function):
    """An activation with multiplier ``Δy/Δx`` on the input half, no signal to the reference."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, activation: Activation, batch: int) -> Any:
        delta_in = x[:batch] - x[batch:]
        at = x[:batch].detach().clone()  # the call below may change x in place
        y = activation.apply_in_forward(ctx, x)
        delta_out = y[:batch] - y[batch:]
        ctx.multiplier = secant_slope(activation, delta_in, delta_out, at, EPS)
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        m = ctx.multiplier
        return torch.cat([g[: m.shape[0]] * m, torch.zeros_like(g[m.shape[0] :])]), None, None


class _RevealCancelActivation(torch.autograd.Function):
    """An activation whose signal goes to the positive and negative parts separately."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        positive: torch.Tensor,
        negative: torch.Tensor,
        activation: Activation,
        batch: int,
    ) -> Any:
        reference, at = x[batch:], x[:batch].detach()
        f = activation.out_of_place
        dy_pos = 0.5 * (f(reference + positive) - f(reference)) + 0.5 * (
            f(reference + negative + positive) - f(reference + negative)
        )
        dy_neg = 0.5 * (f(reference + negative) - f(reference)) + 0.5 * (
            f(reference + positive + negative) - f(reference + positive)
        )
        ctx.m_pos = secant_slope(activation, positive, dy_pos, at, EPS)
        ctx.m_neg = secant_slope(activation, negative, dy_neg, at, EPS)
        return activation.apply_in_forward(ctx, x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        g = g[: ctx.m_pos.shape[0]]
        return None, g * ctx.m_pos, g * ctx.m_neg, None, None


class _RescaleMaxPool(torch.autograd.Function):
    """Captum's DeepLIFT max-pool rule on the input half."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, pool: Callable[..., Any], batch: int, kw: dict) -> Any:
        out, indices = pool(x, **kw, return_indices=True)
        ctx.save_for_backward(indices)
        ctx.shape = x.shape
        ctx.batch = batch
        out_in, out_ref = out[:batch], out[batch:]
        cross = torch.maximum(out_in, out_ref)
        ctx.delta_out = (cross - out_ref, out_in - cross)
        ctx.delta_in = x[:batch] - x[batch:]
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        (indices,) = ctx.saved_tensors
        batch = ctx.batch
        g_in = g[:batch]
        idx_in, idx_ref = indices[:batch], indices[batch:]
        shape = ctx.shape[1:]

        def unpool(values: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
            flat = values.new_zeros(batch, shape[0], shape[1:].numel())
            flat.scatter_add_(2, idx.flatten(2), values.flatten(2))
            return flat.reshape(batch, *shape)

        first, second = ctx.delta_out
        delta_in = ctx.delta_in
        rescaled = unpool(g_in * first, idx_in) + unpool(g_in * second, idx_ref)
        plain = unpool(g_in, idx_in)
        safe = delta_in.masked_fill(delta_in == 0, 1)
        grad = torch.where(delta_in.abs() < EPS, plain, rescaled / safe)
        return torch.cat([grad, torch.zeros_like(grad)]), None, None, None


class DeepLiftHandler(OpHandler):
    """The DeepLIFT rules for activations, max pooling and (RevealCancel) residual additions.

    Args:
        reference: Reference input, shaped like the inputs.
        rule: ``"rescale"``, ``"reveal_cancel"`` or ``"ablation"`` (decoupled RevealCancel).
        maxpool: ``"rescale"`` (the rule in Captum's source) or ``"gradient"``.
    """

    compares_with_reference = True
    ops: ClassVar[frozenset[str]] = (
        RELU_OPS | ACTIVATION_OPS | frozenset(_POOLS) | MAX_REDUCTIONS | MOVING_OPS | PACKING_OPS
    )

    def __init__(
        self,
        reference: torch.Tensor,
        rule: Literal["rescale", "reveal_cancel", "ablation"] = "rescale",
        maxpool: Literal["rescale", "gradient"] = "rescale",
    ) -> None:
        if rule not in ("rescale", "reveal_cancel", "ablation"):
            raise ValueError(f"rule must be rescale, reveal_cancel or ablation; got {rule!r}")
        if maxpool not in ("rescale", "gradient"):
            raise ValueError(f"maxpool must be 'rescale' or 'gradient'; got {maxpool!r}")
        self.reference = reference
        self.rule = rule
        self.maxpool = maxpool
        self.batch = 0
        self.input: torch.Tensor | None = None  # the stacked inputs and references
        self.parts: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.layers: Mapping[str, LayerRecord] = {}
        self.consumed: dict[int, torch.Tensor] = {}  # tensors whose parts an activation used
        # id of x.view_as(x) made without gradients → (it, x): a user's full backward hook
        # wraps a module's output so; its parts are x's, made with gradients when needed
        self.aliases: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.axes = BatchAxes()  # where the model moved the batch
        self.packed = False  # the model packed sequences (a step's rows: those still running)
        if rule != "rescale":
            self.ops = self.ops | ADD_OPS | RESHAPE_COPIES | _FUNCTIONAL_LAYERS

    @property
    def needs_layers(self) -> bool:
        """RevealCancel splits every affine layer's output: the pass must record them."""
        return self.rule != "rescale"

    def start(self, inputs: torch.Tensor, layers: Mapping[str, LayerRecord]) -> torch.Tensor:  # noqa: D102
        self.batch = inputs.shape[0]
        self.parts.clear()
        self.consumed.clear()
        self.aliases.clear()
        self.axes.clear()
        self.packed = False
        self.layers = layers
        self.input = torch.cat([inputs, self.reference.to(inputs)])
        return self.input

    def _is_activation(self, value: Any) -> bool:
        """Whether ``value`` is computed from the pass's stacked inputs and references.

        The stacked tensor itself counts (``z + x``: a skip from the raw input), though it is
        a leaf: weights and constants are the leaves that do not.
        """
        return (
            isinstance(value, torch.Tensor)
            and value.dim() > 0
            and value.shape[0] == 2 * self.batch
            and (value.grad_fn is not None or value is self.input)
        )

    def _pairs_rows(self, reader: str, x: Any) -> bool:
        """Whether ``x`` holds rows of inputs and references on its first axis, for ``reader``.

        ``reader``: a nonlinearity (``"operation 'relu'"``), or a layer whose output
        RevealCancel splits. ``False`` for a constant (computed from weights only): it runs as
        written.

        Raises:
            UnsupportedModelError: ``x`` is computed from the inputs but does not have their
                rows on its first axis (the batch moved: ``h.transpose(0, 1)``), where its
                difference from reference cannot be found; also where the first axis is as
                long, if the pass followed the batch elsewhere.
        """
        rows = 2 * self.batch
        if self._is_activation(x):
            # as many rows elsewhere: refused only where the batch is known to be elsewhere (an
            # axis the pass does not follow counts as first)
            axis = self.axes.axis_of(x) if rows in x.shape[1:] else 0
            if axis is None or axis == 0:
                return True
        elif not isinstance(x, torch.Tensor) or not _computed_from(x, self.input):
            return False
        if self.packed:
            raise UnsupportedModelError(
                f"{reader} gets a tensor of shape {tuple(x.shape)} from packed sequences: a "
                "step's rows are the sequences still running, sorted by length, not the "
                f"{rows} rows of the {self.batch} inputs and their references stacked that "
                "DeepLIFT pairs. Explain the model with Explainer(model, method).attribute(x, "
                "target, additional_forward_args=lengths), which runs the samples of each "
                "length together (every step then has all their rows)"
            )
        raise UnsupportedModelError(
            f"{reader} gets a tensor of shape {tuple(x.shape)} computed from the inputs whose "
            f"first axis is not the batch: DeepLIFT runs the {self.batch} inputs and their "
            f"references stacked on the first axis ({rows} rows) and finds each value's "
            "reference value there. Apply it where the batch is the first axis (before a "
            "transpose(0, 1), or in a recurrent layer with batch_first=True), or explain with "
            "a method that needs no reference (lrp.epsilon, gradient)"
        )

    # positive/negative parts ---------------------------------------------------------------
    def register(self, tensor: torch.Tensor, positive: torch.Tensor, negative: torch.Tensor):
        """Record the parts of ``tensor``'s difference from reference (input half)."""
        self.parts[id(tensor)] = (tensor, positive, negative)

    def parts_of(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The positive and negative parts of ``tensor``, or ``None``.

        Affine layers' outputs and sums of them have parts (until an activation used them).
        """
        while (alias := self.aliases.get(id(tensor))) is not None and alias[0] is tensor:
            tensor = alias[1]  # wrapped by several hooks (the output layer's, the model's)
        if self.consumed.get(id(tensor)) is tensor:
            return None
        entry = self.parts.get(id(tensor))
        if entry is not None and entry[0] is tensor:
            return entry[1], entry[2]
        for name, record in reversed(self.layers.items()):  # the layer that made it ran last
            if record.output is tensor:
                assert record.call.layer is not None
                self._pairs_rows(f"layer {name!r}", record.input)
                positive, negative = self._layer_parts(record.call.layer, record.input)
                self.register(tensor, positive, negative)
                return positive, negative
        return None

    def split(self, tensor: torch.Tensor, pop: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The parts of ``tensor``, or its difference split by sign."""
        parts = self.parts_of(tensor)
        if pop:
            self.parts.pop(id(tensor), None)
            self.consumed[id(tensor)] = tensor
        if parts is not None:
            return parts
        delta = tensor[: self.batch] - tensor[self.batch :]
        return delta * (delta > 0), delta * (delta < 0)

    def _layer_parts(
        self, layer: AffineLayer, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``Δz⁺``, ``Δz⁻`` of an affine layer, differentiable functions of its input ``x``.

        Their backward is the paper's Eq. 13 (or its decoupled ablation).
        """
        batch = self.batch
        delta = x[:batch] - x[batch:]
        dpos, dneg = delta * (delta > 0), delta * (delta < 0)
        wp, wn = layer.weight.clamp(min=0), layer.weight.clamp(max=0)
        pos_pos, neg_neg = layer.forward(dpos, wp), layer.forward(dneg, wn)
        pos_neg, neg_pos = layer.forward(dpos, wn), layer.forward(dneg, wp)
        if self.rule == "ablation":  # values of Eq. 13, signal only along W⁺ (r⁺) and W⁻ (r⁻)
            positive = pos_pos + neg_neg.detach()
            negative = (pos_neg + neg_pos).detach() + neg_neg - neg_neg.detach()
        else:
            positive = pos_pos + neg_neg
            negative = pos_neg + neg_pos
        return positive, negative

    def handle(self, name, func, args, kwargs):  # noqa: D102
        if not args and "input" in kwargs:  # torch.amax(input=h, dim=1): the input first
            kwargs = dict(kwargs)
            args = (kwargs.pop("input"),)
        x = args[0]
        if name in RELU_OPS | ACTIVATION_OPS:
            if not self._pairs_rows(f"operation {name!r}", x):
                return func(*args, **kwargs)
            activation = Activation(func, args, kwargs)
            if self.rule == "rescale":
                return _RescaleActivation.apply(x, activation, self.batch)
            positive, negative = self.split(x, pop=True)
            return _RevealCancelActivation.apply(x, positive, negative, activation, self.batch)
        if name in _POOLS:
            if self.maxpool == "gradient" or not self._pairs_rows(f"operation {name!r}", x):
                return func(*args, **kwargs)
            return self._pool(name, args, kwargs)
        if name in MAX_REDUCTIONS:
            return self._max_over_dimensions(name, func, args, kwargs)
        if name in PACKING_OPS:
            self.packed = self.packed or name == "_pack_padded_sequence"
            return func(*args, **kwargs)
        if name in MOVING_OPS or name in RESHAPE_COPIES:
            arranged = name in RESHAPE_COPIES and self.rule != "rescale"  # parts arranged alike
            result = self._arrange(func, args, kwargs) if arranged else func(*args, **kwargs)
            if name in MOVING_OPS:
                self.axes.note(name, args, kwargs, result, self._is_activation)
            return result
        if name in _FUNCTIONAL_LAYERS:
            return self._functional_layer(name, func, args, kwargs)
        return self._add(name, func, args, kwargs)

    def _functional_layer(
        self, name: str, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict
    ) -> Any:
        """``F.linear(x, W, b)`` or ``torch.addmm(b, x, W)``: its output's parts, as a Linear's."""
        result = func(*args, **kwargs)
        x = args[0] if name == "linear" else args[1]
        if not self._pairs_rows(f"operation {name!r}", x):
            return result
        layer = functional_linear(name, args, kwargs, x)
        if layer is None:  # addmm with beta or alpha: not a dense layer's parts
            raise UnsupportedModelError(
                f"operation {name!r} with beta or alpha: DeepLIFT {self.rule} splits a dense "
                "layer's output into positive and negative parts, and has no split for it; "
                "write it as F.linear(x, W, b) (or scale the result), or use deeplift.rescale"
            )
        self.register(result, *self._layer_parts(layer, x))
        return result

    def _arrange(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict) -> Any:
        """A reshape or permute of a tensor with parts: the same of its parts (RevealCancel).

        The parts (the input half's rows each) are arranged stacked, as many rows as the
        tensor, so that arguments naming its batch size (``h.view(h.shape)``) fit them too.
        """
        result = func(*args, **kwargs)
        if not torch.is_grad_enabled():  # parts made here would have no graph to differentiate
            if func is torch.Tensor.view_as and args[0] is args[1]:
                self.aliases[id(result)] = (result, args[0])
            return result
        parts = self.parts_of(args[0]) if isinstance(args[0], torch.Tensor) else None
        if parts is None or not isinstance(result, torch.Tensor) or len(result) != 2 * self.batch:
            return result
        positive, negative = func(torch.cat(parts), *args[1:], **kwargs).chunk(2)
        self.register(result, positive, negative)
        return result

    def _pool(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Max pooling (fixed or adaptive windows) with the rescale rule; indices if asked."""
        pool, names = _POOLS[name]
        parameters = dict(zip(names, args[1:], strict=False))
        parameters.update({k: v for k, v in kwargs.items() if k in names})
        positional = args[len(names) + 1] if len(args) > len(names) + 1 else False
        output = _RescaleMaxPool.apply(args[0], pool, self.batch, parameters)
        if not kwargs.get("return_indices", positional):
            return output
        return output, pool(args[0].detach(), **parameters, return_indices=True)[1]

    def _max_over_dimensions(
        self, name: str, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """``x.amax(dims)``, ``torch.max(x, dim)``: max pooling over those dimensions.

        The dimensions are moved last and flattened into one window of a 1-d max pooling.
        ``torch.max`` of two tensors, and a maximum that includes the batch dimension, are
        not max pooling: they run as they are.
        """
        x = args[0]
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        keepdim = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
        if isinstance(dim, int):
            dims = {dim % x.dim()}
        elif isinstance(dim, (tuple, list)) and dim:
            dims = {d % x.dim() for d in dim}
        elif name == "amax" and not isinstance(dim, torch.Tensor) and "other" not in kwargs:
            dims = set(range(x.dim()))  # amax(dim=()) reduces every dimension
        else:
            dims = {0}  # torch.max(x) of every value, or torch.max(a, b): not a pooling
        if (
            self.maxpool == "gradient"
            or not self._pairs_rows(f"operation {name!r}", x)
            or 0 in dims
        ):
            return func(*args, **kwargs)
        kept = [d for d in range(x.dim()) if d not in dims]
        moved = x.permute(*kept, *sorted(dims))
        window = moved.shape[len(kept) :].numel()
        windows = moved.reshape(x.shape[0], -1, window)
        pooled = _RescaleMaxPool.apply(windows, F.max_pool1d, self.batch, {"kernel_size": window})
        values = pooled.reshape(moved.shape[: len(kept)])
        if keepdim:
            for d in sorted(dims):
                values = values.unsqueeze(d)
        if name == "max":
            return torch.return_types.max((values, func(x.detach(), *args[1:], **kwargs)[1]))
        return values

    def _add(self, name, func, args, kwargs):
        result = func(*args, **kwargs)
        operands = [a for a in args[:2] if self._is_activation(a)]
        if not operands or not self._is_activation(result) or "alpha" in kwargs:
            return result
        positive = negative = None
        for index, operand in enumerate(args[:2]):
            if not self._is_activation(operand):
                continue
            p, n = self.split(operand)
            if index == 1 and name.startswith("sub"):
                p, n = -n, -p
            positive = p if positive is None else positive + p
            negative = n if negative is None else negative + n
        self.register(result, positive, negative)
        return result


def _computed_from(tensor: torch.Tensor, leaf: torch.Tensor) -> bool:
    """Whether ``tensor``'s autograd graph reaches ``leaf`` (each node visited once)."""
    if tensor is leaf:
        return True
    pending, seen = [tensor.grad_fn], set()
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if getattr(node, "variable", None) is leaf:
            return True
        pending.extend(next_node for next_node, _ in node.next_functions)
    return False


def _run(handler: DeepLiftHandler, model: Any, inputs: torch.Tensor, *, record: bool) -> Any:
    """The pass of one DeepLIFT rule.

    The gradient through affine layers; the handler's rules for activations, max pooling and
    (RevealCancel) additions.
    """
    composite = gradient_composite(f"deeplift.{handler.rule}")
    return ModifiedBackprop(composite, handler, record=record).forward(model, inputs)


def check_reference(inputs: torch.Tensor, baselines: torch.Tensor | None) -> torch.Tensor:
    """The reference input, zeros by default.

    Raises:
        InvalidInputError: If it does not fit the inputs' shape.
    """
    if baselines is None:
        return torch.zeros_like(inputs)
    if not isinstance(baselines, torch.Tensor):
        baselines = torch.as_tensor(baselines, dtype=inputs.dtype, device=inputs.device)
    try:
        return torch.broadcast_to(baselines, inputs.shape).to(inputs)
    except RuntimeError:
        raise InvalidInputError(
            f"the reference input (baselines) of shape {tuple(baselines.shape)} does not fit the "
            f"inputs of shape {tuple(inputs.shape)}; give one reference per sample or one for all"
        ) from None


@dataclass
class _DeepLift(Method):
    """Shared body of the DeepLIFT methods."""

    maxpool: str = "rescale"
    uses_baselines = True
    rule: ClassVar[str] = "rescale"
    convergence_delta = True
    multiplies_by_inputs = True  # (inputs − reference) ⊙ multipliers

    def __post_init__(self) -> None:
        DeepLiftHandler(torch.zeros(1), self.rule, self.maxpool)  # type: ignore[arg-type]

    def layer_propagator(self, model, inputs, baselines):
        from explain_modbp.propagation import EnginePropagator

        reference = check_reference(inputs, baselines)
        handler = DeepLiftHandler(reference, self.rule, self.maxpool)  # type: ignore[arg-type]
        forward = _run(handler, model, inputs, record=True)
        return EnginePropagator(
            forward,
            "signal",
            batch=inputs.shape[0],
            handler=handler,
            method=f"deeplift.{self.rule}",
        )

    def attribute(self, model, inputs, target, baselines) -> MethodResult:
        reference = check_reference(inputs, baselines)
        handler = DeepLiftHandler(reference, self.rule, self.maxpool)  # type: ignore[arg-type]
        forward = _run(handler, model, inputs, record=handler.needs_layers)
        batch = inputs.shape[0]
        both = forward.output.detach()
        output, reference_output = both[:batch], both[batch:]
        check_output_finite(output)  # said first: NaN at the input is the model's own
        check_reference_output_finite(reference_output, f"deeplift.{self.rule}")
        chosen = select_target(output, target)
        start = one_hot(output, chosen)
        parts = handler.parts_of(forward.output) if handler.needs_layers else None
        if parts is not None:
            # The output layer's positive and negative parts both carry the start signal, so
            # its rule (coupled or decoupled) applies too.
            (signal,) = vjp(parts, forward.input, (start, start))
            multiplier = signal[:batch]
        else:
            signal = torch.cat([start, torch.zeros_like(reference_output)])
            multiplier = forward.backward(signal).input_signal[:batch]
        handler.parts.clear()
        attribution = (inputs - reference) * multiplier
        gain = (output - reference_output).gather(1, chosen[:, None])[:, 0]
        return MethodResult(
            attribution,
            output,
            chosen,
            gain - per_sample_sum(attribution),
            {"baselines": reference, "multipliers": multiplier},
        )


@dataclass
class DeepLiftRescale(_DeepLift):
    """DeepLIFT with the Rescale rule (``captum.attr.DeepLift``; see the module on max pooling).

    Attributes:
        maxpool: ``"rescale"`` (the max-pool rule in Captum's source) or ``"gradient"`` (what
            Captum 0.9 computes in practice).
    """

    rule: ClassVar[str] = "rescale"


@dataclass
class DeepLiftRevealCancel(_DeepLift):
    """DeepLIFT with the RevealCancel rule (positive and negative parts, Eq. 13)."""

    rule: ClassVar[str] = "reveal_cancel"


@dataclass
class DeepLiftAblation(_DeepLift):
    """The paper's DeepLIFT ablation: RevealCancel with decoupled positive/negative chains."""

    rule: ClassVar[str] = "ablation"


def method_specs(spec: Callable[[str, object, str], MethodSpec]) -> list[MethodSpec]:
    """The registered names of this module."""
    return [
        spec("deeplift.rescale", DeepLiftRescale, "DeepLIFT Rescale with a reference input"),
        spec(
            "deeplift.reveal_cancel",
            DeepLiftRevealCancel,
            "DeepLIFT RevealCancel with a reference input",
        ),
        spec(
            "deeplift.ablation",
            DeepLiftAblation,
            "DeepLIFT with decoupled positive/negative chains (the paper's ablation)",
        ),
    ]
