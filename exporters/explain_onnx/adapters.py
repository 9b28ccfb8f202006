"""Export forms of the library's models: the same arithmetic without data-dependent checks.

``torch.export`` cannot trace Python branches on tensor *values*. The models of the built-in
plugins validate their inputs that way (``CoDANet`` refuses NaN inputs, dynamic routing refuses
NaN couplings), which is right in eager mode and impossible in a graph. An adapter computes the
model's forward from the model's own submodules and parameters, leaving only those checks out;
parity checks (:mod:`explain_onnx.parity`) compare every export against the model itself.

Adapters are looked up by the model's exact type (a subclass may have changed ``forward``);
:func:`register_adapter` adds one for another model type. Models without an adapter are exported
as they are.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

Adapter = Callable[[nn.Module], nn.Module]
_ADAPTERS: dict[type, Adapter] = {}


def register_adapter(model_type: type, adapter: Adapter) -> None:
    """Export models of exactly ``model_type`` through ``adapter(model)`` (an ``nn.Module``)."""
    _ADAPTERS[model_type] = adapter


def exportable(model: nn.Module) -> nn.Module:
    """The module to hand to ``torch.export`` for ``model``: its adapter, or the model itself."""
    _register_builtin_adapters()
    adapter = _ADAPTERS.get(type(model))
    return adapter(model) if adapter is not None else model


class CoDAGraph(nn.Module):
    """``CoDANet.forward`` without its NaN check: ``T⁻¹·Σ_{h,w} layers(x) + b₀``.

    ``DAUConv2d`` computes Algorithm 1's direct form while exporting (ONNX has no QR).
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, classes)`` of encoded inputs."""
        model = self.model
        return model.layers(x).sum(dim=(2, 3)) / model.temperature + model.logit_bias


def route(layer: nn.Module, votes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic routing of ``layer`` (a routing capsule layer) over its fixed iterations, unrolled.

    The forward arithmetic of :func:`explain_capsules.routing.dynamic_routing` (the gradient
    options do not change values), without its NaN check; the layer's ``coupling_transform`` is
    applied in eval mode, as the layer does.

    Returns:
        ``(v, c)``: output capsules ``(batch, n_out, d_out)`` and final couplings
        ``(batch, n_in, n_out)``.
    """
    from explain_capsules.routing import squash

    transform = None if layer.training else layer.coupling_transform
    logits = votes.new_zeros(votes.shape[:3])
    for r in range(layer.iterations):
        couplings = torch.softmax(logits, dim=2)
        last = r == layer.iterations - 1
        if last and transform is not None:
            couplings = transform(couplings)
        v = squash(torch.einsum("bij,bijd->bjd", couplings, votes))
        if not last:
            logits = logits + torch.einsum("bijd,bjd->bij", votes, v)
    return v, couplings


class CapsuleGraph(nn.Module):
    """DR-CapsNet or multi-layer CapsNet forward, routing unrolled: class capsule lengths."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def routing_layers(self) -> list[nn.Module]:
        """The routing layers in forward order."""
        routing = getattr(self.model, "routing", None)
        return list(routing) if routing is not None else [self.model.class_capsules]

    def capsules(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Primary capsules, class capsules and the couplings of the first routing layer."""
        primary = self.model.primary_capsules(x)
        u, first = primary, None
        for layer in self.routing_layers():
            u, couplings = route(layer, layer.votes(u))
            first = couplings if first is None else first
        assert first is not None  # every capsule model here has a routing layer
        return primary, u, first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class capsule lengths ``(batch, classes)``."""
        from explain_capsules.routing import capsule_length

        return capsule_length(self.capsules(x)[1])


_BUILTINS_REGISTERED = False


def _register_builtin_adapters() -> None:
    global _BUILTINS_REGISTERED
    if _BUILTINS_REGISTERED:
        return
    _BUILTINS_REGISTERED = True
    try:
        from explain_coda import CoDANet
    except ImportError:  # pragma: no cover - the plugin ships with the package
        pass
    else:
        _ADAPTERS.setdefault(CoDANet, CoDAGraph)
    try:
        from explain_capsules import DRCapsNet, MultiLayerCapsNet
    except ImportError:  # pragma: no cover
        pass
    else:
        _ADAPTERS.setdefault(DRCapsNet, CapsuleGraph)
        _ADAPTERS.setdefault(MultiLayerCapsNet, CapsuleGraph)
