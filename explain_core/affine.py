"""Affine layers as rules see them: ``z = W ∗ x + b`` with a forward and a transposed map.

Linear, Conv1d/2d/3d, ConvTranspose1d/2d/3d, a Linear/Conv merged with the BatchNorm that
follows it (by the :class:`~explain_core.canonizers.MergeBatchNorm` canonizer), and a BatchNorm
on its own (a per-channel scale) all become an :class:`AffineLayer`, handed to rules as
``call.layer``. Rules
only call :meth:`AffineLayer.forward` (with modified weights) and :meth:`AffineLayer.transpose`
(the vector-Jacobian product with modified weights: one transposed convolution), so no module is
run again during the backward pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from explain_core.errors import UnsupportedModelError

__all__ = [
    "AFFINE_TYPES",
    "BATCHNORM_TYPES",
    "FUNCTIONAL_LINEAR_OPS",
    "LINEAR_TYPES",
    "TRANSPOSED_CONV_TYPES",
    "AffineLayer",
    "batchnorm_affine",
    "functional_linear",
    "is_affine",
]

TRANSPOSED_CONV_TYPES = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
LINEAR_TYPES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, *TRANSPOSED_CONV_TYPES)
BATCHNORM_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
AFFINE_TYPES = LINEAR_TYPES + BATCHNORM_TYPES


def is_affine(module: nn.Module) -> bool:
    """Whether ``module`` is a Linear, ConvNd or BatchNorm (what :class:`AffineLayer` views)."""
    return isinstance(module, AFFINE_TYPES)


_CONV_FORWARD = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_TRANSPOSED_FORWARD = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def _shaped_like(like: torch.Tensor | torch.Size, signal: torch.Tensor) -> torch.Tensor:
    """An input for a transposed product, which the backend reads only for shape and layout.

    ``like`` itself where it is on ``signal``'s device; else (a shape, or a stand-in on the
    ``meta`` device) uninitialised memory of that shape and layout, never touched: an expanded
    one-element tensor would be copied out in full by the backend.
    """
    if not isinstance(like, torch.Tensor):
        return signal.new_empty(like)
    if like.device == signal.device:
        return like
    return torch.empty_strided(like.shape, like.stride(), dtype=signal.dtype, device=signal.device)


@dataclass(frozen=True)
class AffineLayer:
    """One affine layer ``z = W ∗ x + b``.

    Attributes:
        name: Qualified name of the module (of the Linear/Conv when merged with a BatchNorm).
        kind: ``"linear"``, ``"conv"``, ``"conv_transpose"`` (a transposed convolution, its weight
            ``(in, out / groups, *kernel)``) or ``"scale"`` (per-channel ``x·w + b``, a lone
            BatchNorm).
        weight: Weight tensor (for ``"scale"``: one value per channel).
        bias: Bias or ``None``.
        dims: Spatial dimensions of a convolution (1, 2, 3).
        stride, padding, dilation, groups: Convolution settings (integers per dimension).
        output_padding: A transposed convolution's extra output size per dimension.
        merged: Name of the BatchNorm folded into this layer, if any.
        input_sign: What is known of the input's sign: ``"nonnegative"`` (by construction: it
            comes from a ReLU), ``"signed"`` (rules must take forms exact for either sign
            without branching on values, as in a traced graph such as the ONNX export) or
            ``"unknown"`` (rules may look at the values).
        output_rectified: Only a ReLU reads the output, so the signal arriving there is 0 wherever
            the output is ``<= 0``: rules may skip what they compute for such outputs.
    """

    name: str
    kind: Literal["linear", "conv", "conv_transpose", "scale"]
    weight: torch.Tensor
    bias: torch.Tensor | None
    dims: int = 0
    stride: tuple[int, ...] = ()
    padding: tuple[int, ...] = ()
    dilation: tuple[int, ...] = ()
    groups: int = 1
    merged: str | None = None
    input_sign: Literal["nonnegative", "signed", "unknown"] = "unknown"
    output_padding: tuple[int, ...] = ()
    output_rectified: bool = False

    @classmethod
    def from_module(cls, name: str, module: nn.Module) -> AffineLayer:
        """View a Linear or Conv module (its current parameters, detached)."""
        if isinstance(module, nn.BatchNorm1d | nn.BatchNorm2d | nn.BatchNorm3d):
            scale, shift = batchnorm_affine(name, module)  # also without affine parameters
            return cls(name, "scale", scale, shift)
        weight = module.weight.detach()
        bias = module.bias.detach() if module.bias is not None else None
        if isinstance(module, nn.Linear):
            return cls(name, "linear", weight, bias)
        dims = weight.dim() - 2
        if module.padding_mode != "zeros":
            raise UnsupportedModelError(
                f"module {name!r} ({type(module).__name__}) uses padding_mode="
                f"{module.padding_mode!r}; the rules handle a convolution's own zero padding "
                "only. Pad separately: an nn.ReflectionPad/ReplicationPad/CircularPad module (or "
                "F.pad(x, pad, mode=...)) followed by the convolution with padding=0, which "
                "computes the same"
            )
        padding = module.padding
        if isinstance(padding, str):
            padding = _string_padding(name, module, padding)
        transposed = isinstance(module, TRANSPOSED_CONV_TYPES)
        return cls(
            name,
            "conv_transpose" if transposed else "conv",
            weight,
            bias,
            dims,
            tuple(module.stride),
            tuple(padding),
            tuple(module.dilation),
            module.groups,
            output_padding=tuple(module.output_padding) if transposed else (),
        )

    def merge_batchnorm(self, bn_name: str, bn: nn.Module) -> AffineLayer:
        """This layer followed by an eval-mode BatchNorm, as one affine layer."""
        scale, shift = batchnorm_affine(bn_name, bn)
        if self.kind == "conv_transpose":  # output channels on axis 1, per group
            groups, inputs, per_group = self.groups, self.weight.shape[0], self.weight.shape[1]
            kernel = self.weight.shape[2:]
            grouped = self.weight.reshape(groups, inputs // groups, per_group, *kernel)
            factor = scale.reshape(groups, 1, per_group, *(1,) * len(kernel))
            weight = (grouped * factor).reshape(self.weight.shape)
        else:
            weight = self.weight * scale.reshape((-1,) + (1,) * (self.weight.dim() - 1))
        bias = shift if self.bias is None else self.bias * scale + shift
        return replace(self, weight=weight, bias=bias, merged=bn_name)

    def forward(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``weight ∗ x + bias`` with this layer's geometry (defaults: no bias, own weight)."""
        weight = self.weight if weight is None else weight
        if self.kind == "linear":
            return F.linear(x, weight, bias)
        if self.kind == "scale":
            shape = (1, -1) + (1,) * (x.dim() - 2)
            out = x * weight.reshape(shape)
            return out if bias is None else out + bias.reshape(shape)
        if self.kind == "conv_transpose":
            return _TRANSPOSED_FORWARD[self.dims](
                x, weight, bias, self.stride, self.padding, self.output_padding, self.groups,
                self.dilation,
            )  # fmt: skip
        return _CONV_FORWARD[self.dims](
            x, weight, bias, self.stride, self.padding, self.dilation, self.groups
        )

    def transpose(
        self,
        signal: torch.Tensor,
        like: torch.Tensor | torch.Size,
        weight: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``weightᵀ · signal``: the vector-Jacobian product of :meth:`forward` w.r.t. ``x``.

        Args:
            signal: Signal at the output.
            like: The layer's input (only its shape and layout are used: a stand-in on the
                ``meta`` device serves as well) or its shape.
            weight: Weight to use instead of the layer's own.
        """
        weight = self.weight if weight is None else weight
        if self.kind == "linear":
            return signal @ weight
        if self.kind == "scale":
            return signal * weight.reshape((1, -1) + (1,) * (signal.dim() - 2))
        if self._pointwise_strided:
            return self._scattered_transpose(signal, like, weight)
        return self._convolution_backward(
            signal, _shaped_like(like, signal), weight, wrt_input=True
        )

    @property
    def _pointwise_strided(self) -> bool:
        """A 1×1 convolution without padding that skips inputs (a ResNet's downsampling)."""
        return (
            self.kind == "conv"
            and all(size == 1 for size in self.weight.shape[2:])
            and not any(self.padding)
            and any(step > 1 for step in self.stride)
        )

    def _scattered_transpose(
        self, signal: torch.Tensor, like: torch.Tensor | torch.Size, weight: torch.Tensor
    ) -> torch.Tensor:
        """The transpose of a strided 1×1 convolution, scattered.

        The 1×1 product at the output's size, written into every ``stride``-th input position
        (the others are read by no output: 0). Exact, and on CPU several times faster than the
        backend's strided transpose (3–5× on ResNet-50's downsampling layers, measured).
        """
        shape = like.shape if isinstance(like, torch.Tensor) else like
        unstrided = replace(self, stride=(1,) * self.dims)
        read = torch.Size((*shape[:2], *signal.shape[2:]))  # the inputs the outputs read
        at_outputs = unstrided.transpose(signal, read, weight)
        signal_in = at_outputs.new_zeros(shape)
        signal_in[(..., *(slice(None, None, step) for step in self.stride))] = at_outputs
        return signal_in

    def forward_stacked(
        self,
        inputs: Sequence[torch.Tensor],
        weights: Sequence[torch.Tensor],
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``Σ_k weights[k] ∗ inputs[k] + bias``: a rule's denominator over several inputs.

        One convolution (or matrix product) over the inputs and weights stacked along the
        input channels, where the layer is ungrouped: one pass over the output, not one per
        term (an image's first layer, with its 3 input channels, costs about as much as
        a single term).
        """
        if self.kind in ("scale", "conv_transpose") or self.groups != 1:
            total = self.forward(inputs[0], weights[0], bias)
            for x, weight in zip(inputs[1:], weights[1:], strict=True):
                total = total.add_(self.forward(x, weight))
            return total
        axis = -1 if self.kind == "linear" else 1
        stacked = torch.cat(list(inputs), dim=axis)
        return self.forward(stacked, torch.cat(list(weights), dim=1), bias)

    def transpose_stacked(
        self, signal: torch.Tensor, like: torch.Tensor, weights: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        """``(weights[0]ᵀ · signal, weights[1]ᵀ · signal, …)``, as one transposed product.

        Where the layer is ungrouped the weights are stacked along the input channels, so the
        signal is read once (see :meth:`forward_stacked`).
        """
        if self.kind in ("scale", "conv_transpose") or self.groups != 1:
            return tuple(self.transpose(signal, like, weight) for weight in weights)
        stacked = torch.cat(list(weights), dim=1)
        if self.kind == "linear":
            return (signal @ stacked).chunk(len(weights), dim=-1)
        shape = list(like.shape)
        shape[1] *= len(weights)  # the stacked input channels
        return self.transpose(signal, torch.Size(shape), stacked).chunk(len(weights), dim=1)

    def correlate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``Σ y_j ⊗ x_patch`` over batch and positions, shaped like the weight.

        The weight gradient of :meth:`forward` for the output signal ``y``: with ``y = 1`` it
        sums the input patches seen by each output, with ``y`` the outputs it correlates them.
        """
        if self.kind == "linear":
            return y.reshape(-1, y.shape[-1]).T @ x.reshape(-1, x.shape[-1])
        if self.kind == "scale":
            dims = [d for d in range(x.dim()) if d != 1]
            return (x * y).sum(dims)
        return self._convolution_backward(y, x, self.weight, wrt_input=False)

    def _convolution_backward(
        self, signal: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, *, wrt_input: bool
    ) -> torch.Tensor:
        """This convolution's vector-Jacobian product w.r.t. its input or (else) its weight."""
        grads = torch.ops.aten.convolution_backward(
            signal,
            x,
            weight,
            None,
            self.stride,
            self.padding,
            self.dilation,
            self.kind == "conv_transpose",
            list(self.output_padding) or [0] * self.dims,
            self.groups,
            (wrt_input, not wrt_input, False),
        )
        return grads[0] if wrt_input else grads[1]


FUNCTIONAL_LINEAR_OPS = frozenset({"linear", "addmm", "matmul", "mm"})
"""Operations that are a dense layer where they multiply an input by a weight."""


def functional_linear(
    kind: str, args: tuple, kwargs: dict, operand: torch.Tensor
) -> AffineLayer | None:
    """The dense-layer view of a call that multiplies ``operand`` by a weight, else ``None``.

    ``F.linear(x, W, b)``, ``torch.addmm(b, x, W)``, and ``x @ W`` or ``torch.mm(x, W)`` with a
    2-D ``W`` on the right (a projection written as a matrix product, as CLIP's heads are), where
    ``operand``, the call's one input-dependent tensor, is ``x``. With it, affine rules (LRP-ε,
    …) apply to such calls as to Linear modules.
    """
    if kind == "linear":
        x, weight, bias = (*args, None, None, None)[:3]
        x, weight = kwargs.get("input", x), kwargs.get("weight", weight)
        bias = kwargs.get("bias", bias)
    elif kind == "addmm" and not {"beta", "alpha"} & set(kwargs) and len(args) == 3:
        bias, x, weight = args
        weight = weight.mT if isinstance(weight, torch.Tensor) else None
    elif kind in ("matmul", "mm") and len(args) == 2 and not kwargs:
        (x, weight), bias = args, None
        two_dimensional = isinstance(weight, torch.Tensor) and weight.dim() == 2
        weight = weight.mT if two_dimensional else None
    else:
        return None
    if x is not operand or not isinstance(weight, torch.Tensor):
        return None
    bias = bias.detach() if isinstance(bias, torch.Tensor) else None
    return AffineLayer(kind, "linear", weight.detach(), bias)


def batchnorm_affine(name: str, bn: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and shift of an eval-mode BatchNorm: ``BN(x) = scale·x + shift`` per channel."""
    if bn.training or bn.running_mean is None or bn.running_var is None:
        raise UnsupportedModelError(
            f"BatchNorm {name!r} ({type(bn).__name__}) needs eval mode and running statistics "
            "(track_running_stats=True) to be merged; call model.eval() first"
        )
    scale = torch.rsqrt(bn.running_var.detach() + bn.eps)
    if bn.weight is not None:
        scale = scale * bn.weight.detach()
    shift = -bn.running_mean.detach() * scale
    if bn.bias is not None:
        shift = shift + bn.bias.detach()
    return scale, shift


def _string_padding(name: str, module: nn.Module, padding: str) -> tuple[int, ...]:
    dims = module.weight.dim() - 2
    if padding == "valid":
        return (0,) * dims
    total = [d * (k - 1) for d, k in zip(module.dilation, module.kernel_size, strict=True)]
    if any(t % 2 for t in total):
        raise UnsupportedModelError(
            f"module {name!r} ({type(module).__name__}) uses padding='same' with an even kernel "
            "(asymmetric padding); give explicit integer padding instead"
        )
    return tuple(t // 2 for t in total)
