"""Exact merges of per-rank results: gather, order by global sample index, combine.

Every rank sends the results of the chunks it computed, each tagged with its global index range.
After the gather the ranges are sorted and checked to cover ``range(N)`` exactly once, so a
missing or doubly computed sample is an error, never a silently wrong mean. Per-sample values are
concatenated in index order, counts are added, and statistics (means, medians) are computed once
from all the gathered values — the same numbers a single process gets.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from explain_core.distributed.context import DistributedContext
from explain_core.distributed.sharding import check_partition
from explain_core.errors import DistributedError

__all__ = [
    "all_gather_objects",
    "concat_ordered",
    "gather_chunk_results",
    "gather_to_main",
    "merge_csc",
]


def all_gather_objects(obj: Any, context: DistributedContext) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank.

    Raises:
        DistributedError: If another rank stopped (crashed, was killed) instead of taking part.
    """
    if not context.distributed:
        return [obj]
    out: list[Any] = [None] * context.world_size
    try:
        dist.all_gather_object(out, obj)
    except RuntimeError as error:
        raise _peer_stopped(context) from error
    return out


def gather_to_main(obj: Any, context: DistributedContext, dst: int = 0) -> list[Any] | None:
    """Every rank's ``obj`` in rank order on rank ``dst``; ``None`` on the other ranks.

    Raises:
        DistributedError: If another rank stopped (crashed, was killed) instead of taking part.
    """
    if not context.distributed:
        return [obj]
    out: list[Any] | None = [None] * context.world_size if context.rank == dst else None
    try:
        dist.gather_object(obj, out, dst=dst)
    except RuntimeError as error:
        raise _peer_stopped(context) from error
    return out


def _peer_stopped(context: DistributedContext) -> DistributedError:
    # A rank that exits hard (killed, out of memory, os._exit) reports nothing itself; the
    # backend's own error is many lines about sockets, so name what happened (--debug shows it).
    return DistributedError(
        f"another rank stopped while rank {context.rank} was waiting for it (it crashed or was "
        "killed); its own output, or torchrun's summary, says why"
    )


def gather_chunk_results(
    local: Sequence[tuple[range, Any]],
    n: int,
    context: DistributedContext,
    error: BaseException | None = None,
) -> list[tuple[range, Any]]:
    """Gather ``(index range, result)`` pairs from every rank, ordered by index, on every rank.

    A rank that failed passes its exception as ``error`` instead of hanging its peers in a
    collective; every rank then raises the same :class:`DistributedError`.

    Raises:
        DistributedError: If some rank failed, or the ranges do not partition ``range(n)``.
    """
    message = None
    if error is not None:
        lines = traceback.format_exception_only(type(error), error)
        message = "".join(lines).strip()
    payload = (message, [(r.start, r.stop, value) for r, value in local])
    gathered = all_gather_objects(payload, context)
    failures = [f"rank {rank}: {msg}" for rank, (msg, _) in enumerate(gathered) if msg is not None]
    if failures:
        if error is not None and not context.distributed:
            raise error
        raise DistributedError("evaluation failed on " + "; ".join(failures)) from error
    pieces = {}
    ranges = []
    for _, items in gathered:
        for start, stop, value in items:
            ranges.append(range(start, stop))
            pieces.setdefault((start, stop), value)
    try:
        ordered = check_partition(ranges, n)
    except ValueError as problem:
        raise DistributedError(str(problem)) from None
    return [(r, pieces[(r.start, r.stop)]) for r in ordered]


def concat_ordered(parts: Sequence[tuple[range, Any]], key: str) -> torch.Tensor:
    """Concatenate ``value[key]`` (tensors of ``len(range)`` rows) of index-ordered parts."""
    tensors = [value[key] for _, value in parts]
    for (piece, _), tensor in zip(parts, tensors, strict=True):
        if tensor.shape[0] != len(piece):
            raise DistributedError(
                f"{key} of samples {piece.start}..{piece.stop - 1} has {tensor.shape[0]} rows"
            )
    return torch.cat(tensors) if tensors else torch.empty(0)


def merge_csc(parts: Sequence[dict[str, Any]]) -> Any:
    """One :class:`~explain_core.metrics.CSCResult` from per-batch parts, in sample order.

    Each part holds ``start``, ``layers``, per-layer defined ``cosines`` (sample-major), the
    per-layer ``undefined`` fraction and its number of samples ``n``. Cosines are concatenated, so
    the merged median is the median of all cosines; every sample has the same number of cosines
    per layer, so the merged undefined fraction is the sample-weighted mean of the parts'.
    """
    from explain_core.metrics.csc import CSCResult

    if not parts:
        raise DistributedError("no CSC results to merge")
    start, layers = parts[0]["start"], tuple(parts[0]["layers"])
    for part in parts:
        if part["start"] != start or tuple(part["layers"]) != layers:
            raise DistributedError("CSC parts were computed for different layers")
    cosines = {name: np.concatenate([p["cosines"][name] for p in parts]) for name in layers}
    n = sum(p["n"] for p in parts)
    undefined = {
        name: math.fsum(p["undefined"][name] * p["n"] for p in parts) / max(n, 1) for name in layers
    }
    return CSCResult(start, layers, cosines, undefined)
