"""Tracing a model once into a :class:`Plan`: which layer gets which rule, and checks.

The trace runs the model on one sample under a :class:`~torch.overrides.TorchFunctionMode`: it
records the data flow between modules and operations, hands the affine layers to the composite's
canonizers (which fold BatchNorms into layers), resolves a rule for every affine layer and raises
:class:`UnsupportedModelError` for whatever the engine cannot propagate through.
"""

from __future__ import annotations

import inspect
import os
import sys
import types
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.utils.hooks
from torch import nn
from torch.nn.modules._functions import BackwardHookFunction
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from explain_core.affine import (
    AFFINE_TYPES,
    BATCHNORM_TYPES,
    FUNCTIONAL_LINEAR_OPS,
    AffineLayer,
    functional_linear,
)
from explain_core.canonizers import TracedLayers
from explain_core.engine.decompose import DECOMPOSED
from explain_core.engine.hints import RULE_HINT, op_hint
from explain_core.engine.ops import (
    _JOIN_OPS,
    _PRODUCT_OPS,
    _SIGN_PRESERVING,
    ACTIVATION_OPS,
    DROPOUT_OPS,
    EQUALITY_TESTS,
    INDEX_OPS,
    LINEAR_OPS,
    MAX_REDUCTIONS,
    MAXPOOL_OPS,
    PACKING_OPS,
    PAD_MODES,
    RELU_OPS,
    RESHAPE_OPS,
    VALUE_FREE_OPS,
    VALUE_READS,
    op_name,
)
from explain_core.engine.recurrent import input_dependence
from explain_core.errors import UnsupportedModelError
from explain_core.interfaces.relevance import (
    AffineRule,
    Gradient,
    InputLayer,
    OutputLayer,
    Rule,
)
from explain_core.scoped import ModuleListener, listening
from explain_core.validation import CHECKPOINT_ADVICE, check_one_tensor

if TYPE_CHECKING:
    from explain_core.engine.composite import Composite

__all__ = [
    "Plan",
    "Step",
    "move_custom_rules",
    "on_layer_path",
    "resolve_rule",
    "resolve_rules",
    "trace",
]

# One step of the data flow: (operation or module name, input ids, output ids, problem or None).
Step = tuple[str, list[int], list[int], "str | None"]


def on_layer_path(rule: Rule | None) -> bool:
    """Whether an affine module with ``rule`` runs as an engine layer (merged, ``call.layer``).

    Affine rules and the gradient do; any other rule a user maps to an affine module is applied
    to the module as called (it may compute something else than its affine map).
    """
    return rule is None or isinstance(rule, AffineRule | Gradient)


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


@dataclass
class Plan:
    """What one trace of the model found.

    Attributes:
        order: Affine layers in execution order (a merged pair under the Linear/Conv's name).
        merged: Linear/Conv name → name of the BatchNorm merged into it.
        input_layers: Layers whose input is the model input up to reshaping and padding.
        relu_after: Layers whose output feeds a ReLU.
        rectified: Layers whose output only a ReLU reads (the composite leaving ReLUs to their
            gradient): the signal at such an output is 0 wherever it is <= 0.
        rules: Layer name → rule; ``custom``: module name → core rule (opaque modules).
        input_readers: What reads the model input (up to reshaping and padding) besides the
            input layers: the live operations and modules, named for messages, in execution
            order.
        held_output: The operation whose rule cuts every path from the input to the output
            (holds it constant), as its kind and its description for messages, if any.
        functional_output_layer: The last dense layer before the output where it is an operation
            (``F.linear`` in forward, a recurrent layer's gates), not a module: named for
            messages.
        value_dependent: ``forward`` read input-dependent values into Python (``if h.max() >
            0``); such a plan was traced on the whole batch and is not cached.
        branch_free: Rules must not branch on values (the pass is traced into a graph): layers
            whose input is not known to be non-negative are marked ``"signed"``.
        decomposed: The model calls fused attention, which the pass computes in its math form
            (:mod:`explain_core.engine.decompose`).
        calls: Module name → its calls in one forward pass, where more than one (a layer
            reused at every step of a loop, shared weights): its rule applies to each call.
        input_arranged: The model reshapes, permutes or pads its input before a layer reads it
            (the pass then notes how, for the input layer's rule: ``RuleCall.input_path``).
        input_masks: The equality tests of the model input as given (``x != 0``,
            ``x.any(-1)``: its padding, the lengths of its sequences), named for messages; the
            rules take such masks as constants.
    """

    order: list[str] = field(default_factory=list)
    merged: dict[str, str] = field(default_factory=dict)
    input_layers: set[str] = field(default_factory=set)
    relu_after: set[str] = field(default_factory=set)
    rectified: set[str] = field(default_factory=set)
    rules: dict[str, Rule] = field(default_factory=dict)
    custom: dict[str, Rule] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)
    nonnegative_inputs: set[str] = field(default_factory=set)
    trace_order: list[str] = field(default_factory=list)
    opaque_custom: list[str] = field(default_factory=list)
    input_readers: list[str] = field(default_factory=list)
    held_output: tuple[str, str] | None = None
    functional_output_layer: str | None = None
    value_dependent: bool = False
    branch_free: bool = False
    decomposed: bool = False
    calls: dict[str, int] = field(default_factory=dict)
    input_arranged: bool = False
    input_masks: list[str] = field(default_factory=list)

    @property
    def input_relevance_form(self) -> bool:
        """Whether the input layer's rule returns relevance rather than a signal."""
        return any(
            self.rules[name].returns_relevance for name in self.input_layers if name in self.rules
        )

    def input_sign(self, name: str) -> Literal["nonnegative", "signed", "unknown"]:
        """What the rule of layer ``name`` may assume about its input's sign."""
        if name in self.nonnegative_inputs:
            return "nonnegative"
        return "signed" if self.branch_free else "unknown"


class _TraceMode(TorchFunctionMode):
    """Records data flow between modules and operations and the operations it cannot propagate."""

    def __init__(self, tracer: _Tracer) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tracer = self.tracer
        if tracer.opaque_depth:
            return func(*args, **kwargs)
        name = op_name(func)
        if name in DECOMPOSED:  # fused attention: trace the operations it stands for
            tracer.decomposed = True
            with self, input_dependence(tracer.depends_on_input):
                return DECOMPOSED[name](*args, **kwargs)
        tensors = _tensors((args, kwargs))
        inputs = [t for t in tensors if id(t) in tracer.dependent]
        masks = [t for t in tensors if id(t) in tracer.masks]
        result = func(*args, **kwargs)
        if (inputs or masks) and getattr(func, "__name__", "") in VALUE_READS:
            tracer.value_dependent = True  # Python control flow may branch on the values
        if not inputs and masks and name not in VALUE_FREE_OPS:
            tracer.note_masks(result)  # computed from masks alone (lengths, a float mask)
        if not inputs or name in VALUE_FREE_OPS:
            return result
        if name in EQUALITY_TESTS and all(id(t) in tracer.input_like for t in inputs):
            # A mask of the model input's values (its padding, the lengths of its sequences):
            # constant for the rules, as for the gradient, which nothing passes through it.
            # Constant almost everywhere, unlike an order (x * (x > 0) is a ReLU by hand).
            path, type_name = tracer.where()
            tracer.input_masks.append(f"operation {name!r} in module {path!r} ({type_name})")
            tracer.note_masks(result)
            return result
        # h[i] = v writes into h (and returns None); an in-place op on a view writes into its base
        outputs = [args[0]] if name == "setitem" else _tensors(result)
        if name in PACKING_OPS:
            outputs = outputs[:1]  # the data; not the batch sizes or lengths beside it
        if not outputs:
            return result
        writes = name == "setitem" or name.endswith("_")
        bases = [t._base for t in outputs if writes and t._base is not None]
        reads_input = any(id(t) in tracer.input_like for t in inputs)
        reshaped_input = reads_input and (
            name in RESHAPE_OPS | DROPOUT_OPS
            or (name == "pad" and not _padding_problem(args, kwargs))
        )
        tracer.input_arranged = tracer.input_arranged or reshaped_input
        nonnegative = name in RELU_OPS or (
            name in _SIGN_PRESERVING
            and all(id(t) in tracer.nonnegative for t in inputs)
            and _no_negative_operands(name, args, kwargs, tracer.dependent)
        )
        for base in bases:  # the rest of the base keeps its sign, the written part has this one
            tracer.mark(base)
            if not (nonnegative and id(base) in tracer.nonnegative):
                tracer.nonnegative.discard(id(base))
            if not reshaped_input:
                tracer.input_like.discard(id(base))  # written into: no longer the input's values
        for out in outputs:
            tracer.mark(out)
            if reshaped_input:
                tracer.input_like.add(id(out))
            elif writes:  # changed in place (x.sub_(mean)): no longer the input's values
                tracer.input_like.discard(id(out))
            if nonnegative:
                tracer.nonnegative.add(id(out))
            else:
                tracer.nonnegative.discard(id(out))  # an in-place op may make it signed
        outputs += bases
        if _hook_wrapping(name, args, result):  # the same tensor to the rules: same producer
            source = tracer.producer.get(id(args[0]))
            if source is not None:
                tracer.producer[id(result)] = source
        problem = tracer.problem(name, args, kwargs, inputs)
        reads_input = reads_input and not reshaped_input  # what reads a reshape of it counts
        tracer.record(name, inputs, outputs, problem, reads_input=reads_input)
        return result


# Where torch applies BackwardHookFunction for a user's full backward hook (private to torch:
# None if a release renames it, and then the hook's ``view_as`` is refused, never skipped).
_BACKWARD_HOOK_SETUP = getattr(
    getattr(torch.utils.hooks.BackwardHook, "_apply_on_tensors", None), "__code__", None
)


def _hook_wrapping(name: str, args: tuple[Any, ...], result: Any) -> bool:
    """Whether ``x.view_as(x)`` is a user's full backward hook wrapping a module's tensor."""
    return (
        name == "view_as"
        and len(args) == 2
        and args[0] is args[1]
        and not torch.is_grad_enabled()
        and _autograd_function() is BackwardHookFunction
    )


def _autograd_function(depth: int = 16) -> type | None:
    """The ``torch.autograd.Function`` whose forward runs within ``depth`` frames, if any."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None
        code = frame.f_code
        if code.co_name == "apply":  # torch ≤ 2.13: Function.apply is a Python classmethod
            cls = frame.f_locals.get("cls")
            if isinstance(cls, type) and issubclass(cls, torch.autograd.Function):
                return cls
        elif code is _BACKWARD_HOOK_SETUP:  # torch 2.14 wraps the hook's outputs in view_as
            return BackwardHookFunction
        elif code.co_name == "forward" and code.co_varnames[:1] != ("self",):
            # torch 2.14's apply is C: find the class of this (static) forward; a module's
            # forward (``self``) is skipped, as walking the Function classes costs ≈ 0.2 ms
            cls = _function_with_forward(code)
            if cls is not None:
                return cls
        frame = frame.f_back
    return None


def _function_with_forward(code: types.CodeType) -> type | None:
    """The ``torch.autograd.Function`` subclass whose ``forward`` has this code, if any."""
    pending = [torch.autograd.Function]
    while pending:
        cls = pending.pop()
        forward = cls.__dict__.get("forward")
        if isinstance(forward, staticmethod):
            forward = forward.__func__
        if forward is not None and getattr(inspect.unwrap(forward), "__code__", None) is code:
            return cls
        pending.extend(cls.__subclasses__())
    return None


_CHECKPOINT_FILE = os.path.join("torch", "utils", "checkpoint.py")


def _in_checkpoint(depth: int = 64) -> bool:
    """Whether ``torch.utils.checkpoint`` is on the Python stack (activation checkpointing)."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code.co_filename.endswith(_CHECKPOINT_FILE):
            return True
        frame = frame.f_back
    return False


def user_hook_codes(model: nn.Module) -> dict[Any, str]:
    """Code object of each forward (pre-)hook on the model → how messages name it."""
    codes = {}
    for name, module in model.named_modules():
        for kind, hooks in (
            ("forward hook", module._forward_hooks),
            ("forward pre-hook", module._forward_pre_hooks),
        ):
            for hook in hooks.values():
                function = getattr(hook, "__func__", getattr(hook, "func", hook))
                code = getattr(function, "__code__", None)
                if code is not None:
                    label = getattr(function, "__qualname__", "hook")
                    where = f"module {name or '<root>'!r} ({type(module).__name__})"
                    codes[code] = f"the {kind} {label} registered on {where}"
    return codes


def _padding_value(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``torch._pad_packed_sequence``'s padding value (its fourth argument)."""
    return kwargs.get("padding_value", args[3] if len(args) > 3 else 0.0)


def _maximum_of_two(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``torch.max`` gets a second tensor (``other``) rather than dimensions."""
    other = kwargs.get("other", args[1] if len(args) > 1 else None)
    return isinstance(other, torch.Tensor)


def _no_negative_operands(
    name: str, args: tuple[Any, ...], kwargs: dict[str, Any], dependent: dict[int, torch.Tensor]
) -> bool:
    """Whether a sign-preserving op gets no operand that could add negative values.

    Additions and concatenations also take constants, parameters and buffers (``h + shift``, a
    CoordConv's coordinates) and ``alpha``: the output is non-negative by construction only if
    every operand is. Tensors that do not depend on the input may change after tracing (the plan
    is cached), so they count as signed; numbers must be ``>= 0``.
    """
    if name in MAX_REDUCTIONS:
        return not _maximum_of_two(args, kwargs)  # the other operand: refused anyway
    if name in ("add", "add_"):
        alpha = kwargs.get("alpha", args[2] if len(args) > 2 else 1)
        operands = [*args[:2], kwargs.get("other"), alpha]
    elif name in _JOIN_OPS:
        operands = list(_tensors(args[0] if args else kwargs.get("tensors", ())))
    elif name == "setitem":
        operands = [args[0], args[2]]  # the tensor written into and the value
    else:
        return True  # values come from the input-dependent tensor alone
    for operand in operands:
        if isinstance(operand, torch.Tensor):
            if id(operand) not in dependent:
                return False
        elif isinstance(operand, (int, float)) and operand < 0:
            return False
    return True


class _Tracer(ModuleListener):
    def __init__(self, model: nn.Module, composite: Composite, extra_ops: frozenset[str]) -> None:
        self.model = model
        self.composite = composite
        # Operations with a rule (the composite's) or a handler: the pass knows what to do.
        self.handled = extra_ops | composite.op_kinds
        self.names = {id(m): n for n, m in model.named_modules()}
        self.opaque: dict[str, Rule | None] = {}
        self._find_opaque(model, "")
        self.dependent: dict[int, torch.Tensor] = {}
        self.input_like: set[int] = set()
        self.input_arranged = False  # an operation reshaped or padded the input
        self.input_masks: list[str] = []  # the equality tests of the input, named
        # tensor id → a mask of the input, or a tensor computed from such masks alone: no
        # signal, but values of the input (forward may branch on them)
        self.masks: dict[int, torch.Tensor] = {}
        self.producer: dict[int, str] = {}
        self.stack: list[str] = []
        self.calls: dict[str, int] = {}
        self.opaque_depth = 0
        self.order: list[str] = []
        self.layer_inputs: dict[str, list[int]] = {}  # one tensor id per call on the input
        self.layer_input_dims: dict[str, set[int]] = {}
        self.input_layers: set[str] = set()
        self.not_input_layers: set[str] = set()  # called on something else too
        self.nonnegative: set[int] = set()
        self.nonnegative_layers: set[str] = set()
        self.signed_layers: set[str] = set()  # called on inputs of either sign too
        self.steps: list[Step] = []
        self.made_by: dict[int, str] = {}
        self.described: dict[int, str] = {}  # id of a step → what it is, for messages
        self.reading_input: set[int] = set()  # ids of the steps that read the model input
        self.module_steps: set[int] = set()  # ids of steps: modules the trace does not enter
        self.input_id = 0  # id of the model input, set by run()
        self.value_dependent = False
        self.decomposed = False
        self.opaque_args: tuple[Any, ...] = ()
        self.hook_codes = user_hook_codes(model)

    def _find_opaque(self, module: nn.Module, path: str) -> None:
        # The outermost module with a rule (or an affine type) is opaque: the trace does not look
        # inside it and its rule (or the engine's affine handling) replaces its backward.
        rule = self.composite.rule_for(path, module)
        if isinstance(module, AFFINE_TYPES) or rule is not None:
            self.opaque[path] = rule
            return
        for name, child in module.named_children():
            self._find_opaque(child, f"{path}.{name}" if path else name)

    # bookkeeping ---------------------------------------------------------------------------
    def mark(self, tensor: torch.Tensor) -> None:
        self.dependent[id(tensor)] = tensor

    def depends_on_input(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is computed from the traced input."""
        return self.dependent.get(id(tensor)) is tensor

    def note_masks(self, result: Any) -> None:
        """Note the tensors of ``result`` as masks of the input (see ``masks``)."""
        for tensor in _tensors(result):
            self.masks[id(tensor)] = tensor

    def place(self) -> str:
        """Where the running operation is: a module, or a user hook on one (found on the stack)."""
        frame = sys._getframe(1)
        while frame is not None and self.hook_codes:
            hook = self.hook_codes.get(frame.f_code)
            if hook is not None:
                return hook
            frame = frame.f_back
        path, type_name = self.where()
        return f"module {path!r} ({type_name})"

    def _innermost(self) -> nn.Module:
        """The innermost module called now (the model itself outside its submodules)."""
        return self.model.get_submodule(self.stack[-1]) if self.stack else self.model

    def _inside_recurrent_layer(self) -> bool:
        """Whether the innermost module called is an RNN layer or cell (nn.LSTM, nn.GRUCell …)."""
        return isinstance(self._innermost(), (nn.RNNBase, nn.RNNCellBase))

    def where(self) -> tuple[str, str]:
        name = self.stack[-1] if self.stack else ""
        return name or "<root>", type(self._innermost()).__name__

    def record(
        self,
        name: str,
        inputs: list[torch.Tensor],
        outputs: list[torch.Tensor],
        problem: str | None,
        *,
        module: bool = False,
        reads_input: bool = False,
    ) -> None:
        """Note one step of the data flow: an operation, or a module the trace does not enter.

        ``reads_input``: the step reads the model input (up to reshaping and padding) as it is
        then, and is not a reshape or padding of it.
        """
        step = (name, [id(t) for t in inputs], [id(t) for t in outputs], problem)
        self.steps.append(step)
        if reads_input:
            self.reading_input.add(id(step))
        if module:
            made_by = f"module {name!r} ({type(self.model.get_submodule(name)).__name__})"
            self.module_steps.add(id(step))
        elif name in RESHAPE_OPS and id(inputs[0]) in self.made_by:
            made_by = self.made_by[id(inputs[0])]  # name what was reshaped
        else:
            path, type_name = self.where()
            made_by = f"operation {name!r} in module {path!r} ({type_name})"
            if self._inside_recurrent_layer():  # the engine writes its cells out: not the user's
                made_by = f"module {path!r} ({type_name})"
        self.described[id(step)] = made_by
        for t in outputs:
            if id(t) not in self.input_like:
                self.made_by[id(t)] = made_by

    def problem(
        self,
        name: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        inputs: list[torch.Tensor],
    ) -> str | None:
        """The error for an operation the engine cannot propagate through, or ``None``.

        It is raised only if the operation's result reaches the model output: an operation in a
        user's hook that only logs (``out.detach()``, ``out.norm()``) does not matter.
        """
        if not torch.is_grad_enabled():
            function = _autograd_function()
            if function is BackwardHookFunction:
                return None  # a user's full backward hook wraps tensors in an identity
            if function is not None:
                return self.function_problem(function)
            return self.no_grad_problem(name)
        random_slopes = name in ("rrelu", "rrelu_") and kwargs.get(
            "training", len(args) > 3 and args[3]
        )
        binary_max = name in MAX_REDUCTIONS and _maximum_of_two(args, kwargs)
        if name in self.handled and not random_slopes and not binary_max:
            return self._dense_call_problem(name, args, kwargs, inputs)
        problem = None
        if random_slopes:
            problem = "is a randomised leaky ReLU in training mode (call model.eval())"
        elif name in _PRODUCT_OPS | {"rmul", "rdiv"}:
            if len(inputs) > 1 or (
                name in ("div", "div_") and args and id(args[0]) != id(inputs[0])
            ):
                problem = "multiplies or divides two input-dependent tensors"
        elif name == "rdiv":
            problem = "divides by an input-dependent tensor"
        elif name in ("masked_fill", "masked_fill_") and len(inputs) > 1:
            problem = "masks with an input-dependent mask"
        elif name == "where" and any(t.dtype == torch.bool for t in inputs):
            problem = "selects with an input-dependent condition"
        elif name in INDEX_OPS and any(t is not args[0] for t in inputs):
            problem = "selects with an input-dependent index"
        elif name == "_pad_packed_sequence" and (value := _padding_value(args, kwargs)) != 0:
            problem = f"pads with padding_value={value!r} (zero padding is supported)"
        elif name in DROPOUT_OPS:
            training = kwargs.get("training", args[2] if len(args) > 2 else True)
            if training:
                problem = "is dropout in training mode (call model.eval())"
        elif name == "pad":
            problem = _padding_problem(args, kwargs)
        elif name in ACTIVATION_OPS:
            problem = (
                "is an activation this pass has no rule for (LRP's composites pass relevance "
                "through activations and DeepLIFT rescales them; methods defined for ReLU "
                "networks refuse them; a composite of one's own "
                f"maps Op({name!r}) to a rule)"
            )
        elif binary_max:
            problem = "has no relevance rule"  # an element-wise comparison of two tensors
        elif not (
            name in LINEAR_OPS or name in RELU_OPS or name in MAXPOOL_OPS or name in MAX_REDUCTIONS
        ):
            problem = "has no relevance rule"
        if problem is None:
            return None
        path, type_name = self.where()
        if self._inside_recurrent_layer():  # not the user's operation: the engine's cells
            elman = name == "tanh" and type_name in ("RNN", "RNNCell")
            if name in ACTIVATION_OPS:  # not the advice for activations in general
                problem = "is an activation of its cells"
            return (
                f"operation {name!r} of the recurrent layer {path!r} ({type_name}) {problem}: "
                "the engine computes the layer as its cells' operations, and this method has no "
                "rule for them. "
                + (
                    "Methods defined for ReLU networks explain an Elman RNN with "
                    "nonlinearity='relu'; explain this one with the LRP presets (lrp.epsilon, "
                    "lrp.epsilon_plus), DeepLIFT or the gradient methods"
                    if elman
                    else "Explain recurrent layers with the LRP presets (lrp.epsilon, "
                    "lrp.epsilon_plus, lrp.attn: the gates held constant, as Arras et al. 2017 "
                    "do) or with the gradient methods"
                )
            )
        return (
            f"operation {name!r} in {self.place()} {problem}: the "
            f"modified-backpropagation engine cannot see through it and will not fall back "
            f"to the gradient. {op_hint(name, type_name, leaf=self._is_leaf(path))}"
        )

    def _dense_call_problem(
        self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], inputs: list[torch.Tensor]
    ) -> str | None:
        """The error for a matrix product mapped to a dense rule that is not a dense layer's.

        ``x @ W`` and ``F.linear(x, W)`` get the composite's dense rule; a product of two
        input-dependent tensors (attention's ``Q·Kᵀ``, a weight computed from the input) has no
        weight for it to modify. ``F.linear``'s and ``addmm``'s weight is one by definition, so
        the gradient mapped to them is a dense rule too; on a matrix product a product rule, or
        the gradient (CP-LRP's ``A·V``), decides for itself.
        """
        rule = self.composite.rule_for_op(name)
        affine = isinstance(rule, AffineRule)
        if name not in FUNCTIONAL_LINEAR_OPS or not (
            affine or (isinstance(rule, Gradient) and name in ("linear", "addmm"))
        ):
            return None
        if len(inputs) > 1:
            problem = "multiplies two input-dependent tensors, which no dense rule applies to"
        elif affine and functional_linear(name, args, kwargs, inputs[0]) is None:
            problem = (
                "is not a dense layer's product, which the dense rules take as x @ W or "
                "torch.mm(x, W) with a 2-D weight W on the right, F.linear(x, W, b) or "
                "torch.addmm(b, x, W)"
            )
        else:
            return None
        path, type_name = self.where()
        return (
            f"operation {name!r} in {self.place()} {problem}: the modified-backpropagation "
            f"engine will not fall back to the gradient. "
            f"{op_hint(name, type_name, leaf=self._is_leaf(path))}"
        )

    def function_problem(self, function: type) -> str:
        """The error for a custom autograd Function, whose forward the engine cannot see into."""
        path, type_name = self.where()
        if function.__module__ == "torch.utils.checkpoint":
            return f"module {path!r} ({type_name}) runs inside {CHECKPOINT_ADVICE}"
        advice = (
            f"Give module {path!r} a rule in the composite (its type {type_name} or "
            "its name mapped to a Rule, e.g. the pass-through rule of an activation)"
            if self._is_leaf(path)
            else "Put it in a module of its own and give that module a rule in the composite"
        )
        return (
            f"the custom autograd Function {function.__qualname__} called in module "
            f"{path!r} ({type_name}) has no relevance rule: the engine cannot see "
            f"through its forward and will not fall back to its backward. {advice}, or "
            "write it with torch operations"
        )

    def no_grad_problem(self, op: str | None = None) -> str:
        """The error for operation ``op`` (or the current module) run under ``torch.no_grad()``."""
        # A custom autograd Function runs its forward without gradients: name it instead
        function = _autograd_function(depth=64)
        if function is not None and function is not BackwardHookFunction:
            return self.function_problem(function)
        subject = self.place()
        if op is not None and not self._inside_recurrent_layer():  # its ops are the engine's
            subject = f"operation {op!r} in {subject}"
        return (
            f"{subject} runs under torch.no_grad() (or inference mode) inside forward, which "
            "cuts the path relevance travels back along: remove that block (the engine will not "
            "fall back to the gradient)"
        )

    def _is_leaf(self, path: str) -> bool:
        module = self.model if path == "<root>" else self.model.get_submodule(path)
        return next(module.children(), None) is None

    def live_steps(self, output: torch.Tensor) -> list[Step]:
        """The recorded steps the model output depends on, in execution order."""
        live = {id(output)}
        kept = []
        for step in reversed(self.steps):
            if not live.isdisjoint(step[2]):
                live.update(step[1])
                kept.append(step)
        return kept[::-1]

    # module calls (a ModuleListener: this context only) ---------------------------------------
    def before(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        name = self.names.get(id(module))
        if name is None or self.opaque_depth:
            return  # a module outside the model (made or held by forward), or inside an opaque one
        if _in_checkpoint():
            # Recomputed during backward, under whatever rules (or none) that thread runs: the
            # reentrant kind is seen as no_grad, the other kind fails or silently works.
            raise UnsupportedModelError(
                f"module {name!r} ({type(module).__name__}) runs inside {CHECKPOINT_ADVICE}"
            )
        self.stack.append(name)
        if name not in self.opaque:
            return
        # A module called again (a layer reused at every step of a loop, shared weights) gets
        # its rule at every call; what the plan says of the layer must hold for all its calls.
        self.calls[name] = self.calls.get(name, 0) + 1
        # What the module receives before a full backward hook wraps it (the wrapped copies are
        # made inside the opaque module, where the trace does not look).
        self.opaque_args = args
        tensors = [t for t in _tensors(args) if id(t) in self.dependent]
        if any(id(t) in self.input_like for t in tensors):
            self.input_layers.add(name)
        elif tensors:
            self.not_input_layers.add(name)
        if tensors and all(id(t) in self.nonnegative for t in tensors):
            self.nonnegative_layers.add(name)
        elif tensors:
            self.signed_layers.add(name)
        if isinstance(module, AFFINE_TYPES) and tensors:
            self.layer_inputs.setdefault(name, []).append(id(tensors[0]))
            self.layer_input_dims.setdefault(name, set()).add(tensors[0].dim())
        self.opaque_depth += 1

    def after(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        name = self.names.get(id(module))
        if name is None:
            return
        if name in self.opaque and self.stack and self.stack[-1] == name:
            args = self.opaque_args
            if isinstance(module, AFFINE_TYPES) and on_layer_path(self.opaque[name]):
                self._check_affine(name, module, args, output)
            self.opaque_depth -= 1
            inputs = [t for t in _tensors(args) if id(t) in self.dependent]
            if inputs:
                for t in _tensors(output):
                    self.mark(t)
                    self.nonnegative.discard(id(t))
                    if isinstance(module, AFFINE_TYPES):
                        self.producer[id(t)] = name
                problem = None if torch.is_grad_enabled() else self.no_grad_problem()
                reads_input = any(id(t) in self.input_like for t in inputs)
                outputs = _tensors(output)
                self.record(name, inputs, outputs, problem, module=True, reads_input=reads_input)
                if isinstance(module, AFFINE_TYPES) and name not in self.order:
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
        output = output.detach()
        with torch.no_grad():
            expected = layer.forward(tensors[0].detach(), bias=layer.bias)
        half = output.dtype in (torch.float16, torch.bfloat16)
        scale = 1e-4 if half else 1e-9
        # In half types a few units of rounding: BatchNorm's kernel computes in float32 and
        # rounds once, the affine map rounds at each step (bfloat16 differed by 1.7 units).
        tolerance = 4 * torch.finfo(output.dtype).eps if half else 1e-4
        if expected.shape != output.shape or not torch.allclose(
            expected, output, rtol=tolerance, atol=tolerance * (scale + float(output.abs().max()))
        ):
            if hasattr(module, "weight_fake_quant"):
                cause = (
                    "it fake-quantizes its weights, as prepare_qat() made it: explain the float "
                    "model (a copy kept before prepare_qat)"
                )
            elif module._forward_pre_hooks:
                cause = (
                    "does a forward pre-hook of its own change its input? Change the input "
                    "before the call instead, in forward"
                )
            elif children := list(module.named_children()):
                # timm's BatchNormAct2d: a BatchNorm subclass that also runs its dropout and
                # activation, which the trace of an affine layer does not enter
                parts = ", ".join(f"{part!r} ({type(child).__name__})" for part, child in children)
                cause = (
                    f"its forward also runs its submodules {parts}: a layer fused with what "
                    "follows it, as timm's BatchNormAct2d is; explain a copy of the model in "
                    "which it is split into the plain layer and those submodules, e.g. "
                    "nn.Sequential(nn.BatchNorm2d with its state, module.drop, module.act)"
                )
            else:
                cause = (
                    "a subclass with its own forward, e.g. weight standardisation or padding "
                    "computed in forward?"
                )
            raise UnsupportedModelError(
                f"module {name!r} ({type(module).__name__}) does not compute the affine map of "
                f"its parameters on its input ({cause}), so the affine rules would explain a "
                "different function. " + RULE_HINT.format(type=type(module).__name__)
            )

    def run(self, x: torch.Tensor) -> Plan:
        self.mark(x)
        self.input_id = id(x)
        self.input_like.add(id(x))
        # With gradients on, as the real pass runs: a torch.no_grad() block inside forward
        # shows as operations run without them (see problem()).
        with listening(self), torch.enable_grad(), _TraceMode(self):
            output = self.model(x)
        check_one_tensor(output)  # a tuple or a dict is refused with the way out
        if id(output) not in self.dependent:
            raise UnsupportedModelError(
                "the model's output does not depend on its input through operations the engine "
                "can see; the model must return one tensor of scores"
            )
        live = self.live_steps(output)
        for *_, problem in live:
            if problem is not None:
                raise UnsupportedModelError(problem)
        return self._plan(live, output)

    def held_output(self, live: list[Step], output: torch.Tensor) -> tuple[str, str] | None:
        """The operation that holds the model output constant, if every path to it passes one.

        An operation whose rule passes no signal (CP-LRP's softmax) cuts the paths through it;
        it is returned as its kind and its description for messages.
        """
        composite = self.composite
        held = {
            kind
            for kind in composite.op_kinds
            if (rule := composite.rule_for_op(kind)) is not None and rule.gradient_scale(1) == 0
        }
        carrying = {self.input_id}
        cut: tuple[str, str] | None = None
        for step in live:
            name, inputs, outputs, _ = step
            if carrying.isdisjoint(inputs):
                continue
            if name in held and id(step) not in self.module_steps:
                cut = cut or (name, self.described[id(step)])
                continue
            carrying.update(outputs)
        return None if id(output) in carrying else cut

    def functional_output_layer(self, live: list[Step]) -> str | None:
        """The last dense layer of ``live``, named, where it is an operation and not a module."""
        last = None
        for step in live:
            name, inputs, _, _ = step
            if id(step) in self.module_steps:
                if name in self.order:  # an affine module
                    last = None
            elif name in FUNCTIONAL_LINEAR_OPS and len(inputs) == 1:
                last = self.described[id(step)]
        return last

    def traced_layers(self, live: list[Step]) -> TracedLayers:
        """The affine layers and which one each reads alone, for the canonizers.

        A layer called more than once reads another one only where each of its calls reads an
        output of that layer which nothing else reads, and each call of that layer makes one of
        them: then the two are a pair at every call (a shared conv and its BatchNorm).
        """
        consumers: dict[int, list[str]] = {}
        for name, inputs, _, _ in live:  # what only a logging hook reads does not count
            for tensor_id in inputs:
                consumers.setdefault(tensor_id, []).append(name)
        layers = TracedLayers(
            list(self.order), {name: self.model.get_submodule(name) for name in self.order}
        )
        for name in self.order:
            reads = self.layer_inputs.get(name, [])
            sources = {self.producer.get(read) for read in reads}
            source = sources.pop() if len(sources) == 1 else None
            if (
                source is not None
                and all(consumers.get(read) == [name] for read in reads)
                and len(self.layer_inputs.get(source, [])) == len(reads)
            ):
                layers.reads[name] = source
            dims = self.layer_input_dims.get(name, set())
            if len(dims) == 1:
                layers.input_dims[name] = next(iter(dims))
        return layers

    def input_readers(self, live: list[Step], input_layers: set[str]) -> list[str]:
        """What reads the model input (up to reshaping, padding) besides ``input_layers``."""
        return [
            self.described[id(step)]
            for step in live
            if id(step) in self.reading_input
            and not (id(step) in self.module_steps and step[0] in input_layers)
        ]

    def _relu_step(self, step: str) -> bool:
        """Whether a recorded step is a ReLU operation (not a module named ``relu``)."""
        return step in RELU_OPS and step not in self.opaque

    def rectified_layers(
        self, live: list[Step], plan: Plan, merged_back: dict[str, str]
    ) -> set[str]:
        """Layers of ``plan`` every output of which only a ReLU reads.

        An in-place ReLU that reads an output first counts for every later reader: they see the
        rectified tensor. Another first reader, or a reader other than a ReLU, and the layer is
        not rectified (nor is one whose output nothing reads: the model's output).
        """
        readers: dict[int, list[tuple[bool, bool]]] = {}  # (a ReLU, writing in place) each
        for step, inputs, outputs, _ in live:
            relu = self._relu_step(step)
            for tensor_id in inputs:
                readers.setdefault(tensor_id, []).append((relu, tensor_id in outputs))
        verdicts: dict[str, bool] = {}
        for tensor_id, source in self.producer.items():
            if source in plan.merged:  # the BatchNorm merged into it makes the layer's output
                continue
            layer = merged_back.get(source, source)
            reads = readers.get(tensor_id, [])
            through_relu = bool(reads) and (reads[0] == (True, True) or all(r for r, _ in reads))
            verdicts[layer] = verdicts.get(layer, True) and through_relu
        return {layer for layer, rectified in verdicts.items() if rectified and layer in plan.order}

    def _check_repeated_calls(self, plan: Plan) -> None:
        """Refuse a module called more than once where its calls would need different rules.

        Raises:
            UnsupportedModelError: For a layer that reads the model input in some calls only
                (under a composite with an input-layer rule), or the output layer (under one
                with an output-layer rule).
        """
        for name, count in plan.calls.items():
            kind = type(self.model.get_submodule(name)).__name__
            called = f"module {name!r} ({kind}) is called {count} times in one forward pass"
            mixed = name in self.input_layers and name in self.not_input_layers
            if mixed and self.composite.position_rule(InputLayer) is not None:
                raise UnsupportedModelError(
                    f"{called}, on the model input in some calls and on other tensors in "
                    f"others, and the composite {self.composite.name!r} has a rule for the layer "
                    "that reads the input: give each use its own module (copy.deepcopy), or use "
                    "a composite without an input-layer rule"
                )
            last = bool(plan.order) and name == plan.order[-1]
            if last and self.composite.position_rule(OutputLayer) is not None:
                raise UnsupportedModelError(
                    f"{called} and gives the model's output, and the composite "
                    f"{self.composite.name!r} has a rule for the output layer, which would apply "
                    "to its every call: give the last use its own module (copy.deepcopy)"
                )

    def _plan(self, live: list[Step], output: torch.Tensor) -> Plan:
        layers = self.traced_layers(live)
        for canonizer in self.composite.canonizers:
            canonizer.apply(layers)
        plan = Plan(merged=dict(layers.merged))
        folded = set(layers.merged.values())
        for name in self.order:
            plan.types[name] = type(self.model.get_submodule(name)).__name__
            if name not in folded:
                plan.order.append(name)
        plan.calls = {n: c for n, c in self.calls.items() if c > 1}
        self._check_repeated_calls(plan)
        only_input = self.input_layers - self.not_input_layers
        plan.input_layers = {n for n in only_input if n in plan.order}
        plan.input_readers = self.input_readers(live, plan.input_layers)
        plan.input_arranged = self.input_arranged
        plan.input_masks = self.input_masks
        plan.held_output = self.held_output(live, output)
        plan.functional_output_layer = self.functional_output_layer(live)
        nonnegative = self.nonnegative_layers - self.signed_layers
        plan.nonnegative_inputs = {n for n in nonnegative if n in plan.order}
        merged_back = {bn: lin for lin, bn in plan.merged.items()}
        for op, inputs, _, _ in live:
            for tensor_id in inputs if self._relu_step(op) else ():
                source = self.producer.get(tensor_id)
                if source is not None:
                    plan.relu_after.add(merged_back.get(source, source))
        if self.handled.isdisjoint(RELU_OPS):  # else a rule may pass signal where a ReLU is off
            plan.rectified = self.rectified_layers(live, plan, merged_back)
        for name, rule in self.opaque.items():
            if rule is not None and not on_layer_path(rule) and name in self.calls:
                plan.custom[name] = rule
        resolve_rules(self.model, self.composite, plan)
        return plan


def _padding_problem(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why ``F.pad(*args, **kwargs)`` has no rule, or ``None``: zero padding or copies."""
    mode = kwargs.get("mode", args[2] if len(args) > 2 else "constant")
    value = kwargs.get("value", args[3] if len(args) > 3 else None)
    if mode not in PAD_MODES or (mode == "constant" and value not in (None, 0, 0.0)):
        return (
            f"is padding with mode={mode!r}, value={value!r} (zero, reflect, replicate and "
            "circular padding are supported)"
        )
    return None


def _is_batchnorm(model: nn.Module, name: str) -> bool:
    try:
        return isinstance(model.get_submodule(name), BATCHNORM_TYPES)
    except AttributeError:  # a functional layer, named by its operation
        return False


def resolve_rules(model: nn.Module, composite: Composite, plan: Plan) -> None:
    """Fill ``plan.rules`` with the rule of every affine layer in ``plan.order``.

    Raises:
        UnsupportedModelError: If a layer has no rule, the composite has a rule for the layer
            reading the model input but no layer reads it directly (up to reshaping and
            padding), that rule returns relevance and the input also reaches the output past
            the layer, the output is held constant on every path, or the composite has an
            output-layer rule and the output layer is an operation.
    """
    first = composite.position_rule(InputLayer)
    if first is not None and not plan.input_layers:
        reader = plan.input_readers[0] if plan.input_readers else "another operation"
        raise UnsupportedModelError(
            f"the composite {composite.name!r} puts {first!r} on the layer that reads the model "
            f"input, but no Linear/Conv module reads the input directly (up to reshaping and "
            f"padding): {reader} reads it first. {_INPUT_LAYER_ADVICE}"
        )
    normalising = [n for n in sorted(plan.input_layers) if _is_batchnorm(model, n)]
    if first is not None and normalising:
        type_name = type(model.get_submodule(normalising[0])).__name__
        raise UnsupportedModelError(
            f"the composite {composite.name!r} puts {first!r} on the layer that reads the model "
            f"input, but that is {normalising[0]!r} ({type_name}), which normalises the input "
            "channel by channel, not a Linear/Conv layer: on it the rule would be the identity "
            f"(or its bounds those of the raw input). {_INPUT_LAYER_ADVICE}"
        )
    for name in plan.order:
        plan.rules[name] = resolve_rule(model, composite, name, plan)
        if name in plan.merged and not on_layer_path(plan.rules[name]):
            raise UnsupportedModelError(
                f"module {name!r} ({type(model.get_submodule(name)).__name__}) has the rule "
                f"{plan.rules[name]!r}, which is applied to the module as called, but the "
                f"composite's canonizer folded BatchNorm {plan.merged[name]!r} into it: give "
                f"{name!r} an explain_core.AffineRule (it sees the folded layer as call.layer), "
                f"or build the composite with canonizers=() and give {plan.merged[name]!r} a "
                "rule of its own"
            )
    _refuse_relevance_beside_signal(composite, plan)
    _refuse_a_constant_output(composite, plan)
    _refuse_an_output_layer_operation(composite, plan)


def _refuse_an_output_layer_operation(composite: Composite, plan: Plan) -> None:
    """Refuse an output-layer rule where the output layer is an operation, not a module.

    The rule would go to the last Linear/Conv module, which is not the output layer.

    Raises:
        UnsupportedModelError: Naming the operation.
    """
    last = composite.position_rule(OutputLayer)
    if last is None or plan.functional_output_layer is None:
        return
    raise UnsupportedModelError(
        f"the composite {composite.name!r} puts {last!r} on the output layer, but the last "
        f"dense layer before the output is computed by {plan.functional_output_layer}, not by an "
        "nn.Linear module (a functional layer in forward, or a recurrent layer's gates), and "
        "output-layer rules apply to modules only: make the output layer an nn.Linear module, "
        "or use a composite without an output-layer rule"
    )


def _refuse_a_constant_output(composite: Composite, plan: Plan) -> None:
    """Refuse a model output that an operation's rule holds constant on every path.

    CP-LRP holds every softmax constant: one that makes the output (probabilities, also sliced,
    scaled or averaged) would pass no relevance at all, and the map would be zero.

    Raises:
        UnsupportedModelError: Naming the operation, its rule and what to explain instead.
    """
    if plan.held_output is None:
        return
    kind, made_by = plan.held_output
    rule = composite.rule_for_op(kind)
    if rule is None or rule.gradient_scale(1) != 0.0:
        return
    advice = (
        f"If it is the model's final {kind}, relevance methods explain the scores before it: "
        "let forward return the logits. Where the input reaches the output only through "
        "attention weights (queries attending to a constant memory), explain with a "
        "composite whose softmax rule passes relevance (AttnLRP, lrp.attn)"
        if kind in ("softmax", "log_softmax")
        else "Explain what the model computes before it: let forward return that"
    )
    raise UnsupportedModelError(
        f"every path from the model's input to its output passes {made_by}, which the "
        f"composite {composite.name!r} holds constant ({rule!r}), so no relevance would reach "
        "the input and the map would be zero. "
        f"{advice}"
    )


_INPUT_LAYER_ADVICE = (
    "Move preprocessing done inside forward (a normalisation) out of the model and explain it on "
    "preprocessed inputs (for z^B give the bounds of the preprocessed inputs); a recurrent "
    "layer, whose gates read the input and the state together, takes the dense rule instead. "
    "Or use a composite without an input-layer rule (e.g. ε+z⁺)"
)


def _refuse_relevance_beside_signal(composite: Composite, plan: Plan) -> None:
    """Refuse an input-layer rule returning relevance where the input also passes that layer.

    The other paths bring a signal (relevance divided by the input), which cannot be added to
    relevance at the input.

    Raises:
        UnsupportedModelError: Naming the layer, its rule and the other reader.
    """
    for name in sorted(plan.input_layers):
        rule = plan.rules[name]
        if rule.returns_relevance and plan.input_readers:
            raise UnsupportedModelError(
                f"the composite {composite.name!r} puts {rule!r} on {name!r}, which reads the "
                "model input, and that rule returns the input's relevance itself, but the input "
                f"also reaches the output past that layer: {plan.input_readers[0]} reads it too "
                "(a skip connection from, or a concatenation with, the raw input). What that "
                "path brings back is a signal the input multiplies, which the engine cannot add "
                "to relevance: use a composite without an input-layer rule (ε+z⁺, "
                "lrp.epsilon_gamma), or route the input through the input layer only"
            )


def resolve_rule(model: nn.Module, composite: Composite, name: str, plan: Plan) -> Rule:
    """The rule of affine layer ``name`` (first/last slots before the mapping).

    Raises:
        UnsupportedModelError: If no rule matches, or a relevance-returning rule is matched to a
            layer that does not read the model input.
    """
    module = model.get_submodule(name)
    rule = composite.rule_for(
        name, module, reads_input=name in plan.input_layers, is_output=name == plan.order[-1]
    )
    type_name = type(module).__name__
    if rule is None:
        what = (
            "BatchNorm that cannot be merged into the layer before it (it does not directly "
            "follow a Linear/Conv, or normalises another axis than that layer's outputs)"
            if isinstance(module, BATCHNORM_TYPES)
            else "layer with weights"
        )
        raise UnsupportedModelError(
            f"no rule for module {name!r} ({type_name}), a {what}, in the composite "
            f"{composite.name!r}; give it one: composite.with_rules(({type_name}, MyRule())) "
            f"for every {type_name}, or with_rules(({name!r}, explain_core.Gradient())) for "
            "this module alone"
        )
    if not on_layer_path(rule):
        return rule  # a rule of the user's that runs the module itself (see move_custom_rules)
    if rule.returns_relevance and name not in plan.input_layers:
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

    A model whose forward reads input-dependent values into Python (a branch on them) is traced
    again on the whole batch, so the plan follows the path the real pass takes.

    Raises:
        UnsupportedModelError: For reused modules, layers without a rule and operations the
            engine cannot propagate through.
    """
    _refuse_compiled_graphs(model)
    tracer = _Tracer(model, composite, extra_ops)
    plan = tracer.run(inputs[:1].detach())
    if tracer.value_dependent and inputs.shape[0] > 1:
        # forward reads tensor values into Python (e.g. branches on them): trace the whole
        # batch, so the plan follows the path the real pass takes (never cached)
        tracer = _Tracer(model, composite, extra_ops)
        plan = tracer.run(inputs.detach())
    plan.decomposed = tracer.decomposed
    plan.value_dependent = tracer.value_dependent
    plan.trace_order = list(plan.order)
    plan.opaque_custom = list(plan.custom)
    move_custom_rules(plan)
    return plan


def _refuse_compiled_graphs(model: nn.Module) -> None:
    """Refuse TorchScript and ATen-level graphs: their layers are not modules rules attach to.

    Without this the trace saw no operation at all (TorchScript runs in its own interpreter)
    and blamed the output, or refused an exported program's first ``aten.conv2d`` by name.
    """
    for name, module in model.named_modules():
        path = name or "<root>"
        if isinstance(module, torch.jit.ScriptModule):
            raise UnsupportedModelError(
                f"module {path!r} ({type(module).__name__}) is TorchScript (torch.jit.script, "
                "trace or load): its operations run inside the TorchScript interpreter, where "
                "the relevance engine cannot see them, and it will not fall back to the "
                "gradient. Explain the Python nn.Module it was made from (its state_dict() loads "
                "into it); the gradient methods run on TorchScript as it is"
            )
        if isinstance(module, torch.fx.GraphModule) and any(
            node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
            for node in module.graph.nodes
        ):
            raise UnsupportedModelError(
                f"module {path!r} ({type(module).__name__}) runs ATen operations "
                "(torch.ops.aten.conv2d.default and the like), as a torch.export'ed program's "
                "module() does: its layers are no longer the nn.Modules the rules attach to. "
                "Explain the nn.Module it was exported from (the program's state_dict() loads "
                "into it); the gradient methods run on it as it is"
            )


def move_custom_rules(plan: Plan) -> None:
    """Move the rules not on the layer path from ``plan.rules`` to ``plan.custom``."""
    for name, rule in list(plan.rules.items()):
        if not on_layer_path(rule):
            plan.custom[name] = rule
            del plan.rules[name]
            plan.order.remove(name)
