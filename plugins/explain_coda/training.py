"""Training CoDA-Nets: BCE one-vs-all, optional ``λ·mean|W_{0→L}|``, safe checkpoints, resume.

Every random choice of epoch ``e`` (shuffling, the wrong class of the regulariser) comes from a
generator seeded with ``(seed, e)``, so a run resumed from a checkpoint continues exactly as the
uninterrupted run would. Checkpoints are safetensors files (weights and optimizer moments) with a
JSON header for the rest: loading one never unpickles anything.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from explain_coda.model import CoDANet, bce_one_vs_all
from explain_core.checkpoints import load_training_checkpoint, save_training_checkpoint
from explain_core.errors import InvalidInputError
from explain_core.interfaces.dynamic_linear import dynamic_linear_rows
from explain_core.training import EpochHistory, train_resumable
from explain_core.validation import check_inputs, refuse_inference_mode

CHECKPOINT_NAME = "checkpoint.safetensors"


@dataclass
class TrainConfig:
    """Options of :func:`train_coda`.

    Attributes:
        epochs: Passes over the training data.
        batch_size: Samples per step.
        lr: Adam learning rate.
        lr_halving_epochs: Halve the learning rate every this many epochs (``None``: never).
        regularisation: λ of ``λ·mean|W_{0→L}(x)|`` over the true class and one random wrong
            class per sample (eq. 10); 0 switches it off.
        seed: Seed of shuffling and of the regulariser's class choice.
    """

    epochs: int = 30
    batch_size: int = 32
    lr: float = 1e-3
    lr_halving_epochs: int | None = None
    regularisation: float = 0.0
    seed: int = 0


class TrainHistory(EpochHistory):
    """Per-epoch mean training loss and, when evaluation data was given, test accuracy."""


def weight_regulariser(
    model: CoDANet, inputs: torch.Tensor, labels: torch.Tensor, generator: torch.Generator
) -> torch.Tensor:
    """``mean|W_{0→L}(x)|`` over the rows of the true class and one random wrong class.

    The rows come from vector-Jacobian products in explanation mode with ``create_graph``, so
    the penalty is differentiable w.r.t. every parameter that builds the dynamic weights (the
    activations feeding each layer's weight computation are treated as constants, as in
    explanation mode).
    """
    offset = torch.randint(1, model.num_classes, labels.shape, generator=generator)
    wrong = (labels + offset.to(labels.device)) % model.num_classes
    rows, _ = dynamic_linear_rows(
        model, inputs, torch.stack([labels, wrong], dim=1), create_graph=True
    )
    return (rows * model.temperature).abs().mean()


def train_coda(
    model: CoDANet,
    images: torch.Tensor,
    labels: torch.Tensor,
    config: TrainConfig,
    *,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    evaluate: Callable[[CoDANet], float] | None = None,
    stop_after_epoch: int | None = None,
) -> TrainHistory:
    """Train ``model`` on encoded ``images``; resume from ``checkpoint_dir`` if it has one.

    Args:
        model: The CoDA-Net (its initial weights should come from a seeded constructor).
        images: Encoded training inputs ``(N, 2C, H, W)``.
        labels: Integer class indices ``(N,)``.
        config: Training options.
        checkpoint_dir: Folder (a path or str) for ``checkpoint.safetensors``, written after
            every epoch; a checkpoint already there is resumed from.
        evaluate: Called after every epoch with the model in eval mode; returns an accuracy.
        stop_after_epoch: Stop after this many epochs in total (to simulate an interruption).

    Returns:
        The history of all epochs, including those before a resume.

    Raises:
        InvalidInputError: For images or labels that do not fit the model or each other, a
            ``checkpoint_dir`` that is not a folder path, or a call inside
            ``torch.inference_mode()``.
        ModelLoadError: If the checkpoint in ``checkpoint_dir`` was written by another kind of
            model, a model with other settings (e.g. temperature) or another configuration.
    """
    refuse_inference_mode("train_coda()", model)
    labels = _check_training_data(model, images, labels)
    checkpoint = None if checkpoint_dir is None else _checkpoint_file(checkpoint_dir)

    def batch_loss(
        batch_images: torch.Tensor, batch_labels: torch.Tensor, generator: torch.Generator
    ) -> torch.Tensor:
        loss = bce_one_vs_all(model(batch_images), batch_labels)
        if config.regularisation:
            penalty = weight_regulariser(model, batch_images, batch_labels, generator)
            loss = loss + config.regularisation * penalty
        return loss

    return train_resumable(
        model,
        images,
        labels,
        config,
        TrainHistory(),
        learning_rate=lambda epoch: _lr(config, epoch),
        batch_loss=batch_loss,
        description="CoDA",
        checkpoint=checkpoint,
        load_checkpoint=load_checkpoint,
        save_checkpoint=save_checkpoint,
        evaluate=evaluate,
        stop_after_epoch=stop_after_epoch,
    )


def _check_training_data(
    model: CoDANet, images: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """Refuse training data the loop would fail on deep inside torch; return int64 labels."""
    if not isinstance(images, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise InvalidInputError(
            f"images and labels must be torch tensors; got {type(images).__name__} and "
            f"{type(labels).__name__}; convert them with torch.as_tensor(...)"
        )
    # One sample is enough to check dtype, device and shape against the model, without a copy
    # of the whole training set.
    check_inputs(images[:1], model, name="images")
    if isinstance(model, CoDANet):
        model.check_input(images[:1])
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise InvalidInputError(
            f"labels must be integer class indices; got dtype {labels.dtype}. Convert labels "
            "that hold whole numbers with labels.long()"
        )
    if labels.dim() != 1 or len(labels) != len(images):
        raise InvalidInputError(
            f"labels must hold one class index per image: shape ({len(images)},) for "
            f"{len(images)} images; got {tuple(labels.shape)}"
        )
    n_classes = getattr(model, "num_classes", None)
    if n_classes is not None and (int(labels.min()) < 0 or int(labels.max()) >= n_classes):
        raise InvalidInputError(
            f"labels must lie in [0, {n_classes - 1}] for a model with {n_classes} classes; got "
            f"values from {int(labels.min())} to {int(labels.max())}"
        )
    return labels.long()  # one_hot needs int64; a no-op for int64 labels


def _checkpoint_file(checkpoint_dir: object) -> Path:
    if not isinstance(checkpoint_dir, (str, os.PathLike)):
        raise InvalidInputError(
            "checkpoint_dir must be a folder path (str or pathlib.Path); got "
            f"{type(checkpoint_dir).__name__}"
        )
    folder = Path(checkpoint_dir)
    if folder.exists() and not folder.is_dir():
        raise InvalidInputError(
            f"checkpoint_dir {folder} is a file; give a folder, where {CHECKPOINT_NAME} is kept"
        )
    return folder / CHECKPOINT_NAME


def _model_settings(model: nn.Module) -> dict[str, Any]:
    # Other DAU models have no settings to record; their class is still checked.
    return model.settings() if isinstance(model, CoDANet) else {}


def _lr(config: TrainConfig, epoch: int) -> float:
    halvings = epoch // config.lr_halving_epochs if config.lr_halving_epochs else 0
    return config.lr * 0.5**halvings


def save_checkpoint(
    path: Path,
    model: CoDANet,
    optimizer: torch.optim.Optimizer,
    config: TrainConfig,
    epoch: int,
    history: TrainHistory,
) -> None:
    """Write weights, optimizer moments, progress and the model's settings atomically."""
    save_training_checkpoint(
        path,
        model,
        optimizer,
        epoch=epoch,
        config=asdict(config),
        history=asdict(history),
        model_settings=_model_settings(model),
    )


def load_checkpoint(
    path: Path,
    model: CoDANet,
    optimizer: torch.optim.Optimizer | None = None,
    config: TrainConfig | None = None,
) -> tuple[int, TrainHistory]:
    """Restore a checkpoint written by :func:`save_checkpoint`.

    Returns:
        The number of finished epochs and the history so far.

    Raises:
        ModelLoadError: If the file is not such a checkpoint, does not match the model, was
            written by another model class or a model with other settings (temperature, bias,
            strides...), or with another configuration than ``config`` (resuming would then not
            reproduce the run).
    """
    epoch, history = load_training_checkpoint(
        path,
        model,
        optimizer,
        config=None if config is None else asdict(config),
        model_settings=_model_settings(model),
    )
    return epoch, TrainHistory(**history)
