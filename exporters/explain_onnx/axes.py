"""The exported graph's batch axis, named ``batch`` in every input, output and inferred shape."""

from __future__ import annotations

import re
from pathlib import Path

BATCH = "batch"


def name_batch_axis(path: Path) -> str | None:
    """Rename the symbol torch.export gave the batch axis (``s48``, ``s77``) to ``batch``.

    The symbol is the first axis of the graph's first input; it is replaced wherever a shape
    names it, also inside expressions such as ``2*s48``. Returns the old name (``None`` if the
    first axis is not symbolic, and nothing was changed).
    """
    import onnx

    model = onnx.load(str(path))
    first = model.graph.input[0].type.tensor_type.shape.dim
    old = first[0].dim_param if len(first) else ""
    if not old or old == BATCH:
        return None
    symbol = re.compile(rf"\b{re.escape(old)}\b")
    graph = model.graph
    for value in [*graph.input, *graph.output, *graph.value_info]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param:
                dim.dim_param = symbol.sub(BATCH, dim.dim_param)
    onnx.save(model, str(path))
    return old
