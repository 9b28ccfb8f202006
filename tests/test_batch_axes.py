"""Where the batch goes through the operations that move it (``explain_modbp.batch_axes``).

The reference is torch itself: a tensor whose entries are their index on the batch's axis,
run through the operation, shows where those indices went.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from explain_modbp.batch_axes import axis_after

SHAPE = (2, 3, 4, 5)

# name, args after the tensor, kwargs, the operation as torch runs it
CASES: list[tuple[str, tuple, dict, Callable[[torch.Tensor], torch.Tensor]]] = [
    ("transpose", (0, 1), {}, lambda x: x.transpose(0, 1)),
    ("transpose", (-1, 1), {}, lambda x: x.transpose(-1, 1)),
    ("transpose", (), {"dim0": 2, "dim1": 0}, lambda x: torch.transpose(x, dim0=2, dim1=0)),
    ("swapaxes", (0, 3), {}, lambda x: x.swapaxes(0, 3)),
    ("swapdims", (1, 2), {}, lambda x: x.swapdims(1, 2)),
    ("permute", (2, 0, 3, 1), {}, lambda x: x.permute(2, 0, 3, 1)),
    ("permute", ((3, 2, 1, 0),), {}, lambda x: torch.permute(x, (3, 2, 1, 0))),
    ("permute", (), {"dims": (1, 3, 0, 2)}, lambda x: x.permute(dims=(1, 3, 0, 2))),
    ("movedim", (0, 2), {}, lambda x: x.movedim(0, 2)),
    ("movedim", (3, 0), {}, lambda x: x.movedim(3, 0)),
    ("movedim", ((0, 1), (3, 2)), {}, lambda x: torch.movedim(x, (0, 1), (3, 2))),
    ("moveaxis", (-1, 1), {}, lambda x: x.moveaxis(-1, 1)),
    ("T", (), {}, lambda x: x.permute(*reversed(range(x.dim())))),
    ("mT", (), {}, lambda x: x.mT),
    ("select", (0, 1), {}, lambda x: x.select(0, 1)),
    ("select", (2, -1), {}, lambda x: x.select(2, -1)),
    ("unbind", (1,), {}, lambda x: x.unbind(1)[0]),
    ("unbind", (), {}, lambda x: x.unbind()[1]),
    ("getitem", (-1,), {}, lambda x: x[-1]),
    ("getitem", ((slice(None), 0),), {}, lambda x: x[:, 0]),
    ("getitem", ((Ellipsis, 1),), {}, lambda x: x[..., 1]),
    ("getitem", ((None, 1, Ellipsis, None),), {}, lambda x: x[None, 1, ..., None]),
    ("getitem", ((slice(None), slice(0, 2)),), {}, lambda x: x[:, :2]),
    ("getitem", ((0, slice(None), 2),), {}, lambda x: x[0, :, 2]),
]


def _batch_axis(x: torch.Tensor, axis: int) -> int | None:
    """Where ``x``'s entries, their index on ``axis`` of the input, run along (``None``: gone)."""
    moved = [d for d in range(x.dim()) if x.shape[d] > 1 and not _constant_along(x, d)]
    return moved[0] if len(moved) == 1 else None


def _constant_along(x: torch.Tensor, dim: int) -> bool:
    return bool((x == x.narrow(dim, 0, 1)).all())


@pytest.mark.parametrize("case", CASES, ids=lambda case: f"{case[0]}{case[1]}{case[2]}")
@pytest.mark.parametrize("axis", range(len(SHAPE)))
def test_the_batch_goes_where_torch_takes_it(case, axis):
    name, args, kwargs, operation = case
    index = torch.arange(SHAPE[axis]).reshape([-1 if d == axis else 1 for d in range(len(SHAPE))])
    result = operation(index.expand(SHAPE).clone())
    expected = _batch_axis(result, axis)
    if expected is not None and result.shape[expected] != SHAPE[axis]:
        expected = None  # a part of the batch (x[:, :2]) is not the batch
    assert axis_after(name, (None, *args), kwargs, len(SHAPE), axis) == expected


@pytest.mark.parametrize("name", ["t", "T", "mT"])
def test_a_matrix_transposed_moves_its_batch(name):
    assert axis_after(name, (None,), {}, 2, 0) == 1
    assert axis_after(name, (None,), {}, 2, 1) == 0


def test_an_index_tensor_on_the_batch_axis_is_not_followed():
    assert axis_after("getitem", (None, torch.tensor([0, 1])), {}, 4, 0) is None
    assert axis_after("getitem", (None, (slice(None), torch.tensor([0]))), {}, 4, 2) is None
