"""Where the batch is, in a pass that stacks inputs and references on the first axis (DeepLIFT).

A model may move the batch off the first axis (``h.transpose(0, 1)``, time-major states from
``torch.stack(steps)``, a recurrent layer's final states ``h_n``) and back (``h_n[-1]``,
``x.unbind(0)``, another transpose). :class:`BatchAxes` follows the batch through these
operations, keyed by the autograd node of their results, so that a nonlinearity can tell
whether its input has the batch first also where another axis is as long.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

# Operations that move the batch to another axis, or back (see ``axis_after``).
MOVING_OPS = frozenset(
    {
        *("permute", "transpose", "swapaxes", "swapdims", "t", "T", "mT", "movedim", "moveaxis"),
        *("stack", "getitem", "select", "unbind"),
    }
)


class BatchAxes:
    """The batch's axis in the results of :data:`MOVING_OPS` that moved it (one pass)."""

    def __init__(self) -> None:
        self.moved: dict[Any, int | None] = {}  # node → the batch's axis (None: unknown), not 0
        self.restored: set[Any] = set()  # nodes whose results have it first again

    def clear(self) -> None:
        """Forget the last pass."""
        self.moved.clear()
        self.restored.clear()

    def axis_of(self, tensor: torch.Tensor) -> int | None:
        """The batch's axis in ``tensor``, ``None`` where the pass cannot tell.

        A tensor computed from a moved one by operations that keep axes (element-wise
        arithmetic, activations, layers) has an unknown axis: only :data:`MOVING_OPS` are
        followed.
        """
        node = tensor.grad_fn
        if not self.moved or node is None or node in self.restored:
            return 0
        if node in self.moved:
            return self.moved[node]
        if self._reaches_moved(node):
            self.moved[node] = None  # remembered: later walks stop here
            return None
        return 0

    def note(
        self,
        name: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        result: Any,
        batch_first: Callable[[Any], bool],
    ) -> None:
        """Record where operation ``name`` left the batch in ``result``.

        ``batch_first``: whether a tensor holds the stacked batch on its first axis (its rows);
        a tensor that neither does nor comes from a moved one carries no batch (a weight).
        """
        if name == "stack":
            tensors = list(args[0] if args else kwargs["tensors"])
            carrying = [t for t in tensors if self._followed(t) or batch_first(t)]
            if not carrying:
                return
            axes = {self.axis_of(t) for t in carrying}
            axis = axes.pop() if len(axes) == 1 else None
            dim = _argument(args, kwargs, 1, "dim", 0) % (tensors[0].dim() + 1)
            new = None if axis is None else axis + (axis >= dim)
        else:
            x = args[0] if args else kwargs.get("input")
            if not isinstance(x, torch.Tensor) or not (self._followed(x) or batch_first(x)):
                return
            axis = self.axis_of(x)
            new = None if axis is None else axis_after(name, args, kwargs, x.dim(), axis)
        outputs = result if isinstance(result, (tuple, list)) else (result,)
        node = outputs[0].grad_fn if outputs and isinstance(outputs[0], torch.Tensor) else None
        if node is None:
            return
        if new != 0:
            self.moved[node] = new
        elif axis != 0:
            self.restored.add(node)

    def _followed(self, tensor: Any) -> bool:
        node = getattr(tensor, "grad_fn", None)
        return node is not None and (node in self.moved or node in self.restored)

    def _reaches_moved(self, node: Any) -> bool:
        """Whether the graph behind ``node`` reaches a moved result before a restored one.

        Where it does not, no node it passed does either (the graph behind a node never
        changes): they count as restored, so that a loop over time walks each step once.
        """
        pending, seen = [node], set()
        while pending:
            current = pending.pop()
            if current is None or current in seen or current in self.restored:
                continue
            if current in self.moved:
                return True
            seen.add(current)
            pending.extend(next_node for next_node, _ in current.next_functions)
        self.restored.update(seen)
        return False


def _argument(args: Sequence[Any], kwargs: dict[str, Any], position: int, *names: Any) -> Any:
    """Argument ``position`` (counting the tensor) or keyword ``names[:-1]``; else ``names[-1]``."""
    *keywords, default = names
    for keyword in keywords:
        if keyword in kwargs:
            return kwargs[keyword]
    return args[position] if len(args) > position else default


def _dims(value: Any, rank: int) -> list[int]:
    return [d % rank for d in ([value] if isinstance(value, int) else value)]


def axis_after(
    name: str, args: tuple[Any, ...], kwargs: dict[str, Any], rank: int, axis: int
) -> int | None:
    """The axis the batch, on ``axis`` of the first argument, has in the result of ``name``.

    ``None`` where the operation selects from the batch (``h[:, 0]`` of a time-major ``h``), or
    the index is one the pass does not follow (a tensor of indices).
    """
    if name == "t":
        return 1 - axis if rank == 2 else axis
    if name == "T":
        return rank - 1 - axis
    if name == "mT":
        return {rank - 1: rank - 2, rank - 2: rank - 1}.get(axis, axis)
    if name == "permute":
        # x.permute(2, 0, 1), or one sequence: torch.permute(x, (2, 0, 1)), dims=(2, 0, 1)
        spread = len(args) > 1 and isinstance(args[1], int)
        dims = args[1:] if spread else _argument(args, kwargs, 1, "dims", ())
        return _dims(dims, rank).index(axis)
    if name in ("movedim", "moveaxis"):
        source = _dims(_argument(args, kwargs, 1, "source", ()), rank)
        destination = _dims(_argument(args, kwargs, 2, "destination", ()), rank)
        if axis in source:
            return destination[source.index(axis)]
        free = [d for d in range(rank) if d not in destination]  # the other axes, in order
        return free[[d for d in range(rank) if d not in source].index(axis)]
    if name in ("transpose", "swapaxes", "swapdims"):
        first = _argument(args, kwargs, 1, "dim0", "axis0", 0) % rank
        second = _argument(args, kwargs, 2, "dim1", "axis1", 0) % rank
        return {first: second, second: first}.get(axis, axis)
    if name in ("select", "unbind"):
        dim = _argument(args, kwargs, 1, "dim", 0) % rank
        return None if dim == axis else axis - (dim < axis)
    return _after_index(_argument(args, kwargs, 1, "idx", None), rank, axis)  # getitem


def _after_index(index: Any, rank: int, axis: int) -> int | None:
    """``axis`` in ``x[index]``: moved by integers before it and ``None`` (new axes)."""
    entries = index if isinstance(index, tuple) else (index,)
    consumed = sum(1 for e in entries if e is not None and e is not Ellipsis)
    position = out = 0  # the input's and the result's axis at each entry
    for entry in entries:
        if entry is None:
            out += 1
            continue
        width = rank - consumed if entry is Ellipsis else 1
        if isinstance(entry, bool) or not isinstance(entry, (int, slice, type(Ellipsis))):
            return None  # advanced indexing, which may move the axes
        if position <= axis < position + width:
            if entry is Ellipsis or entry == slice(None):
                return out + axis - position
            return None  # an integer or a part of the batch's axis
        position += width
        out += 0 if isinstance(entry, int) else width
    return out + axis - position
