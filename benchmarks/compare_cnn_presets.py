"""Which LRP composite explains each CNN family most faithfully: the measurement behind the presets.

Three small networks with torchvision's module structure (the test suite's re-creations,
``tests/zoo.py``) are trained here on the bundled digits (upsampled to 32×32, grey replicated to
3 channels, values in [0, 1]; 1347 training images): a residual net (ResNet bottlenecks,
BatchNorm), two depthwise-separable nets (MobileNetV3 blocks: depthwise convolutions, Hardswish,
squeeze-excitation with a hard-sigmoid gate, linear bottlenecks; EfficientNet's MBConv blocks
with SiLU and a sigmoid gate) and a normalisation-heavy net
(ConvNeXt blocks: 7×7 depthwise convolutions, channels-last LayerNorm, GELU, pointwise ``Linear``
layers, layer scale). Every candidate explains the predicted class of the 450 test digits, and
pixel-deletion curves are taken with :func:`explain_core.metrics.pixel_removal_curve`: pixels
removed (set to 0, the digits' background) most relevant first (MoRF) and least relevant first
(LeRF) in 16 steps up to every pixel. Faithfulness = ``AUC(LeRF) − AUC(MoRF)`` (logits; higher
is better), the area-between-curves of the AttnLRP paper; random maps give the noise level.

Candidates: the gradient family for scale, the LRP presets, and compositions written for these
families: γ on convolutions and ε on dense layers (EpsilonGammaBox without its input rule), the
same with ε on the depthwise convolutions, and γ on every layer but the output layer (so the
pointwise ``Linear`` layers of ConvNeXt count as convolutions, not as a dense head). The
recommendations per family in ``docs/cnn_layers.md`` come from this table.

    PYTHONPATH=.:plugins:exporters:tests python benchmarks/compare_cnn_presets.py  # ≈ 10 min
    PYTHONPATH=.:plugins:exporters:tests python benchmarks/compare_cnn_presets.py --quick
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from harness import write_results
from torch import nn
from zoo import ConvNeXt, EfficientNet, MobileNetV3, ResNet

from explain_core import Composite, Rule, explain
from explain_core.affine import BATCHNORM_TYPES, LINEAR_TYPES
from explain_core.data import load_digits
from explain_core.interfaces.relevance import OutputLayer
from explain_core.metrics import pixel_removal_curve
from explain_core.training import accuracy, train_classifier
from explain_modbp import composites, rules

FAMILIES: dict[str, Callable[[], nn.Module]] = {
    "residual (ResNet bottlenecks)": lambda: ResNet(depths=(1, 1, 1, 1), width=0.25),
    "depthwise-separable (MobileNetV3)": lambda: MobileNetV3(width=0.5, blocks=8),
    "depthwise-separable (EfficientNet)": lambda: EfficientNet(width=0.25, max_repeats=1),
    "normalisation-heavy (ConvNeXt)": lambda: ConvNeXt(depths=(1, 1, 2, 1), width=0.25),
}
STEPS = 16


def depthwise(name: str, module: nn.Module) -> bool:
    """Depthwise convolutions: one group per input channel."""
    return isinstance(module, nn.Conv2d) and 1 < module.groups == module.in_channels


def gamma_composite(*, dense: str, depthwise_rule: Rule | None = None, name: str) -> Composite:
    """γ on convolutions; ε on the dense layers (``dense="dense"``) or on the output layer only
    (``dense="output"``: ConvNeXt's pointwise ``Linear`` layers then get γ); optionally another
    rule on the depthwise convolutions."""
    gamma, epsilon = rules.Gamma(0.25), rules.Epsilon()
    first = [(depthwise, depthwise_rule)] if depthwise_rule is not None else []
    if dense == "dense":
        layers = [(composites.CONV_TYPES, gamma), (LINEAR_TYPES, epsilon)]
        ops = (composites.LINEAR_OPS, epsilon)
    else:
        layers = [(OutputLayer(), epsilon), (LINEAR_TYPES, gamma)]
        ops = (composites.LINEAR_OPS, gamma)
    return Composite(
        [
            *first,
            *layers,
            ops,
            (BATCHNORM_TYPES, epsilon),
            composites.ACTIVATIONS,
            composites.NORMS,
            composites.GATES,
        ],
        name=name,
    )


def candidates() -> dict[str, tuple[str, dict[str, Any]]]:
    """Label → (method, options)."""

    def custom(**options: Any) -> tuple[str, dict[str, Any]]:
        return "lrp.custom", {"composite": gamma_composite(**options)}

    return {
        "gradient": ("gradient", {}),
        "input_x_gradient": ("input_x_gradient", {}),
        "integrated_gradients": ("integrated_gradients", {"steps": 32}),
        "lrp.epsilon": ("lrp.epsilon", {}),
        "lrp.epsilon_plus": ("lrp.epsilon_plus", {}),
        "lrp.alpha_beta (α2β1)": ("lrp.alpha_beta", {}),
        "lrp.gamma": ("lrp.gamma", {}),
        "lrp.epsilon_gamma_box": ("lrp.epsilon_gamma_box", {"low": 0.0, "high": 1.0}),
        "γ convolutions, ε dense": custom(dense="dense", name="γ conv ε dense"),
        "… ε on depthwise convolutions too": custom(
            dense="dense", depthwise_rule=rules.Epsilon(), name="γ conv ε dense+depthwise"
        ),
        "γ on every layer but the output (ε)": custom(dense="output", name="γ body ε output"),
    }


def auc(curves: torch.Tensor) -> np.ndarray:
    """Trapezoidal area under each row, fraction removed from 0 to 1."""
    values = curves.double().numpy()
    return (values[:, 1:] + values[:, :-1]).sum(1) / (2 * (values.shape[1] - 1))


def faithfulness(
    model: nn.Module, x: torch.Tensor, maps: torch.Tensor, target: torch.Tensor
) -> dict[str, float]:
    """MoRF and LeRF AUCs and their difference (mean and standard error over the samples)."""
    areas = {
        order: auc(
            pixel_removal_curve(model, x, maps, target, fraction=1.0, steps=STEPS, order=order)
        )
        for order in ("most", "least")
    }
    between = areas["least"] - areas["most"]
    return {
        "MoRF AUC": float(areas["most"].mean()),
        "LeRF AUC": float(areas["least"].mean()),
        "LeRF − MoRF": float(between.mean()),
        "± se": float(between.std(ddof=1) / np.sqrt(len(between))),
    }


def family_rows(
    family: str, make: Callable[[], nn.Module], epochs: int, samples: int
) -> list[dict[str, Any]]:
    """Train one network and score every candidate on it."""
    digits = load_digits(image_size=32)
    train = digits.train_images.repeat(1, 3, 1, 1)
    test = digits.test_images.repeat(1, 3, 1, 1)[:samples]
    torch.manual_seed(0)
    model = train_classifier(
        make(), train, digits.train_labels, epochs=epochs, lr=3e-3, description=family
    ).eval()
    acc = accuracy(model, test, digits.test_labels[:samples])
    with torch.no_grad():
        target = model(test).argmax(1)
    rows = []
    generator = torch.Generator().manual_seed(0)
    random_maps = torch.rand(test.shape[0], 32, 32, generator=generator)
    scored = {"random": faithfulness(model, test, random_maps, target)}
    for label, (method, options) in candidates().items():
        try:
            result = explain(model, test, method, target, **options)
        except Exception as error:  # a refusal is a result too
            scored[label] = {"refused": f"{type(error).__name__}: {error}"[:160]}
            continue
        maps = result.attribution.sum(1)
        scored[label] = faithfulness(model, test, maps, target)
    for label, values in scored.items():
        rows.append({"family": family, "test accuracy": acc, "candidate": label, **values})
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 epoch, 32 samples; no results")
    args = parser.parse_args()
    torch.set_num_threads(2)
    epochs, samples = (1, 32) if args.quick else (20, 450)
    rows = [
        row
        for family, make in FAMILIES.items()
        for row in family_rows(family, make, epochs, samples)
    ]
    if args.quick:
        return
    write_results(
        "cnn_presets",
        rows,
        title="LRP composites per CNN family: pixel-deletion faithfulness on the digits",
        command="PYTHONPATH=.:plugins:exporters:tests python benchmarks/compare_cnn_presets.py",
        notes=(
            f"Trained here for {epochs} epochs (Adam 3e-3, seed 0) on the bundled digits at 32×32; "
            f"{samples} test digits, their predicted class; pixels set to 0 in {STEPS} steps up "
            "to all pixels, most (MoRF) or least (LeRF) relevant first; AUCs of the logit over "
            "the fraction removed; LeRF − MoRF: higher is more faithful (± its standard error)."
        ),
    )


if __name__ == "__main__":
    main()
