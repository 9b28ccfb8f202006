"""Tracing a model once into a :class:`Plan`: which layer gets which rule, and checks.

The trace runs the model on one sample under a :class:`~torch.overrides.TorchFunctionMode`: it
records the data flow between modules and operations, merges each BatchNorm into the Linear/Conv
it directly follows, resolves a rule for every affine layer and raises
:class:`UnsupportedModelError` for whatever the engine cannot propagate through.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from explain_core.interfaces.relevance import Composite, Rule
from explain_modbp.base import LayerComposite, LayerRule
from explain_modbp.errors import RULE_HINT, SOFTMAX_HINT, UnsupportedModelError
from explain_modbp.layers import AFFINE_TYPES, BATCHNORM_TYPES, LINEAR_TYPES, AffineLayer
from explain_modbp.ops import (
    _PRODUCT_OPS,
    _SIGN_PRESERVING,
    ACTIVATION_OPS,
    DROPOUT_OPS,
    LINEAR_OPS,
    MAXPOOL_OPS,
    RELU_OPS,
    RESHAPE_OPS,
    op_name,
)


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


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
        elif name in ACTIVATION_OPS and name not in self.extra_ops:
            problem = (
                "is an activation this method does not handle (only the LRP methods and DeepLIFT "
                "see through activations other than ReLU; Guided BP, Deconv, RectGrad, Excitation "
                "BP, PatternNet and the ONNX export of LRP are defined for ReLU networks)"
            )
        elif not (
            name in LINEAR_OPS or name in RELU_OPS or name in MAXPOOL_OPS or name in self.extra_ops
        ):
            problem = "has no relevance rule"
        if problem is not None:
            path, type_name = self.where()
            hint = SOFTMAX_HINT if name in ("softmax", "log_softmax") else RULE_HINT
            raise UnsupportedModelError(
                f"operation {name!r} in module {path!r} ({type_name}) {problem}: the "
                f"modified-backpropagation engine cannot see through it and will not fall back "
                f"to the gradient. {hint.format(type=type_name)}"
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
            plan.rules[name] = resolve_rule(self.model, self.composite, name, plan)
        return plan


def resolve_rule(model: nn.Module, composite: Composite, name: str, plan: Plan) -> LayerRule:
    """The rule of affine layer ``name`` (first/last slots before the mapping).

    Raises:
        UnsupportedModelError: If no rule matches, or a relevance-returning rule is matched to a
            layer that does not read the model input.
    """
    module = model.get_submodule(name)
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
            "BatchNorm that does not directly follow a Linear/Conv layer (so it cannot be merged)"
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
    move_custom_rules(plan)
    return plan


def move_custom_rules(plan: Plan) -> None:
    """Move the core rules matched to affine modules from ``plan.rules`` to ``plan.custom``."""
    for name, rule in list(plan.rules.items()):
        if not isinstance(rule, LayerRule):
            plan.custom[name] = rule
            del plan.rules[name]
            plan.order.remove(name)
