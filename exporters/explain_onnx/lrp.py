"""LRP composites (``lrp.*``, ``excitation_bp``) as exportable graphs: the engine's rules, traced.

Nothing about a rule is restated here. The modified-backprop engine (:mod:`explain_modbp.engine`)
attaches every rule through a forward hook that returns the layer's output values through a small
autograd function whose backward is the rule (``rule.prepare`` in the forward pass,
``rule.signal_backward`` in the backward pass, both plain tensor code over
:class:`~explain_modbp.AffineLayer`'s convolution and transposed convolution). This module

1. resolves the composite of the method (its options included) and traces the model once with
   the engine's own checks (:func:`explain_modbp.tracing.trace`: which layer gets which rule,
   which BatchNorm is merged into which Linear/Conv, which layers read non-negative inputs);
2. attaches the engine's hooks for that plan and traces *the whole attribution* — forward pass,
   the explained logit's one-hot signal (or ``1 / f_t(x)`` for Excitation BP), the backward pass
   through the rules, ``x ⊙ signal`` — with ``make_fx(tracing_mode="symbolic")`` over
   ``torch.func.functional_call`` (:mod:`explain_onnx.gradtrace`), so the batch axis stays
   dynamic and the rules' backward operators (transposed convolutions, max-pool index scatters)
   are decomposed into standard ONNX operators.

One adjustment is needed for a graph: LRP-αβ / z⁺ / γ decides per call whether a layer's input is
non-negative (``bool((x >= 0).all())``, a branch on tensor values) unless the engine proved it
(input after a ReLU). For the other layers (the input layer, typically) the exported graph always
takes the rule's signed-input form (``x = x⁺ + x⁻``: the rule's own ``prepare_for(...,
nonnegative=False)`` and backward); for non-negative inputs both forms give the same
relevance (the ``x⁻`` terms are zero), which the parity check confirms on every export.

Exportable: every method of the plugin defined by one composite (``lrp.z``, ``lrp.epsilon``,
``lrp.zplus``, ``lrp.alpha_beta``/``lrp.alpha2beta1``, ``lrp.gamma``, ``lrp.w2``, ``lrp.flat``,
``lrp.epsilon_plus``, ``lrp.cmp``, ``excitation_bp``, ``excitation_bp.contrastive``) for models
the engine supports (Linear/Conv/BatchNorm, ReLU, pooling, zero/reflect/replicate/circular
padding, flatten, additions, tensors made inside ``forward``, …). Not
exportable: ``lrp.zb`` (its bounds check branches on values), ``lrp.contrastive`` (two backward
passes; not one composite).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from explain_core.errors import InvalidInputError

# Methods of one composite whose rules branch on tensor values in the forward pass.
UNSUPPORTED = {"lrp.zb": "the z^B rule checks its input bounds with a branch on tensor values"}


def composite_methods() -> dict[str, Any]:
    """Registered method name → spec, for the plugin's one-composite methods."""
    from explain_modbp import method_specs
    from explain_modbp.methods import CompositeMethod

    return {
        spec.name: spec
        for spec in method_specs()
        if isinstance(spec.factory, type)
        and issubclass(spec.factory, CompositeMethod)
        and spec.name not in UNSUPPORTED
    }


class _SignedInputs:
    """A rule with a value branch on its input's sign (αβ, z⁺, γ), always in its signed form.

    ``prepare`` is the wrapped rule's :meth:`~explain_modbp.AlphaBeta.prepare_for` with
    ``nonnegative=False`` (exact for inputs of any sign); the backward is the rule's own.
    """

    relevance_output = False
    passes_gradient = False

    def __init__(self, rule: Any) -> None:
        self.rule = rule

    def prepare(self, layer: Any, x: torch.Tensor, z: torch.Tensor) -> Any:
        return self.rule.prepare_for(layer, x, z, nonnegative=False)

    def signal_backward(self, layer: Any, state: Any, x: Any, z: Any, signal: Any) -> Any:
        return self.rule.signal_backward(layer, state, x, z, signal)

    def relevance_backward(self, layer: Any, state: Any, x: Any, relevance: Any) -> Any:
        return self.rule.relevance_backward(layer, state, x, relevance)

    def attach(self, engine_pass: Any, layer: Any, x: Any, output: Any) -> Any:
        return engine_pass.apply_rule(self, layer, x, output)


def _graph_rules(plan: Any) -> Any:
    """The plan with value-branching rules replaced by their branch-free forms."""
    from explain_modbp.rules import AlphaBeta, Gamma

    rules = dict(plan.rules)
    for name, rule in plan.rules.items():
        if isinstance(rule, AlphaBeta | Gamma) and name not in plan.nonnegative_inputs:
            rules[name] = _SignedInputs(rule)
    return replace(plan, rules=rules)


def lrp_graph(
    model: nn.Module,
    method: str,
    example: torch.Tensor,
    *,
    target_input: bool,
    **options: Any,
) -> nn.Module:
    """A module ``(x[, target]) → (logits, relevance)`` of the LRP method ``method``.

    Raises:
        InvalidInputError: For a method without a composite, invalid options, or a model the
            engine does not support (``UnsupportedModelError``, naming the module).
    """
    from explain_core.scoped import listening
    from explain_modbp.attach import RulePass
    from explain_modbp.base import safe_divide
    from explain_modbp.tracing import trace
    from explain_onnx.gradtrace import logits_and_selector, trace_explanation

    specs = composite_methods()
    if method not in specs:
        raise InvalidInputError(
            f"{method!r} is not an exportable LRP method "
            f"({UNSUPPORTED.get(method, 'not one composite')})"
        )
    engine = specs[method].create(**options)
    composite = engine.build_composite()
    if composite.canonizers:
        raise InvalidInputError(f"the composite of {method!r} uses canonizers; they do not export")
    plan = trace(model, example[:1].detach(), composite)
    if plan.custom:
        names = ", ".join(sorted(plan.custom))
        raise InvalidInputError(
            f"modules {names} have custom (non-affine) rules, which the ONNX export of "
            f"{method!r} does not support"
        )
    plan = _graph_rules(plan)
    start_one = getattr(engine, "start", "logit") == "one"

    def explained(state: dict[str, torch.Tensor], x: torch.Tensor, *target: torch.Tensor) -> Any:
        x = x.detach().requires_grad_(True)
        with listening(RulePass(model, plan, record=False)), torch.enable_grad():
            logits, signal = logits_and_selector(model, state, x, target)
            if start_one:  # relevance 1 at the explained output
                signal = safe_divide(signal, logits.detach())
            (input_signal,) = torch.autograd.grad(logits, x, signal)
        relevance = input_signal if plan.input_relevance_form else x.detach() * input_signal
        return logits.detach(), relevance.detach()

    return trace_explanation(model, explained, example, target_input=target_input)
