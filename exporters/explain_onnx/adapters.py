"""Export forms of the library's models: the same arithmetic without data-dependent checks.

``torch.export`` cannot trace Python branches on tensor *values*. The models of the built-in
plugins validate their inputs that way (``CoDANet`` refuses NaN inputs, dynamic routing refuses
NaN couplings), which is right in eager mode and impossible in a graph. An adapter computes the
model's forward from the model's own submodules and parameters, leaving only those checks out;
parity checks (:mod:`explain_onnx.parity`) compare every export against the model itself.

Adapters (:class:`~explain_core.export_forms.ExportAdapter`) are registered by plugins through the
``explain_register_export_adapters`` hook (this package's own in :mod:`explain_onnx.plugin`) and
looked up by the model's exact type (a subclass may have changed ``forward``). Models without an
adapter are exported as they are.
"""

from __future__ import annotations

import torch
from torch import nn

from explain_core import plugin_manager

__all__ = ["CapsuleGraph", "CoDAGraph", "FactorisedDAU", "exportable", "route"]


def exportable(model: nn.Module) -> nn.Module:
    """The module to hand to ``torch.export`` for ``model``: its adapter, or the model itself."""
    adapter = plugin_manager.get_plugin_manager().export_adapters().get(type(model))
    return adapter.build(model) if adapter is not None else model


class FactorisedDAU(nn.Module):
    """A ``DAUConv2d``'s factorised forward with its QR basis baked in as a constant.

    The eager layer's factorised form (the module docstring of :mod:`explain_coda.layers`)
    computes ``‖w_j‖² = ‖Q_jᵀA'_j z'‖²`` with ``Q_j`` from a QR factorisation of the weights
    ``A'_j`` — a constant per weight, but ONNX has no QR operator. ``Q_jᵀA'_j`` (and the
    numerator's kernel ``A'_jᵀ``) depend only on the weights, so they are computed here once, in
    PyTorch, with the layer's own QR, and the graph only holds convolutions:

    - numerator ``w_jᵀp = z'ᵀ(A'_jᵀp)``: one ``k × k`` convolution of ``x`` with
      ``out · (rank + 1)`` channels, contracted with ``z' = [Bx; 1]``;
    - squared norm: a ``1 × 1`` convolution of ``Bx`` with ``Q_jᵀA_j`` (bias ``Q_jᵀb_j``), squared
      and summed over the basis.

    The weights are copied at construction: build the adapter when exporting (as
    :func:`exportable` does), not before training further.
    """

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        from explain_coda.layers import orthonormal_columns

        self.layer = layer
        out, rank, k = layer.out_channels, layer.rank, layer.kernel_size
        n = rank + 1
        with torch.no_grad():
            a = torch.cat(
                [
                    layer.weightings.weight.reshape(layer.patch_dim, out, rank),
                    layer.weightings.bias.reshape(layer.patch_dim, out, 1),
                ],
                2,
            ).permute(1, 0, 2)  # (out, patch_dim, n): A'_j, as the layer builds it
            coords = orthonormal_columns(a).transpose(1, 2) @ a  # (out, m, n) = Q_jᵀA'_j
            m = coords.shape[1]
            kernel = a.transpose(1, 2).reshape(out * n, layer.in_channels, k, k)
            norm_kernel = coords.reshape(out * m, n)
        self.register_buffer("numerator_kernel", kernel.contiguous())
        self.register_buffer("norm_weight", norm_kernel[:, :rank, None, None].contiguous())
        self.register_buffer("norm_bias", norm_kernel[:, rank].contiguous())
        self.out, self.n, self.m = out, n, m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(batch, in, H, W) → (batch, out, h, w)``, the layer's output values."""
        import torch.nn.functional as F

        from explain_coda.nonlinearity import scale_from_squared_norm

        layer = self.layer
        reduced = layer.dim_reduction(layer.weight_input(x))  # Bx: (B, rank, h, w)
        batch, rank, h, w = reduced.shape
        projected = F.conv2d(
            x, self.numerator_kernel, stride=layer.stride, padding=layer.padding
        ).view(batch, self.out, self.n, h, w)
        # z'ᵀ(A'_jᵀp) with z' = [Bx; 1]: the last channel of each DAU is the bias term.
        numerator = (projected[:, :, :rank] * reduced[:, None]).sum(2) + projected[:, :, rank]
        rotated = F.conv2d(reduced, self.norm_weight, self.norm_bias)  # Q_jᵀw_j: (B, out·m, h, w)
        squared_norm = rotated.view(batch, self.out, self.m, h, w).square().sum(2)
        return numerator * scale_from_squared_norm(squared_norm, layer.nonlinearity)


def export_form(layer: nn.Module) -> nn.Module:
    """The exported form of one CoDA layer: the form the eager layer uses, QR baked in.

    ``DAUConv2d`` layers whose eager forward is factorised get :class:`FactorisedDAU`; others
    (``form="direct"``, or ``"auto"`` where the direct form is cheaper) export as they are.
    """
    try:
        from explain_coda import DAUConv2d
    except ImportError:  # pragma: no cover
        return layer
    factorised = isinstance(layer, DAUConv2d) and (
        layer.form == "factorised" or (layer.form == "auto" and layer.patch_dim > layer.rank + 1)
    )
    return FactorisedDAU(layer) if factorised else layer


class CoDAGraph(nn.Module):
    """``CoDANet.forward`` without its NaN check: ``T⁻¹·Σ_{h,w} layers(x) + b₀``.

    ``DAUConv2d`` layers run the form their eager forward uses: factorised, with the QR basis
    computed once here (:class:`FactorisedDAU`), or Algorithm 1's direct form.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.layers = nn.ModuleList(export_form(layer) for layer in model.layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, classes)`` of encoded inputs."""
        model = self.model
        h = x
        for layer in self.layers:
            h = layer(h)
        return h.sum(dim=(2, 3)) / model.temperature + model.logit_bias


def route(layer: nn.Module, votes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic routing of ``layer`` (a routing capsule layer) over its fixed iterations, unrolled.

    The forward arithmetic of :func:`explain_capsules.routing.dynamic_routing` (the gradient
    options do not change values), without its NaN check; the layer's coupling transform in force
    (``active_coupling_transform``) is applied in eval mode, as the layer does.

    Returns:
        ``(v, c)``: output capsules ``(batch, n_out, d_out)`` and final couplings
        ``(batch, n_in, n_out)``.
    """
    from explain_capsules.routing import squash

    transform = None if layer.training else layer.active_coupling_transform
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
