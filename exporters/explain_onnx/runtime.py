"""onnxruntime sessions that use CUDA only where it really works, and say what they use.

onnxruntime falls back to the CPU silently when a requested provider cannot start (and
onnxruntime-gpu logs error lines about it on CPU-only machines). :class:`OnnxSession` therefore
asks for ``CUDAExecutionProvider`` only when ``get_available_providers()`` lists it *and* a probe
session really runs on it, keeps onnxruntime's own logging to fatal errors while probing, and
reports the providers the session actually uses (``session.get_providers()``).
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from importlib.metadata import PackageNotFoundError, metadata
from pathlib import Path
from typing import Any, Literal

import numpy as np

from explain_core.errors import InvalidInputError
from explain_onnx._deps import require

Device = Literal["auto", "cpu", "cuda"]
CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
TARGET = "target"  # the class input of explained graphs exported with target_input=True
QUIET = 3  # onnxruntime severities: 0 verbose, 1 info, 2 warning, 3 error, 4 fatal
SILENT = 4


def session_options(*, threads: int | None = None, severity: int = QUIET) -> Any:
    """``SessionOptions`` with onnxruntime's logging at ``severity`` and optional thread count."""
    ort = require("onnxruntime")
    options = ort.SessionOptions()
    options.log_severity_level = severity
    if threads is not None:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    return options


def identity_probe(opset: int) -> bytes:
    """A serialised one-node ONNX graph (``y = Identity(x)``) at ``opset``, to probe onnxruntime."""
    onnx = require("onnx")
    helper = onnx.helper
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "probe",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
    )
    # ORT rejects the newest IR versions that onnx.helper writes by default.
    opsets = [helper.make_opsetid("", opset)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8).SerializeToString()


@dataclass(frozen=True)
class CudaStatus:
    """Whether onnxruntime runs on CUDA here and, if not, why.

    Attributes:
        usable: A CUDA session really runs here.
        listed: ``get_available_providers()`` lists CUDA (onnxruntime-gpu is installed).
        reason: Why CUDA cannot start, from onnxruntime's own log (``""`` if usable or unlisted).
    """

    usable: bool
    listed: bool
    reason: str = ""


@cache
def cuda_status() -> CudaStatus:
    """Probe CUDA once (cached), with onnxruntime's log lines captured instead of printed.

    onnxruntime-gpu without its CUDA libraries writes error lines from native code to the
    process's standard error and falls back to the CPU; they are read back to say why.
    """
    ort = require("onnxruntime")
    if CUDA not in ort.get_available_providers():
        return CudaStatus(usable=False, listed=False)
    used, raised = CPU, ""
    with _native_stderr() as log:
        try:
            probe = ort.InferenceSession(
                identity_probe(13),
                sess_options=session_options(severity=SILENT),
                providers=[CUDA, CPU],
            )
            used = probe.get_providers()[0]
        except Exception as error:  # onnxruntime raises its own Fail types
            raised = str(error)
    if used == CUDA:
        return CudaStatus(usable=True, listed=True)
    return CudaStatus(usable=False, listed=True, reason=_failure_reason([*log, raised]))


def cuda_usable() -> bool:
    """Whether a CUDA session really runs here: listed as available *and* used (cached)."""
    return cuda_status().usable


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _failure_reason(log: list[str]) -> str:
    """The library that failed to load and the versions onnxruntime asks for, from its log."""
    text = _ANSI.sub("", "\n".join(log))
    parts = []
    missing = re.search(r"with error: ([^\n]+)", text)
    if missing:
        parts.append(missing.group(1).strip())
    needs = re.search(r"Require ([^.]*\.\*[^.]*\.\*)", text)
    if needs:
        parts.append(f"it requires {needs.group(1).strip()}")
    if not parts:
        first = next((line.strip() for line in text.splitlines() if line.strip()), "")
        parts.append(first or "the probe session fell back to the CPU without saying why")
    return "; ".join(parts)


@contextmanager
def _native_stderr() -> Iterator[list[str]]:
    """Capture what native code writes to file descriptor 2; the lines fill in on exit."""
    lines: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            lines.extend(sink.read().decode(errors="replace").splitlines())


def choose_providers(device: Device = "auto") -> list[str]:
    """Execution providers for ``device``: CUDA first only where :func:`cuda_usable`.

    Raises:
        InvalidInputError: For ``device="cuda"`` where CUDA cannot run (saying whether
            onnxruntime-gpu is missing or its CUDA libraries are), or an unknown device.
    """
    if device not in ("auto", "cpu", "cuda"):
        raise InvalidInputError(f"device must be 'auto', 'cpu' or 'cuda'; got {device!r}")
    if device == "cpu":
        return [CPU]
    status = cuda_status()
    if status.usable:
        return [CUDA, CPU]
    if device == "cuda":
        raise InvalidInputError(_no_cuda_message(status))
    return [CPU]


def _no_cuda_message(status: CudaStatus) -> str:
    ort = require("onnxruntime")
    if not status.listed:
        return (
            "device='cuda' was requested but the installed onnxruntime has no CUDA provider "
            f"(available: {', '.join(ort.get_available_providers())}); install onnxruntime-gpu "
            "(extra 'gpu', instead of 'onnx') on a machine with an NVIDIA GPU, or use "
            "device='cpu'"
        )
    try:
        extras = set(metadata("onnxruntime-gpu").get_all("Provides-Extra") or [])
    except PackageNotFoundError:  # a CUDA build from elsewhere (conda, a source build)
        extras = set()
    fix = (
        "pip install 'onnxruntime-gpu[cuda,cudnn]' and call onnxruntime.preload_dlls() first, "
        "or put them on the library path"
        if {"cuda", "cudnn"} <= extras
        else "put them on the library path"
    )
    return (
        f"device='cuda' was requested and onnxruntime {ort.__version__} lists its CUDA "
        f"provider, but it cannot start here: {status.reason}. It needs an NVIDIA GPU and the "
        f"CUDA and cuDNN libraries it was built for: {fix} ({_REQUIREMENTS}); or use "
        "device='cpu'"
    )


_REQUIREMENTS = (
    "https://onnxruntime.ai/docs/execution-providers/CUDA-ExecutionProvider.html#requirements"
)


class OnnxSession:
    """An onnxruntime session on the best usable device, taking and returning NumPy arrays.

    Args:
        path: The ``.onnx`` file.
        device: ``"auto"`` (CUDA where usable, else CPU), ``"cpu"`` or ``"cuda"``.
        threads: Intra-op threads (``None``: onnxruntime's default).
        tf32: Let CUDA compute float32 convolutions and matrix products in TF32 (10-bit
            mantissas; onnxruntime's own default, faster on Ampere and later GPUs). Off here,
            so that a CUDA session computes the float32 maps the export's parity check accepts.

    Attributes:
        providers: The providers the session actually uses, best first.
        input_names, output_names: The graph's input and output names.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        device: Device = "auto",
        threads: int | None = None,
        tf32: bool = False,
    ) -> None:
        ort = require("onnxruntime")
        path = Path(path)
        if not path.is_file():
            raise InvalidInputError(f"ONNX file {path} does not exist")
        # The CUDA provider's option for cuBLAS's and cuDNN's float32 math.
        cuda = (CUDA, {"use_tf32": "1" if tf32 else "0"})
        requested = [cuda if name == CUDA else name for name in choose_providers(device)]
        self.session = ort.InferenceSession(
            str(path), sess_options=session_options(threads=threads), providers=requested
        )
        self.providers: list[str] = list(self.session.get_providers())
        self._declared = self.session.get_inputs()  # names, element types and shapes
        self.input_names = [i.name for i in self._declared]
        self.output_names = [o.name for o in self.session.get_outputs()]
        logits = self.session.get_outputs()[0].shape
        # An explained graph with a target input: its first output's classes bound the targets.
        self._classes = (
            logits[1]
            if TARGET in self.input_names and len(logits) == 2 and isinstance(logits[1], int)
            else None
        )

    @property
    def provider(self) -> str:
        """The provider that runs the graph (the first one in use)."""
        return self.providers[0]

    def run(self, *inputs: Any, **named: Any) -> list[np.ndarray]:
        """Run the graph on inputs given in order or by name (tensors or arrays).

        Raises:
            InvalidInputError: For a wrong number or unknown names of inputs, or targets outside
                ``[0, classes)`` for an explained graph with a target input (the graph itself
                returns NaN maps for them).
        """
        feeds = self._feeds(inputs, named)
        if self._classes is not None:
            _check_targets(feeds[TARGET], self._classes)
        for declared in self._declared:
            feeds[declared.name] = _fitted(declared, feeds[declared.name])
        if TARGET in feeds and len(feeds) == 2:  # an explained graph: one class per sample
            rows = {name: len(array) for name, array in feeds.items() if array.ndim}
            if len(set(rows.values())) > 1:
                raise InvalidInputError(
                    "give one target per sample; got "
                    + ", ".join(f"{name}: {count} rows" for name, count in rows.items())
                )
        return self.session.run(None, feeds)

    def _feeds(self, inputs: Sequence[Any], named: Mapping[str, Any]) -> dict[str, np.ndarray]:
        if inputs and named:
            raise InvalidInputError("give the inputs either in order or by name, not both")
        if inputs:
            if len(inputs) != len(self.input_names):
                raise InvalidInputError(
                    f"the graph takes {len(self.input_names)} inputs "
                    f"({', '.join(self.input_names)}); got {len(inputs)}"
                )
            named = dict(zip(self.input_names, inputs, strict=True))
        unknown = sorted(set(named) - set(self.input_names))
        missing = sorted(set(self.input_names) - set(named))
        if unknown or missing:
            raise InvalidInputError(
                f"the graph takes inputs {', '.join(self.input_names)}; "
                f"missing {missing or 'none'}, unknown {unknown or 'none'}"
            )
        return {name: _as_array(value) for name, value in named.items()}

    def __repr__(self) -> str:
        return f"OnnxSession(providers={self.providers}, inputs={self.input_names})"


def _check_targets(target: np.ndarray, classes: int) -> None:
    if not np.issubdtype(target.dtype, np.integer):
        raise InvalidInputError(
            f"target must hold integer class indices (int64, one per sample); got {target.dtype}"
        )
    bad = np.flatnonzero((target < 0) | (target >= classes))
    if bad.size:
        shown = ", ".join(f"sample {i}: {int(target.flat[i])}" for i in bad[:5])
        raise InvalidInputError(
            f"target must lie in [0, {classes - 1}] for a graph with {classes} classes; got "
            f"{shown}{' …' if bad.size > 5 else ''}"
        )


# onnxruntime's names of the element types an exported graph's inputs have
_ELEMENT_TYPES = {
    "tensor(float)": np.float32,
    "tensor(double)": np.float64,
    "tensor(float16)": np.float16,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(bool)": np.bool_,
}


def _fitted(declared: Any, array: np.ndarray) -> np.ndarray:
    """``array`` checked against the graph's input ``declared`` (integers widened to it).

    Only an exported graph's named axes (its batch) are dynamic: every other size, and the
    rank, is the export's. Raises InvalidInputError naming the input otherwise (onnxruntime's
    own error names a node).
    """
    dtype = _ELEMENT_TYPES.get(declared.type)
    if dtype is not None and array.dtype != dtype:
        if np.issubdtype(dtype, np.integer) and np.can_cast(array.dtype, dtype, "safe"):
            array = array.astype(dtype)  # class indices: int32 → int64 loses nothing
        else:
            raise InvalidInputError(
                f"input {declared.name!r} must be {np.dtype(dtype).name}, the type the graph "
                f"was exported with; got {array.dtype.name} (convert it: "
                f"x.to(torch.{np.dtype(dtype).name}) or array.astype(np.{np.dtype(dtype).name}))"
            )
    shape = declared.shape
    if not shape:  # a scalar, or a graph that declares no shape: onnxruntime checks it
        return array
    fixed = [(axis, size) for axis, size in enumerate(shape) if isinstance(size, int)]
    if array.ndim != len(shape) or any(array.shape[axis] != size for axis, size in fixed):
        wanted = ", ".join(str(size) if size is not None else "?" for size in shape)
        raise InvalidInputError(
            f"input {declared.name!r} must have shape ({wanted}), as exported (only its "
            f"named axes may differ); got {tuple(array.shape)}: export again with inputs of "
            "the sizes to run on"
        )
    return array


def _as_array(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor, without importing torch here
        value = value.detach().cpu().numpy()
    return np.ascontiguousarray(value)
