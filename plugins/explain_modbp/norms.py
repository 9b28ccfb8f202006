"""Normalisation layers with their normalising scale held constant (AttnLRP's identity rule).

``layer_norm``, ``group_norm``, per-sample ``instance_norm``, ``rms_norm`` and ``normalize``
(Swin V2's cosine attention) divide by a scale computed from their input. Held constant, the layer
is linear in its input, and relevance passes through it as through any linear map (the mean
subtraction stays). An ``instance_norm`` that uses running statistics (eval mode with
``track_running_stats``) is an affine map already, and the rule is exact for it.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from explain_core.interfaces.relevance import Rule, RuleCall

__all__ = ["NORM_OPS", "NormScale"]

NORM_OPS = ("layer_norm", "rms_norm", "group_norm", "instance_norm", "normalize")
"""The normalisation operations :class:`NormScale` explains."""

_SIGNATURES = {
    "layer_norm": inspect.signature(F.layer_norm),
    "rms_norm": inspect.signature(F.rms_norm),
    "group_norm": inspect.signature(F.group_norm),
    "instance_norm": inspect.signature(F.instance_norm),
    "normalize": inspect.signature(F.normalize),
}


class NormScale(Rule):
    """A normalisation with its scale held constant, for the operations of :data:`NORM_OPS`.

    ``layer_norm``: ``y = γ ⊙ (x − μ)/σ + β`` with σ constant is linear in ``x``:
    ``s_x = C(γ ⊙ s_y / σ)``, ``C`` the centering over the normalised dimensions; β absorbs
    relevance. ``group_norm``: the same per group of channels (and positions); ``instance_norm``
    per channel over positions, or with running statistics ``s_x = γ ⊙ s_y / √(v + ε)``.
    ``rms_norm``: ``y = γ ⊙ x / rms(x)``, ``s_x = γ ⊙ s_y / rms``, so ``R_x = R_y`` element-wise;
    ``normalize``: ``y = x / max(‖x‖_p, ε)``, ``s_x = s_y / max(‖x‖_p, ε)``, likewise.
    """

    output_in_backward = False

    def forward(self, call: RuleCall) -> tuple:  # noqa: D102
        bound = _SIGNATURES[call.name].bind(*call.args, **call.kwargs).arguments
        x = call.inputs[0]
        eps = bound.get("eps")
        if eps is None:
            eps = torch.finfo(x.dtype).eps
        weight = bound.get("weight")
        weight = None if weight is None else weight.detach()
        if call.name == "normalize":
            norm = x.norm(bound.get("p", 2.0), bound.get("dim", 1), keepdim=True)
            return None, norm.clamp_min(bound.get("eps", 1e-12)), None, None
        if call.name == "rms_norm":
            dims = tuple(range(-len(bound["normalized_shape"]), 0))
            return weight, torch.sqrt(x.square().mean(dims, keepdim=True) + eps), None, None
        if call.name == "layer_norm":
            dims = tuple(range(-len(bound["normalized_shape"]), 0))
            scale = torch.sqrt(x.var(dims, unbiased=False, keepdim=True) + eps)
            return weight, scale, dims, None
        if call.name == "group_norm":
            groups = bound["num_groups"]
            grouped = x.reshape(x.shape[0], groups, -1)
            scale = torch.sqrt(grouped.var(2, unbiased=False, keepdim=True) + eps)
            return weight, scale, (2,), groups
        running = bound.get("running_var")
        if running is not None and not bound.get("use_input_stats", True):
            shape = (1, -1) + (1,) * (x.dim() - 2)
            return weight, torch.sqrt(running.detach() + eps).reshape(shape), None, None
        dims = tuple(range(2, x.dim()))
        return weight, torch.sqrt(x.var(dims, unbiased=False, keepdim=True) + eps), dims, None

    def backward(self, call: RuleCall, grad_output: torch.Tensor) -> tuple[torch.Tensor]:  # noqa: D102
        weight, scale, dims, groups = call.state
        signal = grad_output
        if weight is not None:
            if call.name in ("group_norm", "instance_norm"):  # per channel, axis 1
                weight = weight.reshape((1, -1) + (1,) * (signal.dim() - 2))
            signal = signal * weight
        if groups is not None:  # per group: (batch, groups, rest)
            grouped = signal.reshape(signal.shape[0], groups, -1) / scale
            grouped = grouped - grouped.mean(2, keepdim=True)
            return (grouped.reshape(signal.shape),)
        signal = signal / scale
        if dims is not None:
            signal = signal - signal.mean(dims, keepdim=True)
        return (signal,)
