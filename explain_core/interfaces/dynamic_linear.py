"""Dynamic-linear layers: ``y = W(x)·x (+ b)`` and their exact contributions.

A network built only from dynamic-linear layers and linear operations (sums, pooling, reshapes,
linear maps, ReLU as ``diag(x > 0)·x``) computes ``f(x) = W_{0→L}(x)·x + b``. When the dynamic part
``W(x)`` is treated as a constant (the *explanation mode*), one vector-Jacobian product with respect
to the input returns the rows of ``W_{0→L}(x)``, and ``W_{0→L}(x) ⊙ x`` are exact contributions:
they sum to ``f(x)`` minus the bias terms.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from explain_core.eager import eager_mode, uncompiled
from explain_core.errors import InvalidInputError
from explain_core.scoped import scoped_setting, scoped_settings
from explain_core.validation import input_gradient

__all__ = [
    "Contributions",
    "DynamicLinear",
    "dynamic_linear_contributions",
    "dynamic_linear_rows",
    "explanation_mode",
]


class DynamicLinear(nn.Module):
    """Base class of layers computing ``y = W(x)·x (+ b)``.

    Subclasses compute ``W`` from :meth:`weight_input` instead of from ``x`` directly; in
    explanation mode that input is detached, so gradients flow only through the linear path
    ``W·x`` and Input×Gradient gives exact contributions.

    Subclasses may override :meth:`dynamic_weight` to return ``W(x)`` explicitly (useful for
    tests and small layers); large convolutional layers need not materialise it.
    """

    @property
    def explanation_mode(self) -> bool:
        """Whether the dynamic weights are detached here (see :func:`explanation_mode`)."""
        return bool(scoped_setting(self, _EXPLANATION_MODE, False))

    def weight_input(self, x: torch.Tensor) -> torch.Tensor:
        """The tensor to compute ``W(x)`` from: ``x`` itself, or ``x.detach()`` when explaining."""
        return x.detach() if self.explanation_mode else x

    def dynamic_weight(self, x: torch.Tensor) -> torch.Tensor:
        """Return ``W(x)`` explicitly, shape ``(batch, out_features, *input_shape)``.

        Raises:
            NotImplementedError: If the layer does not provide an explicit weight.
        """
        raise NotImplementedError(
            f"{type(self).__name__} does not materialise W(x); use contributions() instead"
        )


@contextmanager
def explanation_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Detach the dynamic weights of every :class:`DynamicLinear` layer inside ``model``.

    The mode holds in the calling context only (its thread or asyncio task): the layers are not
    changed, so other threads using the same model at the same time compute as usual.

    Args:
        model: Any module; only its :class:`DynamicLinear` submodules are affected.

    Yields:
        The same model.
    """
    layers = [m for m in uncompiled(model).modules() if isinstance(m, DynamicLinear)]
    # compiled code would keep the weights it traced with gradients
    with scoped_settings(_EXPLANATION_MODE, dict.fromkeys(layers, True)), eager_mode():
        yield model


_EXPLANATION_MODE = "explanation_mode"


@dataclass(frozen=True)
class Contributions:
    """Exact contributions of a dynamic-linear model.

    Attributes:
        contributions: ``W_{0→L}(x)_j ⊙ x`` for each requested output, shape
            ``(batch, *input_shape)`` for one target per sample, or
            ``(batch, n_targets, *input_shape)`` when several targets were requested.
        output: The model output, detached, shape ``(batch, n_outputs)``.
        targets: The explained output indices, shape ``(batch,)`` or ``(batch, n_targets)``.
    """

    contributions: torch.Tensor
    output: torch.Tensor
    targets: torch.Tensor


def dynamic_linear_rows(
    model: nn.Module | Callable[[torch.Tensor], torch.Tensor],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    create_graph: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``W_{0→L}(x)_j`` of the dynamic linear map, by vector-Jacobian products.

    Args:
        model: A module built from :class:`DynamicLinear` layers and linear operations, returning
            ``(batch, n_outputs)``; it is put into explanation mode here. A callable is accepted
            too (it must already be in explanation mode if it wraps dynamic-linear layers).
        inputs: ``(batch, *input_shape)`` floating-point inputs.
        targets: Output index per sample ``(batch,)``, or several per sample
            ``(batch, n_targets)``, explained in one batched vector-Jacobian product.
        create_graph: Keep the graph so the rows can be differentiated w.r.t. the parameters
            (e.g. for a regulariser on ``|W_{0→L}|``).

    Returns:
        ``(rows, output)``: rows shaped ``(batch, *input_shape)`` for one target per sample, or
        ``(batch, n_targets, *input_shape)``; the output ``(batch, n_outputs)``.

    Raises:
        InvalidInputError: If the model output is not ``(batch, n_outputs)`` or a target is out
            of range.
    """
    if not inputs.is_floating_point():
        raise InvalidInputError(f"inputs must be floating point; got dtype {inputs.dtype}")
    x = inputs.detach().requires_grad_(True)
    context = explanation_mode(model) if isinstance(model, nn.Module) else _null_context()
    with context, torch.enable_grad():
        output = model(x)
        _check_output(output, x.shape[0])
        multi = targets.dim() == 2
        index = targets if multi else targets[:, None]
        _check_targets(index, output.shape[1])
        selected = output.gather(1, index)  # (batch, n_targets)
        n_targets = index.shape[1]
        if n_targets == 1:
            rows = input_gradient(selected.sum(), x, create_graph=create_graph)[:, None]
        else:
            # One VJP per target column in a single batched call: row k of eye selects column k.
            eye = torch.eye(n_targets, dtype=selected.dtype, device=selected.device)
            grad_outputs = eye[:, None, :].expand(n_targets, *selected.shape)
            rows = input_gradient(
                selected, x, grad_outputs, is_grads_batched=True, create_graph=create_graph
            )
            rows = rows.movedim(0, 1)  # (batch, n_targets, *input_shape)
    return (rows if multi else rows[:, 0]), output


def dynamic_linear_contributions(
    model: nn.Module | Callable[[torch.Tensor], torch.Tensor],
    inputs: torch.Tensor,
    targets: torch.Tensor,
) -> Contributions:
    """Exact contributions ``W_{0→L}(x)_j ⊙ x`` by vector-Jacobian products in explanation mode.

    Arguments are as for :func:`dynamic_linear_rows`.

    Returns:
        The contributions, the output and the targets.

    Raises:
        InvalidInputError: If the model output is not ``(batch, n_outputs)`` or a target is out
            of range.
    """
    rows, output = dynamic_linear_rows(model, inputs, targets)
    x = inputs.detach() if targets.dim() == 1 else inputs.detach()[:, None]
    return Contributions((rows * x).detach(), output.detach(), targets)


@contextmanager
def _null_context() -> Iterator[None]:
    yield None


def _check_output(output: object, batch: int) -> None:
    if not isinstance(output, torch.Tensor) or output.dim() != 2 or output.shape[0] != batch:
        shape = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
        raise InvalidInputError(
            f"the model must return scores of shape (batch, n_outputs) = ({batch}, n); got "
            f"{shape}. Wrap the model so that it returns one score per output class."
        )


def _check_targets(index: torch.Tensor, n_outputs: int) -> None:
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= n_outputs):
        raise InvalidInputError(
            f"targets must lie in [0, {n_outputs - 1}] for a model with {n_outputs} outputs; got "
            f"values from {int(index.min())} to {int(index.max())}"
        )
