"""ONNX export of models and their explanations, onnxruntime sessions and parity checks.

``export_onnx(model, x, "model.onnx", explain="coda.contributions")`` writes one graph returning
the logits and the explanation, with a dynamic batch axis, checked with the full ONNX checker and
against PyTorch in onnxruntime. ``OnnxSession`` runs it on CUDA where that really works, else on
the CPU, and reports the provider in use. The optional dependencies (the ``onnx`` extra: onnx,
onnxscript, onnxruntime) are imported only when a function needs them.

Modules: :mod:`~explain_onnx.export` (export and its errors), :mod:`~explain_onnx.explained`
(explained graphs; more methods come from plugins' ``explain_register_export_forms`` hooks),
:mod:`~explain_onnx.adapters` (export forms of the library's models),
:mod:`~explain_onnx.plugin` (this package as a plugin: command, demo step, forms, adapters),
:mod:`~explain_onnx.gradtrace` (gradient functions traced into graphs),
:mod:`~explain_onnx.runtime` (sessions), :mod:`~explain_onnx.parity` (checks).
"""

from explain_onnx.adapters import exportable
from explain_onnx.explained import available_explainers, explained_module, get_explainer
from explain_onnx.export import ExportResult, export_onnx
from explain_onnx.parity import ParityReport, check_graph, check_parity
from explain_onnx.runtime import OnnxSession, choose_providers, cuda_status, cuda_usable

__all__ = [
    "ExportResult",
    "OnnxSession",
    "ParityReport",
    "available_explainers",
    "check_graph",
    "check_parity",
    "choose_providers",
    "cuda_status",
    "cuda_usable",
    "explained_module",
    "export_onnx",
    "exportable",
    "get_explainer",
]
