"""Train a small CoDA-Net on the bundled digits and export it, with its explanation, to ONNX.

The exported graph takes encoded digits ``[x, 1 − x]`` ``(batch, 2, 8, 8)`` and returns the logits
and the CoDA contributions ``W_{0→L}(x)_t ⊙ x`` of the predicted class ``t`` (same shape as the
input; summed over the two channels they give a spatial map, and summed over everything the
logit minus the model's fixed bias ``b₀``). ``export_onnx`` checks the file with the full ONNX
checker and compares onnxruntime with PyTorch at two batch sizes before writing it.

Beside the ``.onnx`` file, ``held_back.npz`` stores held-back test digits with PyTorch's logits
and contributions for them, so that ``run_onnxruntime.py`` (numpy and onnxruntime only, no torch)
can run the graph and compare.

Run it from the repository root (needs the onnx extra: pip install 'explain-torch[onnx]')::

    .venv/bin/python examples/onnx_coda_export/export_coda.py --out onnx-demo
    .venv/bin/python examples/onnx_coda_export/run_onnxruntime.py onnx-demo
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from explain_coda import CoDANet, TrainConfig, coda_contributions, encode_input, train_coda
from explain_core.data import load_digits
from explain_onnx import export_onnx

HELD_BACK = 64


def main(out: Path, epochs: int = 4, threads: int | None = 1) -> dict[str, object]:
    """Train, export and store held-back samples in ``out``; returns paths and numbers."""
    if threads is not None:
        torch.set_num_threads(threads)
    start = time.perf_counter()
    digits = load_digits()
    x_train, x_test = encode_input(digits.train_images), encode_input(digits.test_images)
    torch.manual_seed(0)
    model = CoDANet.from_preset("digits", temperature=8.0)
    train_coda(model, x_train, digits.train_labels, TrainConfig(epochs=epochs))
    model.eval()
    held_back, labels = x_test[:HELD_BACK], digits.test_labels[:HELD_BACK]
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == digits.test_labels).float().mean().item()

    out.mkdir(parents=True, exist_ok=True)
    result = export_onnx(
        model, x_test[HELD_BACK : HELD_BACK + 8], out / "coda_digits.onnx",
        explain="coda.contributions",
    )  # fmt: skip
    reference = coda_contributions(model, held_back)  # the predicted class, as in the graph
    np.savez(
        out / "held_back.npz",
        inputs=held_back.numpy(),
        labels=labels.numpy(),
        logits=reference.output.numpy(),
        contributions=reference.contributions.numpy(),
        logit_bias=np.float32(model.logit_bias),
    )
    print(result.summary())
    print(
        f"test accuracy {accuracy:.3f} after {epochs} epochs; {time.perf_counter() - start:.0f} s"
    )
    print(f"now run: python {Path(__file__).with_name('run_onnxruntime.py')} {out}")
    return {"onnx": result.path, "samples": out / "held_back.npz", "accuracy": accuracy}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("onnx-demo"), help="output folder")
    parser.add_argument("--epochs", type=int, default=4, help="training epochs")
    arguments = parser.parse_args()
    main(arguments.out, arguments.epochs)
