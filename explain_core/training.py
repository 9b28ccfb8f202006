"""Small, readable training loops for classifiers on tensors (used by demos, tests, plugins)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from tqdm.auto import tqdm

from explain_core.errors import InvalidInputError

__all__ = [
    "BatchLoss",
    "EpochHistory",
    "EpochSettings",
    "History",
    "Loss",
    "Settings",
    "accuracy",
    "train_classifier",
    "train_resumable",
]

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
BatchLoss = Callable[[torch.Tensor, torch.Tensor, torch.Generator], torch.Tensor]


def train_classifier(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    *,
    epochs: int = 10,
    batch_size: int = 64,
    lr: float = 1e-3,
    seed: int = 0,
    loss_fn: Loss | None = None,
    description: str = "training",
) -> nn.Module:
    """Train ``model`` with Adam and return it in eval mode.

    Shuffling uses its own generator seeded with ``seed``; initialise the model under
    ``torch.manual_seed`` for fully deterministic runs.

    Args:
        model: Classifier returning ``(batch, classes)`` scores.
        images: Training inputs ``(N, ...)``.
        labels: int64 ``(N,)`` class labels.
        epochs: Passes over the data.
        batch_size: Samples per step.
        lr: Adam learning rate.
        seed: Seed of the shuffling order.
        loss_fn: ``loss(scores, labels)``; cross-entropy by default.
        description: Label of the progress bar.

    Returns:
        The trained model, switched to eval mode.
    """
    loss_fn = loss_fn or nn.functional.cross_entropy
    generator = torch.Generator().manual_seed(seed)
    loader = DataLoader(
        TensorDataset(images, labels), batch_size=batch_size, shuffle=True, generator=generator
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    with tqdm(total=epochs * len(loader), desc=description, leave=False, disable=None) as bar:
        for _ in range(epochs):
            for batch_images, batch_labels in loader:
                optimizer.zero_grad()
                loss = loss_fn(model(batch_images), batch_labels)
                loss.backward()
                optimizer.step()
                bar.set_postfix(loss=f"{loss.item():.3f}")
                bar.update()
    return model.eval()


class EpochSettings(Protocol):
    """What :func:`train_resumable` reads from a training configuration."""

    epochs: int
    batch_size: int
    lr: float
    seed: int


@dataclass
class EpochHistory:
    """Per-epoch mean training loss and, when an evaluation was given, its accuracy."""

    loss: list[float] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)


History = TypeVar("History", bound=EpochHistory)
Settings = TypeVar("Settings", bound=EpochSettings)


def train_resumable(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    config: Settings,
    history: History,
    *,
    learning_rate: Callable[[int], float],
    batch_loss: BatchLoss,
    description: str,
    checkpoint: Path | None,
    load_checkpoint: Callable[
        [Path, nn.Module, torch.optim.Optimizer, Settings], tuple[int, History]
    ],
    save_checkpoint: Callable[
        [Path, nn.Module, torch.optim.Optimizer, Settings, int, History], None
    ],
    evaluate: Callable[[nn.Module], float] | None = None,
    stop_after_epoch: int | None = None,
) -> History:
    """Train with Adam for ``config.epochs``; resume from ``checkpoint`` if that file exists.

    Every random choice of epoch ``e`` comes from one generator seeded with
    ``config.seed * 100_003 + e``: the shuffling, then whatever ``batch_loss`` draws from it. The
    learning rate of epoch ``e`` is set to ``learning_rate(e)`` (set, not decayed in place, so a
    resumed run gets the same rate). A run resumed from the checkpoint of epoch ``k`` therefore
    continues exactly as the uninterrupted one would.

    Args:
        model: The model; in train mode during an epoch, in eval mode after it.
        images: Training inputs ``(N, ...)``.
        labels: Labels ``(N,)``.
        config: ``epochs``, ``batch_size``, ``lr`` (Adam's initial rate) and ``seed``.
        history: An empty history, used unless the run resumes.
        learning_rate: The learning rate of an epoch.
        batch_loss: ``batch_loss(images, labels, generator)``, the loss of one batch.
        description: Label of the progress bar, e.g. ``"CoDA"``.
        checkpoint: The checkpoint file, written after every epoch (``None``: no checkpoints).
        load_checkpoint: ``load_checkpoint(path, model, optimizer, config)`` restores a
            checkpoint and returns the number of finished epochs and the history so far.
        save_checkpoint: ``save_checkpoint(path, model, optimizer, config, epochs, history)``
            writes one.
        evaluate: Called after every epoch with the model in eval mode; returns an accuracy.
        stop_after_epoch: Stop after this many epochs in total (to simulate an interruption).

    Returns:
        The history of all epochs, including those before a resume.
    """
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    start = 0
    if checkpoint is not None and checkpoint.exists():
        start, history = load_checkpoint(checkpoint, model, optimizer, config)
    epochs = config.epochs
    last = epochs if stop_after_epoch is None else min(epochs, stop_after_epoch)
    dataset = TensorDataset(images, labels)
    for epoch in range(start, last):
        generator = torch.Generator().manual_seed(config.seed * 100_003 + epoch)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(epoch)
        loader = DataLoader(dataset, config.batch_size, shuffle=True, generator=generator)
        model.train()
        total = 0.0
        for batch_images, batch_labels in tqdm(
            loader, desc=f"{description} epoch {epoch + 1}/{epochs}", leave=False, disable=None
        ):
            optimizer.zero_grad()
            loss = batch_loss(batch_images, batch_labels, generator)
            loss.backward()
            optimizer.step()
            total += loss.item() * len(batch_labels)
        model.eval()
        history.loss.append(total / len(dataset))
        if evaluate is not None:
            history.accuracy.append(evaluate(model))
        if checkpoint is not None:
            save_checkpoint(checkpoint, model, optimizer, config, epoch + 1, history)
    model.eval()  # also when a resumed run had no epoch left
    return history


@torch.no_grad()
def accuracy(
    model: nn.Module, images: torch.Tensor, labels: torch.Tensor, batch_size: int = 256
) -> float:
    """Fraction of ``images`` whose arg-max score is the label, in eval mode, in batches.

    The model's training flags are put back afterwards. Works for every model that returns one
    score per class (CNNs, CoDA-Nets, capsule networks returning capsule lengths).

    Raises:
        InvalidInputError: On images and labels that do not pair up, or an empty set.
    """
    if images.dim() < 2 or labels.shape != (images.shape[0],):
        raise InvalidInputError(
            f"accuracy: expected images (N, ...) and labels (N,); got images "
            f"{tuple(images.shape)} and labels {tuple(labels.shape)}"
        )
    if labels.dtype.is_floating_point or len(labels) == 0:
        raise InvalidInputError(
            f"accuracy: expected at least one integer label; got {len(labels)} of {labels.dtype}"
        )
    flags = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        correct = sum(
            int((model(chunk).argmax(1) == target.to(chunk.device)).sum())
            for chunk, target in zip(
                images.split(batch_size), labels.split(batch_size), strict=True
            )
        )
    finally:
        for module, flag in flags:
            module.training = flag
    return correct / len(labels)
