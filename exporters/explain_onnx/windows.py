"""The elements of square pooling windows as one operator that exports to ``SpaceToDepth``.

Max pooling's exported form (:mod:`explain_onnx.gradtrace`) reads each element of every window.
As strided slices that is two ``Slice`` operators per element, which onnxruntime runs as slow
gathers. :func:`window_elements` returns them all at once, element-major, so that each is one
contiguous block per sample; its ONNX translation (:mod:`explain_onnx.translations`) is
``SpaceToDepth``, whose ``DCR`` order is exactly that layout.

It is a PyTorch custom operator (``explain_onnx::window_elements``), so that ``torch.export``
keeps it whole.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("explain_onnx::window_elements", mutates_args=())
def window_elements(inputs: torch.Tensor, size: int) -> torch.Tensor:
    """``(N, C, H, W) → (N, size², C, H/size, W/size)``: element ``a·size + b`` of every window.

    Args:
        inputs: A batch whose height and width are multiples of ``size``.
        size: The side of the square, non-overlapping windows.
    """
    n, c, h, w = inputs.shape
    grid = inputs.reshape(n, c, h // size, size, w // size, size)
    out = grid.permute(0, 3, 5, 1, 2, 4).reshape(n, size * size, c, h // size, w // size)
    # A custom operator must not return a view of its input (size 1: the reshape is one).
    return out.clone() if out.data_ptr() == inputs.data_ptr() else out


@window_elements.register_fake
def _(inputs: torch.Tensor, size: int) -> torch.Tensor:
    n, c, h, w = inputs.shape
    return inputs.new_empty(n, size * size, c, h // size, w // size)
