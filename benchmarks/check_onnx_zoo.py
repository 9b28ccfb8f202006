"""Explained ONNX exports of the zoo's ResNet-50, MobileNetV3, ConvNeXt and an LSTM classifier.

Each re-creation (``tests/zoo.py``) is exported with ``lrp.epsilon_plus`` and with
``input_x_gradient`` and run in a plain onnxruntime session on held-back inputs; the maps are
compared with ``explain()``'s (the export's own parity check, on the same device, must pass
too). ``--device cuda`` runs the sessions on onnxruntime's CUDA provider in float32 (``--tf32``:
in onnxruntime's default TF32; it fails where onnxruntime would fall back to the CPU) and
compares them with a CPU session too. Writes ``benchmarks/results/onnx_zoo.md``
(``cuda_onnx_zoo.md``). Reproduce with

    PYTHONPATH=.:plugins:exporters:tests .venv/bin/python benchmarks/check_onnx_zoo.py
    PYTHONPATH=.:plugins:exporters:tests python benchmarks/check_onnx_zoo.py --device cuda --jobs 8
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import onnxruntime
import torch
from torch import nn
from zoo import ZOO, randomise_batchnorm

from explain_core import explain
from explain_core.errors import ParityError, UnsupportedOperatorError
from explain_onnx import export_onnx
from explain_onnx.parity import relative_difference

RESULTS = Path(__file__).parent / "results"
MODELS = ("resnet50", "mobilenet_v3_large", "convnext_tiny", "lstm")
METHODS = ("lrp.epsilon_plus", "input_x_gradient")
PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


class LSTMClassifier(nn.Module):
    """Two LSTM layers read at the last step by a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(4, 16, batch_first=True, num_layers=2)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


def session(path: Path, device: str, tf32: bool = False) -> onnxruntime.InferenceSession:
    """A plain session on ``device``'s provider; an error where onnxruntime would fall back.

    On CUDA, float32 stays float32 unless ``tf32`` (onnxruntime's own default is TF32).
    """
    requested = PROVIDERS[device]
    options = {"use_tf32": "1" if tf32 else "0"} if device == "cuda" else {}
    made = onnxruntime.InferenceSession(str(path), providers=[(requested, options)])
    if made.get_providers()[0] != requested:
        raise RuntimeError(f"onnxruntime runs {made.get_providers()} instead of {requested}")
    return made


def check(name: str, method: str, device: str, threads: int, tf32: bool = False) -> str:
    """Export ``name`` explained by ``method``, run it on ``device`` and compare: one table row."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = randomise_batchnorm((LSTMClassifier if name == "lstm" else ZOO[name])()).eval()
    shape = (6, 4) if name == "lstm" else (3, 32, 32)
    example = torch.rand(4, *shape, generator=torch.Generator().manual_seed(1))
    held_back = torch.rand(3, *shape, generator=torch.Generator().manual_seed(2))
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"{name}.onnx"
        started = time.perf_counter()
        try:
            parity = export_onnx(model, example, path, explain=method).parity
        except (UnsupportedOperatorError, ParityError) as error:
            return f"| {name} | `{method}` | refused: {error} | | | |"
        seconds = time.perf_counter() - started
        feed = {"input": held_back.numpy()}
        logits, maps = session(path, device, tf32).run(None, feed)
        on_cpu = session(path, "cpu").run(None, feed)[1] if device != "cpu" else maps
    expected = explain(model, held_back, method)
    logit_diff = float(np.abs(logits - expected.output.numpy()).max())
    map_diff = relative_difference(maps, expected.attribution.numpy())
    noise = parity.explanation_noise if parity else None
    checked = "passed" + (f" (PyTorch's float32 error {noise:.1e})" if noise else "")
    row = f"| {name} | `{method}` | {seconds:.0f} | {checked} | {logit_diff:.1e} | {map_diff:.1e} |"
    if device != "cpu":
        row += f" {relative_difference(maps, on_cpu):.1e} |"
    return row


def main() -> None:
    """Export, run in plain sessions (in parallel with ``--jobs``), compare, write the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=sorted(PROVIDERS), default="cpu")
    parser.add_argument("--jobs", type=int, default=1, help="cases checked at once, each a process")
    parser.add_argument("--out", type=Path, help="the table's file (default: results/)")
    parser.add_argument(
        "--tf32", action="store_true", help="CUDA sessions in TF32 (onnxruntime's default)"
    )
    args = parser.parse_args()
    out = args.out or RESULTS / ("onnx_zoo.md" if args.device == "cpu" else "cuda_onnx_zoo.md")
    cases = [(name, method) for name in MODELS for method in METHODS]
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    header = (
        "| model | method | export (s) | export's parity check | max abs diff, logits "
        "| max rel diff, maps |"
    )
    rule = "| --- | --- | --- | --- | --- | --- |"
    if args.device != "cpu":
        header += " max rel diff, maps, against a CPU session |"
        rule += " --- |"
    if args.jobs > 1:
        spawn = multiprocessing.get_context("spawn")  # fresh interpreters: no forked torch state
        with ProcessPoolExecutor(args.jobs, mp_context=spawn) as pool:
            futures = [pool.submit(check, *case, args.device, threads, args.tf32) for case in cases]
            rows = [future.result() for future in futures]
    else:
        rows = [check(*case, args.device, threads, args.tf32) for case in cases]
    print(*rows, sep="\n", flush=True)
    where = "CPU"
    if args.device == "cuda":
        math = "TF32" if args.tf32 else "float32 (use_tf32=0)"
        where = f"CUDA provider ({torch.cuda.get_device_name()}, {math})"
    text = [
        "# Explained ONNX exports of the zoo (re-creations, 3×32×32; LSTM 6 steps × 4)",
        "",
        f"onnxruntime {onnxruntime.__version__}, torch {torch.__version__}, {where}; plain "
        "`onnxruntime.InferenceSession` on 3 held-back inputs against `explain()` on the CPU. "
        "Reproduce with the command in `benchmarks/check_onnx_zoo.py`.",
        "",
        header,
        rule,
        *rows,
        "",
    ]
    out.write_text("\n".join(text), encoding="utf-8")


if __name__ == "__main__":
    main()
