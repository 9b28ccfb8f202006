"""What the engine's errors advise for a layer or operation it cannot propagate through."""

from __future__ import annotations

__all__ = ["ATTENTION_HINT", "RULE_HINT", "op_hint"]

_SUPPORTED = (
    "Linear/Conv/BatchNorm modules, ReLU, +, -, cat, view/flatten, pooling, dropout in eval mode"
)

RULE_HINT = (
    "To explain such a model, give the module a rule in the composite: "
    "composite.with_rules(({type}, MyRule())) where MyRule subclasses explain_core.Rule "
    "(explain_core.AffineRule for layers with weights); or rewrite the forward with supported "
    f"operations ({_SUPPORTED})"
)
SOFTMAX_HINT = (
    "If it is the model's last layer, relevance methods explain the scores before it: explain "
    "a model that returns the logits (leave the {type} out, e.g. "
    "nn.Sequential(*list(model)[:-1])). Inside the model it has no relevance rule: " + RULE_HINT
)

# Supported ways to write what a model's own forward does with an unsupported operation.
_OP_ALTERNATIVES = {
    "max": (
        "a maximum of two tensors is a comparison of activations, which has no relevance rule "
        "(a maximum over dimensions, x.max(dim) or x.amax(dim), is max pooling and has one); "
        "use F.relu where that is what it computes"
    ),
    **dict.fromkeys(
        ["clamp", "clamp_", "clip", "clip_", "clamp_min", "clamp_min_"],
        "for clamp(min=0) use F.relu, for clamp(0, 6) F.relu6, for clamp(-1, 1) F.hardtanh, "
        "activations with relevance rules (a clamp away from 0, clamp(min=1e-6) before a "
        "power, has none)",
    ),
    "threshold": "for a threshold at 0 use F.relu",
    "detach": "keep the path to the output differentiable (a detached tensor carries no relevance)",
    "data": "use the tensor itself, not .data (which is detached and carries no relevance)",
    **dict.fromkeys(
        ["gt", "lt", "ge", "le", "eq", "ne", "where"],
        "a comparison of activations (a mask, torch.where, a maximum of two tensors) has no "
        "relevance rule; use F.relu or max pooling where that is what it computes (an "
        "equality test of the model input as given, x != 0 for its padding, is a constant "
        "and needs none)",
    ),
}


# Operations of attention models, which AttnLRP and CP-LRP give rules.
_ATTENTION_OPS = frozenset({"softmax", "matmul", "bmm", "einsum", "scaled_dot_product_attention"})
ATTENTION_HINT = (
    "For an attention model (a transformer), explain with AttnLRP or CP-LRP, whose composites "
    "give layer_norm, softmax and products of activations their rules"
)
# Normalisations and products, which CNNs use too (ConvNeXt's LayerNorm, squeeze-excitation).
_NORM_OPS = frozenset({"layer_norm", "rms_norm", "group_norm", "instance_norm", "normalize"})
_NORM_HINT = (
    "The LRP composites give normalisations a rule (the normalising scale held constant), and "
    "so do AttnLRP and CP-LRP for attention models; methods without one (DeepLIFT, Guided BP, "
    "Excitation BP) refuse them"
)
_PRODUCT_HINT = (
    "The LRP composites give a product with a gate an activation made (squeeze-excitation, "
    "gating) a rule (the gate held constant, all relevance to the signal); for products of two "
    "activations in an attention model explain with AttnLRP or CP-LRP; methods without such "
    "rules (DeepLIFT, Guided BP, Excitation BP) refuse them"
)
_FAMILY_HINTS = {
    **dict.fromkeys(_ATTENTION_OPS, ATTENTION_HINT),
    **dict.fromkeys(_NORM_OPS, _NORM_HINT),
    **dict.fromkeys(("mul", "mul_"), _PRODUCT_HINT),
}


def op_hint(op: str, type_name: str, *, leaf: bool) -> str:
    """What to do about an unsupported operation ``op`` in a module of type ``type_name``.

    A leaf module (e.g. a custom activation) can be mapped to a rule; an operation written in a
    forward that also calls submodules (the model's own, say) is better rewritten, or given a
    rule by its kind.
    """
    if op in ("softmax", "log_softmax"):
        if leaf:
            return SOFTMAX_HINT.format(type=type_name)
        return (
            f"If it is the model's final {op}, relevance methods explain the scores before it: "
            f"let forward return the logits. {ATTENTION_HINT}."
        )
    if op in _FAMILY_HINTS:
        return f"{_FAMILY_HINTS[op]}; or give the operation a rule of your own ({_by_kind(op)})."
    if op in ("detach", "data"):  # a cut path: no rule can bring relevance across it
        return f"Rewrite it: {_OP_ALTERNATIVES[op]}."
    if op in _OP_ALTERNATIVES:
        return (
            f"Rewrite it: {_OP_ALTERNATIVES[op]}; or give the operation a rule of your own "
            f"({_by_kind(op)})."
        )
    if op == "stft" or op.startswith("fft_"):
        return (
            "A spectral front-end (an STFT, a Fourier transform) has no relevance rule: explain "
            "the model from its output (compute the spectrogram outside the model and pass it "
            "as the input), or explain the raw input with a gradient method"
        )
    if leaf:
        return RULE_HINT.format(type=type_name)
    return (
        f"Rewrite that forward with supported operations ({_SUPPORTED}), give the operation a "
        f"rule by its kind ({_by_kind(op)}), or move it into a module of its own and give that "
        "module a rule"
    )


def _by_kind(op: str) -> str:
    return (
        f"composite.with_rules((explain_core.Op({op!r}), MyRule())) where MyRule subclasses "
        "explain_core.Rule"
    )
