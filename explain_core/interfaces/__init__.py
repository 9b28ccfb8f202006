"""The three interfaces plugins build on: dynamic-linear layers, routing layers, relevance rules."""

from explain_core.interfaces.dynamic_linear import (
    Contributions,
    DynamicLinear,
    dynamic_linear_contributions,
    dynamic_linear_rows,
    explanation_mode,
)
from explain_core.interfaces.relevance import (
    AffineRule,
    CompositeSpec,
    Gradient,
    InputLayer,
    InputPath,
    ModifiedGradient,
    Op,
    OutputLayer,
    Rule,
    RuleCall,
    safe_divide,
)
from explain_core.interfaces.routing import (
    RoutedBatches,
    RoutingEvent,
    RoutingLayer,
    RoutingRecording,
    record_routing,
    record_routing_batches,
    routing_in_eval_mode,
)

__all__ = [
    "AffineRule",
    "CompositeSpec",
    "Contributions",
    "DynamicLinear",
    "Gradient",
    "InputLayer",
    "InputPath",
    "ModifiedGradient",
    "Op",
    "OutputLayer",
    "RoutedBatches",
    "RoutingEvent",
    "RoutingLayer",
    "RoutingRecording",
    "Rule",
    "RuleCall",
    "dynamic_linear_contributions",
    "dynamic_linear_rows",
    "explanation_mode",
    "record_routing",
    "record_routing_batches",
    "routing_in_eval_mode",
    "safe_divide",
]
