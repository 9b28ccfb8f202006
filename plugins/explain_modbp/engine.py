"""The engine that runs modified backpropagation on ordinary PyTorch models.

**Signal convention.** Everything flows backwards as a *signal* ``s`` shaped like the tensor it
belongs to, with relevance ``R = h ⊙ s`` for an activation ``h`` (for DeepLIFT ``Δh ⊙ s``: the
signal is DeepLIFT's multiplier). In this convention the ordinary gradient already is LRP-0 for
every linear operation without parameters: ReLU, max pooling (winner takes all), average pooling,
sums of branches (residual additions), concatenation, flatten/view and dropout in eval mode all
redistribute relevance exactly and conserve it. Only layers with weights need rules: each ruled
Linear/Conv (merged with the BatchNorm that follows it, without touching the model) gets a forward
hook that returns the same output values through a small autograd function whose backward is the
rule, computed from the tensors saved in the forward pass (one transposed convolution per weight
variant; no module is run again).

**Checks.** Before attaching anything the engine traces the model once on the first sample with a
:class:`~torch.overrides.TorchFunctionMode`: every operation on input-dependent tensors outside a
ruled module must be one of the operations above; a ruled module called twice, a Linear/Conv
without a rule, a BatchNorm that cannot be merged and any other operation (a sigmoid, a
``F.linear`` in ``forward``, a product of two activations) raise :class:`UnsupportedModelError`
naming the module path and type and how to register a rule. Nothing falls back to the gradient
silently.

**Layers.** :meth:`ModifiedBackprop.forward` returns a :class:`ForwardPass` whose
:meth:`~ForwardPass.backward` starts from the output or injects a signal or a relevance at any
ruled layer ``k`` and reads the signal at the input of every layer below it (what the CSC metric
needs).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from explain_core.interfaces.relevance import Composite, Matcher, Rule, RuleCall
from explain_core.model_guard import ModelGuard
from explain_modbp.errors import RULE_HINT, UnsupportedModelError
from explain_modbp.layers import BATCHNORM_TYPES, LINEAR_TYPES, AffineLayer

AFFINE_TYPES = LINEAR_TYPES + BATCHNORM_TYPES


# --------------------------------------------------------------------------------------------
# Rules for affine layers
# --------------------------------------------------------------------------------------------


class LayerRule(Rule):
    """A rule for an affine layer (Linear, ConvNd, Linear/Conv + BatchNorm, lone BatchNorm).

    Subclasses implement :meth:`relevance_backward` (LRP-style rules: relevance at the output →
    signal at the input) or override :meth:`signal_backward` (gradient-style rules). The same
    object also works with the core's :meth:`explain_core.Composite.context` (through
    :meth:`Rule.backward`), in the signal convention.

    Attributes:
        relevance_output: The rule returns relevance (not a signal) at its input; such rules
            (w², flat, z^B) only apply to the layer that reads the model input.
        passes_gradient: The rule is the ordinary gradient; the engine attaches no hook.
    """

    relevance_output: ClassVar[bool] = False
    passes_gradient: ClassVar[bool] = False

    def prepare(self, layer: AffineLayer, x: torch.Tensor, z: torch.Tensor) -> Any:
        """Forward-time state (no autograd): e.g. the stabilised denominators."""
        return None

    def relevance_backward(
        self, layer: AffineLayer, state: Any, x: torch.Tensor, relevance: torch.Tensor
    ) -> torch.Tensor:
        """Signal (or relevance, if :attr:`relevance_output`) at the input from output relevance."""
        raise NotImplementedError(f"{type(self).__name__} defines no relevance_backward")

    def signal_backward(
        self,
        layer: AffineLayer,
        state: Any,
        x: torch.Tensor,
        z: torch.Tensor,
        signal: torch.Tensor,
    ) -> torch.Tensor:
        """Signal at the input from the signal at the output ``z`` (relevance ``z ⊙ signal``)."""
        return self.relevance_backward(layer, state, x, signal * z)

    def attach(
        self, engine_pass: _Attached, layer: AffineLayer, x: torch.Tensor, output: torch.Tensor
    ) -> torch.Tensor | None:
        """Return the module's replacement output during the forward pass (``None``: keep it)."""
        return engine_pass.apply_rule(self, layer, x, output)

    # The core interface (Composite.context): same rule, same convention.
    def forward(self, call: RuleCall) -> Any:  # noqa: D102
        layer = AffineLayer.from_module(call.name, call.module)
        return layer, self.prepare(layer, call.inputs[0], call.output)

    def backward(self, call: RuleCall, grad_output: torch.Tensor) -> tuple[torch.Tensor, ...]:  # noqa: D102
        layer, state = call.state
        return (self.signal_backward(layer, state, call.inputs[0], call.output, grad_output),)

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({options})"


class Gradient(LayerRule):
    """The ordinary gradient ``Wᵀ s`` (no hook is attached for it)."""

    passes_gradient = True

    def signal_backward(self, layer, state, x, z, signal):  # noqa: D102
        return layer.transpose(signal, x)

    def relevance_backward(self, layer, state, x, relevance):  # noqa: D102
        return layer.transpose(safe_divide(relevance, layer.forward(x, bias=layer.bias)), x)


def safe_divide(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """``numerator / denominator`` with 0 where the denominator is 0."""
    zero = denominator == 0
    return numerator / denominator.masked_fill(zero, 1.0) * ~zero


# --------------------------------------------------------------------------------------------
# Composites with input/output layer slots
# --------------------------------------------------------------------------------------------


class LayerComposite(Composite):
    """A core :class:`~explain_core.Composite` plus rules for the first and the last layer.

    Args:
        mapping: ``(matcher, rule)`` pairs as for the core composite; the first match wins.
        first: Rule for the affine layer that reads the model input (e.g. z^B, flat, w²).
        last: Rule for the affine layer that produces the output (e.g. contrastive excitation).
        name: Short description for error messages and listings.
    """

    def __init__(
        self,
        mapping: Sequence[tuple[Matcher, Rule]],
        *,
        first: LayerRule | None = None,
        last: LayerRule | None = None,
        name: str = "composite",
        canonizers: Sequence[Any] = (),
    ) -> None:
        super().__init__(mapping, canonizers=canonizers)
        self.first = first
        self.last = last
        self.name = name

    def with_rules(self, *entries: tuple[Matcher, Rule]) -> LayerComposite:
        """A copy with ``entries`` taking precedence over the existing mapping."""
        mapping = [*entries, *((m.matcher, m.rule) for m in self.mapping)]
        return LayerComposite(
            mapping, first=self.first, last=self.last, name=self.name, canonizers=self.canonizers
        )


# --------------------------------------------------------------------------------------------
# Operation handlers (ReLU, max pooling, additions) for methods that change them
# --------------------------------------------------------------------------------------------


class OpHandler:
    """Changes the backward pass of parameter-free operations seen in the forward pass.

    Attributes:
        ops: Normalised operation names the handler intercepts (e.g. ``"relu"``).
    """

    ops: ClassVar[frozenset[str]] = frozenset()

    def prepare_inputs(self, inputs: torch.Tensor) -> torch.Tensor:
        """The tensor actually fed to the model (DeepLIFT appends the reference)."""
        return inputs

    def handle(
        self, name: str, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Compute ``func(*args, **kwargs)`` with a modified backward."""
        return func(*args, **kwargs)


# --------------------------------------------------------------------------------------------
# Operations the engine understands
# --------------------------------------------------------------------------------------------

RESHAPE_OPS = frozenset(
    [
        "view",
        "view_as",
        "reshape",
        "reshape_as",
        "flatten",
        "unflatten",
        "squeeze",
        "squeeze_",
        "unsqueeze",
        "unsqueeze_",
        "permute",
        "transpose",
        "t",
        "contiguous",
        "clone",
        "movedim",
        "to",
        "float",
        "double",
        "type_as",
    ]
)
# Selection, combination and averaging: linear, and non-negative on non-negative inputs.
_GATHER_OPS = frozenset(
    [
        "cat",
        "concat",
        "concatenate",
        "stack",
        "getitem",
        "narrow",
        "select",
        "chunk",
        "split",
        "unbind",
        "expand",
        "expand_as",
        "sum",
        "mean",
    ]
)
AVGPOOL_OPS = frozenset(
    [
        "avg_pool1d",
        "avg_pool2d",
        "avg_pool3d",
        "adaptive_avg_pool1d",
        "adaptive_avg_pool2d",
        "adaptive_avg_pool3d",
    ]
)
LINEAR_OPS = (
    RESHAPE_OPS
    | _GATHER_OPS
    | AVGPOOL_OPS
    | frozenset(["add", "add_", "sub", "sub_", "neg", "mul", "mul_", "div", "div_", "pad"])
)
RELU_OPS = frozenset({"relu", "relu_"})
MAXPOOL_OPS = frozenset(
    [
        "max_pool1d",
        "max_pool2d",
        "max_pool3d",
        "max_pool1d_with_indices",
        "max_pool2d_with_indices",
        "max_pool3d_with_indices",
        "adaptive_max_pool1d",
        "adaptive_max_pool2d",
        "adaptive_max_pool3d",
        "adaptive_max_pool1d_with_indices",
        "adaptive_max_pool2d_with_indices",
        "adaptive_max_pool3d_with_indices",
    ]
)
DROPOUT_OPS = frozenset(
    [
        "dropout",
        "dropout1d",
        "dropout2d",
        "dropout3d",
        "alpha_dropout",
        "feature_alpha_dropout",
    ]
)
ADD_OPS = frozenset({"add", "add_", "sub", "sub_"})
_PRODUCT_OPS = frozenset({"mul", "mul_", "div", "div_"})
# Operations whose output is non-negative when all their input-dependent inputs are.
_SIGN_PRESERVING = (
    RESHAPE_OPS | MAXPOOL_OPS | DROPOUT_OPS | _GATHER_OPS | AVGPOOL_OPS | frozenset(["add", "add_"])
)


def op_name(func: Callable[..., Any]) -> str:
    """``Tensor.__iadd__`` → ``add_``, ``Tensor.__radd__`` → ``add``, ``F.relu`` → ``relu``."""
    name = getattr(func, "__name__", repr(func))
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        if name == "truediv":
            return "div"
        if name in ("iadd", "isub", "imul", "itruediv", "idiv"):
            return {"itruediv": "div", "idiv": "div"}.get(name[1:], name[1:]) + "_"
        if name in ("radd", "rsub", "rmul", "rtruediv"):
            return {"rtruediv": "rdiv"}.get(name, name[1:])
    return name


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


# --------------------------------------------------------------------------------------------
# Tracing: structure and checks
# --------------------------------------------------------------------------------------------


@dataclass
class Plan:
    """What one trace of the model found.

    Attributes:
        order: Affine layers in execution order (a merged pair under the Linear/Conv's name).
        merged: Linear/Conv name → name of the BatchNorm merged into it.
        input_layers: Layers whose input is the model input up to reshaping.
        relu_after: Layers whose output feeds a ReLU.
        rules: Layer name → rule; ``custom``: module name → core rule (opaque modules).
    """

    order: list[str] = field(default_factory=list)
    merged: dict[str, str] = field(default_factory=dict)
    input_layers: set[str] = field(default_factory=set)
    relu_after: set[str] = field(default_factory=set)
    rules: dict[str, LayerRule] = field(default_factory=dict)
    custom: dict[str, Rule] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)
    nonnegative_inputs: set[str] = field(default_factory=set)
    trace_order: list[str] = field(default_factory=list)
    opaque_custom: list[str] = field(default_factory=list)

    @property
    def input_relevance_form(self) -> bool:
        """Whether the input layer's rule returns relevance rather than a signal."""
        return any(self.rules[name].relevance_output for name in self.input_layers)


class _TraceMode(TorchFunctionMode):
    """Records data flow between modules and operations and rejects unsupported operations."""

    def __init__(self, tracer: _Tracer) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tracer = self.tracer
        if tracer.opaque_depth:
            return func(*args, **kwargs)
        name = op_name(func)
        inputs = [t for t in _tensors((args, kwargs)) if id(t) in tracer.dependent]
        result = func(*args, **kwargs)
        if not inputs:
            return result
        outputs = _tensors(result)
        if not outputs:
            return result
        tracer.check_op(name, args, kwargs, inputs)
        for t in inputs:
            tracer.consume(t, name)
        reshaped_input = name in RESHAPE_OPS | DROPOUT_OPS and any(
            id(t) in tracer.input_like for t in inputs
        )
        nonnegative = name in RELU_OPS or (
            name in _SIGN_PRESERVING and all(id(t) in tracer.nonnegative for t in inputs)
        )
        for out in outputs:
            tracer.mark(out)
            if reshaped_input:
                tracer.input_like.add(id(out))
            if nonnegative:
                tracer.nonnegative.add(id(out))
        return result


class _Tracer:
    def __init__(self, model: nn.Module, composite: Composite, extra_ops: frozenset[str]) -> None:
        self.model = model
        self.composite = composite
        self.extra_ops = extra_ops
        self.names = {id(m): n for n, m in model.named_modules()}
        self.opaque: dict[str, Rule | None] = {}
        self._find_opaque(model, "")
        self.dependent: dict[int, torch.Tensor] = {}
        self.input_like: set[int] = set()
        self.producer: dict[int, str] = {}
        self.consumers: dict[int, list[str]] = {}
        self.stack: list[str] = []
        self.calls: dict[str, int] = {}
        self.opaque_depth = 0
        self.order: list[str] = []
        self.bn_input: dict[str, int] = {}
        self.input_layers: set[str] = set()
        self.relu_inputs: set[int] = set()
        self.nonnegative: set[int] = set()
        self.nonnegative_layers: set[str] = set()

    def _find_opaque(self, module: nn.Module, path: str) -> None:
        # The outermost module with a rule (or an affine type) is opaque: the trace does not look
        # inside it and its rule (or the engine's affine handling) replaces its backward. A
        # LayerRule matched to a module that is not affine (e.g. by a broad glob) is ignored.
        rule = self.composite.rule_for(path, module)
        if isinstance(module, AFFINE_TYPES) or (
            rule is not None and not isinstance(rule, LayerRule)
        ):
            self.opaque[path] = rule
            return
        for name, child in module.named_children():
            self._find_opaque(child, f"{path}.{name}" if path else name)

    # bookkeeping ---------------------------------------------------------------------------
    def mark(self, tensor: torch.Tensor) -> None:
        self.dependent[id(tensor)] = tensor

    def consume(self, tensor: torch.Tensor, by: str) -> None:
        self.consumers.setdefault(id(tensor), []).append(by)
        if by in RELU_OPS:
            self.relu_inputs.add(id(tensor))

    def where(self) -> tuple[str, str]:
        name = self.stack[-1] if self.stack else ""
        module = self.model.get_submodule(name) if name else self.model
        return name or "<root>", type(module).__name__

    def check_op(
        self,
        name: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        inputs: list[torch.Tensor],
    ) -> None:
        problem = None
        if name in _PRODUCT_OPS | {"rmul", "rdiv"}:
            if len(inputs) > 1 or (
                name in ("div", "div_") and args and id(args[0]) != id(inputs[0])
            ):
                problem = "multiplies or divides two input-dependent tensors"
        elif name == "rdiv":
            problem = "divides by an input-dependent tensor"
        elif name in DROPOUT_OPS:
            training = kwargs.get("training", args[2] if len(args) > 2 else True)
            if training:
                problem = "is dropout in training mode (call model.eval())"
        elif name == "pad":
            mode = kwargs.get("mode", args[2] if len(args) > 2 else "constant")
            value = kwargs.get("value", args[3] if len(args) > 3 else None)
            if mode != "constant" or value not in (None, 0, 0.0):
                problem = f"is padding with mode={mode!r}, value={value!r} (only zero padding)"
        elif not (
            name in LINEAR_OPS or name in RELU_OPS or name in MAXPOOL_OPS or name in self.extra_ops
        ):
            problem = "has no relevance rule"
        if problem is not None:
            path, type_name = self.where()
            raise UnsupportedModelError(
                f"operation {name!r} in module {path!r} ({type_name}) {problem}: the "
                f"modified-backpropagation engine cannot see through it and will not fall back "
                f"to the gradient. {RULE_HINT.format(type=type_name)}"
            )

    # hooks -----------------------------------------------------------------------------------
    def pre_hook(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self.opaque_depth:
            return
        name = self.names.get(id(module), "?")
        self.stack.append(name)
        if name not in self.opaque:
            return
        count = self.calls[name] = self.calls.get(name, 0) + 1
        if count > 1:
            raise UnsupportedModelError(
                f"module {name!r} ({type(module).__name__}) is called more than once in one "
                "forward pass; relevance rules keep per-layer state, so give each use its own "
                "module instance (e.g. copy.deepcopy) instead of reusing it"
            )
        tensors = [t for t in _tensors(args) if id(t) in self.dependent]
        for t in tensors:
            self.consume(t, name)
        if any(id(t) in self.input_like for t in tensors):
            self.input_layers.add(name)
        if tensors and all(id(t) in self.nonnegative for t in tensors):
            self.nonnegative_layers.add(name)
        if isinstance(module, BATCHNORM_TYPES) and tensors:
            self.bn_input[name] = id(tensors[0])
        self.opaque_depth += 1

    def post_hook(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        name = self.names.get(id(module), "?")
        if name in self.opaque and self.stack and self.stack[-1] == name:
            if isinstance(module, AFFINE_TYPES) and (
                self.opaque[name] is None or isinstance(self.opaque[name], LayerRule)
            ):
                self._check_affine(name, module, args, output)
            self.opaque_depth -= 1
            if any(id(t) in self.dependent for t in _tensors(args)):
                for t in _tensors(output):
                    self.mark(t)
                    if isinstance(module, AFFINE_TYPES):
                        self.producer[id(t)] = name
                if isinstance(module, AFFINE_TYPES):
                    self.order.append(name)
        if not self.opaque_depth and self.stack and self.stack[-1] == name:
            self.stack.pop()

    def _check_affine(
        self, name: str, module: nn.Module, args: tuple[Any, ...], output: Any
    ) -> None:
        # Rules recompute the layer from its parameters: make sure that is what it computes
        # (a subclass with its own forward, e.g. weight standardisation, is not).
        tensors = _tensors(args)
        if len(tensors) != 1 or not isinstance(output, torch.Tensor):
            raise UnsupportedModelError(
                f"module {name!r} ({type(module).__name__}) must take one tensor and return one "
                "tensor to get a relevance rule"
            )
        layer = AffineLayer.from_module(name, module)
        expected = layer.forward(tensors[0], bias=layer.bias)
        scale = 1e-4 if output.dtype in (torch.float16, torch.bfloat16) else 1e-9
        tolerance = 1e-3 if output.dtype in (torch.float16, torch.bfloat16) else 1e-4
        if expected.shape != output.shape or not torch.allclose(
            expected, output, rtol=tolerance, atol=tolerance * (scale + float(output.abs().max()))
        ):
            raise UnsupportedModelError(
                f"module {name!r} ({type(module).__name__}) does not compute the affine map of "
                "its parameters (a subclass with its own forward?), so the affine rules would "
                "explain a different function. " + RULE_HINT.format(type=type(module).__name__)
            )

    def run(self, x: torch.Tensor) -> Plan:
        handles = []
        try:
            for module in self.model.modules():
                handles.append(module.register_forward_pre_hook(self.pre_hook))
                handles.append(module.register_forward_hook(self.post_hook))
            self.mark(x)
            self.input_like.add(id(x))
            with torch.no_grad(), _TraceMode(self):
                output = self.model(x)
        finally:
            for handle in handles:
                handle.remove()
        if not isinstance(output, torch.Tensor) or id(output) not in self.dependent:
            raise UnsupportedModelError(
                "the model's output does not depend on its input through operations the engine "
                "can see; the model must return one tensor of scores"
            )
        return self._plan()

    def _plan(self) -> Plan:
        plan = Plan()
        for name in self.order:
            module = self.model.get_submodule(name)
            plan.types[name] = type(module).__name__
            if isinstance(module, BATCHNORM_TYPES):
                source = self.producer.get(self.bn_input.get(name, -1))
                consumers = self.consumers.get(self.bn_input.get(name, -1), [])
                if (
                    source is not None
                    and isinstance(self.model.get_submodule(source), LINEAR_TYPES)
                    and consumers == [name]
                    and source not in plan.merged
                ):
                    plan.merged[source] = name
                    continue
            plan.order.append(name)
        plan.input_layers = {n for n in self.input_layers if n in plan.order}
        plan.nonnegative_inputs = {n for n in self.nonnegative_layers if n in plan.order}
        merged_back = {bn: lin for lin, bn in plan.merged.items()}
        for tensor_id in self.relu_inputs:
            source = self.producer.get(tensor_id)
            if source is not None:
                plan.relu_after.add(merged_back.get(source, source))
        for name, rule in self.opaque.items():
            if rule is not None and not isinstance(rule, LayerRule) and name in self.calls:
                plan.custom[name] = rule
        for name in plan.order:
            plan.rules[name] = self._rule(name, plan)
        return plan

    def _rule(self, name: str, plan: Plan) -> LayerRule:
        module = self.model.get_submodule(name)
        composite = self.composite
        rule: Rule | None = None
        if isinstance(composite, LayerComposite):
            if composite.first is not None and name in plan.input_layers:
                rule = composite.first
            elif composite.last is not None and name == plan.order[-1]:
                rule = composite.last
        if rule is None:
            rule = composite.rule_for(name, module)
        type_name = type(module).__name__
        if rule is None:
            what = (
                "BatchNorm that does not directly follow a Linear/Conv layer (so it cannot be "
                "merged)"
                if isinstance(module, BATCHNORM_TYPES)
                else "layer with weights"
            )
            raise UnsupportedModelError(
                f"no rule for module {name!r} ({type_name}), a {what}; add an entry for it to "
                f"the composite, e.g. composite.with_rules(({type_name}, Epsilon())) or "
                f"with_rules(({name!r}, Gradient()))"
            )
        if not isinstance(rule, LayerRule):
            return rule  # type: ignore[return-value]  # custom core rule on an affine module
        if rule.relevance_output and name not in plan.input_layers:
            raise UnsupportedModelError(
                f"rule {rule!r} returns relevance and only applies to the layer reading the model "
                f"input, but module {name!r} ({type_name}) reads an intermediate tensor"
            )
        return rule


def trace(
    model: nn.Module,
    inputs: torch.Tensor,
    composite: Composite,
    extra_ops: frozenset[str] = frozenset(),
) -> Plan:
    """Trace ``model`` on the first sample of ``inputs`` and resolve a rule for every layer.

    Raises:
        UnsupportedModelError: For reused modules, layers without a rule and operations the
            engine cannot propagate through.
    """
    tracer = _Tracer(model, composite, extra_ops)
    plan = tracer.run(inputs[:1].detach())
    plan.trace_order = list(plan.order)
    plan.opaque_custom = list(plan.custom)
    _move_custom(plan)
    return plan


def _move_custom(plan: Plan) -> None:
    for name, rule in list(plan.rules.items()):
        if not isinstance(rule, LayerRule):
            plan.custom[name] = rule
            del plan.rules[name]
            plan.order.remove(name)


# --------------------------------------------------------------------------------------------
# Plan cache: the trace (a one-sample run with checks) is reused for the same model structure
# --------------------------------------------------------------------------------------------
#
# Key: the composite's *shape* (matchers that are types, type tuples or name globs, and the type
# of every rule), the handler's extra operations and the input's per-sample shape, dtype and
# device. A composite with other matchers (callables) or with canonizers is never cached.
# Validity, checked on every call: every submodule, parameter and buffer is the same object as
# when traced (compared through weak references), modules are in the same train/eval mode, and
# no hook or instance-level ``forward`` was added or removed. And after the real forward pass the
# affine modules actually called must be exactly the planned ones, each once; otherwise the plan
# is dropped and the pass re-runs with a fresh trace, so a stale plan can never skip a rule.
# The rules themselves are resolved again from the caller's composite on every call.

_PLAN_CACHE: weakref.WeakKeyDictionary[nn.Module, dict[Any, tuple[Any, Plan]]] = (
    weakref.WeakKeyDictionary()
)


def clear_plan_cache() -> None:
    """Forget every cached trace (the next call of each model traces again)."""
    _PLAN_CACHE.clear()


def _composite_key(composite: Composite, extra_ops: frozenset[str]) -> Any:
    if composite.canonizers:
        return None
    entries = []
    for entry in composite.mapping:
        matcher = entry.matcher
        if not (
            isinstance(matcher, (str, type))
            or (isinstance(matcher, tuple) and all(isinstance(t, type) for t in matcher))
        ):
            return None
        entries.append((matcher, type(entry.rule)))
    first = getattr(composite, "first", None)
    last = getattr(composite, "last", None)
    return (type(composite), tuple(entries), type(first), type(last), extra_ops)


def _fingerprint(model: nn.Module) -> list[tuple[Any, ...]]:
    from torch.nn.modules import module as module_globals

    parts: list[tuple[Any, ...]] = [
        (
            len(module_globals._global_forward_hooks),
            len(module_globals._global_forward_pre_hooks),
        )
    ]
    for name, module in model.named_modules():
        parts.append(
            (
                name,
                weakref.ref(module),
                module.training,
                tuple(module._forward_hooks),
                tuple(module._forward_pre_hooks),
                module.__dict__.get("forward"),
                tuple((k, weakref.ref(v)) for k, v in module._parameters.items() if v is not None),
                tuple((k, weakref.ref(v)) for k, v in module._buffers.items() if v is not None),
            )
        )
    return parts


def _same_fingerprint(old: list[tuple[Any, ...]], new: list[tuple[Any, ...]]) -> bool:
    if len(old) != len(new) or old[0] != new[0]:
        return False
    for a, b in zip(old[1:], new[1:], strict=True):
        if a[0] != b[0] or a[1]() is not b[1]() or a[2:6] != b[2:6]:
            return False
        for refs_a, refs_b in ((a[6], b[6]), (a[7], b[7])):
            if len(refs_a) != len(refs_b) or any(
                ka != kb or ra() is not rb()
                for (ka, ra), (kb, rb) in zip(refs_a, refs_b, strict=True)
            ):
                return False
    return True


def _resolve_rules(model: nn.Module, composite: Composite, structure: Plan) -> Plan:
    """A copy of a cached plan with the rules of ``composite`` (raises like the trace)."""
    tracer = _Tracer.__new__(_Tracer)
    tracer.model, tracer.composite = model, composite
    plan = replace(structure, order=list(structure.trace_order), rules={}, custom={})
    for name in structure.opaque_custom:
        rule = composite.rule_for(name, model.get_submodule(name))
        if rule is not None:
            plan.custom[name] = rule
    for name in plan.order:
        plan.rules[name] = tracer._rule(name, plan)
    _move_custom(plan)
    return plan


def planned(
    model: nn.Module,
    inputs: torch.Tensor,
    composite: Composite,
    extra_ops: frozenset[str],
    *,
    cache: bool,
) -> tuple[Plan, bool]:
    """The plan for this call, from the cache when valid; also whether it came from the cache."""
    key = _composite_key(composite, extra_ops) if cache else None
    fingerprint: list[tuple[Any, ...]] = []
    if key is not None:
        key = (key, tuple(inputs.shape[1:]), inputs.dtype, inputs.device)
        entry = _PLAN_CACHE.get(model, {}).get(key)
        fingerprint = _fingerprint(model)
        if entry is not None and _same_fingerprint(entry[0], fingerprint):
            return _resolve_rules(model, composite, entry[1]), True
    plan = trace(model, inputs, composite, extra_ops)
    if key is not None:
        structure = replace(plan, order=[], rules={}, custom={})
        _PLAN_CACHE.setdefault(model, {})[key] = (fingerprint, structure)
    return plan, False


def forget_plan(model: nn.Module) -> None:
    """Drop the cached plans of ``model``."""
    _PLAN_CACHE.pop(model, None)


def _expected_calls(plan: Plan) -> dict[str, int]:
    calls = dict.fromkeys(plan.order, 1)
    calls.update(dict.fromkeys(plan.merged.values(), 1))
    calls.update(dict.fromkeys(plan.custom, 1))
    return calls


# --------------------------------------------------------------------------------------------
# The attribution pass
# --------------------------------------------------------------------------------------------


@dataclass
class RuleState:
    """What a rule's backward needs (held by the autograd graph only)."""

    rule: LayerRule
    layer: AffineLayer
    state: Any
    z: torch.Tensor


@dataclass
class LayerRecord:
    """One ruled layer in a :class:`ForwardPass`.

    Attributes:
        name: Qualified name (of the Linear/Conv for a merged pair).
        input: The tensor the layer read (part of the graph).
        output: The layer's output as the rest of the model saw it (part of the graph).
        core: Rule, layer view and forward-time state.
    """

    name: str
    input: torch.Tensor
    output: torch.Tensor
    core: RuleState


class _RuleFunction(torch.autograd.Function):
    """Identity on a layer's output values whose backward is the layer's rule."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, z: torch.Tensor, core: RuleState) -> torch.Tensor:
        ctx.core = core
        ctx.save_for_backward(x)  # raises at backward if x was changed in place meanwhile
        return z.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, signal: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        (x,) = ctx.saved_tensors
        core: RuleState = ctx.core
        return core.rule.signal_backward(core.layer, core.state, x, core.z, signal), None, None


class _HandlerMode(TorchFunctionMode):
    def __init__(self, handler: OpHandler, attached: _Attached) -> None:
        super().__init__()
        self.handler = handler
        self.attached = attached

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.attached.internal:
            return func(*args, **kwargs)
        name = op_name(func)
        if name in self.handler.ops:
            return self.handler.handle(name, func, args, kwargs)
        return func(*args, **kwargs)


class _Attached:
    """Hooks of one attribution pass."""

    def __init__(self, model: nn.Module, plan: Plan, record: bool) -> None:
        self.model = model
        self.plan = plan
        self.record = record
        self.records: dict[str, LayerRecord] = {}
        self.stash: dict[str, torch.Tensor] = {}
        self.internal = False

    @contextlib.contextmanager
    def internal_ops(self) -> Iterator[None]:
        previous, self.internal = self.internal, True
        try:
            yield
        finally:
            self.internal = previous

    def apply_rule(
        self, rule: LayerRule, layer: AffineLayer, x: torch.Tensor, output: torch.Tensor
    ) -> torch.Tensor:
        """Replace ``output`` by the same values with ``rule`` as backward."""
        z = output.detach()
        with torch.no_grad():
            state = rule.prepare(layer, x.detach(), z)
        core = RuleState(rule, layer, state, z)
        out = _RuleFunction.apply(x, z, core)
        self.records[layer.name] = LayerRecord(layer.name, x, out, core)
        return out

    def call_counter(self) -> tuple[dict[str, int], list[Any]]:
        """Count the calls of every affine module (to validate a cached plan)."""
        calls: dict[str, int] = {}
        skip = tuple(f"{name}." for name in self.plan.custom)
        handles = []
        for name, module in self.model.named_modules():
            if isinstance(module, AFFINE_TYPES) or name in self.plan.custom:
                if name and name.startswith(skip):
                    continue

                def count(module: nn.Module, args: tuple[Any, ...], name: str = name) -> None:
                    calls[name] = calls.get(name, 0) + 1

                handles.append(module.register_forward_pre_hook(count))
        return calls, handles

    def hooks(self) -> list[Any]:
        handles = []
        for name in self.plan.order:
            rule = self.plan.rules[name]
            if rule.passes_gradient and not self.record:
                continue
            module = self.model.get_submodule(name)
            if name in self.plan.merged:
                handles.append(module.register_forward_hook(self._stash_hook(name)))
                bn_name = self.plan.merged[name]
                bn = self.model.get_submodule(bn_name)
                handles.append(bn.register_forward_hook(self._rule_hook(name, bn_name)))
            else:
                handles.append(module.register_forward_hook(self._rule_hook(name, None)))
        return handles

    def _stash_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            self.stash[name] = args[0]

        return hook

    def _rule_hook(self, name: str, bn_name: str | None) -> Callable[..., Any]:
        rule = self.plan.rules[name]

        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            with self.internal_ops():
                if bn_name is None:
                    x = args[0]
                    layer = AffineLayer.from_module(name, module)
                else:
                    x = self.stash.pop(name)
                    linear = self.model.get_submodule(name)
                    layer = AffineLayer.from_module(name, linear).merge_batchnorm(bn_name, module)
                if name in self.plan.nonnegative_inputs:
                    layer = replace(layer, nonnegative_input=True)
                if rule.passes_gradient:
                    z = output.detach()
                    core = RuleState(rule, layer, None, z)
                    self.records[name] = LayerRecord(name, x, output, core)
                    return None
                replaced = rule.attach(self, layer, x, output)
                if replaced is None and self.record:
                    core = RuleState(rule, layer, None, output.detach())
                    self.records[name] = LayerRecord(name, x, output, core)
                return replaced

        return hook


@dataclass
class BackwardResult:
    """Signals after one backward pass.

    Attributes:
        input_signal: Signal at the model input (relevance if ``input_is_relevance``).
        layer_signals: Layer name → signal at that layer's input (only when read).
        input_is_relevance: The input layer's rule returned relevance (w², flat, z^B).
    """

    input_signal: torch.Tensor
    layer_signals: dict[str, torch.Tensor]
    input_is_relevance: bool


@dataclass
class ForwardPass:
    """A forward pass with rules attached; the model itself is already restored.

    Attributes:
        input: The tensor fed to the model (requires grad; for DeepLIFT input and reference).
        output: The model output (part of the graph).
        records: Ruled layers in execution order (all affine layers when recorded).
        plan: What the trace found.
    """

    input: torch.Tensor
    output: torch.Tensor
    records: dict[str, LayerRecord]
    plan: Plan

    @property
    def layers(self) -> list[str]:
        """Names of the recorded layers, input side first."""
        return list(self.records)

    def backward(
        self,
        signal: torch.Tensor | None = None,
        *,
        start: str | None = None,
        relevance: torch.Tensor | None = None,
        read_layers: bool = False,
        retain_graph: bool = False,
    ) -> BackwardResult:
        """Propagate backwards and return the signal at the input (and at every lower layer).

        Args:
            signal: Signal at the model output (``start=None``) or at layer ``start``'s output.
            start: Inject at the output of this recorded layer instead of the model output.
            relevance: Inject relevance (not a signal) at ``start``'s output; it passes through
                that layer's rule first.
            read_layers: Also return the signal at the input of every recorded layer below (and
                at ``start``'s own input).
            retain_graph: Keep the graph for another backward pass.

        Raises:
            KeyError: If ``start`` is not a recorded layer.
        """
        names = list(self.records)
        if start is None:
            below = names
            outputs, grads = self.output, signal
        else:
            if start not in self.records:
                raise KeyError(f"no recorded layer {start!r}; recorded: {', '.join(names)}")
            record = self.records[start]
            below = names[: names.index(start)]
            if relevance is not None:
                core = record.core
                with torch.no_grad():
                    grads = core.rule.relevance_backward(
                        core.layer, core.state, record.input.detach(), relevance
                    )
                outputs = record.input
            else:
                outputs, grads = record.output, signal
        wanted: list[torch.Tensor] = [self.input]
        keys: list[str] = [""]
        if read_layers:
            for name in below:
                wanted.append(self.records[name].input)
                keys.append(name)
            if start is not None:
                wanted.append(self.records[start].input)
                keys.append(start)
        unique: dict[int, torch.Tensor] = {}
        for tensor in wanted:
            unique.setdefault(id(tensor), tensor)
        tensors = list(unique.values())
        results = torch.autograd.grad(
            outputs, tensors, grads, allow_unused=True, retain_graph=retain_graph
        )
        by_id = {
            id(t): (g if g is not None else torch.zeros_like(t))
            for t, g in zip(tensors, results, strict=True)
        }
        signals = {key: by_id[id(t)] for key, t in zip(keys, wanted, strict=True)}
        input_signal = signals.pop("")
        return BackwardResult(input_signal, signals, self.plan.input_relevance_form)


class ModifiedBackprop:
    """Runs a model with a composite's rules (and an operation handler) attached.

    Args:
        composite: Maps modules to rules; :class:`LayerComposite` adds first/last layer slots.
        handler: Changes ReLU/max-pool/addition backward passes (Guided BP, DeepLIFT, …).
        record: Record every affine layer (also gradient-ruled ones) for reading and injecting
            signals at intermediate layers.
        extra_ops: Further operation names the trace accepts (the handler's own).
        cache: Reuse the trace of an earlier call with the same model structure (validated on
            every call and against the modules actually run; see :func:`planned`).
    """

    def __init__(
        self,
        composite: Composite,
        handler: OpHandler | None = None,
        *,
        record: bool = False,
        extra_ops: frozenset[str] = frozenset(),
        cache: bool = True,
    ) -> None:
        self.composite = composite
        self.handler = handler
        self.record = record
        self.cache = cache
        self.extra_ops = extra_ops | (handler.ops if handler is not None else frozenset())

    def forward(self, model: nn.Module, inputs: torch.Tensor, *, grad: bool = True) -> ForwardPass:
        """Trace, attach rules, run the forward pass and restore the model.

        The returned pass holds the autograd graph; call :meth:`ForwardPass.backward`. With
        ``grad=False`` no graph is built (for rules that only collect statistics).
        """
        for use_cache in (self.cache, False):
            with ModelGuard(model), contextlib.ExitStack() as stack:
                for canonizer in self.composite.canonizers:
                    stack.callback(canonizer.apply(model))
                plan, cached = planned(
                    model, inputs, self.composite, self.extra_ops, cache=use_cache
                )
                attached = _Attached(model, plan, self.record)
                handles = attached.hooks()
                calls: dict[str, int] = {}
                if cached:
                    calls, counters = attached.call_counter()
                    handles += counters
                stack.callback(lambda handles=handles: [h.remove() for h in handles])
                if plan.custom:
                    custom = Composite(
                        [(_named(name), rule) for name, rule in plan.custom.items()],
                    )
                    stack.enter_context(custom.context(model))
                x = inputs.detach()
                if self.handler is not None:
                    x = self.handler.prepare_inputs(x)
                x = x.requires_grad_(grad)
                with torch.set_grad_enabled(grad):
                    if self.handler is not None and self.handler.ops:
                        with _HandlerMode(self.handler, attached):
                            output = model(x)
                    else:
                        output = model(x)
            if not cached or calls == _expected_calls(plan):
                break
            forget_plan(model)  # the model ran other modules than planned: trace again
        return ForwardPass(x, output, attached.records, plan)


def _named(name: str) -> Callable[[str, nn.Module], bool]:
    return lambda candidate, module: candidate == name
