"""Explained ONNX exports of the zoo's ResNet-50, MobileNetV3, ConvNeXt and an LSTM classifier.

Each re-creation (``tests/zoo.py``) is exported with ``lrp.epsilon_plus`` and with
``input_x_gradient`` and run in a plain onnxruntime session on held-back inputs; the maps are
compared with ``explain()``'s. Writes ``benchmarks/results/onnx_zoo.md``. Reproduce with

    PYTHONPATH=.:plugins:exporters:tests .venv/bin/python benchmarks/check_onnx_zoo.py
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime
import torch
from torch import nn
from zoo import ZOO, randomise_batchnorm

from explain_core import explain
from explain_onnx import export_onnx
from explain_onnx.parity import relative_difference

RESULTS = Path(__file__).parent / "results" / "onnx_zoo.md"


class LSTMClassifier(nn.Module):
    """Two LSTM layers read at the last step by a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(4, 16, batch_first=True, num_layers=2)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


def main() -> None:
    """Export, run in plain sessions, compare, write the table."""
    cases = {name: ZOO[name] for name in ("resnet50", "mobilenet_v3_large", "convnext_tiny")}
    cases["lstm"] = LSTMClassifier
    rows = [
        "| model | method | export (s) | max abs diff, logits | max rel diff, maps |",
        "| --- | --- | --- | --- | --- |",
    ]
    folder = Path(tempfile.mkdtemp())
    for name, make in cases.items():
        torch.manual_seed(0)
        model = randomise_batchnorm(make()).eval()
        shape = (6, 4) if name == "lstm" else (3, 32, 32)
        example = torch.rand(4, *shape, generator=torch.Generator().manual_seed(1))
        held_back = torch.rand(3, *shape, generator=torch.Generator().manual_seed(2))
        for method in ("lrp.epsilon_plus", "input_x_gradient"):
            started = time.perf_counter()
            path = export_onnx(model, example, folder / f"{name}.onnx", explain=method).path
            seconds = time.perf_counter() - started
            session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            logits, maps = session.run(None, {"input": held_back.numpy()})
            expected = explain(model, held_back, method)
            logit_diff = float(np.abs(logits - expected.output.numpy()).max())
            map_diff = relative_difference(maps, expected.attribution.numpy())
            rows.append(
                f"| {name} | `{method}` | {seconds:.0f} | {logit_diff:.1e} | {map_diff:.1e} |"
            )
            print(rows[-1], flush=True)
    text = [
        "# Explained ONNX exports of the zoo (re-creations, 3×32×32; LSTM 6 steps × 4)",
        "",
        f"onnxruntime {onnxruntime.__version__}, torch {torch.__version__}, CPU; plain "
        "`onnxruntime.InferenceSession` on 3 held-back inputs against `explain()`. Reproduce with "
        "the command in `benchmarks/check_onnx_zoo.py`.",
        "",
        *rows,
        "",
    ]
    RESULTS.write_text("\n".join(text), encoding="utf-8")


if __name__ == "__main__":
    main()
