"""Attaching the rules during one attribution pass: module listeners and autograd functions.

Each ruled layer's call (seen through :func:`explain_core.scoped.listening`, in this context only)
returns the layer's output values through :class:`_RuleFunction`, whose backward is the rule
computed from tensors saved in the forward pass; an operation handler runs as a
:class:`~torch.overrides.TorchFunctionMode` around the model.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from explain_core.affine import AFFINE_TYPES, AffineLayer, functional_linear
from explain_core.engine.decompose import DECOMPOSED, scaled_dot_product_attention
from explain_core.engine.ops import (
    ARRANGING_OPS,
    DROPOUT_OPS,
    RELU_OPS,
    RESHAPE_COPIES,
    RESHAPE_OPS,
    SPLITTING_OPS,
    OpHandler,
    op_name,
    without_function_modes,
)
from explain_core.engine.recurrent import input_dependence
from explain_core.engine.tracing import Plan, user_hook_codes
from explain_core.errors import InvalidInputError, UnsupportedModelError
from explain_core.interfaces.relevance import AffineRule, Gradient, InputPath, Rule, RuleCall
from explain_core.scoped import ModuleListener, unheard

if TYPE_CHECKING:
    from explain_core.engine.composite import Composite

__all__ = [
    "LayerRecord",
    "OperationMode",
    "RulePass",
    "masks_rectified_outputs",
]


@dataclass
class LayerRecord:
    """One affine layer in a :class:`ForwardPass`.

    Attributes:
        name: Qualified name (of the Linear/Conv for a merged pair).
        input: The tensor the layer read (part of the graph).
        output: The layer's output as the rest of the model saw it (part of the graph).
        rule: The layer's rule.
        call: The call as the rule saw it (layer view, detached tensors, forward-time state).
    """

    name: str
    input: torch.Tensor
    output: torch.Tensor
    rule: Rule
    call: RuleCall


_NOT_KEPT = torch.empty(0)
"""``call.output`` of a call whose rule does not read it in backward."""


def _graph_kept() -> bool:
    """Whether the running backward pass keeps the graph (``retain_graph=True``).

    Unknown (a torch without the query) counts as kept: nothing is released then.
    """
    query = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if query is None else bool(query())


def _begin_backward(ctx: Any) -> RuleCall:
    """The call of ``ctx``, told whether this backward is its last (``call.last_backward``)."""
    call: RuleCall = ctx.call
    call.last_backward = not _graph_kept()
    return call


def _release(ctx: Any) -> None:
    """Drop what a rule kept for its backward once it has run, as autograd frees saved tensors.

    Without this the calls (their inputs, outputs and state) would live until the whole graph
    is freed, and a backward pass would hold every layer's tensors to its end.
    """
    if ctx.call.last_backward:
        ctx.rule = ctx.call = None


class _RuleFunction(torch.autograd.Function):
    """A ruled layer's output values, from its input, whose backward is the layer's rule."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, rule: Rule, call: RuleCall, keep_input: bool, reads_relu: bool
    ) -> torch.Tensor:
        ctx.rule, ctx.call, ctx.stand_in, ctx.reads_relu = rule, call, not keep_input, reads_relu
        # Kept, it raises at backward if x was changed in place meanwhile; else the rule reads
        # only x's stand-in (shape and layout) and x is the model's to free.
        ctx.save_for_backward(x if keep_input else None)
        if rule.output_in_backward:  # a copy: the model may change its own in place (ReLU)
            return call.output.clone()
        output, call.output = call.output, _NOT_KEPT  # the model's alone: not kept
        return output.detach()

    @staticmethod
    @once_differentiable
    def backward(
        ctx: Any, signal: torch.Tensor
    ) -> tuple[torch.Tensor | None, None, None, None, None]:
        ctx.saved_tensors  # noqa: B018  (the in-place check)
        rule, call = ctx.rule, _begin_backward(ctx)
        if ctx.reads_relu:
            _check_rectified_output(call)
        try:
            (grad,) = rule.backward(call, signal)
        except (RuntimeError, NotImplementedError) as error:
            if not ctx.stand_in or "meta" not in str(error):
                raise
            raise _read_stand_in(rule, call) from error
        if ctx.stand_in and grad is not None and grad.device.type == "meta":
            raise _read_stand_in(rule, call)
        _release(ctx)
        return grad, None, None, None, None


def _check_rectified_output(call: RuleCall) -> None:
    """Before backward: the ReLU output the rule reads is there, unchanged since the ReLU."""
    relu_output = call.rectified_output
    if relu_output is None:
        raise UnsupportedModelError(
            f"no ReLU read the output of layer {call.name!r} in this pass, though the traced "
            "pass found only a ReLU reading it (its rule computes from that ReLU's output): "
            "the model's forward took another path than when it was traced; make forward "
            "take one path for inputs of one shape (no randomness or state that changes it)"
        )
    if relu_output._version != call.rectified_version:
        raise UnsupportedModelError(
            f"the output of the ReLU that reads layer {call.name!r} was changed in place later "
            "in forward (as autograd's own backward would refuse: a ReLU keeps its output for "
            "its gradient); write that change out of place (e.g. h = h * 2, not h *= 2)"
        )


def _read_stand_in(rule: Rule, call: RuleCall) -> InvalidInputError:
    """The error for a rule that computed with the stand-in of an input it said it does not read."""
    return InvalidInputError(
        f"{type(rule).__name__}.backward computed with the input of layer {call.name!r}, but "
        "its reads_input_in_backward returned False for that call, so the engine kept only a "
        "stand-in of the input (its shape, on the meta device); return True from "
        "reads_input_in_backward where backward reads the input's values"
    )


class _ModuleRule(torch.autograd.Function):
    """A ruled module's output, from its inputs, with the module's rule as backward.

    The module itself ran without autograd (its own graph would only be thrown away): this
    function is the one step from the module's inputs to its output.
    """

    @staticmethod
    def forward(ctx: Any, rule: Rule, call: RuleCall, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.rule, ctx.call = rule, call
        ctx.versions = _versions(call)
        # A new tensor on the module's output storage: not an input returned as-is (autograd
        # would treat it as a view and forbid changing it in place later), not call.output
        # (its grad_fn would close a cycle through the graph), and no copy.
        return call.output.detach()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rule: Rule = ctx.rule
        call = _begin_backward(ctx)
        _check_versions(rule, call, ctx.versions, f"module {call.name or '<root>'!r}")
        call.grad_output = grad_output
        with torch.enable_grad():
            results = tuple(rule.backward(call, grad_output))
        if len(results) != len(call.inputs):
            raise InvalidInputError(
                f"{type(rule).__name__}.backward returned {len(results)} tensors for the "
                f"{len(call.inputs)} tensor inputs of module {call.name or '<root>'!r}"
            )
        _release(ctx)
        return (None, None, *results)


class _PassedThrough(torch.autograd.Function):
    """A ReLU's output values, from its input, whose backward passes the signal unchanged.

    For a ReLU that reads a layer whose rule gives no signal to the outputs the ReLU stops
    (:attr:`~explain_core.interfaces.relevance.AffineRule.uses_rectified_outputs`): the ReLU's
    own backward would only mask what the rule masks anyway, at the cost of a pass over the
    signal.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        return output.detach()

    @staticmethod
    def backward(ctx: Any, signal: torch.Tensor) -> tuple[torch.Tensor, None]:
        return signal, None


class _BiasAdded(torch.autograd.Function):
    """``y = d ± c``: a layer's bias written as an addition (``x @ W + b``), for a rule without one.

    ``c`` is a constant, ``d`` the output of a layer whose rule ignores biases. The backward
    hands the layer the whole relevance of ``y``, as the rule does with a bias of its own: the
    signal ``s ⊙ y / d``, so that ``d ⊙ s_d = y ⊙ s`` (0 where ``d`` is 0, where the layer's
    relevance ``d ⊙ s_d`` is 0 whatever the signal).
    """

    @staticmethod
    def forward(ctx: Any, d: torch.Tensor, compute: Any) -> torch.Tensor:
        y = compute()
        ctx.ratio = torch.where(d != 0, y / d, 0)
        return y

    @staticmethod
    def backward(ctx: Any, signal: torch.Tensor) -> tuple[torch.Tensor, None]:
        return signal * ctx.ratio, None


def _stand_in(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor on the ``meta`` device with ``tensor``'s shape, dtype and strides (no values)."""
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")


def masks_rectified_outputs(rule: Rule, call: RuleCall) -> bool:
    """Whether ``rule`` gives no signal to the outputs ``<= 0`` of the layer of ``call``.

    That is, the layer's output only a ReLU reads and the rule applies that ReLU's gradient
    itself (:attr:`~explain_core.interfaces.relevance.AffineRule.uses_rectified_outputs`).
    """
    masks = getattr(rule, "uses_rectified_outputs", False)  # affine rules only
    return bool(masks) and call.layer is not None and call.layer.output_rectified


def _versions(call: RuleCall) -> tuple[int, ...]:
    """The version counters of the call's inputs and output (to find in-place changes)."""
    return tuple(t._version for t in (*call.inputs, call.output))


def _check_versions(rule: Rule, call: RuleCall, versions: tuple[int, ...], what: str) -> None:
    """Before backward: what the model changed in place since the call.

    Inputs changed in place are refused (as autograd does); an output changed in place is
    computed again from the inputs if the rule reads it.
    """
    *inputs, output = versions
    if any(t._version != v for t, v in zip(call.inputs, inputs, strict=True)):
        raise UnsupportedModelError(
            f"an input of {what} was changed in place later in forward (as autograd's own "
            "backward would refuse for most operations); write that change out of place "
            "(e.g. h = h + x, not h += x)"
        )
    if rule.output_in_backward and call.output._version != output:
        assert call.function is not None
        with torch.no_grad():
            call.output = call.function(*call.inputs).detach()


class _OpRuleFunction(torch.autograd.Function):
    """One traced operation as written, whose backward is the composite's rule for it."""

    @staticmethod
    def forward(ctx: Any, rule: Rule, call: RuleCall, apply: Any, *inputs: torch.Tensor) -> Any:
        versions = tuple(t._version for t in call.inputs)
        y = apply(*inputs)  # the call as written: in place where the model asked for that
        if any(t._version != v for t, v in zip(call.inputs, versions, strict=True)):
            raise UnsupportedModelError(
                f"operation {call.name!r} changed its input in place in a way the engine did "
                "not foresee; pass inplace=True by keyword, or write it out of place"
            )
        if not isinstance(y, torch.Tensor):
            raise InvalidInputError(
                f"operation {call.name!r} returns {type(y).__name__}; a rule needs an "
                "operation that returns one tensor"
            )
        call.output = y.detach()
        if any(y is t for t in inputs):  # in place: autograd moves y's version on; a copy
            ctx.mark_dirty(y)
            call.output = call.output.clone()
        with torch.no_grad():
            call.state = rule.forward(call)
        # Saved by reference, as autograd saves tensors: versions tell in-place changes.
        ctx.versions = _versions(call)
        if not rule.output_in_backward:  # not kept: the model may free it (attention scores)
            call.output = _NOT_KEPT
        ctx.rule, ctx.call = rule, call
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        call = _begin_backward(ctx)
        _check_versions(ctx.rule, call, ctx.versions, f"operation {call.name!r}")
        call.grad_output = grad_output
        grads = tuple(ctx.rule.backward(call, grad_output))
        if len(grads) != len(call.inputs):
            raise InvalidInputError(
                f"{type(ctx.rule).__name__}.backward returned {len(grads)} tensors for the "
                f"{len(call.inputs)} input-dependent tensors of operation {call.name!r}"
            )
        _release(ctx)
        return (None, None, None, *grads)


def _apply_op_rule(
    rule: Rule,
    kind: str,
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    attached: RulePass,
) -> Any:
    """``func(*args, **kwargs)`` with ``rule`` as the backward of its input-dependent tensors.

    Those are the tensor arguments that carry gradient and are not parameters (the pass's input
    requires grad, so everything computed from it does; weights are left out).
    """
    flat, spec = tree_flatten((args, kwargs))
    positions = [
        i
        for i, value in enumerate(flat)
        if isinstance(value, torch.Tensor) and attached.depends_on_input(value)
    ]
    if len(positions) < max(rule.min_inputs, 1):  # e.g. no input-dependent tensor at all
        return func(*args, **kwargs)

    def apply(*values: torch.Tensor) -> Any:
        filled = list(flat)
        for position, value in zip(positions, values, strict=True):
            filled[position] = value
        call_args, call_kwargs = tree_unflatten(filled, spec)
        return func(*call_args, **call_kwargs)

    def out_of_place(*values: torch.Tensor) -> Any:
        return apply(*(value.clone() for value in values))

    inputs = tuple(flat[i] for i in positions)
    # An in-place call (relu_, F.elu(x, inplace=True), F.elu(x, 1.0, True)) overwrites its
    # inputs: rules see copies of them
    in_place = kind.endswith("_") or kwargs.get("inplace") is True or any(a is True for a in args)
    layer = functional_linear(kind, args, kwargs, inputs[0]) if len(inputs) == 1 else None
    if layer is not None and attached.plan.branch_free:  # a graph cannot look at the input's sign
        layer = replace(layer, input_sign="signed")
    call = RuleCall(
        None,
        kind,
        tuple(t.detach().clone() if in_place else t.detach() for t in inputs),
        torch.empty(0),
        function=out_of_place if in_place else apply,
        layer=layer,
        args=args,
        kwargs=kwargs,
        sources=tuple(attached.source_of(t) for t in inputs),
        branch_free=attached.plan.branch_free,
    )
    try:
        output = attached.produced(_OpRuleFunction.apply(rule, call, apply, *inputs), call)
    except UnsupportedModelError as error:  # a rule refused the call: say where it was made
        raise UnsupportedModelError(f"{error} (in {attached.place()})") from error
    if layer is not None:
        attached.note_output(rule, output)
    return output


def _wraps(alias: torch.Tensor, tensor: torch.Tensor) -> bool:
    """Whether ``alias`` is ``tensor`` wrapped by a user's full backward hooks.

    Their ``BackwardHookFunction`` returns an alias of each tensor it wraps; its node's inputs
    are the nodes of those tensors.
    """
    node, index = alias.grad_fn, alias.output_nr
    if node is None or type(node).__name__ != "BackwardHookFunctionBackward":
        return False
    while node is not None and type(node).__name__ == "BackwardHookFunctionBackward":
        node, index = node.next_functions[index]
    return node is tensor.grad_fn and index == tensor.output_nr


def _from_weights(tensor: torch.Tensor, inputs: torch.Tensor | None, budget: int = 16) -> bool:
    """Whether ``tensor`` is a weight or computed from weights only (``w.view(1, -1, 1)``).

    Weights are parameters, and leaves other than the pass's input ``inputs`` where it is known.
    The autograd graph is walked back for at most ``budget`` nodes: one that ends in weights
    only within them is the model's weights, reshaped or scaled; anything longer counts as
    input-dependent (a product rule then refuses it rather than treat it as a weight).
    """

    def is_weight(leaf: torch.Tensor) -> bool:
        return isinstance(leaf, nn.Parameter) or (inputs is not None and leaf is not inputs)

    if tensor.grad_fn is None:
        return is_weight(tensor)
    pending = [tensor.grad_fn]
    while pending:
        node = pending.pop()
        budget -= 1
        if node is None:
            continue
        if budget < 0:
            return False
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf
        if variable is not None:
            if not is_weight(variable):
                return False  # the pass's input
            continue
        pending.extend(next_node for next_node, _ in node.next_functions)
    return True


class OperationMode(TorchFunctionMode):
    """Applies the composite's operation rules and the handler's to this pass's operations."""

    def __init__(self, composite: Composite, handler: OpHandler | None, attached: RulePass) -> None:
        super().__init__()
        self.composite = composite
        self.kinds = composite.op_kinds
        self.handler = handler
        self.attached = attached

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.attached.internal or self.attached.affine_depth:
            return func(*args, **kwargs)
        name = op_name(func)
        if name in DECOMPOSED:  # fused attention: its operations, for the rules to apply to
            if name == "scaled_dot_product_attention":
                fused = self._fused_attention(func, args, kwargs)
                if fused is not None:
                    return fused
            with self, input_dependence(self.attached.depends_on_input):
                return DECOMPOSED[name](*args, **kwargs)
        if name in RELU_OPS and args and self.attached.is_masked_output(args[0]):
            with torch.no_grad():  # the layer's rule applies this ReLU's gradient
                y = func(*args, **kwargs)
            self.attached.note_relu_output(args[0], y)
            return y if y is args[0] else _PassedThrough.apply(args[0], y)
        if name in self.kinds:
            rule = self.composite.rule_for_op(name)
            if isinstance(rule, Gradient):  # nothing to change: let it through as written
                if self.handler is not None and name in self.handler.ops:  # it takes note
                    return self._noted(
                        name, func, args, kwargs, self._handled(name, func, args, kwargs)
                    )
                return self._noted(name, func, args, kwargs, func(*args, **kwargs))
            with self.attached.internal_ops():
                result = _apply_op_rule(rule, name, func, args, kwargs, self.attached)
            return self._keeping_source(name, args, result)
        if self.handler is not None and name in self.handler.ops:
            return self._handled(name, func, args, kwargs)
        if name in ("add", "sub") and self.attached.without_bias:
            biased = self._bias_added(func, args, kwargs)
            if biased is not None:
                return self._noted(name, func, args, kwargs, biased)
        return self._noted(name, func, args, kwargs, func(*args, **kwargs))

    def _handled(self, name: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The handler's result for the operation; where it refuses it, the error says where."""
        assert self.handler is not None
        try:
            return self.handler.handle(name, func, args, kwargs)
        except UnsupportedModelError as error:
            raise UnsupportedModelError(f"{error} (in {self.attached.place()})") from error

    def _bias_added(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``d ± c`` or ``c ± d`` as :class:`_BiasAdded`, else ``None``.

        ``d`` is the output of a layer whose rule ignores biases, ``c`` a constant of no larger
        shape.
        """
        if len(args) != 2 or kwargs:
            return None
        attached = self.attached
        if getattr(func, "__name__", "") == "__rsub__":  # c − d: d enters with the other sign
            return None
        orders = [args] if op_name(func) == "sub" else [args, args[::-1]]  # d − c, not c − d
        for d, c in orders:
            if not (isinstance(d, torch.Tensor) and attached.ignores_bias(d)):
                continue
            constant = not isinstance(c, torch.Tensor) or not attached.depends_on_input(c)
            if constant and torch.broadcast_shapes(d.shape, getattr(c, "shape", ())) == d.shape:
                output = _BiasAdded.apply(d, lambda: func(*args))
                attached.note_without_bias(output)  # a second constant added: a bias too
                return output
        return None

    def _noted(
        self, name: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any
    ) -> Any:
        """``result`` of an operation as written, noted for the sources and the input's path."""
        attached = self.attached
        if (
            name in RESHAPE_COPIES  # a layer's output, arranged, is one still
            and attached.without_bias
            and args
            and isinstance(args[0], torch.Tensor)
            and attached.ignores_bias(args[0])
        ):
            attached.note_without_bias(result)  # conv(x).flatten(2) + a position embedding
        if name in _INPUT_ARRANGING and self.attached.plan.input_arranged:
            self.attached.note_arrangement(func, args, kwargs, result)
        return self._keeping_source(name, args, result)

    def _keeping_source(self, name: str, args: tuple[Any, ...], result: Any) -> Any:
        """``result``, noted as made by the source of the one tensor it is computed from.

        A gate stays a gate through the shape a model gives it and arithmetic with numbers
        (``σ(s).view(b, c, 1, 1).expand_as(x)``, ``1 - σ(s)``, ``relu6(s + 3) / 6``) and
        through splits (``σ(s).chunk(3, 1)``): see ``RuleCall.sources``.
        """
        tensor = _computed_from_alone(name, args)
        if tensor is not None:
            parts = result if isinstance(result, (tuple, list)) else (result,)
            for part in parts:
                self.attached.pass_source(tensor, part)
        return result

    def _fused_attention(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> torch.Tensor | None:
        """The fused kernel with its gradients scaled, where the rules allow it; else ``None``.

        With rules that scale the gradient by constants (:meth:`Rule.gradient_scale`) on the
        products and on softmax — AttnLRP: ``1/2`` per factor and 1; CP-LRP: 1 and 0 — the
        relevance through ``softmax(Q·Kᵀ·s + M)·V`` is the kernel's own gradient, scaled per
        input: ``V`` by the ``A·V`` share, ``Q`` and ``K`` by the ``Q·Kᵀ`` share × softmax's ×
        the ``A·V`` share. The attention weights then never exist as a tensor, as in the plain
        gradient. Not with a handler, nor in traced passes (the fused kernels' backward has no
        ONNX translation), nor where another rule applies to the other operations.
        """
        if self.handler is not None or self.attached.plan.branch_free:
            return None
        bound = _ATTENTION_SIGNATURE.bind(*args, **kwargs)
        if bound.arguments.get("dropout_p", 0.0):
            return None  # the math form refuses it, with the way out
        for kind in _ATTENTION_STEPS:  # scaling, masking, grouped heads: one input-dependent
            rule = self.composite.rule_for_op(kind)
            if rule is not None and rule.min_inputs < 2 and rule.gradient_scale(1) != 1.0:
                return None
        names = ("query", "key", "value")
        q, k, v = (
            isinstance(t, torch.Tensor)
            and t.requires_grad
            and not _from_weights(t, self.attached.input)
            for t in (bound.arguments[name] for name in names)
        )
        product = self.composite.rule_for_op("matmul")
        qk = _share(product, q + k)
        av = _share(product, (q or k) + v)
        weights = _share(self.composite.rule_for_op("softmax"), 1)
        if qk is None or av is None or weights is None:
            return None
        scales = (qk * weights * av, qk * weights * av, av)
        for name, dependent, scale in zip(names, (q, k, v), scales, strict=True):
            if dependent and scale != 1.0:
                tensor = bound.arguments[name]
                bound.arguments[name] = (
                    tensor.detach() if scale == 0 else _ScaledGradient.apply(tensor, scale)
                )
        given = dict(bound.arguments)  # as keywords: the kernel takes some only by keyword
        tensors = [given.pop(name) for name in names]
        return func(*tensors, **given)


# What may make the tensor the input layer reads from the model input (the trace refuses
# paddings other than with zeros or copies).
_INPUT_ARRANGING = RESHAPE_OPS | DROPOUT_OPS | {"pad"}


def _unchanged(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _computed_from_alone(name: str, args: tuple[Any, ...]) -> torch.Tensor | None:
    """The one tensor an operation computes its result from, with numbers, if it does.

    Rearrangements, selections and splits of it, and arithmetic of it with a number.
    """
    if name in ARRANGING_OPS or name in SPLITTING_OPS:
        return args[0] if args and isinstance(args[0], torch.Tensor) else None
    if name not in _NUMBER_ARITHMETIC or len(args) != 2:
        return None
    tensor, number = args if isinstance(args[0], torch.Tensor) else args[::-1]
    is_number = isinstance(number, (int, float)) and not isinstance(number, bool)
    return tensor if isinstance(tensor, torch.Tensor) and is_number else None


_NUMBER_ARITHMETIC = frozenset({"add", "sub", "mul", "div", "rdiv"})
"""Operations that, with a number as the other operand, compute from one tensor alone."""


def _share(rule: Rule | None, factors: int) -> float | None:
    """The constant a rule scales the gradient by for a call with ``factors`` dependent inputs."""
    if rule is None or factors < max(rule.min_inputs, 1):
        return 1.0  # not ruled, or a call the rule leaves to the gradient
    return rule.gradient_scale(factors)


class _ScaledGradient(torch.autograd.Function):
    """The identity, whose backward scales the gradient by a constant."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


_ATTENTION_SIGNATURE = inspect.signature(scaled_dot_product_attention)
_ATTENTION_STEPS = ("mul", "add", "masked_fill", "repeat_interleave", "transpose")
"""The operations of attention's math form besides the two products and softmax."""


_Pending = tuple[RuleCall, tuple[torch.Tensor, ...], tuple[int, ...], bool]


class RulePass(ModuleListener):
    """The rules of one attribution pass, applied to the module calls of its context only.

    Other threads running the same model (plain forwards, other attributions) are not seen: the
    pass listens through :func:`explain_core.scoped.listening` and registers nothing on the
    model. Everything it records lives on this object.
    """

    def __init__(self, model: nn.Module, plan: Plan, record: bool) -> None:
        self.model = model
        self.plan = plan
        self.record = record
        self.records: dict[str, LayerRecord] = {}
        # id of a merged Linear/Conv's output → (a weak reference to it, the layer's input),
        # until the BatchNorm that reads it runs (calls of a shared pair may interleave)
        self.stash: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}
        self.internal = False
        self.stashed: dict[int, str] = {}  # module id → layer name (a Linear/Conv before its BN)
        # module id → (layer name, BN name, the Linear/Conv whose weights the rule reads)
        self.ruled: dict[int, tuple[str, str | None, nn.Module]] = {}
        self.counted: dict[int, str] = {}
        self.calls: dict[str, int] = {}
        modules = dict(model.named_modules(remove_duplicate=False))  # one walk, not one lookup each
        self.custom = {id(modules[name]): name for name in plan.custom}
        # module name → (its call, its inputs as given, their versions, the grad mode to
        # restore after it)
        self.pending: dict[str, _Pending] = {}
        # tensor id → (a weak reference to it, the ruled call that returned it); a strong one
        # would make a cycle through the autograd graph (tensor → its node → call) that
        # Python's collector cannot see
        self.producers: dict[int, tuple[weakref.ref[torch.Tensor], RuleCall]] = {}
        # the pass's input, once it is set: any other leaf that requires grad is a weight (an
        # exported graph's weights are plain tensors, not parameters)
        self.input: torch.Tensor | None = None
        # inside an affine module with a rule: its own operations (F.linear, F.conv2d) are left
        # alone, the module's rule replaces their backward as a whole
        self.affine_depth = 0
        self.stack: list[nn.Module] = []  # the modules running now, for messages
        # tensor id → a weak reference to a ruled layer's output whose rule masks what a ReLU
        # reading it stops (such ReLUs run without autograd: see _PassedThrough), and the
        # layer's call where its rule reads that ReLU's output
        self.masked_outputs: dict[int, tuple[weakref.ref[torch.Tensor], RuleCall | None]] = {}
        # outputs of layers whose rule ignores biases (and those outputs arranged or plus
        # constants), with their version: an in-place operation (a ReLU) makes another tensor
        self.without_bias: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        # tensor id → (a weak reference to it, the model's operations that made it from the
        # input, as a function of another tensor shaped like the input): see InputPath
        self.arranged: dict[int, tuple[weakref.ref[torch.Tensor], Any]] = {}
        self._plan_modules(modules)

    @contextlib.contextmanager
    def internal_ops(self) -> Iterator[None]:
        """Operations inside the block are the engine's own (a handler leaves them alone)."""
        previous, self.internal = self.internal, True
        try:
            yield
        finally:
            self.internal = previous

    def apply_rule(
        self, rule: Rule, call: RuleCall, x: torch.Tensor, output: torch.Tensor
    ) -> torch.Tensor:
        """Replace ``output`` by the same values with ``rule`` as backward."""
        with torch.no_grad():
            call.state = rule.forward(call)
        keep_input = (
            self.record or not isinstance(rule, AffineRule) or rule.reads_input_in_backward(call)
        )
        if not keep_input:
            call.inputs = tuple(_stand_in(t) for t in call.inputs)
        masks = masks_rectified_outputs(rule, call)
        reads_relu = masks and isinstance(rule, AffineRule) and rule.reads_rectified_output(call)
        out = _RuleFunction.apply(x, rule, call, keep_input, reads_relu)
        if self.record:  # a record holds the layer's output, which the model may free (ReLU)
            self._check_recorded_once(call.name)
            self.records[call.name] = LayerRecord(call.name, x, out, rule, call)
        if masks:
            self.masked_outputs[id(out)] = (weakref.ref(out), call if reads_relu else None)
        self.note_output(rule, out)
        return out

    def note_output(self, rule: Rule, output: Any) -> None:
        """Note ``output`` of a layer whose ``rule`` ignores biases (see :class:`_BiasAdded`)."""
        if isinstance(rule, AffineRule) and not rule.counts_bias:
            self.note_without_bias(output)

    def note_without_bias(self, output: Any) -> None:
        """Note ``output`` as a layer's output whose rule ignores biases."""
        if isinstance(output, torch.Tensor):
            self.without_bias[id(output)] = (weakref.ref(output), output._version)

    def ignores_bias(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is, as it is now, the output of a layer whose rule ignores biases."""
        entry = self.without_bias.get(id(tensor))
        return entry is not None and entry[0]() is tensor and entry[1] == tensor._version

    def _check_recorded_once(self, name: str) -> None:
        """Records are per layer: a layer called twice cannot be recorded (nor checked by them).

        Raises:
            UnsupportedModelError: If ``name`` was recorded in this pass already.
        """
        if name in self.records:
            raise UnsupportedModelError(
                f"module {name!r} is called more than once in one forward pass, and this pass "
                "keeps one record per layer (what DeepLIFT's RevealCancel and ablation, "
                "PatternNet's and PatternAttribution's patterns, per-layer relevance and the "
                "layer checks read): give each use its own module (copy.deepcopy), or explain "
                "with a method that keeps no records (deeplift.rescale, the lrp presets)"
            )

    def count_calls(self) -> dict[str, int]:
        """Count the calls of every affine module from now on (to validate a cached plan)."""
        skip = tuple(f"{name}." for name in self.plan.custom)
        self.counted = {
            id(module): name
            for name, module in self.model.named_modules()
            if (isinstance(module, AFFINE_TYPES) or name in self.plan.custom)
            and not (name and name.startswith(skip))
        }
        return self.calls

    def before(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """Count the call (validating a cached plan); wrap a custom-ruled module's inputs."""
        key = id(module)
        self.stack.append(module)
        name = self.counted.get(key)
        if name is not None:
            self.calls[name] = self.calls.get(name, 0) + 1
        if key in self.ruled:
            self.affine_depth += 1
        name = self.custom.get(key)
        if name is None:
            return None
        tensors = tuple(a for a in args if isinstance(a, torch.Tensor))
        detached = tuple(t.detach() for t in tensors)
        call = RuleCall(
            module,
            name,
            detached,
            torch.empty(0),
            function=self._plain_call(module),
            sources=tuple(self.source_of(t) for t in tensors),
            branch_free=self.plan.branch_free,
        )
        versions = tuple(t._version for t in tensors)
        self.pending[name] = (call, tensors, versions, torch.is_grad_enabled())
        # The module runs without autograd (_ModuleRule is its backward); the grad mode comes
        # back in after(), or with the pass's own context if the module raises. A module that
        # says it works in place (ReLU(inplace=True)) gets copies, so that the call keeps its
        # inputs; other changes in place are found by version in after().
        torch.set_grad_enabled(False)
        in_place = getattr(module, "inplace", False) is True
        given = iter(t.clone() if in_place else t for t in detached)
        return tuple(next(given) if isinstance(a, torch.Tensor) else a for a in args)

    def is_masked_output(self, value: Any) -> bool:
        """Whether ``value`` is a layer's output whose rule applies the ReLU reading it."""
        entry = self.masked_outputs.get(id(value))
        return entry is not None and entry[0]() is value

    def note_relu_output(self, layer_output: torch.Tensor, relu_output: torch.Tensor) -> None:
        """Hand the ReLU's output to the rule of the layer it read, where the rule reads it."""
        _, call = self.masked_outputs[id(layer_output)]
        if call is not None:
            call.rectified_output = relu_output.detach()
            call.rectified_version = relu_output._version

    def place(self) -> str:
        """Where the running operation is: a user's hook on a module, or the module."""
        codes = user_hook_codes(self.model)
        frame = sys._getframe(1)
        while frame is not None and codes:
            hook = codes.get(frame.f_code)
            if hook is not None:
                return hook
            frame = frame.f_back
        names = {id(module): name for name, module in self.model.named_modules()}
        for module in reversed(self.stack):
            if id(module) in names:
                return f"module {names[id(module)] or '<root>'!r} ({type(module).__name__})"
        return "the model's forward"

    def produced(self, output: Any, call: RuleCall) -> Any:
        """Note that ruled ``call`` returned ``output`` (for the sources of later calls)."""
        if isinstance(output, torch.Tensor):
            self.producers[id(output)] = (weakref.ref(output), call)
        return output

    def pass_source(self, tensor: torch.Tensor, result: Any) -> None:
        """Note ``result``, computed from ``tensor`` alone, as made by ``tensor``'s source."""
        source = self.source_of(tensor)
        if source is not None and isinstance(result, torch.Tensor) and result is not tensor:
            self.produced(result, source)

    def note_arrangement(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any
    ) -> None:
        """Note ``result`` of a reshape or padding of the input (or of such a tensor)."""
        source = args[0] if args else kwargs.get("input")
        path = self.path_from_input(source) if isinstance(source, torch.Tensor) else None
        if path is None or not isinstance(result, torch.Tensor):
            return
        # Not the source itself is kept, only what it becomes: the other arguments.
        positional, rest = bool(args), args[1:]
        options = {k: v for k, v in kwargs.items() if positional or k != "input"}

        def arranged(tensor: torch.Tensor) -> torch.Tensor:
            moved = path(tensor)
            if positional:
                return func(moved, *rest, **options)
            return func(*rest, input=moved, **options)

        self.arranged[id(result)] = (weakref.ref(result), arranged)

    def path_from_input(self, tensor: torch.Tensor) -> Any:
        """The model's operations from the pass's input to ``tensor``, or ``None``."""
        if tensor is self.input:
            return _unchanged
        entry = self.arranged.get(id(tensor))
        return entry[1] if entry is not None and entry[0]() is tensor else None

    def depends_on_input(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is computed from the pass's input (weights and constants are not)."""
        return tensor.requires_grad and not _from_weights(tensor, self.input)

    def source_of(self, tensor: torch.Tensor) -> RuleCall | None:
        """The ruled call of this pass that returned ``tensor``, if any."""
        entry = self.producers.get(id(tensor))
        return entry[1] if entry is not None and entry[0]() is tensor else None

    def _plain_call(self, module: nn.Module) -> Any:
        """``module`` as written, without this pass's rules (for a rule that re-runs it)."""
        # A weak reference: the call holding this function is reachable from the autograd
        # graph, and a cycle back to the pass through it would outlive the attribution.
        attached = weakref.ref(self)

        def run(*inputs: torch.Tensor) -> Any:
            rules = attached()
            internal = rules.internal_ops() if rules is not None else contextlib.nullcontext()
            with internal, unheard():
                return module(*inputs)

        return run

    def after(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        """Stash a merged layer's input, or return a ruled module's output with its rule."""
        if self.stack and self.stack[-1] is module:
            self.stack.pop()
        key = id(module)
        name = self.custom.get(key)
        if name is not None:
            return self._apply_custom(name, module, output)
        stashed = self.stashed.get(key)
        if stashed is not None:
            self.stash[id(output)] = (weakref.ref(output), args[0])
            return None
        ruled = self.ruled.get(key)
        if ruled is None:
            return None
        self.affine_depth -= 1
        return self._apply_rule(*ruled, module, args, output)

    def _apply_custom(self, name: str, module: nn.Module, output: Any) -> torch.Tensor:
        call, inputs, versions, grad_mode = self.pending.pop(name)
        torch.set_grad_enabled(grad_mode)
        if not isinstance(output, torch.Tensor):
            raise InvalidInputError(
                f"module {name or '<root>'!r} ({type(module).__name__}) returns "
                f"{type(output).__name__}; a rule needs a module that returns one tensor"
            )
        if any(t._version != v for t, v in zip(inputs, versions, strict=True)):
            raise UnsupportedModelError(
                f"module {name or '<root>'!r} ({type(module).__name__}) changed its input in "
                "place, which its rule needs; give it inplace=False (or an attribute "
                "inplace = True, for which the engine keeps a copy)"
            )
        call.output = output.detach()
        rule = self.plan.custom[name]
        with torch.no_grad():
            call.state = rule.forward(call)
        return self.produced(_ModuleRule.apply(rule, call, *inputs), call)

    def _stashed_input(self, name: str, bn_name: str, bn_input: torch.Tensor) -> torch.Tensor:
        """The input of the call of ``name`` whose output the BatchNorm ``bn_name`` reads."""
        entry = self.stash.pop(id(bn_input), None)
        if entry is None:  # a user's full backward hook wrapped the output, or the BN's input
            for key, (ref, _) in self.stash.items():
                stashed = ref()
                if stashed is not None and _wraps(bn_input, stashed):
                    entry, bn_input = self.stash.pop(key), stashed
                    break
        if entry is None or entry[0]() is not bn_input:
            raise UnsupportedModelError(
                f"BatchNorm {bn_name!r} read something other than the output of {name!r} in "
                "this pass, which the traced pass merged it with: build the composite with "
                "canonizers=() to give each its own rule"
            )
        return entry[1]

    def _input_path(self, name: str, x: torch.Tensor) -> InputPath | None:
        """How the pass's input reaches ``x``, where layer ``name`` reads the model input."""
        if name not in self.plan.input_layers or self.input is None:
            return None
        path = self.path_from_input(x)
        return None if path is None else InputPath(self.input.shape, path)

    def _plan_modules(self, modules: dict[str, nn.Module]) -> None:
        """Which modules get a rule (by identity) and which only stash their input (merged)."""
        for name in self.plan.order:
            rule = self.plan.rules[name]
            if isinstance(rule, Gradient) and not self.record:
                continue
            module = modules[name]
            if name in self.plan.merged:
                self.stashed[id(module)] = name
                bn_name = self.plan.merged[name]
                self.ruled[id(modules[bn_name])] = (name, bn_name, module)
            else:
                self.ruled[id(module)] = (name, None, module)

    def _apply_rule(
        self,
        name: str,
        bn_name: str | None,
        source: nn.Module,
        module: nn.Module,
        args: tuple[Any, ...],
        output: Any,
    ) -> Any:
        rule = self.plan.rules[name]
        # The rule's own operations on the layer (merging a batch norm, W⁺, the rule's forward)
        # bypass every TorchFunctionMode: each mode on the stack (this pass's, the training-call
        # check, a user's) would dispatch each of them through Python: ≈ 1650 calls per
        # ResNet-50 forward. The model's operations still pass through every mode. (On a torch
        # without the switch, internal_ops is what lets this pass's own mode wave them through.)
        with self.internal_ops(), without_function_modes():
            if bn_name is None:
                x = args[0]
                layer = AffineLayer.from_module(name, module)
            else:
                x = self._stashed_input(name, bn_name, args[0])
                layer = AffineLayer.from_module(name, source).merge_batchnorm(bn_name, module)
            layer = replace(
                layer,
                input_sign=self.plan.input_sign(name),
                output_rectified=name in self.plan.rectified,
            )
            call = RuleCall(
                source,
                name,
                (x.detach(),),
                output.detach(),
                layer=layer,
                branch_free=self.plan.branch_free,
                input_path=self._input_path(name, x),
            )
            if isinstance(rule, Gradient):  # planned only when recording
                self._check_recorded_once(name)
                self.records[name] = LayerRecord(name, x, output, rule, call)
                return None
            return self.apply_rule(rule, call, x, output)
