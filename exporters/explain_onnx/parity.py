"""Parity of an exported graph with PyTorch: the full ONNX checker, then outputs compared.

Every export is checked on random inputs and on real inputs, at two or more batch sizes (the batch
axis is dynamic, so sizes other than the example's must work too). Logits may differ by at most
``1e-4`` (absolute); explanation maps by at most ``1e-3`` relative to the largest magnitude of the
reference map of the same sample (``max |ort − torch| / max |torch|``, per sample), so that
maps of any scale are judged alike and near-zero entries do not blow up the ratio.

Some maps are so sensitive to rounding that PyTorch's own float32 map is that far from exact
(LRP on MobileNetV3: 3.7e-4 from its float64 map, measured), and onnxruntime's kernels, with
their other summation orders and algorithms, differ more (1.2e-3 there on the CPU). Where
a batch's map exceeds ``1e-3`` and a float64 reference is given, PyTorch's float32 error is
measured on that batch, and the map may differ by up to :data:`NOISE_FACTOR` times it instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from explain_core.errors import ExportError, ParityError
from explain_onnx._deps import require
from explain_onnx.runtime import OnnxSession

LOGITS_ATOL = 1e-4
EXPLANATION_RTOL = 1e-3
NOISE_FACTOR = 10.0  # times PyTorch's own float32 error, for maps that sensitive to rounding
BATCH_SIZES = (1, 3)

Reference = Callable[[torch.Tensor, torch.Tensor | None], Sequence[torch.Tensor]]


@dataclass
class ParityCase:
    """One compared batch: where it came from, its size and the largest differences."""

    source: str
    batch: int
    logits_max_abs: float
    explanation_max_rel: float | None = None
    explanation_noise: float | None = None  # PyTorch float32's own error (where measured)

    def explanation_passed(self, rtol: float) -> bool:
        """Whether the map (if any) is within ``rtol`` (or NOISE_FACTOR × its float32 noise)."""
        rel, noise = self.explanation_max_rel, self.explanation_noise
        limit = rtol if noise is None else max(rtol, NOISE_FACTOR * noise)
        return rel is None or rel <= limit


@dataclass
class ParityReport:
    """Largest differences between onnxruntime and PyTorch over all compared batches.

    Attributes:
        cases: Every compared batch.
        providers: The onnxruntime providers that ran the graph.
        logits_atol, explanation_rtol: The tolerances applied.
        noise_unmeasured: Why PyTorch's float32 error could not be measured where a map
            exceeded ``explanation_rtol`` (``""`` if it was, or was not needed).
    """

    cases: list[ParityCase] = field(default_factory=list)
    providers: list[str] = field(default_factory=list)
    logits_atol: float = LOGITS_ATOL
    explanation_rtol: float = EXPLANATION_RTOL
    noise_unmeasured: str = ""

    @property
    def logits_max_abs(self) -> float:
        """Largest absolute logit difference."""
        return max((c.logits_max_abs for c in self.cases), default=0.0)

    @property
    def explanation_max_rel(self) -> float | None:
        """Largest relative explanation difference (``None`` for a plain export)."""
        values = [c.explanation_max_rel for c in self.cases if c.explanation_max_rel is not None]
        return max(values) if values else None

    @property
    def explanation_noise(self) -> float | None:
        """PyTorch float32's largest own error, over the batches where it was measured."""
        values = [c.explanation_noise for c in self.cases if c.explanation_noise is not None]
        return max(values) if values else None

    @property
    def passed(self) -> bool:
        """Whether every difference is within its tolerance."""
        return self.logits_max_abs <= self.logits_atol and all(
            c.explanation_passed(self.explanation_rtol) for c in self.cases
        )

    @property
    def batch_sizes(self) -> list[int]:
        """The batch sizes compared."""
        return sorted({c.batch for c in self.cases})

    def summary(self) -> str:
        """One line: verdict, maximum differences and tolerances, batches, provider."""
        text = (
            f"parity {'ok' if self.passed else 'FAILED'}: logits max abs diff "
            f"{self.logits_max_abs:.2g} (limit {self.logits_atol:g})"
        )
        if self.explanation_max_rel is not None:
            text += (
                f", explanation max rel diff {self.explanation_max_rel:.2g} "
                f"(limit {self.explanation_rtol:g}"
            )
            noise = self.explanation_noise
            if noise is not None:
                text += (
                    f", or {NOISE_FACTOR:g}× PyTorch's own float32 error {noise:.2g} where larger"
                )
            if self.noise_unmeasured:
                text += f"; PyTorch's float32 error not measured: {self.noise_unmeasured}"
            text += ")"
        sources = sorted({c.source for c in self.cases})
        provider = self.providers[0] if self.providers else "?"
        sizes = ", ".join(map(str, self.batch_sizes))
        return (
            f"{text}; {len(self.cases)} batches ({', '.join(sources)}; sizes {sizes}) on {provider}"
        )


def check_graph(path: str | Path) -> None:
    """``onnx.checker.check_model(full_check=True)`` on the file (shape inference included).

    Raises:
        ExportError: If the checker rejects the graph.
    """
    onnx = require("onnx")
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as error:  # onnx raises ValidationError / InferenceError
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ExportError(f"the ONNX checker rejected {Path(path).name}: {first}") from error


def relative_difference(actual: np.ndarray, expected: np.ndarray) -> float:
    """Largest per-sample ``max |actual − expected| / max |expected|``."""
    batch = expected.shape[0]
    diff = np.abs(actual - expected).reshape(batch, -1).max(axis=1)
    scale = np.abs(expected).reshape(batch, -1).max(axis=1)
    return float((diff / np.maximum(scale, 1e-12)).max()) if batch else 0.0


def random_like(example: torch.Tensor, batch: int, generator: torch.Generator) -> torch.Tensor:
    """Uniform random inputs in the value range of ``example``, batch size ``batch``."""
    low, high = float(example.min()), float(example.max())
    if high <= low:
        low, high = 0.0, 1.0
    shape = (batch, *example.shape[1:])
    return low + (high - low) * torch.rand(shape, generator=generator, dtype=example.dtype)


def check_parity(
    path: str | Path,
    reference: Reference,
    real_inputs: torch.Tensor,
    *,
    num_classes: int,
    target_input: bool = False,
    explained: bool = False,
    batch_sizes: Sequence[int] = BATCH_SIZES,
    session: OnnxSession | None = None,
    seed: int = 0,
    real_source: str = "real",
    raise_on_failure: bool = True,
    reference64: Reference | None = None,
) -> ParityReport:
    """Compare the graph at ``path`` with ``reference`` on random and real inputs.

    Args:
        path: The exported ``.onnx`` file.
        reference: ``reference(x, target) -> (logits,)`` or ``(logits, explanation)`` in PyTorch;
            ``target`` is ``None`` (predicted class) unless the graph takes one.
        real_inputs: Real samples (at least one); batches of each size in ``batch_sizes`` are
            taken from them (repeated if there are fewer).
        num_classes: Number of classes, for random targets.
        target_input: The graph takes the class to explain as a second input.
        explained: The graph returns an explanation after the logits.
        batch_sizes: Batch sizes to compare (two or more).
        session: A session to reuse (default: a new CPU-or-CUDA session).
        seed: Seed of the random inputs and targets.
        real_source: Label of ``real_inputs`` batches in the report.
        raise_on_failure: Raise :class:`ParityError` when a tolerance is exceeded.
        reference64: ``reference`` in float64 (float inputs cast), run only for batches whose
            map exceeds ``1e-3``, to measure PyTorch's own float32 error there (module docs).

    Returns:
        The report with the largest differences.

    Raises:
        ParityError: If a difference exceeds its tolerance (with ``raise_on_failure``).
    """
    session = session or OnnxSession(path)
    generator = torch.Generator().manual_seed(seed)
    report = ParityReport(providers=session.providers)
    for batch in batch_sizes:
        index = torch.arange(batch) % real_inputs.shape[0]
        for source, x in (
            ("random", random_like(real_inputs, batch, generator)),
            (real_source, real_inputs[index]),
        ):
            target = None
            if target_input:
                target = torch.randint(0, num_classes, (batch,), generator=generator)
            expected = [t.detach().cpu().numpy() for t in reference(x, target)]
            feeds = [x] if target is None else [x, target]
            actual = session.run(*feeds)
            if len(actual) != len(expected):
                raise ParityError(
                    f"the graph returns {len(actual)} outputs; PyTorch returns {len(expected)}"
                )
            case = ParityCase(source, batch, float(np.abs(actual[0] - expected[0]).max()))
            if explained:
                _check_shape(actual[1], expected[1])
                case.explanation_max_rel = relative_difference(actual[1], expected[1])
                failed = not case.explanation_passed(report.explanation_rtol)
                if failed and reference64 and not report.noise_unmeasured:  # not again
                    _measure_noise(case, report, reference64, x, target, expected[1])
            report.cases.append(case)
    if raise_on_failure and not report.passed:
        raise ParityError(f"{Path(path).name}: {report.summary()}")
    return report


def _measure_noise(
    case: ParityCase,
    report: ParityReport,
    reference64: Reference,
    x: torch.Tensor,
    target: torch.Tensor | None,
    expected: np.ndarray,
) -> None:
    """Set ``case.explanation_noise`` to PyTorch float32's error against float64 on ``x``."""
    try:
        exact = reference64(x.double() if x.is_floating_point() else x, target)[1]
    except Exception as error:  # a model that cannot run in float64: say so in the report
        report.noise_unmeasured = f"{type(error).__name__}: {error}".splitlines()[0]
        return
    case.explanation_noise = relative_difference(expected, exact.detach().cpu().numpy())


def _check_shape(actual: np.ndarray, expected: np.ndarray) -> None:
    if actual.shape != expected.shape:
        raise ParityError(
            f"the exported explanation has shape {actual.shape}; PyTorch's has {expected.shape}"
        )
