"""Errors of the modified-backpropagation plugin (subclasses of the core's user errors)."""

from __future__ import annotations

from explain_core.errors import InvalidInputError, UnsupportedModelError

__all__ = ["PatternMismatchError", "UnsupportedModelError", "op_hint"]

RULE_HINT = (
    "To explain such a model with LRP, map the module to a rule: explain(model, x, "
    "'lrp.custom', composite=explain_modbp.composites.lrp_epsilon_plus().with_rules(({type}, "
    "MyRule()))) where MyRule subclasses explain_core.Rule (explain_core.AffineRule for "
    "layers with weights); or rewrite the forward with supported operations "
    "(Linear/Conv/BatchNorm modules, ReLU, +, -, cat, view/flatten, pooling, dropout in eval mode)"
)
SOFTMAX_HINT = (
    "Relevance methods explain the scores before normalisation: explain a model that returns "
    "the logits (leave out its final {type}, e.g. nn.Sequential(*list(model)[:-1]))"
)


# Supported ways to write what a model's own forward does with an unsupported operation.
_OP_ALTERNATIVES = {
    "max": "for global max pooling use F.adaptive_max_pool2d(x, 1) (or nn.AdaptiveMaxPool*d)",
    "amax": "for global max pooling use F.adaptive_max_pool2d(x, 1) (or nn.AdaptiveMaxPool*d)",
    "clamp": "for clamp(min=0) use F.relu",
    "clamp_min": "for clamp_min(0) use F.relu",
    "clamp_min_": "for clamp_min_(0) use F.relu(x, inplace=True)",
    "clamp_": "for clamp_(min=0) use F.relu(x, inplace=True)",
    "clip": "for clip(min=0) use F.relu",
    "threshold": "for a threshold at 0 use F.relu",
    "detach": "keep the path to the output differentiable (a detached tensor carries no relevance)",
    "data": "use the tensor itself, not .data (which is detached and carries no relevance)",
    **dict.fromkeys(
        ["gt", "lt", "ge", "le", "eq", "ne", "where"],
        "a comparison of activations (a mask, torch.where, a maximum of two tensors) has no "
        "relevance rule; use F.relu or max pooling where that is what it computes",
    ),
}


def op_hint(op: str, type_name: str, *, leaf: bool) -> str:
    """What to do about an unsupported operation ``op`` in a module of type ``type_name``.

    A leaf module (e.g. a custom activation) can be mapped to a rule; an operation written in a
    forward that also calls submodules (the model's own, say) is better rewritten.
    """
    if op in ("softmax", "log_softmax"):
        if leaf:
            return SOFTMAX_HINT.format(type=type_name)
        return (
            "Relevance methods explain the scores before normalisation: let forward return the "
            f"logits (leave out the {op})"
        )
    if op in _OP_ALTERNATIVES:
        return f"Rewrite it: {_OP_ALTERNATIVES[op]}."
    if leaf:
        return RULE_HINT.format(type=type_name)
    return (
        "Rewrite that forward with supported operations (Linear/Conv/BatchNorm modules, ReLU, +, "
        "-, cat, view/flatten, pooling, dropout in eval mode), or move the operation into a "
        "module of its own and map that module to a rule (for LRP: explain(model, x, "
        "'lrp.custom', composite=explain_modbp.composites.lrp_epsilon_plus().with_rules("
        "(MyModule, MyRule()))) where MyRule subclasses explain_core.Rule)"
    )


class PatternMismatchError(InvalidInputError):
    """Patterns that were fitted on a different architecture than the model being explained."""
