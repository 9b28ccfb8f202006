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
``rem-dictionary``        REM parse-tree dictionary of a capsule net (counts summed over ranks)
========================  =====================================================================
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from explain_core.distributed.data import EvaluationData
from explain_core.distributed.gather import (
    concat_ordered,
    merge_csc,
    merge_dictionaries,
)
from explain_core.errors import InvalidInputError

__all__ = ["JOBS", "Job", "JobConfig"]


@dataclass(frozen=True)
class JobConfig:
    """Settings shared by the jobs (each job reads the ones it needs).

    Attributes:
        method: Registered attribution method (all jobs but ``rem-dictionary``).
        options: Method options.
        target: ``"label"`` (explain the true class), ``"predicted"``, or ``"auto"`` (labels
            when the data set has them).
        batch_size: Samples per forward/backward pass.
        shard_size: Samples per chunk (and per shard file).
        levels: REM quantisation levels ``K``.
        layer: REM routing layer (default: the last one).
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
    """

    method: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    target: str = "auto"
    batch_size: int = 64
    shard_size: int = 256
    levels: int = 11
    layer: str | None = None
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


def tensor_digest(hasher: Any, tensor: torch.Tensor) -> None:
    """Feed a tensor's dtype, shape and bytes into a ``hashlib`` hasher."""
    tensor = tensor.detach().cpu().contiguous()
    hasher.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    hasher.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())


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


def _attribute(model: nn.Module, batch: EvaluationData, config: JobConfig) -> Any:
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


def _spatial_maps(attribution: torch.Tensor) -> torch.Tensor:
    if attribution.dim() != 4:
        raise InvalidInputError(
            f"this job needs image inputs (batch, channels, H, W); got attributions of shape "
            f"{tuple(attribution.shape)}"
        )
    return attribution.detach().sum(dim=1)


class Job:
    """A job: ``compute_chunk`` on the ranks, ``merge`` of all chunks, ``write`` on rank 0."""

    name = ""
    needs_method = True
    needs_masks = False
    needs_out_dir = False
    options: frozenset[str] = frozenset()  # JobConfig fields this job takes as options

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
    needs_out_dir = True

    def compute_chunk(
        self, model: nn.Module, data: Any, piece: range, config: JobConfig
    ) -> dict[str, Any]:
        """Reuse the chunk's shard if it is complete, else compute and write it."""
        from explain_core.distributed.store import read_valid_shard, write_shard

        assert config.out_dir is not None
        extra = {"inputs_sha256": chunk_fingerprint(data.slice(piece.start, piece.stop), config)}
        sample_shape = config.sample_shape
        entry = read_valid_shard(config.out_dir, piece, config.run_key, sample_shape, extra)
        if entry is not None:
            return {"entry": entry, "reused": True}
        tensors: dict[str, list[torch.Tensor]] = {"attribution": [], "target": [], "score": []}
        for part in batches(piece, config.batch_size):
            result = _attribute(model, data.slice(part.start, part.stop), config)
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
    needs_masks = True

    def compute_batch(
        self, model: nn.Module, batch: EvaluationData, part: range, config: JobConfig
    ) -> dict[str, Any]:
        """Scores of one batch."""
        from explain_core.metrics import localisation_score

        result = _attribute(model, batch, config)
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
    options = frozenset({"fraction", "removal_steps", "order", "removed_value"})

    def compute_batch(
        self, model: nn.Module, batch: EvaluationData, part: range, config: JobConfig
    ) -> dict[str, Any]:
        """Curves of one batch."""
        from explain_core.metrics import pixel_removal_curve

        result = _attribute(model, batch, config)
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
    options = frozenset({"n_vectors", "seed", "start"})

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


class RemDictionaryJob(Job):
    """REM parse-tree dictionary (quantised couplings of the predicted class) per chunk."""

    name = "rem-dictionary"
    needs_method = False
    options = frozenset({"levels", "layer"})

    def compute_chunk(
        self, model: nn.Module, data: Any, piece: range, config: JobConfig
    ) -> dict[str, Any]:
        """The chunk's dictionary state and predictions."""
        from explain_capsules.recording import record_parse_tree_data
        from explain_capsules.rem import ParseTreeDictionary

        dictionary = ParseTreeDictionary(levels=config.levels)
        predicted, labels = [], []
        for part in batches(piece, config.batch_size):
            batch = data.slice(part.start, part.stop)
            recording = record_parse_tree_data(
                model, batch.inputs, levels=config.levels, batch_size=len(part)
            )
            if not recording.layers:
                raise InvalidInputError("the model has no routing layers")
            layer = recording.layers[-1] if config.layer is None else recording.layer(config.layer)
            dictionary.update(layer.couplings, recording.predicted, config.levels)
            predicted.append(recording.predicted)
            if batch.labels is not None:
                labels.append(batch.labels.cpu())
        return {
            "state": dictionary.to_state(),
            "predicted": torch.cat(predicted),
            "label": torch.cat(labels) if labels else None,
            "reused": False,
        }

    def merge(
        self, parts: Sequence[tuple[range, dict[str, Any]]], config: JobConfig
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor], Any]:
        """Counts summed over chunks; entropies and key counts of the merged dictionary."""
        dictionary = merge_dictionaries([value["state"] for _, value in parts])
        predicted = concat_ordered(parts, "predicted")
        per_sample = {"predicted": predicted}
        summary: dict[str, Any] = {
            "levels": config.levels,
            "mean_entropy": dictionary.mean_entropy(),
            "entropy": [float(v) for v in dictionary.entropy()],
            "keys_per_class": dictionary.keys_per_class().tolist(),
            "samples_per_class": dictionary.samples_per_class().tolist(),
        }
        if all(value["label"] is not None for _, value in parts):
            labels = concat_ordered(parts, "label")
            per_sample["label"] = labels
            summary["accuracy"] = float((predicted == labels).double().mean())
        return summary, per_sample, dictionary


JOBS: dict[str, Job] = {
    job.name: job
    for job in (
        AttributionsJob(),
        LocalisationJob(),
        PixelRemovalJob(),
        CSCJob(),
        RemDictionaryJob(),
    )
}
"""The jobs by name."""
