"""Reproduce Sixt et al. (2020), "When explanations lie", on bundled digits.

1. The paper's small network (appendix D: conv32, conv64, pool, conv128, conv128, pool,
   dense1024, dense10, ReLU, dropout 0.5) trained on the scikit-learn digits upsampled to 16×16
   (weights cached in ``benchmarks/.cache/modbp/``).
2. CSC (cosine similarity convergence): random relevance vectors set at the logits (``fc6``) and
   propagated by every method; median |cos| per layer over samples × vector pairs × locations.
3. Random-logit SSIM (maps for the true vs a random other class) and cascading parameter
   randomisation (``fc6`` → ``conv1``; max of SSIM(s) and SSIM(−s)), for every method.
4. The non-negative matrix-chain simulation of the paper's Fig. 7.

Why 16×16: at the native 8×8 the two poolings leave 2×2 maps and SSIM's 7×7 window covers the
whole map; 16×16 keeps the network exactly as in appendix D (only the input has 1 channel and
16×16 instead of 3×32×32), leaves 4×4 maps before the dense layers like CIFAR's 8×8 do after
scaling, and trains in about a minute on two loaded cores.

    python benchmarks/reproduce_modbp.py          # full run (≈ 5–10 min on 2 loaded cores)
    python benchmarks/reproduce_modbp.py --quick  # smoke run, nothing written to results/
"""

from __future__ import annotations

import argparse
import time
from collections import OrderedDict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch
from harness import write_results
from torch import nn

from explain_core.data.digits import load_digits
from explain_core.metrics import (
    UnsupportedMethodError,
    cascading_randomisation,
    cosine_similarity_convergence,
    matrix_chain_convergence,
    method_maps,
    random_logit_ssim,
)
from explain_modbp.pattern import fit_patterns

ROOT = Path(__file__).resolve().parent
CACHE = ROOT / ".cache" / "modbp"
FIGURES = ROOT / "results" / "figures"
SIZE = 16
SEED = 0
# Relevance at the input of each layer is the relevance of the activation named here.
READ_POINTS = OrderedDict(
    [
        ("fc6", "fc5"),
        ("fc5", "pool4"),
        ("conv4", "conv3"),
        ("conv3", "pool2"),
        ("conv2", "conv1"),
        ("conv1", "input"),
    ]
)
RANDOMISE = ["fc6", "fc5", "conv4", "conv3", "conv2", "conv1"]


def appendix_d_network(channels: int = 1, size: int = SIZE) -> nn.Sequential:
    """The paper's CIFAR-10 network (appendix D) for ``channels × size × size`` inputs."""
    flat = 128 * (size // 4) ** 2
    return nn.Sequential(
        OrderedDict(
            [
                ("conv1", nn.Conv2d(channels, 32, 3, padding=1)),
                ("relu1", nn.ReLU()),
                ("conv2", nn.Conv2d(32, 64, 3, padding=1)),
                ("relu2", nn.ReLU()),
                ("pool2", nn.MaxPool2d(2)),
                ("conv3", nn.Conv2d(64, 128, 3, padding=1)),
                ("relu3", nn.ReLU()),
                ("conv4", nn.Conv2d(128, 128, 3, padding=1)),
                ("relu4", nn.ReLU()),
                ("pool4", nn.MaxPool2d(2)),
                ("flatten", nn.Flatten()),
                ("dropout5", nn.Dropout(0.5)),
                ("fc5", nn.Linear(flat, 1024)),
                ("relu5", nn.ReLU()),
                ("dropout6", nn.Dropout(0.5)),
                ("fc6", nn.Linear(1024, 10)),
            ]
        )
    )


def trained_network(digits, epochs: int) -> tuple[nn.Sequential, float]:
    """Train (or load from the cache) the appendix-D network; returns it and test accuracy."""
    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / f"appendix_d_{SIZE}px_seed{SEED}_e{epochs}.pt"
    torch.manual_seed(SEED)
    model = appendix_d_network()
    if path.exists():
        model.load_state_dict(torch.load(path, weights_only=True))
    else:
        optimiser = torch.optim.Adam(model.parameters(), lr=1e-3)
        x, y = digits.train_images, digits.train_labels
        generator = torch.Generator().manual_seed(SEED)
        for epoch in range(epochs):
            model.train()
            order = torch.randperm(len(x), generator=generator)
            total = 0.0
            for batch in order.split(64):
                optimiser.zero_grad()
                loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
                loss.backward()
                optimiser.step()
                total += float(loss) * len(batch)
            print(f"epoch {epoch + 1}/{epochs}: loss {total / len(x):.4f}", flush=True)
        torch.save(model.state_dict(), path)
    model.eval()
    with torch.no_grad():
        predicted = model(digits.test_images).argmax(1)
    return model, float((predicted == digits.test_labels).float().mean())


def methods(patterns) -> dict[str, tuple[str, dict]]:
    """Display name → (registered method, options)."""
    return {
        "gradient": ("gradient", {}),
        "input×gradient": ("input_x_gradient", {}),
        "integrated gradients": ("integrated_gradients", {"steps": 16}),
        "LRP-z": ("lrp.z", {}),
        "LRP-ε": ("lrp.epsilon", {"epsilon": 1e-3}),
        "LRP-α1β0 (z⁺)": ("lrp.zplus", {}),
        "LRP-α2β1": ("lrp.alpha2beta1", {}),
        "LRP-α5β4": ("lrp.alpha_beta", {"alpha": 5.0, "beta": 4.0}),
        "LRP-γ": ("lrp.gamma", {}),
        "DTD w²": ("lrp.w2", {}),
        "DTD z^B": ("lrp.zb", {"low": 0.0, "high": 1.0}),
        "LRP flat": ("lrp.flat", {}),
        "LRP ε+z⁺": ("lrp.epsilon_plus", {}),
        "LRP-CMP α1β0": ("lrp.cmp", {"alpha": 1.0}),
        "LRP-CMP α2β1": ("lrp.cmp", {"alpha": 2.0}),
        "contrastive LRP": ("lrp.contrastive", {}),
        "Excitation BP": ("excitation_bp", {}),
        "c-Excitation BP": ("excitation_bp.contrastive", {}),
        "Guided BP": ("guided_bp", {}),
        "Deconv": ("deconv", {}),
        "RectGrad": ("rectgrad", {}),
        "DeepLIFT Rescale": ("deeplift.rescale", {}),
        "DeepLIFT RevealCancel": ("deeplift.reveal_cancel", {}),
        "DeepLIFT ablation": ("deeplift.ablation", {}),
        "PatternNet": ("patternnet", {"patterns": patterns}),
        "PatternAttribution": ("pattern_attribution", {"patterns": patterns}),
    }


def csc_rows(model, x, table) -> tuple[list[dict], dict[str, dict[str, float]]]:
    rows, curves = [], {}
    layouts = {"fc5": (128, SIZE // 4, SIZE // 4)}  # per location, like the conv layers
    for display, (name, options) in table.items():
        row: dict = {"method": display}
        try:
            result = cosine_similarity_convergence(
                model, x, name, n_vectors=5, seed=SEED, layouts=layouts, **options
            )
        except UnsupportedMethodError:
            row.update({label: "n/a" for label in READ_POINTS.values()})
            rows.append(row)
            continue
        median = result.median
        curves[display] = {READ_POINTS[k]: median[k] for k in READ_POINTS}
        for layer, label in READ_POINTS.items():
            value = median[layer]
            row[label] = round(value, 6) if value < 0.9999 else f"1−{1 - value:.0e}"
        rows.append(row)
        print(f"CSC {display:24s}", {k: f"{v:.4f}" for k, v in curves[display].items()})
    return rows, curves


def sanity_rows(model, x, targets, table) -> tuple[list[dict], dict[str, list[float]]]:
    rows, curves = [], {}
    for display, (name, options) in table.items():
        maps = method_maps(name, **options)
        logit = random_logit_ssim(model, maps, x, targets, seed=SEED)
        steps = cascading_randomisation(
            model, maps, x, targets, RANDOMISE, seed=SEED, absolute_sign=True
        )
        curves[display] = [s.mean_ssim for s in steps]
        row = {"method": display, "random logit": round(logit.mean_ssim, 3)}
        for step in steps:
            row[f"rand. {step.layers[-1]}"] = round(step.mean_ssim, 3)
        rows.append(row)
        print(f"sanity {display:24s} logit {logit.mean_ssim:.3f}", np.round(curves[display], 3))
    return rows, curves


def matrix_chain_rows() -> tuple[list[dict], dict[str, np.ndarray]]:
    widths = (256,) * 17  # square 1×1 "kernels", as in the paper's simulation
    cases = {
        "vanilla": ("vanilla", {}),
        "ReLU": ("relu", {}),
        "non-negative": ("nonnegative", {}),
        "positive": ("positive", {}),
        "αW⁺+βW⁻, β=1": ("alpha_beta", {"beta": 1.0}),
        "αW⁺+βW⁻, β=4": ("alpha_beta", {"beta": 4.0}),
        "αW⁺+βW⁻, β=16": ("alpha_beta", {"beta": 16.0}),
    }
    rows, curves = [], {}
    for display, (kind, options) in cases.items():
        curve = matrix_chain_convergence(kind, widths, repeats=3, seed=SEED, **options)  # type: ignore[arg-type]
        curves[display] = curve.median_cosine
        row = {"matrices": display}
        for n in (1, 2, 4, 8, 16):
            row[f"n={n}"] = float(f"{curve.median_cosine[n - 1]:.6g}")
        rows.append(row)
    return rows, curves


def plot_csc(curves: dict[str, dict[str, float]], path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    labels = list(READ_POINTS.values())
    for display, curve in curves.items():
        values = np.array([curve[k] for k in labels])
        style = "-" if "DeepLIFT" not in display and "LRP-z" not in display else "--"
        axes[0].plot(labels, values, style, marker="o", label=display)
        axes[1].plot(labels, np.clip(1 - values, 1e-8, None), style, marker="o")
    axes[0].set_ylabel("median |cos| (CSC)")
    axes[1].set_yscale("log")
    axes[1].set_ylabel("1 − CSC")
    for ax in axes:
        ax.set_xlabel("relevance at (output side → input)")
    axes[0].legend(fontsize=7, ncol=2)
    fig.suptitle("CSC from random relevance at the logits, appendix-D net on 16×16 digits")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sanity(logit_rows, curves, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.5))
    names = [r["method"] for r in logit_rows]
    axes[0].barh(names, [r["random logit"] for r in logit_rows])
    axes[0].set_xlabel("SSIM(true class map, random class map)")
    axes[0].invert_yaxis()
    for display, curve in curves.items():
        axes[1].plot(RANDOMISE, curve, marker="o", label=display)
    axes[1].set_ylabel("SSIM to the original map (max of ±)")
    axes[1].set_xlabel("randomised down to")
    axes[1].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_chain(curves, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for display, values in curves.items():
        ax.plot(np.arange(1, len(values) + 1), np.clip(1 - values, 1e-16, None), label=display)
    ax.set_yscale("log")
    ax.set_xlabel("chain length n")
    ax.set_ylabel("1 − median column cosine")
    ax.legend(fontsize=7)
    ax.set_title("matrix chains (Fig. 7)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_examples(model, x, targets, table, path: Path) -> None:
    shown = ["gradient", "LRP-z", "LRP-α1β0 (z⁺)", "Guided BP", "PatternAttribution"]
    shown += ["DeepLIFT Rescale"]
    fig, axes = plt.subplots(len(shown), 4, figsize=(7, 1.8 * len(shown)))
    other = (targets[:2] + 3) % 10
    for row, display in enumerate(shown):
        name, options = table[display]
        maps = method_maps(name, **options)
        panels = [maps(model, x[:2], targets[:2]), maps(model, x[:2], other)]
        for col in range(4):
            image = panels[col // 2][col % 2].detach().numpy()
            scale = np.abs(image).max() or 1.0
            axes[row, col].imshow(image, cmap="bwr", vmin=-scale, vmax=scale)
            axes[row, col].set_xticks([])
            axes[row, col].set_yticks([])
        axes[row, 0].set_ylabel(display, fontsize=7)
    for col, title in enumerate(["true, #1", "true, #2", "other, #1", "other, #2"]):
        axes[0, col].set_title(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="few samples, no results written")
    args = parser.parse_args()
    torch.set_num_threads(1)
    began = time.perf_counter()
    digits = load_digits(image_size=SIZE, seed=SEED)
    model, accuracy = trained_network(digits, epochs=2 if args.quick else 12)
    print(f"test accuracy {accuracy:.3f} ({time.perf_counter() - began:.0f}s)", flush=True)
    patterns = fit_patterns(model, digits.train_images)
    table = methods(patterns)
    n_csc, n_sanity = (4, 6) if args.quick else (64, 100)
    x, y = digits.test_images, digits.test_labels
    csc, csc_curves = csc_rows(model, x[:n_csc], table)
    print(f"CSC done ({time.perf_counter() - began:.0f}s)", flush=True)
    sanity, sanity_curves = sanity_rows(model, x[:n_sanity], y[:n_sanity], table)
    print(f"sanity checks done ({time.perf_counter() - began:.0f}s)", flush=True)
    chain, chain_curves = matrix_chain_rows()
    folder = CACHE / "quick" if args.quick else ROOT / "results"
    figures = folder / "figures" if args.quick else FIGURES
    figures.mkdir(parents=True, exist_ok=True)
    plot_csc(csc_curves, figures / "modbp_csc.png")
    plot_sanity(sanity, sanity_curves, figures / "modbp_sanity.png")
    plot_chain(chain_curves, figures / "modbp_matrix_chain.png")
    plot_examples(model, x[:2], y[:2], table, figures / "modbp_examples.png")
    command = "python benchmarks/reproduce_modbp.py"
    minutes = (time.perf_counter() - began) / 60
    write_results(
        "modbp_csc",
        csc,
        title="Modified BP: CSC on the appendix-D net (16×16 digits)",
        command=command,
        notes=(
            f"Median |cosine| between the relevance propagated from 5 random vectors N(0, I) set "
            f"at the logits, per layer (the activation whose relevance is compared; per spatial "
            f"location for feature maps, the 1-channel input as a whole map), over {n_csc} test "
            f"digits × 10 vector pairs. 1 = the layers above cannot change the explanation. "
            f"Network: appendix D of Sixt et al. (conv32-conv64-pool-conv128-conv128-pool-"
            f"fc1024-fc10), test accuracy {accuracy:.3f}; run took {minutes:.1f} min in all."
        ),
        folder=folder,
    )
    write_results(
        "modbp_sanity",
        sanity,
        title="Modified BP: random-logit and cascading-randomisation SSIM (16×16 digits)",
        command=command,
        notes=(
            f"Mean SSIM over {n_sanity} test digits (maps normalised by max |·|, 7×7 window). "
            "'random logit': map of the true class vs a random other class (1 = class-"
            "insensitive). 'rand. L': parameters re-initialised from fc6 down to L, "
            "max(SSIM(s), SSIM(−s)) to the original map (high = insensitive to the weights)."
        ),
        folder=folder,
    )
    write_results(
        "modbp_matrix_chain",
        chain,
        title="Modified BP: matrix-chain convergence (the paper's Fig. 7)",
        command=command,
        notes=(
            "Median cosine between the columns of a product of n random 256×256 matrices "
            "(3 chains): non-negative chains converge to rank 1 within a few factors, Gaussian "
            "ones do not; αW⁺+βW⁻ (α = 1 + β) converges more slowly as β grows."
        ),
        folder=folder,
    )


if __name__ == "__main__":
    main()
