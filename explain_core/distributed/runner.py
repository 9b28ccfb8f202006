"""``evaluate``: one call that runs an evaluation job in 1 process or under ``torchrun``.

The same code runs everywhere: alone, ``evaluate`` computes every chunk; under ``torchrun`` (or
with a process group the caller initialised) each rank computes its own chunks, the results are
gathered with ``all_gather_object`` and merged exactly, and every rank returns the same
:class:`EvaluationResult`. Rank 0 writes the output files.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from explain_core.distributed.context import DistributedContext, init_distributed
from explain_core.distributed.data import as_evaluation_data
from explain_core.distributed.gather import all_gather_objects, gather_chunk_results
from explain_core.distributed.jobs import JobConfig, registered_jobs
from explain_core.distributed.lock import OutputLock
from explain_core.distributed.sharding import Mode, assign_chunks, chunk_ranges
from explain_core.distributed.store import tensor_digest
from explain_core.errors import DistributedError, InvalidInputError

__all__ = ["EvaluationResult", "evaluate"]


@dataclass(frozen=True)
class EvaluationResult:
    """The merged result of an evaluation job (the same on every rank).

    Attributes:
        job: Job name.
        method: Attribution method (``None`` for ``rem-dictionary``).
        n_samples: Number of samples evaluated, each exactly once.
        world_size: Number of processes that computed it.
        summary: JSON-serialisable statistics (means, medians, entropies, …).
        per_sample: Per-sample tensors in global sample order (scores, curves, predictions,
            CSC cosines).
        details: Job-specific object: e.g. a plugin job's dictionary, the
            :class:`~explain_core.metrics.CSCResult`, or the shard entries of ``attributions``.
        files: Files written by rank 0.
        computed: Index ranges computed in this run.
        reused: Index ranges whose shards were complete already (``attributions`` only).
    """

    job: str
    method: str | None
    n_samples: int
    world_size: int
    summary: dict[str, Any]
    per_sample: dict[str, torch.Tensor] = field(default_factory=dict)
    details: Any = None
    files: tuple[Path, ...] = ()
    computed: tuple[range, ...] = ()
    reused: tuple[range, ...] = ()

    def summary_lines(self) -> list[str]:
        """A short human-readable summary."""
        head = f"{self.job}"
        if self.method:
            head += f" ({self.method})"
        lines = [f"{head}: {self.n_samples} samples on {self.world_size} process(es)"]
        for key, value in self.summary.items():
            lines.append(f"  {key}: {_short(value)}")
        if self.reused:
            lines.append(
                f"  reused {len(self.reused)} complete shard(s), computed {len(self.computed)}"
            )
        lines.extend(f"  wrote {path}" for path in self.files)
        return lines


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, dict):
        return ", ".join(f"{k}={_short(v)}" for k, v in value.items())
    if isinstance(value, list) and value and isinstance(value[0], float):
        return "[" + ", ".join(f"{v:.4g}" for v in value) + "]"
    return str(value)


def evaluate(
    job: str,
    model: nn.Module,
    dataset: Any,
    *,
    method: str | None = None,
    out_dir: str | Path | None = None,
    batch_size: int = 64,
    shard_size: int = 256,
    target: str = "auto",
    device: str | torch.device | None = None,
    mode: Mode = "strided",
    progress: Callable[[range, bool], None] | None = None,
    **options: Any,
) -> EvaluationResult:
    """Run an evaluation job over ``dataset``, sharded over the ranks of the process group.

    Samples are split into chunks of ``shard_size`` (fixed global index ranges, independent of
    the number of processes) and the chunks are dealt to the ranks without padding; within a
    chunk, batches of ``batch_size`` start at the chunk's start. Each sample is therefore
    computed in the same batch whatever the world size, and 1 and N processes give identical
    results (with the same threads and device). Called under ``torchrun`` without an
    initialised process group, it initialises one (gloo on CPU, NCCL on CUDA).

    Args:
        job: A registered job: ``"attributions"``, ``"localisation"``, ``"pixel-removal"``,
            ``"csc"``, or one a plugin adds (``"rem-dictionary"`` of the capsules plugin).
        model: The model (in eval mode); moved to this rank's device.
        dataset: Tensor, tuple ``(inputs, labels[, masks])``, ``TensorDataset``,
            :class:`~explain_core.distributed.EvaluationData` or map-style ``Dataset``.
        method: Registered attribution method (for the jobs that need one).
        out_dir: Output folder: required for ``attributions`` (its shards and ``index.json``);
            for the metric jobs rank 0 writes ``{job}.json`` and ``{job}.safetensors`` there.
        batch_size: Samples per pass.
        shard_size: Samples per chunk (and per shard file).
        target: ``"auto"`` (labels when present, else predicted), ``"label"`` or
            ``"predicted"``.
        device: ``"cpu"`` (default) or ``"cuda"`` (GPU ``LOCAL_RANK`` on each rank).
        mode: How chunks are dealt: ``"strided"`` (round robin) or ``"contiguous"``.
        progress: Called as ``progress(chunk_range, reused)`` after each chunk of this rank.
        **options: Options of the job (``fraction``, ``removal_steps``, ``order``,
            ``removed_value`` for ``pixel-removal``; ``n_vectors``, ``seed``, ``start`` for
            ``csc``; a plugin job's own, e.g. ``levels``, ``layer``); any other
            keyword is a method option (e.g. ``steps=32`` for integrated gradients), as are the
            entries of ``method_options={...}``.

    Returns:
        The merged result, identical on every rank.

    Raises:
        InvalidInputError: For an unknown job, missing method, masks or output folder, bad sizes.
        DistributedError: If a rank failed or stopped, the ranks' samples do not partition the
            data, or (``attributions``) rank 0 cannot see a shard another rank wrote.
    """
    jobs = registered_jobs()
    if job not in jobs:
        raise InvalidInputError(f"unknown job {job!r}; choose from {', '.join(jobs)}")
    runner = jobs[job]
    method_options = dict(options.pop("method_options", None) or {})
    job_options = {k: options.pop(k) for k in list(options) if k in runner.options}
    method_options.update(options)
    for name, value in (("batch_size", batch_size), ("shard_size", shard_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidInputError(f"{name} must be an int >= 1; got {value!r}")
    if target not in ("auto", "label", "predicted"):
        raise InvalidInputError(f'target must be "auto", "label" or "predicted"; got {target!r}')
    if runner.needs_method:
        if method is None:
            raise InvalidInputError(f"job {job!r} needs a method, e.g. method='gradient'")
        from explain_core.plugin_manager import get_registry

        get_registry()[method].create(**method_options)  # unknown names and options fail here
    elif method is not None or method_options:
        raise InvalidInputError(f"job {job!r} takes no attribution method or method options")
    if runner.needs_out_dir and out_dir is None:
        raise InvalidInputError(f"job {job!r} writes its results to disk: give out_dir")

    context = init_distributed(device)
    data = as_evaluation_data(dataset)
    n = len(data)
    if n < 1:
        raise InvalidInputError("the data set is empty")
    first = data.slice(0, 1)
    if runner.needs_masks and first.masks is None:
        raise InvalidInputError(
            f"job {job!r} needs ground-truth masks (N, H, W); {first.name} has none (try the "
            "cluttered digits)"
        )
    model = model.to(context.device)
    config = JobConfig(
        method=method,
        options=method_options,
        target=target,
        batch_size=batch_size,
        shard_size=shard_size,
        out_dir=None if out_dir is None else Path(out_dir),
        sample_shape=tuple(first.inputs.shape[1:]),
        **{k: v for k, v in job_options.items() if k in _CONFIG_FIELDS},
        extra={k: v for k, v in job_options.items() if k not in _CONFIG_FIELDS},
    )
    if runner.needs_out_dir:
        config = replace(config, run_key=_run_key(model, config, first.name, n))

    chunks = chunk_ranges(n, shard_size)
    with contextlib.ExitStack() as held:
        if config.out_dir is not None:
            held.enter_context(_folder_lock(config.out_dir, context))
        local, error = _compute_chunks(runner, model, data, chunks, config, context, mode, progress)
        parts = gather_chunk_results(local, n, context, error)
        summary, per_sample, details = runner.merge(parts, config)
        computed = tuple(piece for piece, value in parts if not value.get("reused"))
        reused = tuple(piece for piece, value in parts if value.get("reused"))
        files: tuple[Path, ...] = ()
        failure: BaseException | None = None
        if context.is_main and config.out_dir is not None:
            try:
                writers = {
                    piece.start: rank
                    for rank in range(context.world_size)
                    for piece in assign_chunks(chunks, rank, context.world_size, mode)
                }
                files = _write_outputs(
                    job, config, n, context, summary, per_sample, details, writers
                )
            except Exception as problem:  # tell the other ranks instead of leaving them waiting
                failure = problem
        # Doubles as the barrier: nobody returns before rank 0 has written (or failed to).
        statuses = all_gather_objects(None if failure is None else _one_line(failure), context)
    if failure is not None:
        raise failure
    if statuses[0] is not None:
        raise DistributedError(f"rank 0 could not write the results: {statuses[0]}")
    if not files and config.out_dir is not None:
        files = _expected_files(job, config.out_dir)
    return EvaluationResult(
        job=job,
        method=method,
        n_samples=n,
        world_size=context.world_size,
        summary=summary,
        per_sample=per_sample,
        details=details,
        files=files,
        computed=computed,
        reused=reused,
    )


def _compute_chunks(
    runner: Any,
    model: nn.Module,
    data: Any,
    chunks: list[range],
    config: JobConfig,
    context: DistributedContext,
    mode: Mode,
    progress: Callable[[range, bool], None] | None,
) -> tuple[list[tuple[range, Any]], BaseException | None]:
    """This rank's chunks and the error that stopped it, if any.

    The ranks go through their chunks in rounds, one chunk each, and tell each other after every
    round whether one failed: a failure on any rank stops every rank within one chunk, instead of
    the others computing the rest of their share first.
    """
    mine = assign_chunks(chunks, context.rank, context.world_size, mode)
    rounds = max(
        len(assign_chunks(chunks, rank, context.world_size, mode))
        for rank in range(context.world_size)
    )
    local: list[tuple[range, Any]] = []
    error: BaseException | None = None
    for step in range(rounds):
        if step < len(mine):
            piece = mine[step]
            try:
                value = runner.compute_chunk(model, data, piece, config)
            except Exception as problem:  # reported to every rank, so no rank waits forever
                error = problem
            else:
                local.append((piece, value))
                if progress is not None:
                    progress(piece, bool(value.get("reused")))
        if context.distributed:
            if any(all_gather_objects(error is not None, context)):
                break
        elif error is not None:
            break
    return local, error


@contextlib.contextmanager
def _folder_lock(out_dir: Path, context: DistributedContext) -> Iterator[None]:
    """Rank 0 holds the output folder's lock for the run; every rank learns if it is taken."""
    lock = OutputLock(out_dir)
    problem = None
    if context.is_main:
        try:
            lock.acquire()
        except DistributedError as error:
            problem = str(error)
    statuses = all_gather_objects(problem, context)
    if statuses[0] is not None:
        raise DistributedError(statuses[0])
    try:
        yield
    finally:
        lock.release()


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


_CONFIG_FIELDS = frozenset(f.name for f in fields(JobConfig))


def _run_key(model: nn.Module, config: JobConfig, name: str, n: int) -> str:
    """Hash of the model weights, method, options, target mode, batch size and data size."""
    hasher = hashlib.sha256()
    for key, tensor in sorted(model.state_dict().items()):
        hasher.update(key.encode())
        tensor_digest(hasher, tensor)
    settings = {
        "model": type(model).__qualname__,
        "method": config.method,
        "options": repr(sorted(config.options.items())),
        "target": config.target,
        "data": name,
        "n": n,
        "shard_size": config.shard_size,
        # Batched methods (e.g. integrated gradients) differ in the last bits between batch sizes.
        "batch_size": config.batch_size,
    }
    hasher.update(json.dumps(settings, sort_keys=True).encode())
    return hasher.hexdigest()


def _expected_files(job: str, out_dir: Path) -> tuple[Path, ...]:
    from explain_core.distributed.store import INDEX_NAME

    if job == "attributions":
        return (out_dir / INDEX_NAME,)
    return (out_dir / f"{job}.json", out_dir / f"{job}.safetensors")


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _write_outputs(
    job: str,
    config: JobConfig,
    n: int,
    context: DistributedContext,
    summary: dict[str, Any],
    per_sample: dict[str, torch.Tensor],
    details: Any,
    writers: dict[int, int],
) -> tuple[Path, ...]:
    from explain_core.distributed.store import (
        FORMAT,
        VERSION,
        check_listed_shards,
        remove_unlisted_shards,
        write_index,
    )
    from explain_core.files import write_atomically

    assert config.out_dir is not None
    out_dir = config.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    header = {
        "job": job,
        "method": config.method,
        "options": {k: repr(v) for k, v in config.options.items()},
        "target": config.target,
        "n_samples": n,
        "shard_size": config.shard_size,
        "batch_size": config.batch_size,
        "world_size": context.world_size,
    }
    if job == "attributions":
        # The index must not vouch for shards rank 0 cannot read (a folder that is not shared).
        check_listed_shards(out_dir, details, writers)
        index = {
            "format": FORMAT,
            "version": VERSION,
            **header,
            "run_key": config.run_key,
            "sample_shape": list(config.sample_shape or ()),
            "shards": details,
        }
        written = write_index(out_dir, index)
        remove_unlisted_shards(out_dir, details)  # an earlier run's: nothing vouches for them
        return (written,)
    from safetensors.torch import save

    document = {**header, "summary": _json_safe(summary)}
    if job == "rem-dictionary":
        document["dictionary"] = details.to_state()
    json_path, tensor_path = _expected_files(job, out_dir)
    write_atomically(json_path, (json.dumps(document, indent=1) + "\n").encode())
    tensors = {k: v.detach().cpu().contiguous() for k, v in per_sample.items()}
    write_atomically(tensor_path, save(tensors, {"job": job}))
    return (json_path, tensor_path)
