"""Deterministic sharding of ``N`` samples over ranks, without padding.

``torch.utils.data.DistributedSampler`` pads every rank to ``ceil(N / world)`` samples by repeating
samples, so summed or averaged metrics count some samples twice. Everything here splits the
indices into disjoint pieces whose union is exactly ``range(N)``.

Evaluation works on *chunks*: fixed ranges ``[k·S, min((k+1)·S, N))`` of the global index, with
``S`` the samples per shard. Chunks do not depend on the number of processes, so every sample is
computed in the same batch, with the same seed, whatever the world size: results are identical in
1 and N processes, and a run interrupted with one world size resumes with another.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Literal

from torch.utils.data import Sampler

__all__ = [
    "Mode",
    "ShardSampler",
    "assign_chunks",
    "check_partition",
    "chunk_ranges",
    "shard_indices",
]

Mode = Literal["strided", "contiguous"]


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must lie in [0, world_size); got rank={rank}, {world_size=}")


def shard_indices(n: int, rank: int, world_size: int, mode: Mode = "strided") -> range:
    """The sample indices of one rank; the ranks' indices partition ``range(n)``.

    ``"strided"`` gives ``rank, rank + world, …``; ``"contiguous"`` gives one block, the first
    ``n % world`` ranks one sample more. Ranks may get different counts (and none): no padding.

    Raises:
        ValueError: For ``n < 0``, a rank outside ``[0, world_size)`` or an unknown mode.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0; got {n}")
    _check_rank(rank, world_size)
    if mode == "strided":
        return range(rank, n, world_size)
    if mode == "contiguous":
        base, extra = divmod(n, world_size)
        start = rank * base + min(rank, extra)
        return range(start, start + base + (rank < extra))
    raise ValueError(f'mode must be "strided" or "contiguous"; got {mode!r}')


def chunk_ranges(n: int, chunk_size: int) -> list[range]:
    """Consecutive ranges of ``chunk_size`` indices covering ``range(n)`` (the last may be short).

    Raises:
        ValueError: For ``n < 0`` or ``chunk_size < 1``.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0; got {n}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk size must be an int >= 1; got {chunk_size!r}")
    return [range(start, min(start + chunk_size, n)) for start in range(0, n, chunk_size)]


def assign_chunks(
    chunks: Sequence[range], rank: int, world_size: int, mode: Mode = "strided"
) -> list[range]:
    """The chunks one rank computes.

    Chunk ``k`` goes to rank ``k % world`` (``"strided"``), or the ranks take consecutive blocks
    of chunks (``"contiguous"``).
    """
    return [chunks[i] for i in shard_indices(len(chunks), rank, world_size, mode)]


def check_partition(ranges: Sequence[range], n: int) -> list[range]:
    """Sort ``ranges`` and check that they cover ``range(n)`` exactly once.

    Returns:
        The ranges in index order.

    Raises:
        ValueError: If a sample is missing or covered twice (e.g. by sampler padding).
    """
    ordered = sorted(ranges, key=lambda r: (r.start, r.stop))
    position = 0
    for piece in ordered:
        if piece.step != 1:
            raise ValueError(f"ranges must have step 1; got {piece}")
        if piece.start < position:
            raise ValueError(
                f"samples {piece.start}..{min(position, piece.stop) - 1} are covered twice; "
                "results would double-count them"
            )
        if piece.start > position:
            raise ValueError(f"samples {position}..{piece.start - 1} were not computed by any rank")
        position = piece.stop
    if position != n:
        raise ValueError(f"samples {position}..{n - 1} were not computed by any rank")
    return ordered


class ShardSampler(Sampler[int]):
    """A sampler over one rank's indices, like ``DistributedSampler`` but never padding.

    Args:
        n: Data set size.
        rank: This process's rank.
        world_size: Number of processes.
        mode: ``"strided"`` or ``"contiguous"`` (see :func:`shard_indices`).
    """

    def __init__(self, n: int, rank: int, world_size: int, mode: Mode = "strided") -> None:
        self.indices = shard_indices(n, rank, world_size, mode)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)
