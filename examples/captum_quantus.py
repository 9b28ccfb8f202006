"""Check explanations with the tools you already use: Captum's NoiseTunnel and metrics, Quantus.

A small CNN trained on the bundled digits is explained by registered methods through
``Explainer`` (Captum's interface) and ``quantus_explain`` (Quantus' ``explain_func``); Captum's
``NoiseTunnel``, ``sensitivity_max`` and ``infidelity`` and five Quantus metrics score them. The
methods' names are the only thing that changes between rows.

Run from the repository root (a few seconds: it trains briefly on the bundled digits)::

    .venv/bin/python examples/captum_quantus.py --samples 16

Quantus is installed by ``scripts/setup-env.sh`` (``pip install --no-deps quantus==0.6.0``
plus pandas, cachetools and opencv-python-headless: its torch extra would pull torchvision).
"""

from __future__ import annotations

import argparse
import warnings

import numpy as np
import quantus
import torch
from captum.attr import NoiseTunnel
from captum.metrics import infidelity, sensitivity_max
from torch import nn

from explain_core import Explainer, quantus_explain
from explain_core.data import load_digits
from explain_core.training import accuracy, train_classifier

METHODS = ("gradient", "input_x_gradient", "integrated_gradients", "lrp.epsilon_plus")


def small_cnn() -> nn.Module:
    """Conv-ReLU-pool and a dense layer: 8×8 digits to 10 logits."""
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 10),
    )


def captum_scores(model: nn.Module, x: torch.Tensor, y: torch.Tensor, method: str) -> str:
    """SmoothGrad over the method by NoiseTunnel, and Captum's two metrics of the method."""
    explainer = Explainer(model, method)
    torch.manual_seed(0)
    smoothed = NoiseTunnel(explainer).attribute(x, target=y, nt_samples=8, stdevs=0.1)
    torch.manual_seed(0)
    sensitivity = sensitivity_max(explainer.attribute, x, target=y, n_perturb_samples=4)

    def perturb(inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        noise = 0.05 * torch.randn_like(inputs)
        return noise, inputs - noise

    torch.manual_seed(0)
    error = infidelity(model, perturb, x, explainer.attribute(x, target=y), target=y)
    return (
        f"NoiseTunnel |map| {smoothed.abs().mean():.4f}, sensitivity_max "
        f"{sensitivity.mean():.3f}, infidelity {error.mean():.4f}"
    )


def quantus_scores(model: nn.Module, x: np.ndarray, y: np.ndarray, method: str) -> str:
    """Five Quantus metrics (one per family) with ``quantus_explain`` as the explain_func."""
    quiet = {"disable_warnings": True, "display_progressbar": False}
    call = {
        "model": model,
        "x_batch": x,
        "y_batch": y,
        "a_batch": None,
        "device": "cpu",
        "explain_func": quantus_explain,
        "explain_func_kwargs": {"method": method},
    }
    np.random.seed(0)
    faithfulness = quantus.FaithfulnessCorrelation(nr_runs=20, subset_size=8, **quiet)(**call)
    np.random.seed(0)
    sensitivity = quantus.MaxSensitivity(nr_samples=4, **quiet)(**call)
    random_logit = quantus.RandomLogit(num_classes=10, **quiet)(**call)
    randomised = quantus.MPRT(**quiet)(**call)  # ModelParameterRandomisation's new name
    last = list(randomised)[-1]  # every layer randomised, from the top down
    pointing = quantus.PointingGame(**quiet)(**call, s_batch=x > 0.3)  # the digits' ink
    return (
        f"faithfulness {np.mean(faithfulness):+.3f}, max sensitivity "
        f"{np.mean(sensitivity):.3f}, random logit {np.mean(random_logit):.3f}, "
        f"randomised {np.mean(randomised[last]):+.3f}, pointing {np.mean(pointing):.2f}"
    )


def main() -> None:
    """Train, then score every method with Captum's and Quantus' tools."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=16, help="test digits to explain")
    parser.add_argument("--epochs", type=int, default=3, help="training epochs")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), help="registered names")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=UserWarning)  # Quantus' notices on every call

    digits = load_digits()
    torch.manual_seed(0)
    model = train_classifier(
        small_cnn(), digits.train_images, digits.train_labels, epochs=args.epochs
    )
    print(f"test accuracy {accuracy(model, digits.test_images, digits.test_labels):.3f}")
    x, y = digits.test_images[: args.samples], digits.test_labels[: args.samples]
    for method in args.methods:
        print(f"{method}:")
        print(f"  Captum: {captum_scores(model, x, y, method)}")
        print(f"  Quantus: {quantus_scores(model, x.numpy(), y.numpy(), method)}")


if __name__ == "__main__":
    main()
