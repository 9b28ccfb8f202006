"""explain_core: plugin-based explainability for PyTorch.

Quickstart::

    from explain_core import explain
    result = explain(model.eval(), images, method="input_x_gradient", target=labels)
    result.attribution  # same shape as images

Importing this package loads torch and the core interfaces only; plugins are loaded on first use
and optional dependencies (onnx, networkx, graphviz) only by the features that need them.
"""

from explain_core.affine import AffineLayer
from explain_core.api import Explainer, explain, quantus_explain
from explain_core.attribution import Attribution
from explain_core.canonizers import Canonizer, MergeBatchNorm
from explain_core.engine import Composite
from explain_core.errors import (
    DuplicateMethodError,
    ExplainError,
    InvalidInputError,
    ModelLoadError,
    ModelRunError,
    ModelStateError,
    NumericalError,
    OutOfMemoryError,
    UnknownMethodError,
    UnsupportedModelError,
)
from explain_core.hookspecs import hookimpl
from explain_core.interfaces import (
    AffineRule,
    Contributions,
    DynamicLinear,
    Gradient,
    InputLayer,
    ModifiedGradient,
    Op,
    OutputLayer,
    RoutingEvent,
    RoutingLayer,
    RoutingRecording,
    Rule,
    RuleCall,
    dynamic_linear_contributions,
    explanation_mode,
    record_routing,
)
from explain_core.model_guard import ModelGuard
from explain_core.plugin_manager import get_plugin_manager, get_registry, package_version
from explain_core.registry import Method, MethodResult, MethodSpec
from explain_core.tokens import TokenAttribution, explain_inputs, explain_tokens

__version__ = package_version()

__all__ = [
    "AffineLayer",
    "AffineRule",
    "Attribution",
    "Canonizer",
    "Composite",
    "Contributions",
    "DuplicateMethodError",
    "DynamicLinear",
    "ExplainError",
    "Explainer",
    "Gradient",
    "InputLayer",
    "InvalidInputError",
    "MergeBatchNorm",
    "Method",
    "MethodResult",
    "MethodSpec",
    "ModelGuard",
    "ModelLoadError",
    "ModelRunError",
    "ModelStateError",
    "ModifiedGradient",
    "NumericalError",
    "Op",
    "OutOfMemoryError",
    "OutputLayer",
    "RoutingEvent",
    "RoutingLayer",
    "RoutingRecording",
    "Rule",
    "RuleCall",
    "TokenAttribution",
    "UnknownMethodError",
    "UnsupportedModelError",
    "__version__",
    "dynamic_linear_contributions",
    "explain",
    "explain_inputs",
    "explain_tokens",
    "explanation_mode",
    "get_plugin_manager",
    "get_registry",
    "hookimpl",
    "quantus_explain",
    "record_routing",
]
