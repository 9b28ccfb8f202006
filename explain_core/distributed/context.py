"""Who am I in a distributed run: rank, world size and device, from ``torch.distributed``.

``torchrun`` starts one process per rank and passes ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT`` in the environment. :func:`init_distributed` reads them and
initialises the default process group (``nccl`` when the run uses CUDA, ``gloo`` on CPU); a
process started without them (or with ``WORLD_SIZE=1``) runs alone and needs no process group. A
group that the caller initialised already (any backend, any ``init_method``) is used as it is.
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from explain_core.errors import InvalidInputError

__all__ = ["DistributedContext", "current_context", "init_distributed", "shutdown_distributed"]

_OWNED = {"group": False}  # whether this module initialised the default process group


@dataclass(frozen=True)
class DistributedContext:
    """Rank, world size and device of this process.

    Attributes:
        rank: Global rank, ``0 … world_size-1``.
        world_size: Number of processes.
        local_rank: Rank on this machine (selects the GPU).
        device: Device this rank computes on.
        backend: Backend of the process group, or ``None`` when running alone.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that writes merged results and prints."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """True when a process group with more than one process is active."""
        return self.backend is not None and self.world_size > 1

    def barrier(self) -> None:
        """Wait for every rank (no-op when running alone)."""
        if self.distributed:
            dist.barrier()


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise InvalidInputError(f"environment variable {name}={value!r} is not an int") from None


def _resolve_device(device: str | torch.device | None, local_rank: int) -> torch.device:
    if device is None:
        return torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        if not torch.cuda.is_available():
            raise InvalidInputError("device 'cuda' was asked for but CUDA is not available")
        device = torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
    return device


def current_context(device: str | torch.device | None = None) -> DistributedContext:
    """The context of this process without initialising anything.

    With an initialised default process group, rank and world size come from it; otherwise the
    process runs alone (rank 0 of 1).

    Args:
        device: ``"cpu"`` (default), ``"cuda"`` (one GPU per local rank) or an explicit device.
    """
    local_rank = _env_int("LOCAL_RANK", 0)
    if dist.is_available() and dist.is_initialized():
        return DistributedContext(
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            local_rank=local_rank,
            device=_resolve_device(device, local_rank),
            backend=str(dist.get_backend()),
        )
    return DistributedContext(0, 1, 0, _resolve_device(device, 0), None)


def init_distributed(
    device: str | torch.device | None = None, *, backend: str | None = None
) -> DistributedContext:
    """Initialise the default process group from ``torchrun``'s environment when needed.

    Idempotent: an initialised group is reused. Without ``WORLD_SIZE > 1`` in the environment
    nothing is initialised and the process runs alone. A group initialised here is destroyed by
    :func:`shutdown_distributed` (also registered to run at exit).

    Args:
        device: ``"cpu"`` (default) or ``"cuda"``; CUDA ranks use GPU ``LOCAL_RANK``.
        backend: Process-group backend; default ``nccl`` for CUDA, ``gloo`` for CPU.

    Raises:
        InvalidInputError: If the environment is inconsistent, or torch.distributed is missing.
    """
    if dist.is_available() and dist.is_initialized():
        return current_context(device)
    world_size = _env_int("WORLD_SIZE", 1)
    if world_size <= 1:
        return current_context(device)
    if not dist.is_available():
        raise InvalidInputError(
            f"WORLD_SIZE={world_size} but this torch build has no torch.distributed"
        )
    rank, local_rank = _env_int("RANK", -1), _env_int("LOCAL_RANK", 0)
    if not 0 <= rank < world_size:
        raise InvalidInputError(
            f"RANK={os.environ.get('RANK')!r} is not in [0, {world_size}); start the processes "
            "with torchrun, which sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"
        )
    resolved = _resolve_device(device, local_rank)
    if resolved.type == "cuda":
        torch.cuda.set_device(resolved)
    backend = backend or ("nccl" if resolved.type == "cuda" else "gloo")
    options = {"device_id": resolved} if resolved.type == "cuda" else {}
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size, **options)
    if not _OWNED["group"]:
        atexit.register(shutdown_distributed)
    _OWNED["group"] = True
    return current_context(resolved)


def shutdown_distributed() -> None:
    """Destroy the default process group if :func:`init_distributed` created it."""
    if _OWNED["group"] and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _OWNED["group"] = False
