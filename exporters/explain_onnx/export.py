"""Export a model, or a model with its explanation, to ONNX with a dynamic batch axis.

The path is ``torch.export.export`` (non-strict) → ``torch.onnx.export`` (the torch.export-based
exporter, which needs ``onnxscript``) → the full ONNX checker → parity against PyTorch in
onnxruntime. The graph is written beside its destination and moved into place only when every
check passed, so a failed export leaves no file behind. Errors say what to change: a model in
training mode, an output path that cannot be written, model code that branches on tensor values,
an operator without an ONNX translation (named with the module that called it), a parity failure.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import linecache
import logging
import os
import re
import textwrap
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.backends.opt_einsum  # not imported with torch before 2.9
from torch import nn

from explain_core.eager import eager_mode, uncompiled_tree
from explain_core.errors import (
    ExplainError,
    ExportError,
    InvalidInputError,
    ModelStateError,
    UnsupportedOperatorError,
)
from explain_core.files import check_output_path, temporary_beside
from explain_core.validation import check_inputs, run_once
from explain_onnx._deps import require
from explain_onnx.adapters import exportable
from explain_onnx.axes import name_batch_axis
from explain_onnx.explained import InvalidTargetsAsNaN, explained_module, get_explainer
from explain_onnx.foldable import cast_like_as_cast
from explain_onnx.parity import BATCH_SIZES, ParityReport, check_graph, check_parity
from explain_onnx.runtime import CPU, SILENT, OnnxSession, identity_probe, session_options
from explain_onnx.translations import onnx_translations

MAX_INLINE_BYTES = 1_800_000_000  # ONNX protobufs stop at 2 GB
# torch.onnx builds opset-18 graphs and converts them down with onnx's version converter, which
# has no adapter below opset 15 for Shape (in every graph that reshapes with a dynamic batch
# axis), nor below 14 for Add, Mul and Reshape. Opsets 15-17 work for some models (Conv, Linear,
# capsule nets) but not for others (Pad, in CoDA-Nets); the export says which.
MIN_OPSET = 15
TRANSLATION_OPSET = 18  # torchlib's functions are written at this opset


@dataclass
class ExportResult:
    """What :func:`export_onnx` wrote and checked.

    Attributes:
        path: The ``.onnx`` file.
        input_names: ``["input"]``, or ``["input", "target"]`` with a class input.
        output_names: ``["logits"]``, or ``["logits", "explanation"]``.
        method: The exported explanation method, or ``None``.
        opset: The ONNX opset of the default domain.
        parity: The parity report (``None`` when parity was skipped).
    """

    path: Path
    input_names: list[str]
    output_names: list[str]
    method: str | None
    opset: int
    parity: ParityReport | None

    def summary(self) -> str:
        """A few lines: file, signature, opset, parity and provider."""
        lines = [
            f"exported {self.path} (opset {self.opset}): "
            f"({', '.join(self.input_names)}) -> ({', '.join(self.output_names)}), dynamic batch"
        ]
        if self.parity is not None:
            lines.append(self.parity.summary())
            lines.append(f"provider: {self.parity.providers[0]}")
        return "\n".join(lines)


@eager_mode()  # a compiled model (or submodule) is exported as its eager self
def export_onnx(
    model: nn.Module,
    example_inputs: torch.Tensor,
    path: str | Path,
    *,
    explain: str | None = None,
    target_input: bool = False,
    opset: int | None = None,
    parity: bool = True,
    real_inputs: bool = True,
    batch_sizes: tuple[int, ...] = BATCH_SIZES,
    **options: Any,
) -> ExportResult:
    """Export ``model`` (with the explanation ``explain``) to ``path`` and check it.

    Args:
        model: A model in eval mode returning ``(batch, classes)`` scores.
        example_inputs: A batch of inputs: shapes for tracing, values for parity (with random
            inputs of the same value range).
        path: Destination ``.onnx`` file; its folder is created if needed.
        explain: An exportable method (see :func:`explain_onnx.available_explainers`); the graph
            then returns ``(logits, explanation)``.
        target_input: With ``explain``: take the class to explain as a second input (int64
            ``(batch,)``) instead of explaining the predicted class.
        opset: ONNX opset to target, from 15 to the newest that both the installed onnx and
            onnxruntime know (default: the exporter's). torch.onnx builds graphs at opset 18
            and converts them to others; an opset it cannot convert the model to is refused,
            not silently replaced.
        parity: Run the checker and compare onnxruntime with PyTorch (strongly recommended).
        real_inputs: Whether ``example_inputs`` are real samples (as opposed to random ones);
            only labels the parity report.
        batch_sizes: Batch sizes compared in the parity check (positive ints).
        **options: Options of the explanation method (e.g. ``levels=11``).

    Returns:
        The result, with the parity report.

    Raises:
        ModelStateError: If a module of the model is in training mode.
        UnknownMethodError: For a method no plugin registers (with the closest names).
        InvalidInputError: For an unwritable path, inputs the model cannot run on, a model
            that does not return one tensor of scores, a method that does not export, an
            opset outside the supported range or bad batch sizes.
        UnsupportedOperatorError: For an operator without ONNX translation.
        ExportError: If tracing, the conversion to ``opset`` or the checker fails, or
            onnxruntime cannot load the graph.
        ParityError: If onnxruntime and PyTorch disagree beyond the tolerances.
        MissingDependencyError: Without onnx, onnxscript or onnxruntime.
    """
    if not isinstance(model, nn.Module):
        raise InvalidInputError(f"expected a torch.nn.Module; got {type(model).__name__}")
    model = uncompiled_tree(model)
    check_eval_mode(model)
    devices = {t.device.type for t in [*model.parameters(), *model.buffers()]}
    if devices - {"cpu"}:
        raise InvalidInputError(
            f"the model's tensors are on {', '.join(sorted(devices))}; export from the CPU "
            "(model.cpu()): the exported graph runs on a GPU through onnxruntime's CUDA provider "
            "all the same"
        )
    if target_input and explain is None:
        raise InvalidInputError("target_input=True needs an explanation method (explain=...)")
    if options and explain is None:
        raise InvalidInputError(f"options {sorted(options)} need an explanation method")
    path = check_output_path(path)
    batch_sizes = _check_batch_sizes(batch_sizes)
    example = check_inputs(example_inputs, model, name="example_inputs")
    for module in ("onnx", "onnxscript", "onnxruntime"):
        require(module)
    check_opset(opset)

    spec = get_explainer(explain) if explain is not None else None
    logits = run_once(
        model,
        example,
        name="example_inputs",
        hint="give inputs of the shape the model was built for",
    )
    num_classes = int(logits.shape[1]) if logits.dim() == 2 else 0
    if spec is not None and num_classes == 0:
        raise InvalidInputError(
            f"the model must return scores of shape (batch, classes); got {tuple(logits.shape)}"
        )
    # Two samples: a batch of one would let torch.export specialise the batch axis to 1.
    tracing_example = example[torch.arange(2) % len(example)]
    if spec is not None:
        try:  # the explanation is traced into a graph here, before torch.export sees it
            module = explained_module(
                model, spec.name, tracing_example, target_input=target_input, **options
            )
        except ExplainError:
            raise
        except Exception as error:
            raise _tracing_error(error, type(model).__name__) from error
        if target_input:
            module = InvalidTargetsAsNaN(module)
    else:
        module = exportable(model)
    input_names = ["input", "target"] if target_input else ["input"]
    output_names = ["logits", "explanation"] if spec is not None else ["logits"]
    args: tuple[torch.Tensor, ...] = (tracing_example,)
    if target_input:
        args += (torch.zeros(len(tracing_example), dtype=torch.long),)

    program = trace(module, args, model_name=type(model).__name__)
    onnx_program = convert(program, input_names, output_names, opset)
    opset_used = _default_opset(onnx_program)
    if opset is not None and opset_used != opset:
        # torch.onnx keeps its own opset when it cannot convert the graph, and only logs that.
        lowest = _lowest_convertible(program, input_names, output_names, opset + 1, opset_used)
        raise ExportError(
            f"torch.onnx could not convert {type(model).__name__} to opset {opset} (some "
            f"operator has no conversion) and wrote opset {opset_used} instead; choose opset "
            f"{lowest} or higher (the lowest it converts to), or leave the opset unset"
        )

    report = None
    with temporary_beside(path, suffix=".onnx") as temporary:
        _save(onnx_program, temporary, model)
        check_graph(temporary)
        if parity:

            def reference(x: torch.Tensor, target: torch.Tensor | None) -> list[torch.Tensor]:
                if spec is None:
                    with torch.no_grad():
                        return [model(x)]
                return list(spec.reference(model, x, target, **options))

            # The float64 copy, made only if a map needs it.
            float64_twin = functools.cache(lambda: copy.deepcopy(model).double())

            def reference64(x: torch.Tensor, target: torch.Tensor | None) -> list[torch.Tensor]:
                return list(spec.reference(float64_twin(), x, target, **options))

            report = check_parity(
                temporary,
                reference,
                example,
                session=_open_session(temporary, opset_used),
                num_classes=num_classes,
                target_input=target_input,
                explained=spec is not None,
                batch_sizes=batch_sizes,
                real_source="real" if real_inputs else "example",
                reference64=reference64 if spec is not None else None,
            )
        os.replace(temporary, path)
    return ExportResult(path, input_names, output_names, explain, opset_used, report)


def _check_batch_sizes(batch_sizes: Any) -> tuple[int, ...]:
    sizes = tuple(batch_sizes) if isinstance(batch_sizes, (tuple, list)) else ()
    if not sizes or not all(_is_int(b) and b >= 1 for b in sizes):
        raise InvalidInputError(
            f"batch_sizes must be one or more positive ints, e.g. {BATCH_SIZES}; "
            f"got {batch_sizes!r}"
        )
    return sizes


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_opset(opset: Any, *, name: str = "opset") -> None:
    """Refuse an opset the export cannot produce or onnxruntime cannot load, before exporting.

    Args:
        opset: The requested opset, or ``None`` for the exporter's default.
        name: How the caller calls it in messages (the CLI: ``--opset``).

    Raises:
        InvalidInputError: Giving the range that works here.
        MissingDependencyError: Without onnx or onnxruntime.
    """
    newest = int(require("onnx").defs.onnx_opset_version())
    if opset is None:
        return
    runtime = newest_runtime_opset()
    if runtime is not None and runtime < newest:
        newest = runtime
        why = f"the newest onnxruntime {require('onnxruntime').__version__} loads"
    else:
        why = "the newest the installed onnx knows"
    if not _is_int(opset) or not MIN_OPSET <= opset <= newest:
        raise InvalidInputError(
            f"{name} must be an int from {MIN_OPSET} to {newest} (below {MIN_OPSET}, onnx cannot "
            f"convert torch.onnx's opset-18 graphs; {newest} is {why}); leave it out for the "
            f"exporter's default; got {opset!r}"
        )


@functools.cache
def newest_runtime_opset() -> int | None:
    """The newest default-domain opset the installed onnxruntime loads (cached), if any.

    Found by loading a one-node graph at each opset the installed onnx knows, newest first:
    onnxruntime refuses opsets newer than its release supports when it loads a graph.
    """
    onnx, ort = require("onnx"), require("onnxruntime")
    for opset in range(int(onnx.defs.onnx_opset_version()), MIN_OPSET - 1, -1):
        try:
            ort.InferenceSession(
                identity_probe(opset),
                sess_options=session_options(severity=SILENT),
                providers=[CPU],
            )
        except Exception:  # onnxruntime raises its own Fail / InvalidGraph types
            continue
        return opset
    return None


def _open_session(path: Path, opset: int) -> OnnxSession:
    """An onnxruntime session for the parity check; a graph it cannot load is an export error."""
    try:
        return OnnxSession(path)
    except ExplainError:
        raise
    except Exception as error:  # onnxruntime raises its own Fail / InvalidGraph types
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        version = require("onnxruntime").__version__
        newest = newest_runtime_opset()
        if "Could not find an implementation" in first:  # a kernel missing for the types
            advice = (
                "onnxruntime has no kernel for that operator in the graph's element type (a "
                "float64 Conv on the CPU, for one): export in float32 (model.float() and "
                "float32 inputs)"
            )
        elif newest is not None and opset > newest:
            advice = f"choose opset {newest} or lower"
        else:
            advice = "choose a lower opset"
        raise ExportError(
            f"onnxruntime {version} cannot load the exported graph (opset {opset}): "
            f"{textwrap.shorten(first, 300, placeholder=' …')}; {advice}"
        ) from error


def check_eval_mode(model: nn.Module) -> None:
    """Refuse a model with any module in training mode.

    Raises:
        ModelStateError: Naming the first such module.
    """
    training = [name or type(model).__name__ for name, m in model.named_modules() if m.training]
    if training:
        raise ModelStateError(
            f"the model is in training mode (module {training[0]!r}"
            f"{f' and {len(training) - 1} more' if len(training) > 1 else ''}); call model.eval() "
            "before exporting, so that dropout and batch norm are exported as used for inference"
        )


def trace(module: nn.Module, args: tuple[torch.Tensor, ...], *, model_name: str) -> Any:
    """``torch.export.export`` with the batch axis of every input dynamic.

    Raises:
        ExportError: For model code that branches on tensor values or fixes the batch size,
            with the file and line that did.
    """
    batch = torch.export.Dim("batch", min=1)
    dynamic = tuple({0: batch} for _ in args)
    try:
        with _quiet():
            return torch.export.export(module, args, dynamic_shapes=dynamic, strict=False)
    except Exception as error:
        raise _tracing_error(error, model_name) from error


def convert(
    program: Any, input_names: list[str], output_names: list[str], opset: int | None
) -> Any:
    """``torch.onnx.export`` of an exported program.

    Raises:
        UnsupportedOperatorError: Naming the operator and the module that called it.
        ExportError: For other conversion failures.
    """
    # torch.onnx translates at opset 18 and converts lower opsets with onnxscript's version
    # converter since torch 2.9; torch 2.8 translated at the requested opset, where torchlib has
    # no functions. Converting here does the same on every version.
    translated_at = TRANSLATION_OPSET if opset is not None and opset < TRANSLATION_OPSET else opset
    try:
        with _quiet():
            onnx_program = torch.onnx.export(
                program,
                dynamo=True,
                input_names=input_names,
                output_names=output_names,
                opset_version=translated_at,
                custom_translation_table=onnx_translations(),
                verbose=False,
                # onnxscript's optimizer (0.7) rewrites `x + c` to `x` for |c| ≤ 1e-8, dropping
                # the epsilons of norms (capsule lengths, DAU scaling): sqrt(q + 1e-8) became
                # sqrt(q), 1e-4 off at q = 0. onnxruntime optimises the graph when it loads it.
                optimize=False,
            )
            if translated_at != opset:
                # As torch.onnx does: keeps the opset and logs where no adapter converts a node.
                converter = require("onnxscript.version_converter")
                converter.convert_version(onnx_program.model, opset, fallback=True)
            return onnx_program
    except Exception as error:
        raise _conversion_error(error, program, opset) from error


def _lowest_convertible(
    program: Any, input_names: list[str], output_names: list[str], start: int, built: int
) -> int:
    """The lowest opset from ``start`` that torch.onnx converts ``program`` to (else ``built``)."""
    for opset in range(start, built):
        if _default_opset(convert(program, input_names, output_names, opset)) == opset:
            return opset
    return built


_OP_PATTERNS = (
    re.compile(r"No ONNX function found for <OpOverload\(op='([\w.]+)', overload='(\w+)'\)>"),
    re.compile(r"target=torch\.ops\.([\w.]+)\]"),
)


def _conversion_error(error: Exception, program: Any, opset: int | None) -> ExportError:
    text = str(error)
    operator = ""
    for pattern in _OP_PATTERNS:
        match = pattern.search(text)
        if match:
            operator = ".".join(g for g in match.groups() if g)
            break
    if not operator:
        detail = _last_summary_line(text)
        hint = f" (opset {opset})" if opset is not None else ""
        return ExportError(f"converting the traced model to ONNX{hint} failed: {detail}")
    module = _module_calling(program, operator)
    if module and "TracedGradientGraph" in module:  # the explanation's graph: no user module
        module = ""
    where = f" called by module {module}" if module else ""
    layer = _UNEXPORTED_LAYERS.get(operator.split(".default")[0].removesuffix("_backward"))
    replace = (
        f"it comes from {layer}"
        if layer
        else "replace that computation with standard layers or operations"
    )
    return UnsupportedOperatorError(
        f"the ONNX exporter has no translation for operator {operator}{where}; {replace}, or "
        "register a translation with torch.onnx.export(custom_translation_table=...)",
        operator=operator,
        module=module,
    )


# Layers whose backward (or forward) has no ONNX form here, and how to write them instead.
_UNEXPORTED_LAYERS = {
    "aten.avg_pool2d": (
        "average pooling with ceil_mode=True, or with padding and count_include_pad=False "
        "(write it with ceil_mode=False and count_include_pad=True, padding the input "
        "explicitly where needed)"
    ),
    "aten.adaptive_max_pool2d": (
        "adaptive max pooling (write it as nn.MaxPool2d with the window and stride the input "
        "size gives)"
    ),
}


def _module_calling(program: Any, operator: str) -> str:
    """``'name' (Type)`` of the innermost module around the first node calling ``operator``.

    The operator named by the ONNX translation may be a decomposition of the graph's node
    (``prims.bessel_j0`` of ``aten.special_bessel_j0``): failing an exact match, the node whose
    name contains the operator's base name counts.
    """
    graphs = [m for m in program.graph_module.modules() if isinstance(m, torch.fx.GraphModule)]
    nodes = [
        node
        for graph_module in graphs  # the top graph and those of no_grad regions etc.
        for node in graph_module.graph.nodes
        if node.op == "call_function"
    ]
    base = operator.split(".")[1] if operator.count(".") >= 2 else operator
    exact = [node for node in nodes if str(node.target) == operator]
    for node in exact or [node for node in nodes if base in str(node.target)]:
        stack = node.meta.get("nn_module_stack") or {}
        if stack:
            name, kind = list(stack.values())[-1]
            type_name = getattr(kind, "__name__", str(kind)).rsplit(".", 1)[-1]
            return f"{_strip_wrappers(name)!r} ({type_name})"
    return ""


def _strip_wrappers(name: str) -> str:
    # Adapters keep the user's model as ``model``; report the user's own module names.
    name = re.sub(r"^L\['self'\]\.?", "", name)
    for prefix in ("model.", "capsule_graph.model."):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name or "<root>"


_CALL_SITE = re.compile(r'File "([^"]+)", line (\d+), in (\w+)$', re.MULTILINE)


def _user_call_site(text: str) -> str:
    """`` at file:line in function: `code` `` of the last Python frame outside torch, or ``""``."""
    for file, line, function in reversed(_CALL_SITE.findall(text)):
        python_source = file.endswith(".py") or file.startswith("<")  # or <stdin>, <string>
        # torch 2.8 appends its C++ and CPython frames ("??", "…/Objects/call.c") to the error
        if not python_source or f"{os.sep}torch{os.sep}" in file:
            continue
        # the source line from the file itself: code typed into a REPL has none to quote
        code = linecache.getline(file, int(line)).strip()
        return f" at {Path(file).name}:{line} in {function}" + (f": `{code}`" if code else "")
    return ""


def _runs_packed_sequence(error: Exception) -> bool:
    """Whether a frame of the failed trace held a ``PackedSequence`` (a recurrent layer's input)."""
    packed = torch.nn.utils.rnn.PackedSequence
    frame = error.__traceback__
    while frame is not None:
        if any(isinstance(value, packed) for value in frame.tb_frame.f_locals.values()):
            return True
        frame = frame.tb_next
    return False


def _tracing_error(error: Exception, model_name: str) -> ExportError:
    text = str(error)
    where = _user_call_site(text)
    if _runs_packed_sequence(error):
        return ExportError(
            f"{model_name} runs a recurrent layer on a PackedSequence, which cannot be traced "
            "into a graph (its batch sizes are tensor values that decide the loop): export the "
            "model on padded sequences, without pack_padded_sequence"
        )
    if "data-dependent" in text or "GuardOnDataDependentSymNode" in text:
        return ExportError(
            f"{model_name} branches on tensor values{where}, which a graph cannot do; guard such "
            "checks with `if not torch.compiler.is_exporting():` or compute them with tensor "
            "operations (torch.where)"
        )
    if "Constraints violated" in text or "specialized" in text:
        return ExportError(
            f"{model_name} fixes the batch size{where}; use x.shape[0] or -1 in reshapes instead "
            f"of a constant batch size{_planned_einsum_hint()}"
        )
    return ExportError(
        f"{model_name} could not be traced into a graph{where}: {_last_summary_line(text)}"
    )


def _planned_einsum_hint() -> str:
    """Where opt_einsum is installed, why an einsum can fix the batch size too, and the way out."""
    planner = torch.backends.opt_einsum
    if not (planner.is_available() and planner.enabled):
        return ""
    return (
        "; with opt_einsum installed (as here) an einsum of three or more operands fixes it too, "
        "since torch plans its contraction order from concrete sizes: write it as einsums of two "
        "operands or matrix products, or export with torch.backends.opt_einsum.enabled = False"
    )


def _last_summary_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:
        if line.startswith("<class") and ">:" in line:
            return line.split(">:", 1)[1].strip()[:300]
    return (lines[0] if lines else "unknown error")[:300]


def _default_opset(onnx_program: Any) -> int:
    for entry in onnx_program.model_proto.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return int(entry.version)
    return 0


def _save(onnx_program: Any, path: Path, model: nn.Module) -> None:
    size = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    if size > MAX_INLINE_BYTES:
        raise ExportError(
            f"the model's tensors take {size / 1e9:.1f} GB; ONNX files with inline weights stop at "
            "2 GB and exports with external data are not supported yet"
        )
    with _quiet():
        onnx_program.save(str(path), external_data=False)
    cast_like_as_cast(path)
    name_batch_axis(path)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Keep torch.onnx's and torch.export's progress and advice logs off the console."""
    names = ("torch.onnx", "torch.export", "torch._export", "torch.fx.experimental.symbolic_shapes")
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    try:
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),
        ):
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
