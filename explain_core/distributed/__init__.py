"""Distributed evaluation on ``torch.distributed``: shard, compute, merge exactly.

Run the same script (or ``explain evaluate``) alone or under ``torchrun --nproc_per_node=N``:
:func:`evaluate` deals fixed chunks of the data set to the ranks without padding, computes
attributions or metric terms per sample, gathers them and merges exactly, so 1 and N processes
give identical numbers. ``attributions`` writes resumable safetensors shards with an index.
"""

from explain_core.distributed.context import (
    DistributedContext,
    current_context,
    init_distributed,
    shutdown_distributed,
)
from explain_core.distributed.data import DATASETS, EvaluationData, load_dataset
from explain_core.distributed.jobs import Job, JobArgument, JobConfig, registered_jobs
from explain_core.distributed.runner import EvaluationResult, evaluate
from explain_core.distributed.sharding import ShardSampler, chunk_ranges, shard_indices
from explain_core.distributed.store import StoredAttributions, load_attributions, read_index

__all__ = [
    "DATASETS",
    "DistributedContext",
    "EvaluationData",
    "EvaluationResult",
    "Job",
    "JobArgument",
    "JobConfig",
    "ShardSampler",
    "StoredAttributions",
    "chunk_ranges",
    "current_context",
    "evaluate",
    "init_distributed",
    "load_attributions",
    "load_dataset",
    "read_index",
    "registered_jobs",
    "shard_indices",
    "shutdown_distributed",
]
