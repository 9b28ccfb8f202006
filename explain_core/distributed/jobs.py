"""The evaluation jobs: what one rank computes for a chunk of samples, and how chunks merge.

Every job works on chunks (fixed global index ranges, see :mod:`~.sharding`) and, within a
chunk, on batches of ``batch_size`` starting at the chunk's start, so each sample sees the same
batch and seed in any world size. ``merge`` receives every chunk's result in index order (on
every rank) and computes the statistics once from all per-sample values.

========================  =====================================================================
``attributions``          attribution maps to disk, one safetensors shard per chunk (resumable)
``localisation``          fraction of positive attribution inside the ground-truth mask
``pixel-removal``         target score while pixels are removed in attribution order
``csc``                   cosine similarity convergence (median over all samples' cosines)
========================  =====================================================================

Plugins add jobs through the ``explain_register_jobs`` hook; ``explain evaluate`` offers every
registered job with the command-line options it declares (:class:`JobArgument`).
"""

from __future__ import annotations

import argparse
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from explain_core.distributed.data import EvaluationData
from explain_core.distributed.gather import concat_ordered, merge_csc
from explain_core.distributed.store import read_valid_shard, tensor_digest, write_shard
from explain_core.errors import InvalidInputError

__all__ = [
    "CORE_JOBS",
    "Job",
    "JobArgument",
    "JobConfig",
    "attribute_batch",
    "batches",
    "concat_ordered",
    "registered_jobs",
]


@dataclass(frozen=True)
class JobConfig:
    """Settings shared by the jobs (each job reads the ones it needs).

    Attributes:
        method: Registered attribution method (for jobs that need one).
        options: Method options.
        target: ``"label"`` (explain the true class), ``"predicted"``, or ``"auto"`` (labels
            when the data set has them).
        batch_size: Samples per forward/backward pass.
        shard_size: Samples per chunk (and per shard file).
        fraction: Pixel removal: largest fraction of pixels removed.
        removal_steps: Pixel removal: number of steps (``None``: one pixel per step).
        order: Pixel removal: ``"least"`` or ``"most"`` important first.
        removed_value: Pixel removal: value of a removed pixel.
        n_vectors: CSC: random vectors per sample.
        seed: CSC: base seed; the batch starting at global index ``i`` uses ``seed + i``.
        start: CSC: layer whose output is randomised (default: the output layer).
        out_dir: Output folder (``attributions`` writes its shards there).
        run_key: Identifies the model, method, options and data of an ``attributions`` run.
        sample_shape: Shape of one attribution map (checked when reusing a shard).
        extra: Options of a job that are not fields here (a plugin job's own), by name.
    """

    method: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    target: str = "auto"
    batch_size: int = 64
    shard_size: int = 256
    fraction: float = 0.25
    removal_steps: int | None = None
    order: str = "least"
    removed_value: float = 0.0
    n_vectors: int = 5
    seed: int = 0
    start: str | None = None
    out_dir: Path | None = None
    run_key: str = ""
    sample_shape: tuple[int, ...] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class JobArgument:
    """One option of a job and its ``explain evaluate`` flag.

    Attributes:
        option: The option's name (a :class:`JobConfig` field, or the job's own, which it reads
            from ``config.extra``).
        flag: The command-line flag, e.g. ``"--levels"``.
        help: Its help text.
        type: Converts the flag's text (``int``, ``float``, a checking function); ``None``
            keeps the text.
        default: The value when the flag is not given.
        choices: The values allowed, if limited.
    """

    option: str
    flag: str
    help: str
    type: Any = None
    default: Any = None
    choices: tuple[Any, ...] | None = None


def chunk_fingerprint(chunk: EvaluationData, config: JobConfig) -> str:
    """SHA-256 of a chunk's inputs (and labels, when they are the targets)."""
    hasher = hashlib.sha256()
    tensor_digest(hasher, chunk.inputs)
    if chunk.labels is not None and config.target != "predicted":
        tensor_digest(hasher, chunk.labels)
    return hasher.hexdigest()


def batches(piece: range, batch_size: int) -> list[range]:
    """The batches of a chunk: ``batch_size`` samples from the chunk's start."""
    return [
        range(start, min(start + batch_size, piece.stop))
        for start in range(piece.start, piece.stop, batch_size)
    ]


def _device(model: nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


def _target(batch: EvaluationData, config: JobConfig) -> torch.Tensor | None:
    if config.target == "predicted" or (config.target == "auto" and batch.labels is None):
        return None
    if batch.labels is None:
        raise InvalidInputError(f"target='label' needs labels, but {batch.name} has none")
    return batch.labels


def attribute_batch(model: nn.Module, batch: EvaluationData, config: JobConfig) -> Any:
    """``explain()`` of ``config.method`` on one batch, on the model's device."""
    from explain_core.api import explain

    assert config.method is not None
    device = _device(model)
    target = _target(batch, config)
    return explain(
        model,
        batch.inputs.to(device),
        config.method,
        None if target is None else target.to(device),
        **config.options,
    )


def fraction(text: str) -> float:
    """A number in (0, 1] from the command line (``--fraction``)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 < value <= 1.0:  # also refuses NaN
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], e.g. 0.25; got {text!r}")
    return value


def _spatial_maps(attribution: torch.Tensor) -> torch.Tensor:
    if attribution.dim() != 4:
        raise InvalidInputError(
            f"this job needs image inputs (batch, channels, H, W); got attributions of shape "
            f"{tuple(attribution.shape)}"
        )
    return attribution.detach().sum(dim=1)


class Job:
    """A job: ``compute_chunk`` on the ranks, ``merge`` of all chunks on every rank.

    Attributes:
        name: The job's name (``explain evaluate --job NAME``).
        summary: One line for listings and ``--help``.
        needs_method: Whether it explains with an attribution method.
        needs_masks: Whether the data set must have ground-truth masks.
        needs_out_dir: Whether it writes files itself (else rank 0 writes its results).
        arguments: Its options, with their command-line flags.
    """

    name = ""
    summary = ""
    needs_method = True
    needs_masks = False
    needs_out_dir = False
    arguments: tuple[JobArgument, ...] = ()

    @property
    def options(self) -> frozenset[str]:
        """The option names this job takes."""
        return frozenset(argument.option for argument in self.arguments)

    def check_model(self, model: nn.Module) -> None:
        """Refuse a model the job cannot run on, before any work (default: accept any).

        Raises:
            InvalidInputError: Saying what the job needs.
        """

    def compute_chunk(
        self, model: nn.Module, data: Any, piece: range, config: JobConfig
    ) -> dict[str, Any]:
        """Compute one chunk; the default runs :meth:`compute_batch` over its batches."""
        results = []
        for part in batches(piece, config.batch_size):
            batch = data.slice(part.start, part.stop)
            results.append(self.compute_batch(model, batch, part, config))
        return {"batches": results, "reused": False}

    def compute_batch(
        self, model: nn.Module, batch: EvaluationData, part: range, config: JobConfig
    ) -> dict[str, Any]:
        """Per-sample results of one batch (CPU tensors)."""
        raise NotImplementedError

    def merge(
        self, parts: Sequence[tuple[range, dict[str, Any]]], config: JobConfig
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor], Any]:
        """``(summary, per-sample tensors, details)`` from all chunks in index order."""
        raise NotImplementedError

    @staticmethod
    def batch_parts(parts: Sequence[tuple[range, dict[str, Any]]]) -> list[tuple[range, Any]]:
        """Every batch result of every chunk, tagged with its index range, in index order."""
        return [(batch["_range"], batch) for _, value in parts for batch in value["batches"]]


def _with_range(result: dict[str, Any], part: range) -> dict[str, Any]:
    result["_range"] = part
    return result


class AttributionsJob(Job):
    """Attribution maps to safetensors shards; a valid existing shard is not recomputed."""

    name = "attributions"
    summary = "attribution maps to resumable safetensors shards"
    needs_out_dir = True

    def compute_chunk(
        self, model: nn.Module, data: Any, piece: range, config: JobConfig
    ) -> dict[str, Any]:
        """Reuse the chunk's shard if it is complete, else compute and write it."""
        assert config.out_dir is not None
        extra = {"inputs_sha256": chunk_fingerprint(data.slice(piece.start, piece.stop), config)}
        sample_shape = config.sample_shape
        entry = read_valid_shard(config.out_dir, piece, config.run_key, sample_shape, extra)
        if entry is not None:
            return {"entry": entry, "reused": True}
        tensors: dict[str, list[torch.Tensor]] = {"attribution": [], "target": [], "score": []}
        for part in batches(piece, config.batch_size):
            result = attribute_batch(model, data.slice(part.start, part.stop), config)
            rows = torch.arange(len(part), device=result.output.device)
            tensors["attribution"].append(result.attribution.detach().cpu())
            tensors["target"].append(result.target.detach().cpu())
            tensors["score"].append(result.output.detach()[rows, result.target].cpu())
        stacked = {key: torch.cat(values) for key, values in tensors.items()}
        stacked["index"] = torch.arange(piece.start, piece.stop, dtype=torch.int64)
        entry = write_shard(config.out_dir, piece, stacked, config.run_key, extra)
        return {"entry": entry, "reused": False}

    def merge(
        self, parts: Sequence[tuple[range, dict[str, Any]]], config: JobConfig
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor], Any]:
        """The index of all shards."""
        entries = [value["entry"] for _, value in parts]
        reused = sum(1 for _, value in parts if value.get("reused"))
        summary = {"shards": len(entries), "reused_shards": reused}
        return summary, {}, entries


class LocalisationJob(Job):
    """Fraction of positive attribution (summed over channels) inside each sample's mask."""

    name = "localisation"
    summary = "fraction of positive attribution inside ground-truth masks"
    needs_masks = True

    def compute_batch(
        self, model: nn.Module, batch: EvaluationData, part: range, config: JobConfig
    ) -> dict[str, Any]:
        """Scores of one batch."""
        from explain_core.metrics import localisation_score

        result = attribute_batch(model, batch, config)
        maps = _spatial_maps(result.attribution).cpu()
        assert batch.masks is not None
        score = localisation_score(maps, batch.masks.bool().cpu())
        return _with_range({"score": score, "target": result.target.cpu()}, part)

    def merge(
        self, parts: Sequence[tuple[range, dict[str, Any]]], config: JobConfig
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor], Any]:
        """Mean and median score over all samples."""
        flat = self.batch_parts(parts)
        score = concat_ordered(flat, "score")
        target = concat_ordered(flat, "target")
        summary = {
            "mean": float(score.double().mean()),
            "median": float(score.double().median()),
        }
        return summary, {"score": score, "target": target}, None


class PixelRemovalJob(Job):
    """Target-score curves while pixels are removed in attribution order."""

    name = "pixel-removal"
    summary = "target score while pixels are removed in attribution order"
    arguments = (
        JobArgument(
            "fraction",
            "--fraction",
            "fraction of the pixels removed, in (0, 1] (0.25)",
            type=fraction,
            default=0.25,
        ),
        JobArgument(
            "removal_steps", "--removal-steps", "steps (default: one pixel per step)", type=int
        ),
        JobArgument(
            "order",
            "--order",
            "least or most important first",
            default="least",
            choices=("least", "most"),
        ),
        JobArgument("removed_value", "--removed-value", "value of a removed pixel (0)", float, 0.0),
    )

    def compute_batch(
        self, model: nn.Module, batch: EvaluationData, part: range, config: JobConfig
    ) -> dict[str, Any]:
        """Curves of one batch."""
        from explain_core.metrics import pixel_removal_curve

        result = attribute_batch(model, batch, config)
        inputs = batch.inputs.to(_device(model))
        curve = pixel_removal_curve(
            model,
            inputs,
            _spatial_maps(result.attribution),
            result.target,
            fraction=config.fraction,
            steps=config.removal_steps,
            order=config.order,  # type: ignore[arg-type]
            removed_value=config.removed_value,
        )
        return _with_range({"curve": curve.cpu(), "target": result.target.cpu()}, part)

    def merge(
        self, parts: Sequence[tuple[range, dict[str, Any]]], config: JobConfig
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor], Any]:
        """The mean curve over all samples and the removed pixel counts."""
        flat = self.batch_parts(parts)
        curve = concat_ordered(flat, "curve")
        mean = curve.double().mean(dim=0)
        summary = {
            "order": config.order,
            "mean_curve": [float(v) for v in mean],
            "mean_drop": float(mean[0] - mean[-1]),
        }
        return summary, {"curve": curve, "target": concat_ordered(flat, "target")}, None


class CSCJob(Job):
    """Cosine similarity convergence; the batch at global index ``i`` uses seed ``seed + i``."""

    name = "csc"
    summary = "cosine similarity convergence of random relevance vectors"
    arguments = (
        JobArgument("n_vectors", "--vectors", "random vectors per sample (5)", int, 5),
        JobArgument("seed", "--seed", "base seed (0)", int, 0),
        JobArgument("start", "--start", "layer whose output is randomised (default: last)"),
    )

    def compute_batch(
        self, model: nn.Module, batch: EvaluationData, part: range, config: JobConfig
    ) -> dict[str, Any]:
        """Defined cosines per layer of one batch."""
        from explain_core.metrics import cosine_similarity_convergence

        assert config.method is not None
        result = cosine_similarity_convergence(
            model,
            batch.inputs.to(_device(model)),
            config.method,
            start=config.start,
            n_vectors=config.n_vectors,
            seed=config.seed + part.start,
            **config.options,
        )
        return _with_range(
            {
                "start": result.start,
                "layers": list(result.layers),
                "cosines": result.cosines,
                "undefined": result.undefined,
                "n": len(part),
            },
            part,
        )

    def merge(
        self, parts: Sequence[tuple[range, dict[str, Any]]], config: JobConfig
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor], Any]:
        """Medians from all gathered cosines."""
        merged = merge_csc([value for _, value in self.batch_parts(parts)])
        summary = {
            "start": merged.start,
            "median": merged.median,
            "undefined": merged.undefined,
        }
        cosines = {f"cosines.{name}": torch.from_numpy(v) for name, v in merged.cosines.items()}
        return summary, cosines, merged


CORE_JOBS: tuple[Job, ...] = (AttributionsJob(), LocalisationJob(), PixelRemovalJob(), CSCJob())
"""The core's jobs (registered by its plugin, :mod:`explain_core.builtin`)."""


def registered_jobs() -> dict[str, Job]:
    """Every job of the loaded plugins, by name."""
    from explain_core.plugin_manager import get_plugin_manager

    return get_plugin_manager().jobs()
