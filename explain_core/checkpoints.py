"""Training checkpoints as safetensors files: weights, optimizer moments and JSON progress.

Shared by every plugin's training loop. Loading never unpickles anything, and the file's tensors
are checked against the model (names and shapes, buffers such as pruning masks included) before
anything is loaded, so a refused checkpoint leaves the model untouched.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from explain_core.errors import ModelLoadError

__all__ = [
    "load_training_checkpoint",
    "save_training_checkpoint",
]


def save_training_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    epoch: int,
    config: dict[str, Any],
    history: dict[str, Any],
    model_settings: dict[str, Any] | None = None,
) -> None:
    """Write the model's full state dict, the optimizer's moments and progress, atomically.

    Args:
        path: The ``.safetensors`` file to write (a ``.partial`` file is renamed over it).
        model: Its ``state_dict()`` is saved, buffers included.
        optimizer: Its per-parameter state and parameter groups are saved.
        epoch: Number of finished epochs.
        config: JSON-serialisable training configuration (checked when resuming).
        history: JSON-serialisable progress so far.
        model_settings: JSON-serialisable settings of the model that its state dict does not
            hold (a temperature, strides); checked when resuming with ``model_settings``.
    """
    from safetensors.torch import save_file

    # clone(): tied or aliased tensors would otherwise be refused by safetensors.
    tensors = {f"model.{k}": v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    state = optimizer.state_dict()
    for index, moments in state["state"].items():
        for key, value in moments.items():
            tensors[f"optimizer.{index}.{key}"] = torch.as_tensor(value).clone().contiguous()
    metadata = {
        "model_class": type(model).__name__,
        "epoch": str(epoch),
        "config": json.dumps(config),
        "history": json.dumps(history),
        "param_groups": json.dumps(state["param_groups"]),
    }
    if model_settings is not None:
        metadata["model_settings"] = json.dumps(model_settings)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".partial")
    save_file(tensors, str(temporary), metadata=metadata)
    temporary.replace(path)


def load_training_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    config: dict[str, Any] | None = None,
    model_settings: dict[str, Any] | None = None,
) -> tuple[int, dict[str, Any]]:
    """Restore a checkpoint written by :func:`save_training_checkpoint`.

    Args:
        path: The checkpoint file.
        model: Must have exactly the checkpoint's tensors (names and shapes, incl. buffers).
        optimizer: Optional optimizer to restore the moments into.
        config: When given, must equal the saved configuration (resuming reproduces the run).
        model_settings: When given, the checkpoint must come from a model of the same class and,
            if it recorded settings, these same settings (checkpoints written without settings
            are only checked for the class).

    Returns:
        The number of finished epochs and the saved history.

    Raises:
        ModelLoadError: If the file is not such a checkpoint, its tensors do not match the
            model, it was written with another configuration, or (with ``model_settings``) by
            a model of another class or with other settings.
    """
    from safetensors import safe_open

    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    except Exception as error:
        raise ModelLoadError(f"{path} is not a readable checkpoint: {error}") from error
    if "epoch" not in metadata or "config" not in metadata:
        raise ModelLoadError(f"{path} is not a training checkpoint (no epoch recorded)")
    if model_settings is not None:
        _check_model_settings(path, model, metadata, model_settings)
    saved_config = json.loads(metadata["config"])
    if config is not None and saved_config != config:
        raise ModelLoadError(
            f"{path} was written with another training configuration ({saved_config}); expected "
            f"{config}; use a new checkpoint folder or the same configuration to resume"
        )
    weights = {k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")}
    _check_weights(path, model, weights)
    model.load_state_dict(weights)
    if optimizer is not None:
        moments: dict[int, dict[str, Any]] = {}
        for key, value in tensors.items():
            if key.startswith("optimizer."):
                _, index, name = key.split(".", 2)
                moments.setdefault(int(index), {})[name] = value
        optimizer.load_state_dict(
            {"state": moments, "param_groups": json.loads(metadata["param_groups"])}
        )
    return int(metadata["epoch"]), json.loads(metadata["history"])


_FRESH = (
    "resume with a model built with the checkpoint's settings, or use a new checkpoint folder to "
    "start a new run"
)


def _check_model_settings(
    path: Path, model: nn.Module, metadata: dict[str, str], settings: dict[str, Any]
) -> None:
    """Refuse a checkpoint of another model class or other non-parameter settings.

    The state dict alone cannot tell: a temperature or a stride changes the function the weights
    compute without changing any tensor, and resuming would mix two different runs.
    """
    name = type(model).__name__
    saved_class = metadata.get("model_class", name)
    if saved_class != name:
        raise ModelLoadError(f"{path} was written by a {saved_class}, not a {name}; {_FRESH}")
    if "model_settings" not in metadata:
        return  # written before settings were recorded: nothing to compare
    saved = json.loads(metadata["model_settings"])
    current = json.loads(json.dumps(settings))  # tuples become lists, as in the file
    differing = [
        f"{key}: checkpoint {saved.get(key, '(none)')!r}, model {current.get(key, '(none)')!r}"
        for key in sorted(set(saved) | set(current))
        if saved.get(key) != current.get(key)
    ]
    if differing:
        raise ModelLoadError(
            f"{path} was written by a {name} with other settings ({'; '.join(differing)}); {_FRESH}"
        )


def _check_weights(path: Path, model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    expected = model.state_dict()
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    shapes = [
        f"{k}: model {tuple(expected[k].shape)} vs checkpoint {tuple(weights[k].shape)}"
        for k in sorted(set(expected) & set(weights))
        if expected[k].shape != weights[k].shape
    ]
    if not (missing or unexpected or shapes):
        return
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint: {missing}")
    if unexpected:
        problems.append(f"not in the model: {unexpected}")
    if shapes:
        problems.append(f"shape mismatch: {shapes}")
    masks = any("mask" in k for k in (*missing, *unexpected))
    hint = " (its pruning masks do not match the model)" if masks else ""
    raise ModelLoadError(
        f"{path} does not match {type(model).__name__}{hint}; expected the model's "
        f"{len(expected)} tensors with the same names and shapes; " + "; ".join(problems)
    )
