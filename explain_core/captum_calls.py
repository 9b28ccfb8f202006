"""Captum's call conventions mapped onto :func:`explain_core.explain`.

Captum passes extra model arguments (``additional_forward_args``) and targets in forms that
``explain()`` does not take: per-sample tensors that must follow every copy of a sample that
a method feeds to the model, and tuples indexing outputs with several axes. This module turns
them into plain calls of ``explain()`` on a small forward wrapper.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from explain_core.errors import InvalidInputError

__all__ = [
    "ForwardWithArgs",
    "SampleGroup",
    "check_signature",
    "flat_targets",
    "forward_args",
    "group_samples",
    "has_tuple_targets",
]


def forward_args(additional_forward_args: Any, batch: int) -> tuple[Any, ...]:
    """Captum's ``additional_forward_args`` as a tuple (a non-tuple is one argument).

    Args:
        additional_forward_args: ``None``, one argument, or a tuple of arguments.
        batch: Number of samples; a tensor argument holds one row per sample (Captum's rule),
            except a 0-d tensor, which is shared.

    Raises:
        InvalidInputError: If a tensor argument does not have one row per sample.
    """
    if additional_forward_args is None:
        return ()
    args = (
        additional_forward_args
        if isinstance(additional_forward_args, tuple)
        else (additional_forward_args,)
    )
    for position, arg in enumerate(args):
        if isinstance(arg, torch.Tensor) and arg.dim() > 0 and arg.shape[0] != batch:
            raise InvalidInputError(
                f"additional_forward_args[{position}] has shape {tuple(arg.shape)}; a tensor "
                f"there holds one row per sample ({batch}), as in Captum: repeat a shared "
                f"tensor over the batch (arg.expand({batch}, ...)) or pass a 0-d tensor or a "
                f"number{batch_axis_advice(arg, batch)}"
            )
    return args


def batch_axis_advice(arg: Any, batch: int) -> str:
    """Advice for a forward argument whose batch may be on a later axis (a recurrent state).

    Returns:
        ``""`` unless ``arg`` is a tensor with an axis after the first as long as the batch.
    """
    if not isinstance(arg, torch.Tensor) or batch not in arg.shape[1:]:
        return ""
    axis = 1 + list(arg.shape[1:]).index(batch)
    return (
        f"; if its batch is axis {axis}, as in a recurrent layer's initial state (layers, "
        f"batch, hidden), pass it batch first, arg.movedim({axis}, 0) (h0.transpose(0, 1)), "
        f"and move it back inside forward (h0.movedim(0, {axis}).contiguous())"
    )


def check_signature(model: nn.Module, args: tuple[Any, ...]) -> None:
    """Refuse forward arguments that ``model.forward`` cannot take after the input.

    Raises:
        InvalidInputError: Naming the forward's parameters and the arguments' count.
    """
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):  # a builtin forward: let the call itself decide
        return
    try:
        signature.bind(None, *args)
    except TypeError as error:
        raise InvalidInputError(
            f"{type(model).__name__}.forward{signature} cannot take the input and "
            f"{len(args)} additional_forward_args ({error}); pass as many as the forward "
            "takes after the input"
        ) from None


def _per_sample(arg: Any) -> bool:
    return isinstance(arg, torch.Tensor) and arg.dim() > 0


@dataclass(frozen=True)
class SampleGroup:
    """Samples whose per-sample forward arguments are equal.

    Attributes:
        rows: Indices of the samples, int64 ``(k,)``.
        args: The forward arguments, per-sample tensors reduced to the group's one row
            ``(1, ...)``.
    """

    rows: torch.Tensor
    args: tuple[Any, ...]


def group_samples(args: tuple[Any, ...], batch: int, device: torch.device) -> list[SampleGroup]:
    """Split the batch into groups of samples that share their forward arguments.

    A method may feed the model many rows per sample (path points, noisy copies, a reference)
    in an order of its own; within a group every row gets the same arguments, whatever that
    order. Captum's wrappers repeat each sample's arguments (``NoiseTunnel`` ``nt_samples``
    times), so the groups are usually as many as the original samples, or one for arguments
    shared by the whole batch.

    Args:
        args: Forward arguments checked by :func:`forward_args`.
        batch: Number of samples.
        device: Device of the returned row indices.
    """
    tensors = [arg for arg in args if _per_sample(arg)]
    if not tensors:
        return [SampleGroup(torch.arange(batch, device=device), args)]
    # Rows compared by their bytes: exact, for every dtype, and NaN equals itself.
    keys = torch.cat(
        [t.detach().reshape(batch, -1).contiguous().cpu().view(torch.uint8) for t in tensors], 1
    )
    _, group_of = torch.unique(keys, dim=0, return_inverse=True)
    groups = []
    for group in range(int(group_of.max()) + 1 if batch else 0):
        rows = torch.nonzero(group_of == group).flatten()
        first = rows[:1]
        reduced = tuple(arg[first.to(arg.device)] if _per_sample(arg) else arg for arg in args)
        groups.append(SampleGroup(rows.to(device), reduced))
    return groups


class ForwardWithArgs(nn.Module):
    """The user's model called as ``model(x, *args)``, for Captum's extra forward arguments.

    Per-sample tensors hold one row, repeated to the rows of every call, so that each copy of
    the sample a method feeds to the model gets them. With ``flatten`` the output's axes after
    the batch are flattened, so that a Captum tuple target is one column of it.

    Args:
        model: The user's model (a submodule here: the guard of ``explain()`` watches it).
        args: Forward arguments; tensors other than 0-d ones have exactly one row.
        flatten: Return ``output.flatten(1)``.
    """

    def __init__(self, model: nn.Module, args: tuple[Any, ...], flatten: bool) -> None:
        super().__init__()
        self.model = model
        self.extra_args = args
        self.flatten = flatten
        self.training = model.training  # the user's flag, read only (train() would set theirs)

    def forward(self, inputs: torch.Tensor) -> Any:  # noqa: D102
        rows = inputs.shape[0]
        # A copy per call, never a view with stride 0: the model may write into its arguments.
        args = tuple(
            arg.expand(rows, *arg.shape[1:]).clone() if _per_sample(arg) else arg
            for arg in self.extra_args
        )
        output = self.model(inputs, *args)
        if self.flatten and isinstance(output, torch.Tensor) and output.dim() > 1:
            return output.flatten(1)
        return output


def has_tuple_targets(target: Any) -> bool:
    """Whether ``target`` is a Captum tuple (one for all samples) or a list of them."""
    if isinstance(target, tuple):
        return True
    return isinstance(target, list) and any(isinstance(item, tuple) for item in target)


def flat_targets(
    target: tuple[Any, ...] | Sequence[Any], batch: int, output_shape: Callable[[], torch.Size]
) -> list[int]:
    """Captum's tuple targets as column indices of the flattened output.

    Args:
        target: One tuple for every sample, or a list of one tuple per sample; each tuple
            holds one index per output axis after the batch (negative ones count from the end).
        batch: Number of samples.
        output_shape: Returns the output's shape after the batch axis (runs the model once).

    Raises:
        InvalidInputError: For mixed lists, a wrong count, non-integer indices (slices
            included) or indices outside the output.
    """
    if isinstance(target, tuple):
        per_sample = [target] * batch
    else:
        if not all(isinstance(item, tuple) for item in target):
            raise InvalidInputError(
                "target mixes tuples with other values; give one tuple per sample (indices into "
                "the output's axes after the batch) or one int per sample"
            )
        per_sample = list(target)
        if len(per_sample) != batch:
            raise InvalidInputError(
                f"target must hold one tuple per sample ({batch}); got {len(per_sample)}"
            )
    shape = tuple(output_shape())
    flat = []
    for index in per_sample:
        if len(index) != len(shape) or not all(_is_int(i) for i in index):
            raise InvalidInputError(
                f"a tuple target holds one integer per output axis after the batch; the model's "
                f"output has shape (batch, {', '.join(map(str, shape))}), got {index!r}"
            )
        if not all(-size <= int(i) < size for i, size in zip(index, shape, strict=True)):
            raise InvalidInputError(
                f"target {index!r} lies outside the model's output of shape "
                f"(batch, {', '.join(map(str, shape))})"
            )
        wrapped = [int(i) % size for i, size in zip(index, shape, strict=True)]
        flat.append(int(np.ravel_multi_index(wrapped, shape)))
    return flat


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)
