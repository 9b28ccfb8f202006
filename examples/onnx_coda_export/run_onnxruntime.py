"""Run an exported, explained CoDA-Net with onnxruntime alone: numpy and onnxruntime, no torch.

Reads ``coda_digits.onnx`` and ``held_back.npz`` written by ``export_coda.py`` from the folder
given, runs the graph on the held-back digits, and prints the accuracy, the largest differences
from PyTorch's logits and contributions, the completeness of the contributions
(``Σ contributions = logit − b₀``) and the spatial contribution map of the first digit.

    python examples/onnx_coda_export/run_onnxruntime.py onnx-demo
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort


def main(folder: Path) -> dict[str, float]:
    """Run the graph on the stored samples; returns the measured numbers."""
    options = ort.SessionOptions()
    # Errors only: loading the graph warns that onnxruntime "can't constant fold CastLike" nodes
    # (it has no kernel to fold them ahead of time); harmless, the outputs match PyTorch.
    options.log_severity_level = 3
    session = ort.InferenceSession(
        str(folder / "coda_digits.onnx"), sess_options=options, providers=["CPUExecutionProvider"]
    )
    samples = np.load(folder / "held_back.npz")
    inputs, labels = samples["inputs"], samples["labels"]
    logits, contributions = session.run(None, {session.get_inputs()[0].name: inputs})

    predicted = logits.argmax(axis=1)
    scale = np.abs(samples["contributions"]).max(axis=(1, 2, 3))
    numbers = {
        "accuracy": float((predicted == labels).mean()),
        "logits_max_abs_diff": float(np.abs(logits - samples["logits"]).max()),
        "contributions_max_rel_diff": float(
            (np.abs(contributions - samples["contributions"]).max(axis=(1, 2, 3)) / scale).max()
        ),
        "completeness_max_abs_error": float(
            np.abs(
                contributions.sum(axis=(1, 2, 3))
                - (logits[np.arange(len(logits)), predicted] - samples["logit_bias"])
            ).max()
        ),
    }
    print(f"onnxruntime {ort.__version__} on {session.get_providers()[0]}")
    print(f"inputs {inputs.shape} -> logits {logits.shape}, contributions {contributions.shape}")
    for name, value in numbers.items():
        print(f"{name}: {value:.3g}")
    spatial = contributions[0].sum(axis=0)  # (8, 8): sum over the [x, 1 − x] channels
    print(
        f"digit {labels[0]}, predicted {predicted[0]}; contribution map (+ positive, - negative):"
    )
    limit = np.abs(spatial).max() / 4
    for row in spatial:
        print(" ".join("+" if v > limit else "-" if v < -limit else "." for v in row))
    return numbers


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("onnx-demo"))
    assert "torch" not in sys.modules, "this script must run without torch"
