"""Gradient explanations as exportable graphs: trace the gradient function first.

``torch.export`` cannot trace a forward that calls ``torch.autograd.grad`` for most models
(pytorch#125984). The way around it: trace the *gradient function* with
``make_fx(tracing_mode="symbolic")`` over ``torch.func.functional_call`` (the parameters are graph
inputs, so nothing becomes a fake constant, and the batch size stays symbolic), then export that
graph like any module. The traced graph holds autograd's backward operators; those without an
ONNX translation are decomposed here into forward operators (a convolution's input gradient is a
transposed convolution, adaptive average pooling's is two averaging matrices, replicate padding's
one 0/1 matrix per padded axis, max pooling's a scatter-add), so the exported graph has
standard ONNX operators only. A few more are rewritten into operators onnxruntime runs faster
(max pooling without ``MaxPool``'s indices output and its backward as ``MaxUnpool``, stride-1
transposed convolutions as convolutions, ``nan_to_num`` as one comparison, no ``Where`` in max
pooling and ReLU's backward); each is exact (ReLU's backward: for finite gradients).

The traced graph is a ``GraphModule`` holding the tensors created inside the model's forward
(``torch.tensor(0.5)``, a mask built with ``torch.ones``) as attributes ``_tensor_constant0``, ….
It is kept as the submodule ``traced``, not ``graph``: torch.export rebuilds the module from
qualified names when it decomposes the exported program, and ``graph._tensor_constant0`` would
resolve through ``GraphModule.graph`` (the ``torch.fx.Graph``) of the rebuilt root instead of the
submodule, losing the constants.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from explain_core.engine.decompose import MathAttention
from explain_onnx.windows import window_elements

__all__ = [
    "TracedGradientGraph",
    "input_gradient_graph",
    "logits_and_selector",
    "trace_explanation",
]

aten = torch.ops.aten

# Output channels from which a transposed convolution is exported as a convolution.
BLOCKED_CHANNELS = 16


def _convolution_backward(
    grad: torch.Tensor,
    inputs: torch.Tensor,
    weight: torch.Tensor,
    bias_sizes: Any,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    transposed: bool,
    output_padding: Sequence[int],
    groups: int,
    output_mask: Sequence[bool],
) -> Any:
    """Input gradient of a convolution as the adjoint convolution (no weight/bias gradients)."""
    if output_mask[1] or output_mask[2]:
        return NotImplemented  # parameter gradients are never needed for explanations
    dims = len(stride)
    if transposed:
        grad_input = aten.convolution(
            grad, weight, None, stride, padding, dilation, False, [0] * dims, groups
        )
    else:
        extra = [
            _output_padding(inputs.shape[2 + i], grad.shape[2 + i], weight.shape[2 + i],
                            stride[i], padding[i], dilation[i])
            for i in range(dims)
        ]  # fmt: skip
        grad_input = aten.convolution(
            grad, weight, None, stride, padding, dilation, True, extra, groups
        )
    return grad_input, None, None


def _transposed_convolution(
    inputs: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    transposed: bool,
    output_padding: Sequence[int],
    groups: int,
) -> Any:
    """A stride-1 transposed convolution as the convolution with the flipped, transposed kernel.

    The two sum the same products. onnxruntime runs ``Conv`` with constant weights in its
    blocked-layout kernels and ``ConvTranspose`` in a plain one, 1.3–1.6× slower for the
    backward of every LRP rule; for fewer than 16 output channels (an image's 3) the blocks are
    mostly padding and the plain kernel is faster.
    """
    kernel = weight.shape[2:]
    reach = [d * (k - 1) for d, k in zip(dilation, kernel, strict=True)]
    if (
        not transposed
        or weight.shape[1] * groups < BLOCKED_CHANNELS
        or any(s != 1 for s in stride)
        or any(output_padding)
        or any(p > r for p, r in zip(padding, reach, strict=True))
    ):
        return NotImplemented
    dims = len(kernel)
    grouped = weight.unflatten(0, (groups, -1)).transpose(1, 2).flatten(0, 1)
    flipped = grouped.flip(list(range(2, 2 + dims)))
    opposite = [r - p for p, r in zip(padding, reach, strict=True)]
    return aten.convolution(
        inputs, flipped, bias, [1] * dims, opposite, dilation, False, [0] * dims, groups
    )


def _output_padding(
    size_in: Any, size_out: Any, kernel: Any, stride: Any, padding: Any, dilation: Any
) -> Any:
    """Rows/columns a strided window leaves uncovered; the adjoint must add them back."""
    return size_in - ((size_out - 1) * stride - 2 * padding + dilation * (kernel - 1) + 1)


def _averaging_matrix(size_in: Any, size_out: Any, like: torch.Tensor) -> torch.Tensor:
    """``(size_out, size_in)``: row ``i`` averages adaptive pooling's window ``i``."""
    i = torch.arange(size_out, device=like.device)
    start = (i * size_in) // size_out
    end = ((i + 1) * size_in + size_out - 1) // size_out
    j = torch.arange(size_in, device=like.device)
    inside = (j[None] >= start[:, None]) & (j[None] < end[:, None])
    return inside.to(like.dtype) / (end - start)[:, None].to(like.dtype)


def _adaptive_avg_pool2d_backward(grad: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    rows = _averaging_matrix(inputs.shape[-2], grad.shape[-2], grad)
    cols = _averaging_matrix(inputs.shape[-1], grad.shape[-1], grad)
    # Two matrix products, not a three-operand einsum: where opt_einsum is installed, torch
    # plans such an einsum from concrete sizes, which fixes the traced batch size.
    return rows.mT @ grad @ cols


def _avg_pool2d_backward(
    grad: torch.Tensor,
    inputs: torch.Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    ceil_mode: bool,
    count_include_pad: bool,
    divisor_override: int | None,
) -> Any:
    """Average pooling's input gradient as a depthwise transposed convolution of ones."""
    kernel = list(kernel_size) * (2 // len(kernel_size))
    stride = list(stride or kernel) * (2 // len(stride or kernel))
    padding = list(padding) * (2 // len(padding))
    if ceil_mode or (any(padding) and not count_include_pad):
        return NotImplemented
    channels = inputs.shape[-3]
    divisor = divisor_override or kernel[0] * kernel[1]
    ones = grad.new_ones(channels, 1, kernel[0], kernel[1]) / divisor
    batched = grad if grad.dim() == 4 else grad.unsqueeze(0)
    extra = [
        _output_padding(inputs.shape[-2 + i], grad.shape[-2 + i], kernel[i], stride[i],
                        padding[i], 1)
        for i in range(2)
    ]  # fmt: skip
    out = aten.convolution(batched, ones, None, stride, padding, [1, 1], True, extra, channels)
    return out if grad.dim() == 4 else out.squeeze(0)


def _replication_pad_backward(
    grad: torch.Tensor, inputs: torch.Tensor, padding: Sequence[int]
) -> torch.Tensor:
    """Replicate padding's input gradient: edge values summed back, one padded axis at a time.

    Replicate padding reads input index ``clamp(o - left, 0, size - 1)`` at output index ``o``
    of each padded axis (``padding`` is ``(left, right)`` of the last axis first, as in
    ``F.pad``); its adjoint multiplies that axis with the ``(size_out, size_in)`` 0/1 matrix of
    this map, which sums the gradient of every replicated position into its edge value.
    """
    dims = len(padding) // 2
    for i in range(dims):
        axis = grad.dim() - dims + i
        left = padding[2 * (dims - 1 - i)]
        right = padding[2 * (dims - 1 - i) + 1]
        size = inputs.shape[axis]
        source = torch.arange(-left, size + right, device=grad.device).clamp(0, size - 1)
        reads = source[:, None] == torch.arange(size, device=grad.device)[None]
        grad = (grad.movedim(axis, -1) @ reads.to(grad.dtype)).movedim(-1, axis)
    return grad


def _tiling_windows(
    inputs: torch.Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    ceil_mode: bool,
) -> tuple[int, int] | None:
    """``(kh, kw)`` where max pooling's windows tile the (cropped) input; ``None`` otherwise."""
    kernel = [*kernel_size] * (2 // len(kernel_size))
    steps = [*(stride or kernel)] * (2 // len(stride or kernel))
    height, width = inputs.shape[-2:]
    tiles = steps == kernel and not any(padding) and all(d == 1 for d in dilation)
    if not tiles or inputs.dim() != 4 or (ceil_mode and (height % kernel[0] or width % kernel[1])):
        return None
    return kernel[0], kernel[1]


def _window_offsets(inputs: torch.Tensor, kh: int, kw: int) -> list[tuple[int, int, int]]:
    """``(row, column, flat offset)`` of each element of a window, in PyTorch's scan order."""
    width = inputs.shape[-1]
    return [(a, b, a * width + b) for a in range(kh) for b in range(kw)]


def _window_corners(inputs: torch.Tensor, kh: int, kw: int) -> torch.Tensor:
    """``(oh, ow)``: the flat plane index of every window's first element."""
    height, width = inputs.shape[-2:]
    rows = torch.arange(height // kh, device=inputs.device) * (kh * width)
    cols = torch.arange(width // kw, device=inputs.device) * kw
    return rows[:, None] + cols[None]


def _max_pool2d_with_indices(
    inputs: torch.Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int] = (),
    padding: Sequence[int] = (0,),
    dilation: Sequence[int] = (1,),
    ceil_mode: bool = False,
) -> Any:
    """Max pooling over windows that tile the input, one tensor per window element.

    onnxruntime's ``MaxPool`` with an indices output is many times slower than the pooling
    itself (a third of an explained VGG's time). Here each element of the windows is a strided
    slice of the input (for square windows all come from one operator,
    :func:`~explain_onnx.windows.window_elements`), and a running maximum over them keeps
    PyTorch's maximum (a NaN wins, as there); the indices are PyTorch's, flat per plane: the
    offset of the last element that beat the running maximum (its first maximum, or its last
    NaN), the largest offset among them since offsets grow in scan order. Written without
    ``Where``, which onnxruntime 1.32 runs about 20 times slower than 1.31 on unpredictable
    conditions (measured): the values with ``Max`` (which propagates NaN; of two zeros it may
    keep the other sign), the offsets as ``Max`` of ``better × offset``.
    """
    kernel = _tiling_windows(inputs, kernel_size, stride, padding, dilation, ceil_mode)
    if kernel is None:
        return NotImplemented
    kh, kw = kernel
    height, width = inputs.shape[-2:]
    rows, cols = (height // kh) * kh, (width // kw) * kw
    offsets = _window_offsets(inputs, kh, kw)
    if kh == kw:  # all elements from one operator (ONNX: SpaceToDepth, contiguous blocks)
        cropped = inputs if (rows, cols) == (height, width) else inputs[..., :rows, :cols]
        elements = list(window_elements(cropped, kh).unbind(1))
    else:
        elements = [inputs[..., a:rows:kh, b:cols:kw] for a, b, _ in offsets]
    values = offset = None
    for element, (_, _, flat) in zip(elements, offsets, strict=True):
        if values is None:  # the first element, at offset 0
            # float32 offsets (exact below 2**24) halve the int64 operators' memory traffic
            values, offset = element, torch.zeros_like(element, dtype=torch.float32)
            continue
        better = (element > values) | element.isnan()
        values = torch.maximum(values, element)
        offset = torch.maximum(offset, better.float() * flat)
    return values, _window_corners(inputs, kh, kw) + offset.long()


def _threshold_backward(grad: torch.Tensor, inputs: torch.Tensor, threshold: float) -> Any:
    """ReLU's input gradient as ``grad`` times the 0/1 mask of ``inputs > threshold``.

    PyTorch's form, ``where(inputs <= threshold, 0, grad)``, exports as ``Where``, which
    onnxruntime 1.32 runs about 20 times slower than 1.31 on a ReLU's unpredictable mask
    (measured). The product is the same for every finite gradient (a NaN input passes the
    gradient, as there); an infinite or NaN gradient where the mask is 0 gives NaN instead of 0.
    """
    passes = (inputs <= threshold).logical_not()
    return grad * passes.to(grad.dtype)


def _max_pool2d_with_indices_backward(
    grad: torch.Tensor,
    inputs: torch.Tensor,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    ceil_mode: bool,
    indices: torch.Tensor,
) -> Any:
    """Each window's gradient to its maximum's element: max unpooling, each index written once.

    Windows that tile the input have distinct maxima, so nothing needs adding up (autograd's
    scatter-add, ``ScatterElements`` with a reduction, is the slower kernel in onnxruntime).
    ``max_unpool2d`` exports as ONNX ``MaxUnpool`` (:mod:`explain_onnx.translations`), which
    onnxruntime runs about 4× faster than the plain ``ScatterElements`` it replaces.
    """
    if _tiling_windows(inputs, kernel_size, stride, padding, dilation, ceil_mode) is None:
        # Overlapping windows can share a maximum, whose gradients add up (ONNX
        # ScatterElements with reduction "add"). Written here, not left to torch's decomposition
        # table: with torch 2.11 the backward operator reached the exporter (seen on a GPU box).
        plane = inputs.new_zeros(*inputs.shape[:-2], inputs.shape[-2] * inputs.shape[-1])
        return plane.scatter_add(-1, indices.flatten(-2), grad.flatten(-2)).view(inputs.shape)
    return aten.max_unpool2d(grad, indices, list(inputs.shape[-2:]))


def _nan_to_num(
    inputs: torch.Tensor,
    nan: float | None = None,
    posinf: float | None = None,
    neginf: float | None = None,
) -> Any:
    """Non-finite values to one number, as one comparison (the LRP rules' ``0/0 → 0``).

    The general translation tests NaN, +inf and −inf separately: six operators on every
    layer's largest tensors instead of three.
    """
    if nan is None or not nan == posinf == neginf:
        return NotImplemented
    return torch.where(inputs.abs() < float("inf"), inputs, nan)


def _nan_to_num_(
    inputs: torch.Tensor,
    nan: float | None = None,
    posinf: float | None = None,
    neginf: float | None = None,
) -> Any:
    replaced = _nan_to_num(inputs, nan, posinf, neginf)
    return replaced if replaced is NotImplemented else inputs.copy_(replaced)


BACKWARD_DECOMPOSITIONS: dict[Any, Callable[..., Any]] = {
    aten.convolution.default: _transposed_convolution,
    aten.nan_to_num.default: _nan_to_num,
    aten.nan_to_num_.default: _nan_to_num_,
    aten.threshold_backward.default: _threshold_backward,
    aten.convolution_backward.default: _convolution_backward,
    aten._adaptive_avg_pool2d_backward.default: _adaptive_avg_pool2d_backward,
    aten.avg_pool2d_backward.default: _avg_pool2d_backward,
    aten.max_pool2d_with_indices.default: _max_pool2d_with_indices,
    aten.max_pool2d_with_indices_backward.default: _max_pool2d_with_indices_backward,
    aten.replication_pad1d_backward.default: _replication_pad_backward,
    aten.replication_pad2d_backward.default: _replication_pad_backward,
    aten.replication_pad3d_backward.default: _replication_pad_backward,
}


def _decompositions() -> dict[Any, Callable[..., Any]]:
    from torch._decomp import get_decompositions

    # Backward operators without an ONNX translation, as forward operators.
    table = get_decompositions([aten.silu_backward])
    table.update(BACKWARD_DECOMPOSITIONS)
    return table


def _batch_of_its_own(example: torch.Tensor, tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """``example`` with as many rows as no other size of it or of the model's tensors has.

    Symbolic tracing gives equal sizes one symbol: a batch of 2 in a model with 2 recurrent
    layers would be fixed to 2 where the layer checks its initial states' first size.
    """
    taken = {size for tensor in tensors for size in tensor.shape} | set(example.shape[1:])
    rows = next(n for n in range(2, len(taken) + 3) if n not in taken)
    return example[:1].expand(rows, *example.shape[1:]).contiguous()


class TracedGradientGraph(nn.Module):
    """A traced gradient function with the model's tensors as buffers; see the module docs.

    Attributes:
        traced: The traced ``GraphModule`` (with the forward's tensor constants); named so
            that torch.export's rebuilt module does not confuse it with ``GraphModule.graph``.
    """

    def __init__(self, graph: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.traced = graph
        self._names = list(tensors)
        for index, name in enumerate(self._names):
            self.register_buffer(f"tensor_{index}", tensors[name])

    def forward(self, x: torch.Tensor, target: torch.Tensor | None = None) -> Any:
        """Run the traced function on ``x`` (and ``target``, if it was traced with one)."""
        tensors = {name: getattr(self, f"tensor_{i}") for i, name in enumerate(self._names)}
        return self.traced(tensors, x) if target is None else self.traced(tensors, x, target)


def input_gradient_graph(
    model: nn.Module,
    example: torch.Tensor,
    *,
    target_input: bool,
    multiply_by_input: bool = True,
) -> TracedGradientGraph:
    """A module ``(x[, target]) → (logits, explanation)`` with the gradient written out.

    The explanation is ``∂ŷ_t/∂x`` (times ``x`` for Input×Gradient) for the class ``t`` given as
    the second input, or the predicted class. Fused attention is traced in its math form.

    Args:
        model: A model in eval mode returning ``(batch, classes)``.
        example: An example batch (values do not matter; shapes and dtype do).
        target_input: Take the class to explain as a second input, int64 ``(batch,)``.
        multiply_by_input: Input×Gradient (``True``) or the plain gradient.
    """

    def explained(state: dict[str, torch.Tensor], x: torch.Tensor, *target: torch.Tensor) -> Any:
        x = x.detach().requires_grad_(True)
        with torch.enable_grad(), MathAttention():
            logits, selector = logits_and_selector(model, state, x, target)
            (gradient,) = torch.autograd.grad((logits * selector).sum(), x)
        explanation = gradient * x if multiply_by_input else gradient
        return logits.detach(), explanation.detach()

    return trace_explanation(model, explained, example, target_input=target_input)


def logits_and_selector(
    model: nn.Module, state: dict[str, torch.Tensor], x: torch.Tensor, target: Sequence[Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's logits at ``x`` and the one-hot of the class to explain, in a traced function.

    Args:
        model: The model, run through ``torch.func.functional_call`` with ``state``.
        state: Parameter and buffer name → tensor (the traced graph's inputs).
        x: The input batch.
        target: ``()`` to explain the predicted class, or ``(target,)`` with int64 ``(batch,)``.

    Returns:
        The logits and a ``(batch, classes)`` selector of the logits' dtype.
    """
    logits = torch.func.functional_call(model, state, (x,))
    chosen = target[0] if target else logits.argmax(dim=1)
    classes = torch.arange(logits.shape[1], device=logits.device)
    return logits, (classes[None] == chosen[:, None]).to(logits.dtype)


def trace_explanation(
    model: nn.Module,
    explained: Callable[..., Any],
    example: torch.Tensor,
    *,
    target_input: bool,
) -> TracedGradientGraph:
    """Trace ``explained(state, x[, target])`` over the model's parameters and buffers.

    Args:
        model: The model whose parameters and buffers become the graph's ``state`` input.
        explained: The function to trace; ``state`` maps tensor names to tensors.
        example: An example batch (values do not matter; shapes and dtype do).
        target_input: Trace with the class to explain as a second input, int64 ``(batch,)``.

    Returns:
        The traced graph, with the model's tensors as buffers.
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    tensors = {
        name: tensor.detach()
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]
    }
    inputs = [_batch_of_its_own(example, tensors.values())]
    if target_input:
        inputs.append(torch.zeros(len(inputs[0]), dtype=torch.long, device=example.device))
    try:
        traced_tensors, traced_inputs = _batch_symbolic(tensors, inputs)
    except ImportError:  # a torch that moved these internals: every size symbolic, slower
        traced_tensors, traced_inputs = tensors, inputs
    graph = make_fx(explained, tracing_mode="symbolic", decomposition_table=_decompositions())(
        traced_tensors, *traced_inputs
    )
    return TracedGradientGraph(graph, tensors)


def _batch_symbolic(
    tensors: dict[str, torch.Tensor], inputs: list[torch.Tensor]
) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """Fake copies for symbolic tracing with only the inputs' batch axis symbolic.

    ``make_fx`` alone gives every size of every input a symbol (the model's tensors' too), and
    reasons about all of them with sympy, most of the tracing time; torch.export keeps only the
    batch axis dynamic anyway. The inputs' batch axes are duck-sized: one symbol for all.
    """
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (
        DimDynamic,
        ShapeEnv,
        StatelessSymbolicContext,
    )

    mode = FakeTensorMode(allow_fallback_kernels=False, shape_env=ShapeEnv())
    fake_tensors = {name: mode.from_tensor(t, static_shapes=True) for name, t in tensors.items()}
    fake_inputs = [
        mode.from_tensor(
            x,
            source=ConstantSource(f"input_{index}"),
            symbolic_context=StatelessSymbolicContext(
                dynamic_sizes=[DimDynamic.DUCK] + [DimDynamic.STATIC] * (x.dim() - 1)
            ),
        )
        for index, x in enumerate(inputs)
    ]
    return fake_tensors, fake_inputs
