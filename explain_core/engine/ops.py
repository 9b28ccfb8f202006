"""The operations the engine understands, and handlers that change their backward pass.

The operation sets name what the trace lets through outside ruled modules (linear operations,
ReLU, max pooling, dropout in eval mode); an :class:`OpHandler` replaces the backward pass of some
of them (ReLU, max pooling, additions) for methods such as Guided BP and DeepLIFT.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch

__all__ = [
    "ACTIVATION_OPS",
    "ADD_OPS",
    "ARRANGING_OPS",
    "AVGPOOL_OPS",
    "DROPOUT_OPS",
    "EQUALITY_TESTS",
    "INDEX_OPS",
    "LINEAR_OPS",
    "MAXPOOL_OPS",
    "MAX_REDUCTIONS",
    "PACKING_OPS",
    "PAD_MODES",
    "RELU_OPS",
    "RESHAPE_COPIES",
    "RESHAPE_OPS",
    "SPLITTING_OPS",
    "VALUE_FREE_OPS",
    "VALUE_READS",
    "OpHandler",
    "op_name",
    "without_function_modes",
]


class OpHandler:
    """Changes the backward pass of parameter-free operations seen in the forward pass.

    Attributes:
        ops: Normalised operation names the handler intercepts (e.g. ``"relu"``).
        compares_with_reference: The pass runs the model on the inputs and on references
            stacked with them (DeepLIFT), and compares the two: a model that computes a mask
            from its input (``Plan.input_masks``) is refused, since the masks would differ.
    """

    ops: ClassVar[frozenset[str]] = frozenset()
    compares_with_reference: ClassVar[bool] = False

    def start(self, inputs: torch.Tensor, layers: Mapping[str, Any]) -> torch.Tensor:
        """Called before the forward pass; returns the tensor actually fed to the model.

        Args:
            inputs: The inputs (DeepLIFT appends the reference).
            layers: The pass's :class:`~explain_core.engine.LayerRecord` by layer name,
                filled as the layers run (for a pass run with ``record=True``).
        """
        return inputs

    def handle(
        self, name: str, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Compute ``func(*args, **kwargs)`` with a modified backward."""
        return func(*args, **kwargs)


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
        "swapaxes",
        "swapdims",
        "t",
        "T",
        "mT",
        "contiguous",
        "clone",
        "movedim",
        "moveaxis",
        "to",
        "float",
        "double",
        "type_as",
        "type",
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
        "repeat",
        "repeat_interleave",
        "tile",
        "roll",
        "flip",
        "sum",
        "mean",
        "masked_fill",
        "masked_fill_",
        "cumsum",
        "index_select",
        "gather",
        "take_along_dim",
        # rearrangements of channels and pixels (ShuffleNet, sub-pixel up-sampling)
        "pixel_shuffle",
        "pixel_unshuffle",
        "channel_shuffle",
        "native_channel_shuffle",
    ]
)
# Reshapes and permutes that return a new tensor (not in place).
RESHAPE_COPIES = frozenset(name for name in RESHAPE_OPS if not name.endswith("_"))
# The values of their first argument, rearranged, selected or repeated.
ARRANGING_OPS = RESHAPE_OPS | frozenset(
    [
        *("expand", "expand_as", "broadcast_to", "getitem", "narrow", "select", "repeat", "tile"),
        *("pixel_shuffle", "pixel_unshuffle", "channel_shuffle", "native_channel_shuffle"),
    ]
)
# Parts of their first argument, as a tuple.
SPLITTING_OPS = frozenset(["chunk", "split", "split_with_sizes", "tensor_split", "unbind"])
# pack_padded_sequence and pad_packed_sequence: the steps of each sequence, rearranged. Beside
# the data they return batch sizes or lengths, which come from the lengths alone.
PACKING_OPS = frozenset({"_pack_padded_sequence", "_pad_packed_sequence"})
# Selections by an index tensor, which must not depend on the input (the trace checks).
INDEX_OPS = frozenset({"index_select", "gather", "take_along_dim"})
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
    | PACKING_OPS
    | AVGPOOL_OPS
    | frozenset(
        # where: a selection by a mask that does not depend on the input (the trace refuses
        # input-dependent masks) is linear in the selected tensors
        [
            *("add", "add_", "sub", "sub_", "neg", "mul", "mul_", "div", "div_", "pad", "diff"),
            *("setitem", "where"),
            # resampling (nearest, linear, bilinear, bicubic, …): a fixed linear map
            *("interpolate", "upsample", "upsample_nearest", "upsample_bilinear"),
        ]
    )
)
# Tests of values for equality (a tensor's nonzero entries too): of the model input as given,
# they find its padding; they are constant almost everywhere, so the rules take them as constants.
EQUALITY_TESTS = frozenset(
    {"eq", "ne", "any", "all", "count_nonzero", "isnan", "isinf", "isfinite"}
)
RELU_OPS = frozenset({"relu", "relu_"})
# Other element-wise activations: LRP passes relevance through them and DeepLIFT rescales them
# (see :mod:`.activations`); methods defined for ReLUs only (Guided BP, …) refuse them.
ACTIVATION_OPS = frozenset(
    [
        "leaky_relu",
        "leaky_relu_",
        "elu",
        "elu_",
        "celu",
        "celu_",
        "selu",
        "selu_",
        "gelu",
        "silu",
        "mish",
        "softplus",
        "hardtanh",
        "hardtanh_",
        "relu6",
        "tanh",
        "tanh_",
        "sigmoid",
        "sigmoid_",
        "hardswish",
        "hardswish_",
        "hardsigmoid",
        "hardsigmoid_",
        "prelu",
        "rrelu",  # in eval: a leaky ReLU of slope (lower + upper) / 2 (the trace refuses training)
        "rrelu_",
    ]
)
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
# A maximum over dimensions of one tensor (torch.max(x, dim), x.amax(dim), the global max):
# max pooling over those dimensions. torch.max(x, other) of two tensors is not one (the trace
# tells the two apart).
MAX_REDUCTIONS = frozenset({"max", "amax"})
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
# New tensors shaped like an input-dependent one whose values do not depend on it.
VALUE_FREE_OPS = frozenset(
    [
        "zeros_like",
        "ones_like",
        "empty_like",
        "full_like",
        "rand_like",
        "randn_like",
        "new_zeros",
        "new_ones",
        "new_empty",
        "new_full",
        "new_tensor",
    ]
)
# Reads of tensor values into Python (raw function names): forward may branch on them.
VALUE_READS = frozenset(
    ["__bool__", "__int__", "__float__", "__index__", "item", "tolist", "allclose", "equal"]
)
# F.pad modes that copy values (the gradient is LRP-0's redistribution) or add zeros.
PAD_MODES = frozenset({"constant", "reflect", "replicate", "circular"})
ADD_OPS = frozenset({"add", "add_", "sub", "sub_"})
_PRODUCT_OPS = frozenset({"mul", "mul_", "div", "div_"})
_JOIN_OPS = frozenset({"cat", "concat", "concatenate", "stack"})
# Operations whose output is non-negative when all their operands are (see the trace for the
# operands of additions and joins that do not depend on the input).
_SIGN_PRESERVING = (
    RESHAPE_OPS
    | MAXPOOL_OPS
    | MAX_REDUCTIONS
    | DROPOUT_OPS
    | _GATHER_OPS
    | PACKING_OPS
    | AVGPOOL_OPS
    | frozenset(["add", "add_", "pad", "setitem"])
)


def without_function_modes() -> contextlib.AbstractContextManager[None]:
    """A block of the engine's own bookkeeping and arithmetic, unseen by any ``TorchFunctionMode``.

    Each mode on the stack (an attribution pass's, the training-call check, a user's) dispatches
    every operation through Python: ≈ 1650 calls per forward of a ResNet-50 where the engine
    merges and rectifies weights. The model's own operations never run in such a block.
    A torch without the switch (a private one) runs the block as it is.
    """
    switch = getattr(torch._C, "DisableTorchFunction", None)
    return contextlib.nullcontext() if switch is None else switch()


def op_name(func: Callable[..., Any]) -> str:
    """``Tensor.__iadd__`` → ``add_``, ``Tensor.__radd__`` → ``add``, ``F.relu`` → ``relu``.

    Properties are named by themselves: ``h.T`` → ``T``, ``h.data`` → ``data``.
    """
    name = getattr(func, "__name__", repr(func))
    if name == "__get__":  # a property: h.T, h.mT, h.data
        return getattr(getattr(func, "__self__", None), "__name__", "get")
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        if name == "truediv":
            return "div"
        if name in ("iadd", "isub", "imul", "itruediv", "idiv"):
            return {"itruediv": "div", "idiv": "div"}.get(name[1:], name[1:]) + "_"
        if name in ("radd", "rsub", "rmul", "rtruediv"):
            return {"rtruediv": "rdiv"}.get(name, name[1:])
    return name
