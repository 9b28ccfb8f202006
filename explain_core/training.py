"""A small, readable training loop for classifiers on tensors (used by demos and tests)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from tqdm.auto import tqdm

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


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


@torch.no_grad()
def accuracy(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of samples whose arg-max score equals the label."""
    return (model(images).argmax(dim=1) == labels).double().mean().item()
