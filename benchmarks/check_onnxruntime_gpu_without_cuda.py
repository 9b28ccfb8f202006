"""onnxruntime-gpu on a machine without CUDA libraries: a quiet probe and a clear error.

onnxruntime-gpu cannot be installed beside onnxruntime, so this runs in a throw-away environment:

    python -m venv /tmp/ortgpu
    /tmp/ortgpu/bin/pip install torch==2.13.0 onnxruntime-gpu onnx onnxscript numpy pluggy
    PYTHONPATH=.:plugins:exporters /tmp/ortgpu/bin/python \\
        benchmarks/check_onnxruntime_gpu_without_cuda.py

It runs the probe in a child process and records everything that process writes to its standard
error (onnxruntime writes there from native code), the providers an ``OnnxSession`` uses and the
error for ``device="cuda"``, in ``benchmarks/results/onnxruntime_gpu_without_cuda.txt``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

RESULT = Path(__file__).parent / "results" / "onnxruntime_gpu_without_cuda.txt"

CHILD = """
import onnx, onnxruntime
from onnx import helper, TensorProto
from explain_onnx import OnnxSession, choose_providers, cuda_status
from explain_core.errors import InvalidInputError

graph = helper.make_graph(
    [helper.make_node("Relu", ["x"], ["y"])], "g",
    [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
)
onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
          "/tmp/relu.onnx")
print("onnxruntime", onnxruntime.__version__, onnxruntime.get_available_providers())
print("cuda_status", cuda_status())
print("auto session providers", OnnxSession("/tmp/relu.onnx").providers)
try:
    choose_providers("cuda")
except InvalidInputError as error:
    print("device='cuda':", error)
"""


def main() -> None:
    """Run the child, check that its standard error is empty, and write the record."""
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
    lines = [
        f"command: PYTHONPATH=.:plugins:exporters {Path(sys.executable)} "
        "benchmarks/check_onnxruntime_gpu_without_cuda.py",
        *done.stdout.strip().splitlines(),
        f"bytes the child wrote to standard error: {len(done.stderr.encode())}",
    ]
    RESULT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if done.stderr:
        raise SystemExit(f"the probe printed to standard error:\n{done.stderr}")


if __name__ == "__main__":
    main()
