"""The three interfaces plugins build on: dynamic-linear layers, routing layers, relevance rules."""

from explain_core.interfaces.dynamic_linear import (
    Contributions,
    DynamicLinear,
    dynamic_linear_contributions,
    dynamic_linear_rows,
    explanation_mode,
)
from explain_core.interfaces.relevance import Canonizer, Composite, Rule, RuleCall
from explain_core.interfaces.routing import (
    RoutingEvent,
    RoutingLayer,
    RoutingRecording,
    record_routing,
)

__all__ = [
    "Canonizer",
    "Composite",
    "Contributions",
    "DynamicLinear",
    "RoutingEvent",
    "RoutingLayer",
    "RoutingRecording",
    "Rule",
    "RuleCall",
    "dynamic_linear_contributions",
    "dynamic_linear_rows",
    "explanation_mode",
    "record_routing",
]
