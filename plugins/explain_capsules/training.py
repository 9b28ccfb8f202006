"""Training capsule networks: margin loss (+ reconstruction), Adam with per-epoch decay, resume.

Every random choice of epoch ``e`` (the shuffling) comes from a generator seeded with
``(seed, e)``, so a run resumed from a checkpoint continues exactly as the uninterrupted run
would. Checkpoints are safetensors files holding the full ``model.state_dict()`` (parameters and
buffers, e.g. pruning masks) and the optimizer moments, with a JSON header for the rest: loading
one never unpickles anything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from explain_capsules.models import margin_loss
from explain_core.checkpoints import load_training_checkpoint, save_training_checkpoint
from explain_core.errors import InvalidInputError
from explain_core.training import EpochHistory, train_resumable

__all__ = [
    "CHECKPOINT_NAME",
    "CapsuleTrainConfig",
    "CapsuleTrainHistory",
    "load_capsule_checkpoint",
    "save_capsule_checkpoint",
    "train_capsnet",
]

CHECKPOINT_NAME = "capsnet.safetensors"


@dataclass
class CapsuleTrainConfig:
    """Options of :func:`train_capsnet`.

    Attributes:
        epochs: Passes over the training data.
        batch_size: Samples per step.
        lr: Initial Adam learning rate.
        lr_decay: Multiplies the learning rate after every epoch (``lr · decay^epoch``).
        seed: Seed of the shuffling.
        reconstruction_weight: Weight of the summed squared reconstruction error, used only
            when the model has a decoder.
    """

    epochs: int
    batch_size: int = 128
    lr: float = 1e-3
    lr_decay: float = 0.99
    seed: int = 0
    reconstruction_weight: float = 0.0005

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int; got {value!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0; got {self.lr!r}")
        if not 0 < self.lr_decay <= 1:
            raise ValueError(f"lr_decay must be in (0, 1]; got {self.lr_decay!r}")
        if not self.reconstruction_weight >= 0:
            raise ValueError(
                f"reconstruction_weight must be ≥ 0; got {self.reconstruction_weight!r}"
            )


class CapsuleTrainHistory(EpochHistory):
    """Per-epoch mean training loss and, when evaluation was given, its accuracy."""


def _check_data(images: torch.Tensor, labels: torch.Tensor) -> None:
    if images.dim() < 2 or labels.shape != (images.shape[0],):
        raise InvalidInputError(
            f"train_capsnet: expected images (N, ...) and labels (N,); got images "
            f"{tuple(images.shape)} and labels {tuple(labels.shape)}"
        )
    if labels.dtype.is_floating_point:
        raise InvalidInputError(f"train_capsnet: expected integer labels; got {labels.dtype}")


def _loss(
    model: nn.Module, images: torch.Tensor, labels: torch.Tensor, weight: float
) -> torch.Tensor:
    if getattr(model, "decoder", None) is None:
        return margin_loss(model(images), labels)
    # Training decodes the true class's capsule (masking by the label, as in Sabour et al.).
    lengths, reconstruction = model.lengths_and_reconstruction(images, labels)
    error = ((reconstruction.flatten(1) - images.flatten(1)) ** 2).sum(dim=1).mean()
    return margin_loss(lengths, labels) + weight * error


def train_capsnet(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    config: CapsuleTrainConfig,
    *,
    checkpoint_dir: Path | None = None,
    evaluate: Callable[[nn.Module], float] | None = None,
    stop_after_epoch: int | None = None,
) -> CapsuleTrainHistory:
    """Train a capsule net with the margin loss; resume from ``checkpoint_dir`` if it has one.

    Args:
        model: A :class:`~explain_capsules.models.DRCapsNet` or
            :class:`~explain_capsules.models.MultiLayerCapsNet` (or any module returning class
            capsule lengths; a ``decoder`` attribute switches the reconstruction loss on).
        images: Training inputs ``(N, ...)`` in the model's input shape.
        labels: Integer labels ``(N,)``.
        config: Training options.
        checkpoint_dir: Folder for ``capsnet.safetensors``, written after every epoch.
        evaluate: Called after every epoch with the model in eval mode; returns an accuracy.
        stop_after_epoch: Stop after this many epochs in total (to simulate an interruption).

    Returns:
        The history of all epochs, including those before a resume.

    Raises:
        InvalidInputError: On mismatched images and labels.
        ModelLoadError: If the checkpoint in ``checkpoint_dir`` does not fit the model or the
            configuration.
    """
    _check_data(images, labels)
    return train_resumable(
        model,
        images,
        labels,
        config,
        CapsuleTrainHistory(),
        learning_rate=lambda epoch: config.lr * config.lr_decay**epoch,
        batch_loss=lambda x, y, _: _loss(model, x, y, config.reconstruction_weight),
        description="CapsNet",
        checkpoint=None if checkpoint_dir is None else Path(checkpoint_dir) / CHECKPOINT_NAME,
        load_checkpoint=load_capsule_checkpoint,
        save_checkpoint=save_capsule_checkpoint,
        evaluate=evaluate,
        stop_after_epoch=stop_after_epoch,
    )


def save_capsule_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    config: CapsuleTrainConfig,
    epoch: int,
    history: CapsuleTrainHistory,
) -> None:
    """Write the full state dict, optimizer moments and progress to safetensors atomically."""
    save_training_checkpoint(
        path, model, optimizer, epoch=epoch, config=asdict(config), history=asdict(history)
    )


def load_capsule_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    config: CapsuleTrainConfig | None = None,
) -> tuple[int, CapsuleTrainHistory]:
    """Restore a checkpoint written by :func:`save_capsule_checkpoint` into ``model``.

    See :func:`explain_core.checkpoints.load_training_checkpoint`: names and shapes (pruning
    masks included) are checked before anything is loaded.

    Returns:
        The number of finished epochs and the history so far.

    Raises:
        ModelLoadError: If the file is not such a checkpoint, does not match the model, or was
            trained with another configuration than ``config``.
    """
    epoch, history = load_training_checkpoint(
        path, model, optimizer, config=None if config is None else asdict(config)
    )
    return epoch, CapsuleTrainHistory(**history)
