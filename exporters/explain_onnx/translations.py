"""ONNX translations this exporter adds to ``torch.onnx.export``'s (``custom_translation_table``).

``aten.max_unpool2d`` has none in torch.onnx (it raises ``NotImplementedError``); here it becomes
ONNX ``MaxUnpool``. Explained graphs use it for max pooling's backward over tiling windows
(:mod:`explain_onnx.gradtrace`), where onnxruntime runs it about 4× faster than the
``ScatterElements`` it replaces; a user model calling ``F.max_unpool2d`` exports with it too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def onnx_translations() -> dict[Any, Any]:
    """The ``custom_translation_table`` for ``torch.onnx.export`` (needs onnxscript)."""
    from onnxscript import opset18 as op

    def max_unpool2d(values: Any, indices: Any, output_size: Sequence[int]) -> Any:
        # PyTorch's indices are flat per (sample, channel) plane, MaxUnpool's over the whole
        # tensor: add each plane's start. The output shape is given, so the window attributes
        # only have to admit it.
        leading = op.Shape(values, start=0, end=2)
        planes = op.ReduceProd(leading, keepdims=0)
        plane_size = op.Constant(value_int=int(output_size[0]) * int(output_size[1]))
        starts = op.Mul(
            op.Range(op.Constant(value_int=0), planes, op.Constant(value_int=1)), plane_size
        )
        starts = op.Reshape(starts, op.Concat(leading, op.Constant(value_ints=[1, 1]), axis=0))
        shape = op.Concat(leading, op.Constant(value_ints=[int(s) for s in output_size]), axis=0)
        return op.MaxUnpool(
            values, op.Add(indices, starts), shape, kernel_shape=[1, 1], strides=[1, 1]
        )

    return {torch.ops.aten.max_unpool2d.default: max_unpool2d}
