"""Explained exports: one graph returning ``(logits, explanation)``, and the explainer registry.

An explained-export form (:class:`~explain_core.export_forms.ExportForm`) is registered under a
method name (the same names as ``explain()`` uses) with two functions: ``build(model, example,
target_input, **options)`` returns an ``nn.Module`` computing ``(logits, explanation)`` from ``x``
(and, with ``target_input``, the class to explain, int64 ``(batch,)``; otherwise the predicted
class) with exportable operations only, and ``reference(model, x, target, **options)`` computes the
same with the library's PyTorch method, which is what parity checks compare the exported graph
against.

Built in:

- ``coda.contributions``: CoDA-Net contributions ``W_{0→L}(x)_t ⊙ x`` (shape of the encoded
  input), with the backward pass written out: every DAU layer's ``W_l(x)`` is computed once, used
  for the forward pass and transposed for the backward pass (a transposed unfold is ``Col2Im``).
- ``capsules.saliency``: REM saliency maps of a DR-CapsNet (Eq. 16) in ``explain()``'s shape
  ``(batch, C, H, W)`` (the map spread evenly over the channels), option ``levels`` (``K``-level
  quantised couplings), routing unrolled.
- ``input_x_gradient``: Input×Gradient for plain CNNs and other models of standard layers, the
  gradient function traced first (:mod:`explain_onnx.gradtrace`).
- The modified-backprop plugin's one-composite methods — ``lrp.epsilon_plus`` (ε+z⁺),
  ``lrp.zplus``, ``lrp.epsilon``, ``lrp.z``, ``lrp.alpha_beta``, ``lrp.alpha2beta1``,
  ``lrp.gamma``, ``lrp.w2``, ``lrp.flat``, ``lrp.cmp``, ``excitation_bp``,
  ``excitation_bp.contrastive`` (with their options, e.g. ``epsilon=0.25``): the engine's own
  rules, attached by its hooks, with the whole attribution traced (:mod:`explain_onnx.lrp`).

Extension point: a plugin adds methods through the ``explain_register_export_forms`` hook,
returning :class:`~explain_core.export_forms.ExportForm` objects, exactly as this package
registers the built-in ones (:mod:`explain_onnx.plugin`); a name a built-in plugin registers stays
the built-in's. For rules that act on the gradient, ``build`` can call
:func:`explain_onnx.gradtrace.input_gradient_graph` while the composite's hooks are attached:
the gradient is traced as it is computed, so hooks that rewrite it (checked for forward hooks of
the form ``z.detach() + (r - r.detach())``) end up in the graph; backward operators without an
ONNX translation are named by the export's error. Rules can also be written out as forward
operations, as ``coda.contributions`` is.
"""

from __future__ import annotations

import difflib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from explain_core import plugin_manager
from explain_core.errors import InvalidInputError, UnknownMethodError
from explain_core.export_forms import ExportForm
from explain_core.quantisation import quantise_couplings

__all__ = [
    "BUILTIN_FORMS",
    "InvalidTargetsAsNaN",
    "available_explainers",
    "explained_module",
    "get_explainer",
    "lrp_forms",
]


def available_explainers() -> dict[str, ExportForm]:
    """Every exportable method, by name, from every plugin's export forms."""
    return dict(sorted(plugin_manager.get_plugin_manager().export_forms().items()))


def get_explainer(name: str) -> ExportForm:
    """The explainer registered as ``name``.

    Raises:
        UnknownMethodError: If no plugin registers ``name`` either (a typo), with the closest
            names.
        InvalidInputError: For a registered method that does not export, naming the exportable
            methods (closest first).
    """
    explainers = available_explainers()
    if name not in explainers:
        registry = plugin_manager.get_plugin_manager().registry
        if name not in registry:  # a typo: say so before "cannot be exported"
            raise UnknownMethodError(name, {*registry, *explainers})
        close = difflib.get_close_matches(name, explainers, n=3, cutoff=0.4)
        others = [n for n in explainers if n not in close]
        raise InvalidInputError(
            f"method {name!r} cannot be exported with the model; exportable methods: "
            f"{', '.join(close + others)}"
        )
    return explainers[name]


def explained_module(
    model: nn.Module,
    method: str,
    example: torch.Tensor,
    *,
    target_input: bool = False,
    **options: Any,
) -> nn.Module:
    """The module ``(x[, target]) → (logits, explanation)`` of ``method`` for ``model``.

    Raises:
        UnknownMethodError: For a method no plugin registers.
        InvalidInputError: For a method without an ONNX explainer, or one that does not fit
            the model.
    """
    return get_explainer(method).build(model, example, target_input, **options)


class InvalidTargetsAsNaN(nn.Module):
    """An explained module whose maps are NaN for targets outside ``[0, classes)``.

    A graph cannot raise, and a one-hot of an out-of-range class is all zeros, which reads as
    "nothing is relevant"; NaN rows cannot be mistaken for an explanation.
    :class:`~explain_onnx.runtime.OnnxSession` refuses such targets before running the graph.
    """

    def __init__(self, explained: nn.Module) -> None:
        super().__init__()
        self.explained = explained

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits, explanation)``, the explanation NaN in rows of invalid targets."""
        logits, explanation = self.explained(x, target)
        valid = (target >= 0) & (target < logits.shape[1])
        scale = torch.where(valid, 1.0, float("nan")).to(explanation.dtype)
        return logits, explanation * scale.reshape((-1,) + (1,) * (explanation.dim() - 1))


# --- CoDA contributions --------------------------------------------------------------------


class CoDAContributionsGraph(nn.Module):
    """Logits and contributions of a CoDA-Net, the backward pass written out.

    In explanation mode a CoDA-Net is the linear map ``ŷ = T⁻¹·W_{0→L}(x)·x + b₀`` with constant
    ``W_l(x)``; the row of the explained class is ``W_1ᵀ ⋯ W_Lᵀ`` applied to ``T⁻¹`` times the
    class indicator at every position of the last map, and each ``W_lᵀ`` of a convolutional DAU
    layer is a per-position product followed by a transposed unfold (``F.fold``).
    """

    def __init__(self, model: nn.Module, target_input: bool) -> None:
        super().__init__()
        self.model = model
        self.target_input = target_input

    def forward(
        self, x: torch.Tensor, target: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits (batch, classes), contributions (batch, *x.shape[1:]))``."""
        model = self.model
        inputs, weights = [], []
        h = x
        for layer in model.layers:
            # Per position (B, oh, ow, patch_dim, out): both contractions below are matrix
            # products per position, reading this, the largest tensor, in the layout computed.
            weight = layer.position_major_weight(h)
            batch, oh, ow, patch_dim, _ = weight.shape
            patches = F.unfold(h, layer.kernel_size, padding=layer.padding, stride=layer.stride)
            patches = patches.transpose(1, 2).reshape(batch, oh, ow, 1, patch_dim)
            inputs.append(h)
            weights.append(weight)
            h = (patches @ weight).reshape(batch, oh, ow, -1).permute(0, 3, 1, 2)
        logits = h.sum(dim=(2, 3)) / model.temperature + model.logit_bias
        chosen = target if target is not None else logits.argmax(dim=1)
        classes = torch.arange(logits.shape[1], device=x.device)
        selector = (classes[None] == chosen[:, None]).to(x.dtype) / model.temperature
        grad = selector[:, :, None, None].expand_as(h)
        for layer, h_in, weight in zip(
            reversed(model.layers), reversed(inputs), reversed(weights), strict=True
        ):
            batch, oh, ow, patch_dim, _ = weight.shape
            per_position = grad.permute(0, 2, 3, 1).unsqueeze(-1)  # (B, oh, ow, out, 1)
            patch_grad = (weight @ per_position).reshape(batch, oh * ow, patch_dim)
            grad = F.fold(
                patch_grad.transpose(1, 2),
                output_size=tuple(h_in.shape[2:]),
                kernel_size=layer.kernel_size,
                padding=layer.padding,
                stride=layer.stride,
            )
        return logits, grad * x


def _build_coda(
    model: nn.Module, example: torch.Tensor, target_input: bool, **options: Any
) -> nn.Module:
    from explain_coda import CoDANet, DAUConv2d

    _no_options("coda.contributions", options)
    if not isinstance(model, CoDANet) or not all(isinstance(m, DAUConv2d) for m in model.layers):
        raise InvalidInputError(
            f"the ONNX explainer 'coda.contributions' needs an explain_coda.CoDANet of "
            f"convolutional DAU layers; got {type(model).__name__}"
        )
    return CoDAContributionsGraph(model, target_input)


def _reference_coda(
    model: nn.Module, x: torch.Tensor, target: torch.Tensor | None, **options: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    from explain_coda import coda_contributions

    result = coda_contributions(model, x, target)
    return result.output, result.contributions


# --- capsule saliency ----------------------------------------------------------------------


class CapsuleSaliencyGraph(nn.Module):
    """Class capsule lengths and REM saliency maps (Eq. 16) of a DR-CapsNet."""

    def __init__(self, model: nn.Module, target_input: bool, levels: int | None) -> None:
        super().__init__()
        from explain_onnx.adapters import CapsuleGraph

        self.capsule_graph = CapsuleGraph(model)
        self.target_input = target_input
        self.levels = levels

    def forward(
        self, x: torch.Tensor, target: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(lengths (batch, classes), saliency (batch, C, H, W))``, as ``explain()`` returns."""
        from explain_capsules.routing import capsule_length

        model = self.capsule_graph.model
        primary, capsules, couplings = self.capsule_graph.capsules(x)
        lengths = capsule_length(capsules)
        chosen = target if target is not None else lengths.argmax(dim=1)
        classes = torch.arange(lengths.shape[1], device=x.device)
        selector = (classes[None] == chosen[:, None]).to(couplings.dtype)
        coupling = (couplings * selector[:, None, :]).sum(2)  # (B, n_primary)
        if self.levels is not None:
            # REM's K levels, the same binning as explain(): a graph cannot refuse NaN values
            coupling = quantise_couplings(coupling, self.levels, validate=False)
        activation = torch.sqrt((primary * primary).sum(-1))  # ‖u‖, as the recording reports
        m, n, o = model.primary.grid_shape
        grid = (activation * coupling).view(-1, m, n, o).mean(dim=3)
        maps = F.interpolate(
            grid.unsqueeze(1), size=tuple(x.shape[2:]), mode="bilinear", align_corners=False
        )
        # explain()'s shape: the map spread evenly over the input channels (their sum is it)
        return lengths, (maps / x.shape[1]).expand_as(x)


def _build_saliency(
    model: nn.Module, example: torch.Tensor, target_input: bool, **options: Any
) -> nn.Module:
    from explain_capsules import DRCapsNet
    from explain_core.quantisation import check_levels

    levels = options.pop("levels", None)
    _no_options("capsules.saliency", options)
    check_levels(levels, optional=True)
    if not isinstance(model, DRCapsNet):
        raise InvalidInputError(
            "the ONNX explainer 'capsules.saliency' needs an explain_capsules.DRCapsNet (grid "
            f"capsules routed to the class capsules); got {type(model).__name__}"
        )
    return CapsuleSaliencyGraph(model, target_input, levels)


def _reference_saliency(
    model: nn.Module, x: torch.Tensor, target: torch.Tensor | None, **options: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    from explain_core.api import explain

    result = explain(model, x, "capsules.saliency", target, levels=options.get("levels"))
    return result.output, result.attribution


# --- Input×Gradient ------------------------------------------------------------------------


def _build_input_x_gradient(
    model: nn.Module, example: torch.Tensor, target_input: bool, **options: Any
) -> nn.Module:
    from explain_onnx.gradtrace import input_gradient_graph

    _no_options("input_x_gradient", options)
    return input_gradient_graph(model, example, target_input=target_input)


def _reference_input_x_gradient(
    model: nn.Module, x: torch.Tensor, target: torch.Tensor | None, **options: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    from explain_core.api import explain

    result = explain(model, x, "input_x_gradient", target)
    return result.output, result.attribution


# --- LRP composites (modified backprop) -----------------------------------------------------


def _lrp_spec(name: str, summary: str) -> ExportForm:
    def build(
        model: nn.Module, example: torch.Tensor, target_input: bool, **options: Any
    ) -> nn.Module:
        from explain_onnx.lrp import lrp_graph

        return lrp_graph(model, name, example, target_input=target_input, **options)

    def reference(
        model: nn.Module, x: torch.Tensor, target: torch.Tensor | None, **options: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from explain_core.api import explain

        result = explain(model, x, name, target, **options)
        return result.output, result.attribution

    return ExportForm(name, build, reference, f"{summary} (engine's rules, traced)")


def lrp_forms() -> list[ExportForm]:
    """The exportable methods of the modified-backprop plugin (none without the plugin)."""
    try:
        from explain_onnx.lrp import composite_methods
    except ImportError:  # pragma: no cover - the plugin ships with the package
        return []
    try:
        methods = composite_methods()
    except ImportError:  # pragma: no cover
        return []
    return [_lrp_spec(name, spec.summary) for name, spec in methods.items()]


def _no_options(method: str, options: dict[str, Any]) -> None:
    if options:
        raise InvalidInputError(
            f"the ONNX explainer {method!r} takes no option {', '.join(sorted(options))}"
        )


BUILTIN_FORMS = (
    ExportForm(
        "coda.contributions",
        _build_coda,
        _reference_coda,
        "CoDA-Net contributions W_{0→L}(x)_t ⊙ x, backward pass written out",
    ),
    ExportForm(
        "capsules.saliency",
        _build_saliency,
        _reference_saliency,
        "REM saliency maps of a DR-CapsNet (option levels=K), routing unrolled",
    ),
    ExportForm(
        "input_x_gradient",
        _build_input_x_gradient,
        _reference_input_x_gradient,
        "Input×Gradient of models of standard layers (gradient function traced first)",
    ),
)
