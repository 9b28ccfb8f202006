"""Explain your own ResNet-style model (BatchNorm, residual blocks) with LRP and DeepLIFT.

The model below is written the way people write ResNets: ``BasicBlock`` modules with
Conv-BatchNorm-ReLU, a 1×1 projection shortcut where the shape changes, and ``out + identity`` in
``forward``. Nothing in it knows about explanations. ``explain(model, x, "lrp.epsilon_plus")``
merges each BatchNorm into its convolution for the duration of the call, follows the residual
additions, and leaves the model exactly as it was.

Run from the repository root (a few seconds: it trains briefly on the bundled digits)::

    .venv/bin/python examples/resnet_lrp.py --out resnet-lrp
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch
from torch import nn

from explain_core import explain
from explain_core.data import load_digits
from explain_core.plots import save_attribution_figure
from explain_core.training import accuracy, train_classifier

METHODS = {
    "LRP ε+z⁺": ("lrp.epsilon_plus", {}),
    "LRP-z⁺": ("lrp.zplus", {}),
    "LRP-α2β1": ("lrp.alpha2beta1", {}),
    "DeepLIFT Rescale": ("deeplift.rescale", {}),
    "Input×Gradient": ("input_x_gradient", {}),
}


class BasicBlock(nn.Module):
    """Two 3×3 Conv-BN layers with a residual connection (projection when shapes differ)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut = None
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.shortcut is None else self.shortcut(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class SmallResNet(nn.Module):
    """Stem, two residual stages, global average pooling, linear classifier."""

    def __init__(self, classes: int = 10, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        self.layer1 = BasicBlock(width, width)
        self.layer2 = BasicBlock(width, 2 * width, stride=2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


def main(out: Path, epochs: int = 4) -> dict[str, float]:
    """Train the ResNet briefly, explain six test digits, save a figure; returns numbers."""
    torch.set_num_threads(1)  # small model: one thread is fastest
    digits = load_digits(image_size=16)
    torch.manual_seed(0)
    model = train_classifier(
        SmallResNet(), digits.train_images, digits.train_labels, epochs=epochs, lr=3e-3
    )  # returned in eval mode: BatchNorm uses its running statistics
    test_accuracy = accuracy(model, digits.test_images, digits.test_labels)
    images, labels = digits.test_images[:6], digits.test_labels[:6]
    before = copy.deepcopy(model.state_dict())

    rows, numbers = [], {"test_accuracy": test_accuracy}
    for name, (method, options) in METHODS.items():
        result = explain(model, images, method, target=labels, **options)
        rows.append((name, list(result.spatial_map())))
        if result.delta is not None:
            # output minus summed relevance: biases (folded-in BatchNorm shifts) absorb some
            numbers[f"{method} max |delta|"] = float(result.delta.abs().max())
        print(f"{name:18s} maps {tuple(result.attribution.shape)}", end="")
        print("" if result.delta is None else f", max |delta| {result.delta.abs().max():.3g}")

    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "the model was changed"
    out.mkdir(parents=True, exist_ok=True)
    figure = save_attribution_figure(
        rows,
        out / "resnet_lrp.png",
        inputs=list(images),
        column_titles=[f"label {int(y)}" for y in labels],
        title="A user's ResNet (BatchNorm, residual blocks): LRP and DeepLIFT",
    )
    print(f"test accuracy {test_accuracy:.1%}; model unchanged; wrote {figure}")
    return numbers


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("resnet-lrp"), help="output folder")
    parser.add_argument("--epochs", type=int, default=4, help="training epochs")
    arguments = parser.parse_args()
    main(arguments.out, arguments.epochs)
