"""ONNX translations this exporter adds to ``torch.onnx.export``'s (``custom_translation_table``).

``aten.max_unpool2d`` has none in torch.onnx (it raises ``NotImplementedError``); here it becomes
ONNX ``MaxUnpool``. Explained graphs use it for max pooling's backward over tiling windows
(:mod:`explain_onnx.gradtrace`), where onnxruntime runs it about 4× faster than the
``ScatterElements`` it replaces; a user model calling ``F.max_unpool2d`` exports with it too.
The custom operator ``explain_onnx::window_elements`` (:mod:`explain_onnx.windows`) becomes
``SpaceToDepth``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

import explain_onnx.windows  # noqa: F401  (registers torch.ops.explain_onnx.window_elements)


def onnx_translations() -> dict[Any, Any]:
    """The ``custom_translation_table`` for ``torch.onnx.export`` (needs onnxscript)."""
    from onnxscript import opset18 as op

    def max_unpool2d(values: Any, indices: Any, output_size: Sequence[int]) -> Any:
        # PyTorch's indices are flat per (sample, channel) plane, MaxUnpool's over the whole
        # tensor: add each plane's start. The output shape is given, so the window attributes
        # only have to admit it.
        leading = op.Shape(values, start=0, end=2)
        # batch × channels without ReduceProd, whose opset-18 form does not convert to 17
        planes = op.Squeeze(
            op.Mul(op.Shape(values, start=0, end=1), op.Shape(values, start=1, end=2))
        )
        plane_size = op.Constant(value_int=int(output_size[0]) * int(output_size[1]))
        starts = op.Mul(
            op.Range(op.Constant(value_int=0), planes, op.Constant(value_int=1)), plane_size
        )
        starts = op.Reshape(starts, op.Concat(leading, op.Constant(value_ints=[1, 1]), axis=0))
        shape = op.Concat(leading, op.Constant(value_ints=[int(s) for s in output_size]), axis=0)
        return op.MaxUnpool(
            values, op.Add(indices, starts), shape, kernel_shape=[1, 1], strides=[1, 1]
        )

    def window_elements(inputs: Any, size: int) -> Any:
        # DCR: output channel (a·size + b)·C + c, so the reshape splits element from channel.
        depth = op.SpaceToDepth(inputs, blocksize=size)
        shape = op.Concat(
            op.Shape(depth, start=0, end=1),
            op.Constant(value_ints=[size * size, -1]),
            op.Shape(depth, start=2),
            axis=0,
        )
        return op.Reshape(depth, shape)

    return {
        torch.ops.aten.max_unpool2d.default: max_unpool2d,
        torch.ops.explain_onnx.window_elements.default: window_elements,
    }
