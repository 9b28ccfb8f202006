"""The three interfaces plugins build on: dynamic-linear layers, routing layers, relevance rules."""

from explain_core.interfaces.dynamic_linear import (
    Contributions,
    DynamicLinear,
    dynamic_linear_contributions,
    dynamic_linear_rows,
    explanation_mode,
)
from explain_core.interfaces.relevance import (
    Canonizer,
    Composite,
    CompositeSpec,
    ModifiedGradient,
    Op,
    Rule,
    RuleCall,
)
from explain_core.interfaces.routing import (
    RoutedBatches,
    RoutingEvent,
    RoutingLayer,
    RoutingRecording,
    record_routing,
    record_routing_batches,
)

__all__ = [
    "Canonizer",
    "Composite",
    "CompositeSpec",
    "Contributions",
    "DynamicLinear",
    "ModifiedGradient",
    "Op",
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
]
