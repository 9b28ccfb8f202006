"""Errors of the modified-backpropagation plugin (subclasses of the core's user errors)."""

from __future__ import annotations

from explain_core.errors import InvalidInputError

RULE_HINT = (
    "To explain such a model, map the module to a rule in the composite, e.g. "
    "composite.with_rules(({type}, MyRule())) where MyRule subclasses explain_modbp.LayerRule "
    "(affine layers) or explain_core.Rule (any module), or rewrite the forward with supported "
    "operations (Linear/Conv/BatchNorm modules, ReLU, +, -, cat, view/flatten, pooling, "
    "dropout in eval mode)"
)
SOFTMAX_HINT = (
    "Relevance methods explain the scores before normalisation: explain a model that returns "
    "the logits (leave out its final {type}, e.g. nn.Sequential(*list(model)[:-1]))"
)


class UnsupportedModelError(InvalidInputError):
    """A layer, operation or structure that the rules cannot propagate through.

    Raised instead of silently letting the ordinary gradient through a part of the model.
    """


class PatternMismatchError(InvalidInputError):
    """Patterns that were fitted on a different architecture than the model being explained."""
