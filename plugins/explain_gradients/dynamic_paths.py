"""The check that a model is dynamic-linear, made during the forward of ``dynamic.contributions``.

With each :class:`~explain_core.DynamicLinear` layer's weights held constant, Input×Gradient is
the exact contributions ``W(x) ⊙ x`` only where every other operation on the input's path is
piecewise linear: affine layers, ReLUs, max pooling, sums, reshapes. A smooth nonlinearity (tanh,
GELU, a softmax, a norm's scale, an LSTM's gates) or a product of two tensors computed from the
input has a gradient that is not its ``W(x)``: the map would be Input×Gradient under another name,
and would not sum to the output. :func:`dynamic_linear_path` follows the input through the
forward and refuses the first such operation by name and module, as the relevance engine does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from explain_core.engine.ops import (
    ARRANGING_OPS,
    DROPOUT_OPS,
    EQUALITY_TESTS,
    INDEX_OPS,
    LINEAR_OPS,
    MAX_REDUCTIONS,
    MAXPOOL_OPS,
    RELU_OPS,
    SPLITTING_OPS,
    VALUE_FREE_OPS,
    op_name,
)
from explain_core.errors import UnsupportedModelError
from explain_core.interfaces.dynamic_linear import DynamicLinear
from explain_core.scoped import ModuleListener, listening

__all__ = ["checking_dynamic_linear"]

# Affine in the one input-dependent operand (a weight computed from the input is refused).
_AFFINE = frozenset(
    [
        *("linear", "addmm", "matmul", "mm", "bmm", "baddbmm", "einsum", "batch_norm"),
        *("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d"),
        *("conv_transpose3d", "unfold", "fold", "scatter", "scatter_add", "index_add"),
        *("cpu", "cuda", "requires_grad_"),
    ]
)
# Piecewise linear: within each piece an affine map (a clamp's bound, a hard sigmoid's offset and
# an Elman RNN's bias are biases).
_PIECEWISE_LINEAR = frozenset(
    [
        *("leaky_relu", "leaky_relu_", "prelu", "rrelu", "rrelu_", "relu6", "hardtanh"),
        *("hardtanh_", "hardsigmoid", "hardsigmoid_", "threshold", "threshold_", "clamp"),
        *("clamp_", "clip", "clip_", "clamp_min", "clamp_max", "abs", "abs_", "maximum"),
        *("minimum", "min", "amin", "where", "sort", "topk", "rnn_relu", "rnn_relu_cell"),
    ]
)
_KNOWN = (
    LINEAR_OPS
    | ARRANGING_OPS
    | SPLITTING_OPS
    | INDEX_OPS
    | MAXPOOL_OPS
    | MAX_REDUCTIONS
    | DROPOUT_OPS
    | RELU_OPS
    | _AFFINE
    | _PIECEWISE_LINEAR
)
# Constant around the input (masks, orders, rounding): what they return does not carry it.
_CONSTANT = EQUALITY_TESTS | frozenset(
    [
        *("gt", "ge", "lt", "le", "greater", "less", "logical_and", "logical_or", "logical_not"),
        *("argmax", "argmin", "argsort", "sign", "floor", "ceil", "round", "trunc", "detach"),
        *("data", "zeros", "ones", "full", "empty", "arange"),
    ]
)
_CARRY_NOTHING = VALUE_FREE_OPS | _CONSTANT
# Where a second input-dependent operand makes the operation a product of the input with itself.
_PRODUCTS = frozenset(
    ["mul", "mul_", "div", "div_", "addcmul", "addcdiv"]
    + [name for name in _AFFINE if name not in ("batch_norm", "cpu", "cuda", "requires_grad_")]
)

_ADVICE = (
    "so Input×Gradient there is not its W(x)·x and the map would not sum to the output. Use "
    "input_x_gradient for that map, an LRP preset (lrp.epsilon) for relevance that "
    "sums to the output, or, if the layer is y = W(x)·x, make it an explain_core.DynamicLinear "
    "layer that computes W from weight_input(x)"
)


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_flatten(tree)[0] if isinstance(leaf, torch.Tensor)]


class _Path(TorchFunctionMode, ModuleListener):
    """Follows the tensors computed from the input; refuses an operation not dynamic-linear."""

    def __init__(self, model: Callable[..., Any], x: torch.Tensor) -> None:
        super().__init__()
        modules = model.named_modules() if isinstance(model, nn.Module) else ()
        self.names = {id(module): name for name, module in modules}
        self.dependent: dict[int, torch.Tensor] = {id(x): x}
        self.stack: list[Any] = [model]
        self.held = 0  # depth inside DynamicLinear layers, whose own contract holds there

    # module calls ---------------------------------------------------------------------------
    def before(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self.stack.append(module)
        self.held += isinstance(module, DynamicLinear)

    def after(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self.stack.pop()
        self.held -= isinstance(module, DynamicLinear)
        if any(self._depends(t) for t in _tensors(args)):
            self._mark(output)  # also where torch ran it without a traced operation

    # operations -----------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        name = op_name(func)
        operands = [t for t in _tensors((args, kwargs)) if self._depends(t)]
        if name == "iter":  # iterating a tensor: its rows, which the mode does not see made
            result = iter(rows := list(result))
            if operands:
                self._mark(rows)
            return result
        if not operands or name in _CARRY_NOTHING or not _tensors(result):
            return result
        if not self.held:
            self._check(name, args, operands)
        self._mark(args[0] if name == "setitem" else result)
        return result

    def _check(self, name: str, args: tuple[Any, ...], operands: list[torch.Tensor]) -> None:
        if name not in _KNOWN:
            problem = f"is not piecewise linear in the input (nor a DynamicLinear layer), {_ADVICE}"
        elif (name in _PRODUCTS and len({id(t) for t in operands}) > 1) or _divides_by_it(
            name, args, self._depends
        ):
            problem = (
                "multiplies or divides tensors that both depend on the input (a gate, an "
                f"attention weight, x·x), {_ADVICE}"
            )
        else:
            return
        module = self.stack[-1]
        path = self.names.get(id(module)) or "<root>"
        raise UnsupportedModelError(
            f"dynamic.contributions needs a dynamic-linear model: operation {name!r} in module "
            f"{path!r} ({type(module).__name__}) {problem}"
        )

    def _depends(self, tensor: torch.Tensor) -> bool:
        return self.dependent.get(id(tensor)) is tensor

    def _mark(self, tree: Any) -> None:
        for tensor in _tensors(tree):
            if tensor.is_floating_point():  # not indices, lengths or masks: no gradient there
                self.dependent[id(tensor)] = tensor


def _divides_by_it(name: str, args: tuple[Any, ...], depends: Any) -> bool:
    """Whether a division's divisor depends on the input (``1 / x`` is not linear in ``x``)."""
    divisor = args[1] if len(args) > 1 else None
    return name in ("div", "div_") and isinstance(divisor, torch.Tensor) and depends(divisor)


def checking_dynamic_linear(model: Callable[..., Any]) -> Callable[[torch.Tensor], Any]:
    """``model`` as a function that refuses an operation on its input's path not dynamic-linear.

    Args:
        model: The model (its module names go into messages), already in explanation mode.

    Returns:
        A function of the input that runs ``model`` on it and returns its output.

    Raises:
        UnsupportedModelError: When called, naming the operation, its module and what to use.
    """

    def forward(x: torch.Tensor) -> Any:
        path = _Path(model, x)
        with listening(path), path:
            return model(x)

    return forward
