"""Model-inherent contributions of CoDA-Nets: ``s^l_j(x) = [W_{0→l}(x)]_j ⊙ x`` (eq. 8).

In explanation mode every DAU's weights are constants, so one vector-Jacobian product per
explained unit gives the row ``[W_{0→l}(x)]_j`` exactly; several classes are explained in one
batched product. Contributions live on the encoded input ``[x, 1 − x]``; sum over channels for a
spatial map. For the output, they sum to ``ŷ_j − b₀`` (completeness).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
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
from explain_core.targets import normalize_target, select_target
from explain_core.validation import check_inputs, refuse_inference_mode

__all__ = [
    "MAX_EXPLICIT_ELEMENTS",
    "Classes",
    "CoDAContributions",
    "Unit",
    "coda_contributions",
    "explicit_matrix",
    "require_dau_model",
]

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
        target: One class for all samples (an int) or one per sample (``(batch,)`` integers);
            ``None`` means the predicted class. Ignored when ``classes`` or ``layer`` is given.
        classes: Several classes for every sample (a list, or ``"all"``), explained in one
            batched call; the result gains a class axis after the batch axis.
        layer: Index into ``model.layers`` for contributions to an intermediate layer's output.
        unit: With ``layer``: a channel (summed over positions), a ``(channel, row, col)``
            tuple, or a list of them. The result has a unit axis after the batch axis, also
            for one unit: contributions ``(batch, n_units, *input)``, output (the units'
            values) and targets ``(batch, n_units)``.

    Returns:
        Contributions, output (logits, or the selected unit values for a layer) and targets.

    Raises:
        InvalidInputError: For a non-DAU model, bad inputs (including a dtype or device other
            than the model's), non-integer or out-of-range targets/classes/layers/units, or a
            call inside ``torch.inference_mode()``.
    """
    inputs = _check_call(model, inputs, "coda_contributions()")
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
        targets = _per_sample_targets(target, batch, inputs.device)
    rows, output = dynamic_linear_rows(model, inputs, targets)
    x = inputs.detach() if targets.dim() == 1 else inputs.detach()[:, None]
    return Contributions((rows * x).detach(), output.detach(), targets)


def explicit_matrix(model: CoDANet, inputs: torch.Tensor, classes: Classes = "all") -> torch.Tensor:
    """The rows of ``W_{0→L}(x)`` (before ``T⁻¹``) for small inputs.

    Returns:
        ``(batch, n_classes, *input_shape)``: ``ŷ_j = T⁻¹·⟨W_j, x⟩ + b₀``.

    Raises:
        InvalidInputError: If the result would exceed :data:`MAX_EXPLICIT_ELEMENTS` elements, or
            as :func:`coda_contributions` for bad inputs or classes.
    """
    inputs = _check_call(model, inputs, "explicit_matrix()")
    index = _class_list(classes, model.num_classes)
    size = inputs.numel() * len(index)
    if size > MAX_EXPLICIT_ELEMENTS:
        raise InvalidInputError(
            f"the explicit matrix would have {size:,} entries (limit {MAX_EXPLICIT_ELEMENTS:,}); "
            "use coda_contributions, or fewer samples or classes"
        )
    rows, _ = dynamic_linear_rows(model, inputs, index.to(inputs.device).expand(len(inputs), -1))
    return rows.detach() * model.temperature


def _check_call(model: nn.Module, inputs: torch.Tensor, name: str) -> torch.Tensor:
    """A private copy of ``inputs`` if they fit ``model`` and gradients can be computed."""
    # As explain(): autograd's own error ("does not require grad") says nothing.
    refuse_inference_mode(name, model)
    require_dau_model(model)
    inputs = check_inputs(inputs, model)  # dtype and device against the model, as explain()
    if isinstance(model, CoDANet):
        model.check_input(inputs)
    return inputs


def _per_sample_targets(target: object, batch: int, device: torch.device) -> torch.Tensor:
    """``target`` as int64 ``(batch,)`` by explain()'s rule: integers only, one or per sample."""
    count = _count(target)
    if count and count not in (1, batch):  # an empty target: normalize_target explains
        raise InvalidInputError(
            f"target must be one class for all samples or one class per sample ({batch}); got "
            f"{count} values. To explain several classes for every sample, pass them as "
            'classes=[...] (or classes="all") instead'
        )
    targets = normalize_target(target, batch, device)  # type: ignore[arg-type]
    assert targets is not None  # None was handled by the caller
    return targets


def _count(values: object) -> int | None:
    """How many values a list, array or tensor holds; ``None`` for anything else."""
    if isinstance(values, torch.Tensor):
        return values.numel()
    if isinstance(values, (list, tuple, np.ndarray)):
        try:
            return int(np.size(values))
        except ValueError:  # ragged: normalize_target explains
            return None
    return None


def _index(value: object) -> int | None:
    """``value`` as an int if it is an integer (Python, NumPy or 0-d integer tensor), else None.

    Floats are refused rather than truncated, as for explain()'s targets; bools are no indices.
    """
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, torch.Tensor) and (value.dtype == torch.bool or value.dim() != 0):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:  # floats, float tensors, strings
        return None


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
    single = _index(classes)
    if single is not None:
        index = torch.tensor([single])
    else:
        try:
            index = torch.as_tensor(
                classes if isinstance(classes, torch.Tensor) else np.asarray(classes)
            ).reshape(-1)
        except (TypeError, ValueError, RuntimeError) as error:  # ragged lists, objects
            raise InvalidInputError(
                f'classes must be a list of ints or "all"; got {classes!r}'
            ) from error
        if index.numel() == 0:
            raise InvalidInputError(
                f'classes must name at least one class in [0, {n_classes - 1}], or be "all"; '
                "got an empty list"
            )
        if index.is_floating_point() or index.is_complex() or index.dtype == torch.bool:
            # Truncating 2.7 to class 2 would explain a class nobody asked for.
            raise InvalidInputError(
                f'classes must be a list of ints or "all"; got {index.dtype} values '
                f"{index.tolist()[:10]}. Convert whole-number classes with int(c)"
            )
        index = index.to(torch.long).cpu()
    if int(index.min()) < 0 or int(index.max()) >= n_classes:
        raise InvalidInputError(
            f"classes must lie in [0, {n_classes - 1}] for a model with {n_classes} classes; "
            f"got {index.tolist()}"
        )
    return index


def _layer_contributions(
    model: nn.Module, inputs: torch.Tensor, layer: object, unit: object
) -> Contributions:
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.Sequential):
        raise InvalidInputError("layer=... needs a model with a `layers` nn.Sequential (CoDANet)")
    index = _index(layer)
    if index is None:
        raise InvalidInputError(
            f"layer must be an int index into model.layers, in [{-len(layers)}, "
            f"{len(layers) - 1}]; got {layer!r} ({type(layer).__name__})"
        )
    if not -len(layers) <= index < len(layers):
        raise InvalidInputError(
            f"layer must lie in [{-len(layers)}, {len(layers) - 1}]; got {index}"
        )
    if unit is None:
        raise InvalidInputError("layer=... needs unit=channel or unit=(channel, row, col)")
    units = _unit_list(unit)
    prefix = layers[: (index % len(layers)) + 1]
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
    # A unit axis always, also for one unit: it matches the output's (batch, n_units) values.
    return Contributions((rows * inputs.detach()[:, None]).detach(), values.detach(), targets)


def _unit_list(unit: object) -> list[int | tuple[int, int, int]]:
    """The units as plain ints and ``(channel, row, col)`` tuples.

    Integer tensors and NumPy integers count as ints; anything else is refused here, before it
    could fail deep inside indexing.
    """
    single = _as_unit(unit)
    if single is not None:
        return [single]
    items = None
    if isinstance(unit, (list, tuple, np.ndarray)) or (
        isinstance(unit, torch.Tensor) and unit.dim() == 1
    ):
        items = [_as_unit(u) for u in unit]
    if not items or any(u is None for u in items):
        raise InvalidInputError(
            "unit must be a channel (int), a (channel, row, col) tuple of ints, or a list of "
            f"them; got {unit!r} ({type(unit).__name__})"
        )
    return items  # type: ignore[return-value]


def _as_unit(unit: object) -> int | tuple[int, int, int] | None:
    """One unit as an int or an int triple; ``None`` if ``unit`` is not one unit."""
    channel = _index(unit)
    if channel is not None:
        return channel
    if isinstance(unit, tuple) and len(unit) == 3:
        position = tuple(_index(v) for v in unit)
        if all(v is not None for v in position):
            return position  # type: ignore[return-value]
    return None


def _check_unit(unit: int | tuple[int, int, int], shape: torch.Size) -> None:
    channels, height, width = shape
    if isinstance(unit, int):
        ok = 0 <= unit < channels
    else:
        c, h, w = unit
        ok = 0 <= c < channels and 0 <= h < height and 0 <= w < width
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
    convergence_delta = True
    multiplies_by_inputs = True  # W(x) ⊙ x

    def attribute(self, model, inputs, target, baselines) -> MethodResult:  # noqa: D102
        if self.layer is not None:
            result = coda_contributions(model, inputs, layer=self.layer, unit=self.unit)
            contributions = result.contributions[:, 0]  # one unit: the option's type
            delta = result.output[:, 0] - contributions.flatten(1).sum(1)
            return MethodResult(contributions, result.output, result.targets[:, 0], delta)
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
