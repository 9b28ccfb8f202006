"""LRP composites (``lrp.*``, ``excitation_bp``) as exportable graphs: the engine's rules, traced.

Nothing about a rule is restated here. The relevance engine (:mod:`explain_core.engine`)
returns every ruled layer's output values through a small autograd function whose backward is
the rule (``rule.forward`` in the forward pass, ``rule.backward`` in the backward pass, both
plain tensor code over :class:`~explain_core.AffineLayer`'s convolution and transposed
convolution). This module

1. resolves the composite of the method (its options included) and traces the model once with
   the engine's own checks (:func:`explain_core.engine.tracing.trace`: which layer gets which
   rule, which BatchNorm is merged into which Linear/Conv, which layers read non-negative
   inputs);
2. attaches the engine's hooks for that plan and traces *the whole attribution* — forward pass,
   the explained logit's one-hot signal (or ``1 / f_t(x)`` for Excitation BP), the backward pass
   through the rules, ``x ⊙ signal`` — with ``make_fx(tracing_mode="symbolic")`` over
   ``torch.func.functional_call`` (:mod:`explain_onnx.gradtrace`), so the batch axis stays
   dynamic and the rules' backward operators (transposed convolutions, max-pool index scatters)
   are decomposed into standard ONNX operators.

One adjustment is needed for a graph: LRP-αβ / z⁺ / γ decides per call whether a layer's input is
non-negative (``bool((x >= 0).all())``, a branch on tensor values) unless the engine proved it
(input after a ReLU). The plan is traced ``branch_free``: the other layers (the input layer,
typically) get ``input_sign="signed"`` and the rules take their signed-input form
(``x = x⁺ + x⁻``), exact for inputs of either sign; for non-negative inputs both forms give the
same relevance (the ``x⁻`` terms are zero), which the parity check confirms on every export.
Operation rules see ``RuleCall.branch_free`` and take their branch-free forms too (LRP's pass
rule for activations computes ``f'(0)`` everywhere and selects it where ``x = 0``). Fused
attention is traced in its math form, as in the eager pass, so the attention methods
(``lrp.attn``, ``lrp.cp``) export with their operation rules.

Exportable: every method of the plugin defined by one composite (``lrp.z``, ``lrp.epsilon``,
``lrp.zplus``, ``lrp.alpha_beta``/``lrp.alpha2beta1``, ``lrp.gamma``, ``lrp.w2``, ``lrp.flat``,
``lrp.epsilon_plus``, ``lrp.cmp``, ``excitation_bp``, ``excitation_bp.contrastive``,
``lrp.attn``, ``lrp.cp``) for models the engine supports (Linear/Conv/BatchNorm, ReLU and other
activations, pooling, padding, flatten, additions, attention, tensors made inside ``forward``,
…). Not
exportable: ``lrp.zb`` (its bounds check branches on values), ``lrp.contrastive`` (two backward
passes; not one composite).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from explain_core.errors import InvalidInputError

# Methods of one composite whose rules branch on tensor values in the forward pass.
UNSUPPORTED = {
    name: "the z^B rule checks its input bounds with a branch on tensor values"
    for name in ("lrp.zb", "lrp.epsilon_gamma_box")
}


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
    from explain_core.engine.attach import OperationMode, RulePass
    from explain_core.engine.tracing import trace
    from explain_core.interfaces.relevance import safe_divide
    from explain_core.scoped import listening
    from explain_onnx.gradtrace import logits_and_selector, trace_explanation

    specs = composite_methods()
    if method not in specs:
        raise InvalidInputError(
            f"{method!r} is not an exportable LRP method "
            f"({UNSUPPORTED.get(method, 'not one composite')})"
        )
    engine = specs[method].create(**options)
    composite = engine.build_composite()
    plan = trace(model, example[:1].detach(), composite)
    plan = replace(plan, branch_free=True)  # rules take their forms exact for either sign
    start_one = getattr(engine, "start", "logit") == "one"

    def explained(state: dict[str, torch.Tensor], x: torch.Tensor, *target: torch.Tensor) -> Any:
        x = x.detach().requires_grad_(True)
        attached = RulePass(model, plan, record=False)
        attached.input = x
        with contextlib.ExitStack() as stack:
            stack.enter_context(listening(attached))
            stack.enter_context(torch.enable_grad())
            if composite.op_kinds or plan.decomposed:  # operation rules, fused attention's math
                stack.enter_context(OperationMode(composite, None, attached))
            logits, signal = logits_and_selector(model, state, x, target)
            if start_one:  # relevance 1 at the explained output
                signal = safe_divide(signal, logits.detach())
            (input_signal,) = torch.autograd.grad(logits, x, signal)
        relevance = input_signal if plan.input_relevance_form else x.detach() * input_signal
        return logits.detach(), relevance.detach()

    return trace_explanation(model, explained, example, target_input=target_input)
