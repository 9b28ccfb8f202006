"""The demo's ONNX section: export models with their explanations, check parity, time them.

Registered by the exporter's plugin (:mod:`explain_onnx.plugin`). Without the ``onnx`` extra (onnx,
onnxscript, onnxruntime) the step says so and the section is listed as not available.
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from explain_core.demo import DemoContext, DemoSection, DemoStep, word_list

BATCH = 64
NEEDED = ("onnx", "onnxscript", "onnxruntime")

OWN_MODEL = """\
from explain_onnx import OnnxSession, export_onnx

exported = export_onnx(model, images[:8], "model.onnx", explain="input_x_gradient")  # .parity
logits, explanation = OnnxSession("model.onnx", device="cpu").run(images.numpy())  # no torch
"""


def _median_ms(run: Callable[[], Any], repeats: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


class OnnxDemoStep(DemoStep):
    """Export the demo's CoDA-Net and CNN with their explanations; parity and latency."""

    title = "ONNX export: parity and latency"
    order = 50
    provides = ("onnx",)

    def run(self, context: DemoContext) -> DemoSection:
        """Export every model an earlier step trained and left in ``context.artefacts``."""
        missing = [name for name in NEEDED if importlib.util.find_spec(name) is None]
        if missing:
            return DemoSection(
                self.title,
                unavailable=f"{', '.join(missing)} not installed; install the onnx extra: "
                "pip install 'explain-torch[onnx]'",
            )
        from explain_onnx.export import export_onnx
        from explain_onnx.runtime import OnnxSession

        digits = context.digits()
        jobs = []
        if "coda_model" in context.artefacts:
            from explain_coda.contributions import coda_contributions
            from explain_coda.model import encode_input

            coda = context.artefacts["coda_model"].eval()
            jobs.append(
                (
                    "CoDA-Net",
                    coda,
                    "coda.contributions",
                    encode_input(digits.test_images[:BATCH]),
                    lambda x, m=coda: coda_contributions(m, x),
                )
            )
        if "modbp_model" in context.artefacts:
            from explain_core.api import explain

            cnn, size = context.artefacts["modbp_model"]
            cnn.eval()
            jobs.append(
                (
                    "ReLU CNN",
                    cnn,
                    "input_x_gradient",
                    context.digits(size).test_images[:BATCH],
                    lambda x, m=cnn: explain(m, x, "input_x_gradient"),
                )
            )
        if not jobs:
            return DemoSection(
                self.title, unavailable="no earlier step left a model to export (CoDA, CNN)"
            )
        if context.quick:  # one export is enough to show it; each costs seconds
            jobs = jobs[:1]
        repeats = 5 if context.quick else 30
        folder = context.out_dir / "onnx"
        table = [
            "| model | explanation | file | max logit difference | max relative explanation "
            f"difference | PyTorch, ms per batch of {BATCH} | onnxruntime, ms per batch of "
            f"{BATCH} | provider |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        rows = {}
        for name, model, method, inputs, reference in context.progress(jobs, "exporting"):
            path = folder / f"{name.lower().replace(' ', '_').replace('-', '_')}.onnx"
            result = export_onnx(model, inputs[:8], path, explain=method)
            parity = result.parity
            session = OnnxSession(result.path, device="cpu", threads=torch.get_num_threads())
            array = inputs.numpy()
            torch_ms = _median_ms(lambda f=reference, x=inputs: f(x), repeats)
            onnx_ms = _median_ms(lambda s=session, a=array: s.run(a), repeats)
            _, explanation = session.run(array)
            expected = reference(inputs)
            expected_map = (
                expected.contributions if hasattr(expected, "contributions") else expected
            )
            expected_map = getattr(expected_map, "attribution", expected_map).detach().numpy()
            scale = max(float(abs(expected_map).max()), 1e-12)
            held_back = float(abs(explanation - expected_map).max()) / scale
            size_kb = path.stat().st_size / 1024
            rows[name] = {
                "method": method,
                "file": str(path.relative_to(context.out_dir)),
                "size_kb": round(size_kb, 1),
                "logits_max_abs": parity.logits_max_abs if parity else None,
                "explanation_max_rel": parity.explanation_max_rel if parity else None,
                "parity_passed": parity.passed if parity else None,
                "test_batch_explanation_max_rel": held_back,
                "torch_ms": torch_ms,
                "onnxruntime_ms": onnx_ms,
                "provider": session.provider,
            }
            row = rows[name]
            table.append(
                f"| {name} | `{method}` | `{row['file']}` ({size_kb:.0f} kB) | "
                f"{_sci(row['logits_max_abs'])} | {_sci(row['explanation_max_rel'])} | "
                f"{torch_ms:.2f} | {onnx_ms:.2f} | {session.provider} |"
            )
        passed = all(r["parity_passed"] for r in rows.values())
        summary = {"batch": BATCH, "repeats": repeats, "models": rows}
        return DemoSection(
            self.title,
            lines=[
                "Each model is exported with its explanation as one ONNX graph returning "
                "`(logits, explanation)` for the predicted class, with a dynamic batch axis "
                "(torch.export, then the full ONNX checker). The parity columns compare "
                "onnxruntime with PyTorch on real and random batches of two sizes "
                f"({'all within tolerance' if passed else 'NOT all within tolerance'}); the "
                f"timings are medians of {repeats} runs on {BATCH} test digits, "
                f"{torch.get_num_threads()} CPU thread(s) for both, the explanation included "
                "(PyTorch: the library's own implementation). The `.onnx` files are in the "
                "`onnx/` folder; onnxruntime alone runs them, without torch: "
                "`onnxruntime.InferenceSession(path).run(None, {'input': batch})` returns the "
                "logits and the explanation.",
                "",
                *table,
            ],
            summary=summary,
            own_model=OWN_MODEL,
            takeaways=takeaways(summary),
        )


def takeaways(summary: Mapping) -> list[str]:
    """The section's takeaways, from its numbers (``summary`` as the step returns it).

    Args:
        summary: ``models`` (name → parity, timings and file size) and ``batch``.

    Returns:
        Two sentences: whether the graphs agree with PyTorch, and how fast and large they are.
    """
    models = summary["models"]
    failed = [name for name, row in models.items() if not row["parity_passed"]]
    worst = max(row["test_batch_explanation_max_rel"] for row in models.values())
    if failed:
        first = (
            f"{word_list(failed)} {'does' if len(failed) == 1 else 'do'} NOT match PyTorch "
            "within tolerance: check the export before deploying it."
        )
    else:
        first = (
            f"Every exported graph matches PyTorch, its explanation included (at most "
            f"{worst:.1e} relative on the test batch), so it can be deployed without torch."
        )
    speeds = []
    for name, row in models.items():
        ratio = row["torch_ms"] / row["onnxruntime_ms"]
        if ratio > 1.05:
            pace = f"{ratio:.1f}× as fast as"
        elif ratio < 1 / 1.05:
            pace = f"{1 / ratio:.1f}× slower than"
        else:  # within 5%: timing noise on a shared machine
            pace = "about as fast as"
        speeds.append(
            f"{name} with its explanation runs {pace} PyTorch ({row['onnxruntime_ms']:.1f} vs "
            f"{row['torch_ms']:.1f} ms per batch of {summary['batch']}) from a "
            f"{row['size_kb']:.0f} kB file"
        )
    second = "In onnxruntime, " + "; ".join(speeds) + "."
    return [first, second]


def _sci(value: float | None) -> str:
    return "—" if value is None else f"{value:.1e}"
