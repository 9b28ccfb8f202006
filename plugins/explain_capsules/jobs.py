"""The capsules plugin's evaluation job: REM parse-tree dictionaries over a data set.

``explain evaluate --job rem-dictionary`` (or ``explain_core.distributed.evaluate``) records the
quantised couplings of every sample's predicted class, chunk by chunk on each rank, and merges the
chunks' dictionaries exactly (counts summed), so 1 and N processes give identical entropies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from explain_capsules.recording import record_parse_tree_data
from explain_capsules.rem import ParseTreeDictionary
from explain_core.distributed.jobs import Job, JobArgument, JobConfig, batches, concat_ordered
from explain_core.errors import InvalidInputError
from explain_core.interfaces.routing import RoutingLayer

__all__ = ["RemDictionaryJob", "merge_dictionaries"]


def merge_dictionaries(states: Sequence[dict[str, Any]]) -> ParseTreeDictionary:
    """One dictionary from per-chunk states (counts summed)."""
    merged = ParseTreeDictionary()
    for state in states:
        merged.merge(ParseTreeDictionary.from_state(state))
    return merged


class RemDictionaryJob(Job):
    """REM parse-tree dictionary (quantised couplings of the predicted class) per chunk."""

    name = "rem-dictionary"
    summary = "REM parse-tree dictionaries of a capsule network (counts summed over ranks)"
    needs_method = False
    arguments = (
        JobArgument("levels", "--levels", "quantisation levels K (11)", int, 11),
        JobArgument("layer", "--layer", "routing layer (default: the last)"),
    )

    def check_model(self, model: nn.Module) -> None:
        """Refuse a model without routing layers."""
        if not any(isinstance(module, RoutingLayer) for module in model.modules()):
            raise InvalidInputError(
                f"--job rem-dictionary needs a capsule network, but {type(model).__name__} has "
                "no routing layers (modules deriving from explain_core.RoutingLayer); choose "
                "another --job for this model"
            )

    def compute_chunk(
        self, model: nn.Module, data: Any, piece: range, config: JobConfig
    ) -> dict[str, Any]:
        """The chunk's dictionary state and predictions."""
        levels = config.extra.get("levels", 11)
        layer_name = config.extra.get("layer")
        dictionary = ParseTreeDictionary(levels=levels)
        predicted, labels = [], []
        for part in batches(piece, config.batch_size):
            batch = data.slice(part.start, part.stop)
            recording = record_parse_tree_data(
                model, batch.inputs, levels=levels, batch_size=len(part)
            )
            if not recording.layers:
                raise InvalidInputError("the model has no routing layers")
            layer = recording.layers[-1] if layer_name is None else recording.layer(layer_name)
            dictionary.update(layer.couplings, recording.predicted, levels)
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
            "levels": config.extra.get("levels", 11),
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
