"""REM saliency maps of grid capsules (Renzulli et al., Eq. 16).

For primary capsules on an ``M × N × O`` grid routed to the class capsules, the saliency of grid
position ``(m, n)`` for class ``j`` is

    ``E_(m,n) = (1/O) Σ_o ‖u_(m,n,o)‖ · c̃_(m,n,o),j``,

the capsule activations weighted by their (optionally ``K``-level quantised) couplings to class
``j``, averaged over capsule types; the ``M × N`` map is upsampled bilinearly to the input size.
Only a forward pass is needed. Capsule order is positions × types,
``index = (m * N + n) * O + o`` (see :mod:`explain_capsules.layers`).

The mean runs over the ``O`` types the model has. :func:`explain_capsules.compaction.compact`
keeps a model's outputs but removes dead types, so the compacted model's maps average over the
``O′ < O`` remaining ones: a type removed because its capsules are zero vectors added nothing to
the sum, and the maps are ``O/O′`` times the original's; a type removed because no routing weight
reads it still had ``‖u‖ > 0`` and the uniform coupling ``1/J`` (zero votes never move its
routing logits), so its term ``‖u‖/J`` is lost too. Compare maps of the same model, before or
after compaction, not across it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from explain_capsules.layers import PrimaryCapsules
from explain_core.errors import InvalidInputError
from explain_core.interfaces.routing import RoutingLayer, record_routing, routing_in_eval_mode
from explain_core.model_guard import ModelGuard, require_eval_mode
from explain_core.quantisation import check_levels, quantise_couplings
from explain_core.registry import Method, MethodResult
from explain_core.targets import TargetLike, normalize_target, select_target

__all__ = ["CapsuleSaliency", "capsule_saliency", "find_grid_capsules", "saliency_grid"]


def find_grid_capsules(model: nn.Module) -> tuple[str, PrimaryCapsules, str, RoutingLayer]:
    """The model's grid capsules and the routing layer that consumes them.

    The consumer is the first :class:`RoutingLayer` after the :class:`PrimaryCapsules` module
    in ``model.named_modules()`` order (for DR-CapsNet: the class capsules).

    Returns:
        ``(primary_name, primary, consumer_name, consumer)``.

    Raises:
        InvalidInputError: If the model has no or several ``PrimaryCapsules`` modules, or no
            routing layer after it.
    """
    modules = list(model.named_modules())
    primaries = [(i, name) for i, (name, m) in enumerate(modules) if isinstance(m, PrimaryCapsules)]
    if len(primaries) != 1:
        found = ", ".join(repr(name) for _, name in primaries) or "none"
        raise InvalidInputError(
            f"capsule saliency needs exactly one PrimaryCapsules module (the grid capsules) in "
            f"{type(model).__name__}; found {len(primaries)}: {found}"
        )
    index, primary_name = primaries[0]
    for name, module in modules[index + 1 :]:
        if isinstance(module, RoutingLayer):
            return primary_name, modules[index][1], name, module  # type: ignore[return-value]
    raise InvalidInputError(
        f"capsule saliency needs a routing layer after the PrimaryCapsules module "
        f"{primary_name!r} of {type(model).__name__}; found none"
    )


def saliency_grid(
    activations: torch.Tensor,
    couplings: torch.Tensor,
    grid_shape: tuple[int, int, int],
    *,
    levels: int | None = None,
) -> torch.Tensor:
    """Eq. 16 on the capsule grid: ``E_(m,n) = (1/O) Σ_o ‖u_(m,n,o)‖ · c̃_(m,n,o),j``.

    Args:
        activations: ``‖u‖`` of the grid capsules, ``(B, M*N*O)`` in positions × types order.
        couplings: Couplings of each grid capsule to the explained class ``j``, ``(B, M*N*O)``.
        grid_shape: ``(M, N, O)``.
        levels: Quantise the couplings into ``K`` levels first (REM's ``c̃``); ``None`` uses
            them as given.

    Returns:
        The grid saliency ``(B, M, N)``.

    Raises:
        ValueError: If the shapes do not match the grid or ``levels`` is invalid.
    """
    check_levels(levels, optional=True)
    m, n, o = grid_shape
    expected = (activations.shape[0], m * n * o)
    if activations.shape != expected or couplings.shape != expected:
        raise ValueError(
            f"saliency_grid: grid {m}×{n}×{o} needs activations and couplings of shape "
            f"{expected}; got {tuple(activations.shape)} and {tuple(couplings.shape)}"
        )
    if levels is not None:
        couplings = quantise_couplings(couplings, levels)
    weighted = activations * couplings.to(activations.dtype)
    return weighted.view(-1, m, n, o).mean(dim=3)


def _saliency(
    model: nn.Module, inputs: torch.Tensor, target: TargetLike, levels: int | None
) -> dict[str, Any]:
    check_levels(levels, optional=True)
    if inputs.dim() != 4:
        raise InvalidInputError(
            f"capsule saliency needs image inputs (batch, C, H, W); got shape {tuple(inputs.shape)}"
        )
    primary_name, primary, consumer_name, _ = find_grid_capsules(model)
    wanted = normalize_target(target, inputs.shape[0], inputs.device)
    with (
        ModelGuard(model),  # reads only: other threads may use the model meanwhile
        torch.no_grad(),
        routing_in_eval_mode(model),  # not model.eval(): that would switch it for every thread
        record_routing(model, keep_on_device=True) as recording,
    ):
        output = model(inputs)
        events = [e for e in recording.drain() if e.layer == consumer_name]
        grid_shape = primary.grid_shape
        if len(events) != 1:
            raise InvalidInputError(
                f"capsule saliency needs the routing layer {consumer_name!r} to run exactly "
                f"once per forward pass; it ran {len(events)} times"
            )
        event = events[0]
        activations = event.input_activations.clone()
        couplings_all = event.couplings
        chosen = select_target(output, wanted)
        n_out = couplings_all.shape[2]
        if n_out != output.shape[1]:
            raise InvalidInputError(
                f"capsule saliency needs the grid capsules ({primary_name!r}) to route to the "
                f"class capsules: {consumer_name!r} has {n_out} output capsules but the model "
                f"has {output.shape[1]} outputs"
            )
        index = chosen.view(-1, 1, 1).expand(-1, couplings_all.shape[1], 1)
        couplings = couplings_all.gather(2, index).squeeze(2)
    assert grid_shape is not None  # set by the forward pass
    m, n, o = grid_shape
    if activations.shape[1] != m * n * o:
        raise InvalidInputError(
            f"capsule saliency: {consumer_name!r} routes {activations.shape[1]} input capsules "
            f"but {primary_name!r} produced a {m}×{n}×{o} grid ({m * n * o} capsules); the "
            "primary capsules must feed it directly"
        )
    grid = saliency_grid(activations, couplings, grid_shape, levels=levels)
    maps = F.interpolate(
        grid.unsqueeze(1), size=tuple(inputs.shape[2:]), mode="bilinear", align_corners=False
    ).squeeze(1)
    return {
        "maps": maps,
        "grid": grid,
        "output": output.detach(),
        "target": chosen,
        "primary": primary_name,
        "layer": consumer_name,
    }


def capsule_saliency(
    model: nn.Module,
    inputs: torch.Tensor,
    target: TargetLike = None,
    *,
    levels: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """REM saliency maps (Eq. 16) of a capsule network with one grid of primary capsules.

    Runs one forward pass under ``torch.no_grad``, its routing layers as in eval mode (their
    training flags are not touched; other mode-dependent layers must be in eval mode), and only
    reads the model, so other threads may use it meanwhile (what the forward sets on the model,
    like ``PrimaryCapsules.grid_shape``, stays, as after a plain forward); records ``‖u‖`` of the
    primary capsules and their couplings to the target class in the routing layer consuming them
    (see :func:`find_grid_capsules`), computes :func:`saliency_grid` and upsamples it bilinearly
    (``align_corners=False``) to ``H × W``.

    The maps average over the model's capsule types, so those of a model compacted by
    :func:`~explain_capsules.compaction.compact` (same outputs, dead types removed) differ from
    the original's: ``O/O′`` times them when the removed types had zero capsules (see the module
    docstring).

    Args:
        model: Capsule network with exactly one :class:`PrimaryCapsules` module whose capsules
            are routed directly to the class capsules; returns ``(batch, n_classes)`` scores.
        inputs: Images ``(B, C, H, W)``.
        target: Class to explain: ``None`` (the predicted class), one int, or one per sample.
        levels: Quantise the couplings into ``K`` levels (REM's ``c̃``); ``None`` uses the
            couplings as computed (already quantised if the layer has a coupling transform).
            Only the couplings in Eq. 16 are rounded; the model routes as it does (see
            :func:`~explain_capsules.rem.quantised_routing` for REM's "+Q" model).

    Returns:
        ``(maps, output, target)``: saliency maps ``(B, H, W)``, model output ``(B, n_classes)``
        (detached) and explained class per sample, int64 ``(B,)``.

    Raises:
        InvalidInputError: For non-image inputs, a bad target, a model without exactly one
            ``PrimaryCapsules`` routed to the class capsules.
        ValueError: For invalid ``levels``.
        ModelStateError: If a BatchNorm or Dropout layer is in training mode.
    """
    require_eval_mode(model)  # explain() checks this itself, unless allow_training=True
    result = _saliency(model, inputs, target, levels)
    return result["maps"], result["output"], result["target"]


@dataclass
class CapsuleSaliency(Method):
    """Registry method ``capsules.saliency``: REM saliency maps (Eq. 16) of grid capsules.

    The attribution has the inputs' shape ``(B, C, H, W)`` (as ``explain`` requires): the
    ``(B, H, W)`` saliency map is spread evenly over the channels, so
    ``Attribution.spatial_map()`` (a channel sum) returns it exactly. ``extras`` holds the map
    itself (``"saliency"``, ``(B, H, W)``), the grid map (``"grid"``, ``(B, M, N)``),
    ``"levels"`` and the names of the primary capsule module (``"primary"``) and of the routing
    layer used (``"layer"``).

    Attributes:
        levels: Quantise the couplings into ``K`` levels (REM's ``c̃``), or ``None``.
    """

    levels: int | None = None

    def __post_init__(self) -> None:
        check_levels(self.levels, optional=True)

    def attribute(self, model, inputs, target, baselines) -> MethodResult:  # noqa: D102
        result = _saliency(model, inputs, target, self.levels)
        maps = result["maps"]
        # Spread the spatial map evenly over the input channels, so that summing channels
        # (Attribution.spatial_map) gives back exactly Eq. 16's map.
        attribution = (maps.unsqueeze(1) / inputs.shape[1]).expand_as(inputs).clone()
        extras = {
            "saliency": maps,
            "grid": result["grid"],
            "levels": self.levels,
            "primary": result["primary"],
            "layer": result["layer"],
        }
        return MethodResult(attribution, result["output"], result["target"], extras=extras)
