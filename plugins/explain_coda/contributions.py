"""Model-inherent contributions of CoDA-Nets: ``s^l_j(x) = [W_{0→l}(x)]_j ⊙ x`` (eq. 8).

In explanation mode every DAU's weights are constants, so one vector-Jacobian product per
explained unit gives the row ``[W_{0→l}(x)]_j`` exactly; several classes are explained in one
batched product. Contributions live on the encoded input ``[x, 1 − x]``; sum over channels for a
spatial map. For the output, they sum to ``ŷ_j − b₀`` (completeness).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from explain_coda.model import CoDANet
from explain_core.errors import InvalidInputError
from explain_core.interfaces.dynamic_linear import (
    Contributions,
    DynamicLinear,
    dynamic_linear_rows,
    explanation_mode,
)
from explain_core.registry import Method, MethodResult
from explain_core.targets import select_target

Classes = Sequence[int] | torch.Tensor | Literal["all"]
Unit = int | tuple[int, int, int]
MAX_EXPLICIT_ELEMENTS = 50_000_000


def require_dau_model(model: nn.Module) -> None:
    """Check that every parametrised leaf layer of ``model`` is a dynamic-linear (DAU) layer.

    Raises:
        InvalidInputError: If there is no DAU at all, or naming the first other layer with
            parameters.
    """
    dau_names = [n for n, m in model.named_modules() if isinstance(m, DynamicLinear)]
    if not dau_names:
        raise InvalidInputError(
            f"{type(model).__name__} contains no DAU layer; CoDA contributions need a CoDA-Net "
            "(explain_coda.CoDANet) or another model built from DynamicLinear layers"
        )
    for name, module in model.named_modules():
        inside_dau = any(name == n or name.startswith(f"{n}.") for n in dau_names)
        if not inside_dau and any(True for _ in module.parameters(recurse=False)):
            raise InvalidInputError(
                f"CoDA contributions need a model built from DAU layers (DynamicLinear) and "
                f"linear operations; module {name!r} is a {type(module).__name__}. Use "
                "explain_coda.CoDANet, or the method 'dynamic.contributions' for other models."
            )


def coda_contributions(
    model: CoDANet,
    inputs: torch.Tensor,
    target: torch.Tensor | int | None = None,
    *,
    classes: Classes | None = None,
    layer: int | None = None,
    unit: Unit | Sequence[Unit] | None = None,
) -> Contributions:
    """Contributions of the encoded input to an output class or an intermediate unit.

    Args:
        model: A CoDA-Net (or any model of DAU layers with a ``layers`` sequence).
        inputs: Encoded inputs ``(batch, 2C, H, W)``.
        target: One class per sample (int for all samples, or ``(batch,)``); ``None`` means the
            predicted class. Ignored when ``classes`` or ``layer`` is given.
        classes: Several classes for every sample (a list, or ``"all"``), explained in one
            batched call; the result gains a class axis after the batch axis.
        layer: Index into ``model.layers`` for contributions to an intermediate layer's output.
        unit: With ``layer``: a channel (summed over positions), a ``(channel, row, col)``
            position, or a list of them (the result gains a unit axis).

    Returns:
        Contributions, output (logits, or the selected unit values for a layer) and targets.

    Raises:
        InvalidInputError: For a non-DAU model, bad inputs, or out-of-range classes/units.
    """
    require_dau_model(model)
    if isinstance(model, CoDANet):
        model.check_input(inputs)
    if layer is not None:
        return _layer_contributions(model, inputs, layer, unit)
    if unit is not None:
        raise InvalidInputError("unit needs layer=...; for the output use target or classes")
    batch = inputs.shape[0]
    if classes is not None:
        index = _class_list(classes, _num_outputs(model, inputs))
        targets = index.to(inputs.device).expand(batch, -1)
    elif target is None:
        with torch.no_grad(), explanation_mode(model):
            targets = model(inputs).argmax(dim=1)
    else:
        targets = torch.as_tensor(target, device=inputs.device).long().reshape(-1).expand(batch)
    rows, output = dynamic_linear_rows(model, inputs, targets)
    x = inputs.detach() if targets.dim() == 1 else inputs.detach()[:, None]
    return Contributions((rows * x).detach(), output.detach(), targets)


def explicit_matrix(model: CoDANet, inputs: torch.Tensor, classes: Classes = "all") -> torch.Tensor:
    """The rows of ``W_{0→L}(x)`` (before ``T⁻¹``) for small inputs.

    Returns:
        ``(batch, n_classes, *input_shape)``: ``ŷ_j = T⁻¹·⟨W_j, x⟩ + b₀``.

    Raises:
        InvalidInputError: If the result would exceed :data:`MAX_EXPLICIT_ELEMENTS` elements.
    """
    require_dau_model(model)
    model.check_input(inputs)
    index = _class_list(classes, model.num_classes)
    size = inputs.numel() * len(index)
    if size > MAX_EXPLICIT_ELEMENTS:
        raise InvalidInputError(
            f"the explicit matrix would have {size:,} entries (limit {MAX_EXPLICIT_ELEMENTS:,}); "
            "use coda_contributions, or fewer samples or classes"
        )
    rows, _ = dynamic_linear_rows(model, inputs, index.to(inputs.device).expand(len(inputs), -1))
    return rows.detach() * model.temperature


def _num_outputs(model: nn.Module, inputs: torch.Tensor) -> int:
    if isinstance(model, CoDANet):
        return model.num_classes
    with torch.no_grad():
        return model(inputs[:1]).shape[1]


def _class_list(classes: Classes, n_classes: int) -> torch.Tensor:
    if isinstance(classes, str):
        if classes != "all":
            raise InvalidInputError(f'classes must be a list of ints or "all"; got {classes!r}')
        return torch.arange(n_classes)
    index = torch.as_tensor(classes).long().reshape(-1)
    if index.numel() == 0 or int(index.min()) < 0 or int(index.max()) >= n_classes:
        raise InvalidInputError(
            f"classes must lie in [0, {n_classes - 1}] for a model with {n_classes} classes; "
            f"got {index.tolist()}"
        )
    return index


def _layer_contributions(
    model: nn.Module, inputs: torch.Tensor, layer: int, unit: Unit | Sequence[Unit] | None
) -> Contributions:
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.Sequential):
        raise InvalidInputError("layer=... needs a model with a `layers` nn.Sequential (CoDANet)")
    if not -len(layers) <= layer < len(layers):
        raise InvalidInputError(
            f"layer must lie in [{-len(layers)}, {len(layers) - 1}]; got {layer}"
        )
    if unit is None:
        raise InvalidInputError("layer=... needs unit=channel or unit=(channel, row, col)")
    units = [unit] if isinstance(unit, int) or _is_position(unit) else list(unit)
    prefix = layers[: (layer % len(layers)) + 1]
    with torch.no_grad(), explanation_mode(model):
        shape = prefix(inputs[:1]).shape[1:]
    for u in units:
        _check_unit(u, shape)

    def unit_values(x: torch.Tensor) -> torch.Tensor:
        maps = prefix(x)
        columns = [
            maps[:, u].sum(dim=(1, 2)) if isinstance(u, int) else maps[:, u[0], u[1], u[2]]
            for u in units
        ]
        return torch.stack(columns, dim=1)

    targets = torch.arange(len(units), device=inputs.device).expand(len(inputs), -1)
    with explanation_mode(model):
        rows, values = dynamic_linear_rows(unit_values, inputs, targets)
    contributions = (rows * inputs.detach()[:, None]).detach()
    if len(units) == 1 and not _is_list_of_units(unit):
        return Contributions(contributions[:, 0], values.detach(), targets[:, 0])
    return Contributions(contributions, values.detach(), targets)


def _is_position(unit: object) -> bool:
    return isinstance(unit, tuple) and len(unit) == 3 and all(isinstance(v, int) for v in unit)


def _is_list_of_units(unit: object) -> bool:
    return not (isinstance(unit, int) or _is_position(unit))


def _check_unit(unit: object, shape: torch.Size) -> None:
    channels, height, width = shape
    if isinstance(unit, int):
        ok = 0 <= unit < channels
    elif _is_position(unit):
        c, h, w = unit  # type: ignore[misc]
        ok = 0 <= c < channels and 0 <= h < height and 0 <= w < width
    else:
        ok = False
    if not ok:
        raise InvalidInputError(
            f"unit must be a channel in [0, {channels - 1}] or (channel, row, col) within "
            f"({channels}, {height}, {width}); got {unit!r}"
        )


@dataclass
class CoDAContributions(Method):
    """Registry method ``coda.contributions``: exact model-inherent contributions.

    Attributes:
        layer: Explain an intermediate layer instead of the output (index into ``layers``).
        unit: With ``layer``: a channel or ``(channel, row, col)``; the target is ignored.
    """

    layer: int | None = None
    unit: Unit | None = None

    def attribute(self, model, inputs, target, baselines) -> MethodResult:  # noqa: D102
        if self.layer is not None:
            result = coda_contributions(model, inputs, layer=self.layer, unit=self.unit)
            delta = result.output[:, 0] - result.contributions.flatten(1).sum(1)
            return MethodResult(result.contributions, result.output, result.targets, delta)
        require_dau_model(model)
        if isinstance(model, CoDANet):
            model.check_input(inputs)
        with torch.no_grad():
            chosen = select_target(model(inputs), target)
        result = coda_contributions(model, inputs, chosen)
        explained = result.output.gather(1, chosen[:, None])[:, 0]
        reference = getattr(model, "logit_bias", 0.0)
        delta = explained - reference - result.contributions.flatten(1).sum(1)
        return MethodResult(result.contributions, result.output, chosen, delta)
