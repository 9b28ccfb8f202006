"""The engine on a CUDA GPU: the same maps as on the CPU, their float32 precision, speed, memory.

Three parts (``--parts``, default all), each writing a results file:

- ``parity`` (``results/cuda_parity.md``): every registered method on every architecture of the
  test suite's zoo (``tests/zoo.py``: the CNN re-creations and the U-Net) and on an LSTM, a GRU,
  an LSTM over packed sequences, the digits ViT, a CoDA-Net and a capsule net, in float64, on
  the GPU and on the CPU. Each cell says whether the GPU's map equals the CPU's
  (``max |Δ| / max |map|``, goal ≤ 1e-9: the CPU's maps are the ones the test suite checks
  against independent references), or whether both refuse with the same message. SmoothGrad
  draws its noise from a generator on the input's device, so its GPU map is checked against the
  float64 reference computed on the GPU instead. Every cell also checks that the map lies on
  the GPU and that the model's state is unchanged.
- ``precision`` (``results/cuda_precision.json``): the ResNet-50 re-creation at 224×224 in
  float32 on the GPU against float64, with torch's default settings (cuDNN convolutions in TF32)
  and with TF32 off.
- ``speed`` (``results/cuda_resnet50_lrp.json``): ``benchmarks/bench_resnet_lrp.py``'s
  candidates on the GPU (torchvision's resnet50 where torchvision imports, with Zennit and Captum
  where they import), float32, torch's default settings: each candidate against one gradient and
  each composite against its lower bound, timed alternately (ABBA…), device-synchronised, median
  of the per-round ratios; peak memory above the model and inputs by ``max_memory_allocated``.

    PYTHONPATH=.:plugins:exporters:tests python benchmarks/check_cuda.py  # a CUDA machine
    PYTHONPATH=.:plugins:exporters:tests python benchmarks/check_cuda.py --device cpu \
        --parts parity --out /tmp/dry  # a dry run of the script itself
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import zoo_references
from bench_resnet_lrp import BOUNDS, build, candidates
from harness import alternated_times, median_ratio, registered_methods, write_results
from test_capsule_compaction import small_capsule_net
from test_recurrent import Classifier, PackedClassifier
from torch import nn
from zoo import (
    AUTOGRAD,
    CONSERVING,
    ZOO,
    bias_free,
    float64_reference,
    method_options,
    randomise_batchnorm,
)

from explain_core import ExplainError, explain

RESULTS = Path(__file__).parent / "results"
PARITY_GOAL = 1e-9


def _coda_net() -> nn.Module:
    from explain_coda import CoDANet, LayerSpec

    return CoDANet([LayerSpec(6, 4, 3, 1), LayerSpec(4, 5, 1, 1)], (2, 7, 9))


def _digits_vit() -> nn.Module:
    from explain_modbp.digits_vit import DigitsViT

    return DigitsViT(dim=8, depth=1, heads=2)


def parity_cases() -> dict[str, tuple[Callable[[], nn.Module], torch.Tensor]]:
    """Name → (a model factory, its input batch)."""
    generator = torch.Generator().manual_seed(1)
    image = torch.rand(1, 3, 32, 32, generator=generator)
    sequences = torch.randn(2, 5, 4, generator=generator)
    cases = {name: (make, image) for name, make in ZOO.items()}
    cases["lstm (2 layers, bidirectional)"] = (
        lambda: Classifier(nn.LSTM(4, 5, num_layers=2, bidirectional=True, batch_first=True)),
        sequences,
    )
    cases["gru (time first)"] = (lambda: Classifier(nn.GRU(4, 5)), sequences)
    # packed, of lengths 5, 3, 5, 3, … by row (for every batch a method feeds the model)
    cases["packed lstm (lengths 5, 3)"] = (
        lambda: PackedClassifier(
            nn.LSTM(4, 5, num_layers=2, bidirectional=True, batch_first=True),
            "final",
            torch.tensor([5, 3]).repeat(512),
        ),
        sequences,
    )
    cases["digits ViT"] = (_digits_vit, torch.rand(2, 1, 8, 8, generator=generator))
    cases["CoDA-Net"] = (_coda_net, torch.rand(2, 2, 7, 9, generator=generator))
    cases["capsule net"] = (small_capsule_net, torch.rand(2, 1, 16, 16, generator=generator))
    return cases


def _model_on(device: str, make: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return randomise_batchnorm(make()).double().eval().to(device)


def _run_on(
    device: str,
    method: str,
    make: Callable[[], nn.Module],
    x: torch.Tensor,
    options: dict[str, Any],
    cudnn: bool = True,
) -> tuple[str, Any]:
    """``("map", attribution on the CPU)``, ``("refused", message)`` or ``("broken", why)``."""
    model = _model_on(device, make)
    inputs = x.double().to(device)
    state = copy.deepcopy(model.state_dict())
    try:
        with torch.backends.cudnn.flags(enabled=cudnn):
            result = explain(model, inputs, method, 1, **options)
    except ExplainError as error:
        return "refused", str(error)
    except Exception as error:  # what this check is for: an error from inside torch
        return "broken", f"{type(error).__name__}: {str(error).splitlines()[0][:90]}"
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, state[k])]
    if changed:
        return "broken", f"the model's state changed: {changed[:3]}"
    if result.attribution.device.type != torch.device(device).type:
        return "broken", f"the map lies on {result.attribution.device}"
    if not torch.isfinite(result.attribution).all():
        return "broken", "a map that is not finite"
    return "map", result.attribution.cpu()


def _reference_on(
    device: str, method: str, make: Callable[[], nn.Module], x: torch.Tensor, options: dict
) -> torch.Tensor | None:
    """The zoo's independent float64 reference computed on ``device`` (its kernels), if any."""
    model = _model_on(device, make)
    inputs = x.double().to(device)
    if method in AUTOGRAD:  # gradient, Input×Gradient (no dynamic-linear layers in the zoo)
        inputs.requires_grad_(True)
        (grad,) = torch.autograd.grad(model(inputs)[:, 1].sum(), inputs)
        reference = grad if method == "gradient" else inputs.detach() * grad
    else:
        if "patterns" in options:
            fitted = options["patterns"]
            moved = {name: p.to(device) for name, p in fitted.patterns.items()}
            options = {"patterns": dataclasses.replace(fitted, patterns=moved)}
        reference = float64_reference(method, model, inputs.detach(), options)
    return None if reference is None else reference.detach().cpu()


def _relative(ours: torch.Tensor, reference: torch.Tensor) -> float:
    scale = reference.abs().max()
    return float((ours - reference).abs().max() / scale) if scale > 0 else float(ours.abs().max())


def parity_cell(
    method: str, case: str, make: Callable[[], nn.Module], x: torch.Tensor, device: str
) -> str:
    """One cell of the parity table: ``✓ <max |Δ| / max |map|>``, ``✓ refuses`` or ``✗ why``."""
    # Patterns are fitted once, on the CPU, and used on both devices (as after Patterns.load):
    # fitted from 8 samples they move with the summation order alone (1 and 2 CPU threads
    # differ by 3e-3 on the VGG), which is not what this check compares.
    try:
        options = method_options(method, _model_on("cpu", make), x.double())
    except ExplainError as error:  # fitting patterns refuses the model: on the GPU as well?
        try:
            method_options(method, _model_on(device, make), x.double().to(device))
        except ExplainError as same:
            return "✓ refuses" if str(same) == str(error) else f"✗ refusals differ: {same}"
        return f"✗ refused on the CPU only: {error}"
    cpu = _run_on("cpu", method, make, x, options)
    gpu = _run_on(device, method, make, x, options)
    how = ""
    if cpu[0] == "map" and gpu[0] == "refused" and "cudnn.flags(enabled=False)" in gpu[1]:
        gpu, how = _run_on(device, method, make, x, options, cudnn=False), " with cuDNN off"
    if gpu[0] == "broken" or cpu[0] == "broken":
        return f"✗ {gpu[1] if gpu[0] == 'broken' else 'on the CPU: ' + cpu[1]}"
    if cpu[0] != gpu[0] or (cpu[0] == "refused" and cpu[1] != gpu[1]):
        return f"✗ CPU {cpu[0]}, GPU {gpu[0]}: {gpu[1] if gpu[0] == 'refused' else cpu[1]}"[:120]
    if cpu[0] == "refused":
        return "✓ refuses"
    if method == "smoothgrad":  # its noise comes from a generator on the input's device
        model = _model_on(device, make)
        with torch.backends.cudnn.flags(enabled=not how):
            reference = zoo_references.reference_smoothgrad(model, x.double().to(device), 1)
        return _mark(_relative(gpu[1], reference.cpu()), " vs the GPU's reference" + how)
    difference = _relative(gpu[1], cpu[1])
    if difference > PARITY_GOAL and case in ZOO:  # the GPU's kernels may compute the model
        reference = _reference_on(device, method, make, x, options)  # itself differently
        if reference is not None:
            return _mark(
                _relative(gpu[1], reference),
                f" vs the GPU's reference{how} (the CPU's map: {difference:.0e})",
            )
        if method in CONSERVING:  # no reference map: its exact property on the GPU instead
            return _mark(_conservation_on(device, method, make, x), f" conserves on the GPU{how}")
    return _mark(difference, how)


def _conservation_on(
    device: str, method: str, make: Callable[[], nn.Module], x: torch.Tensor
) -> float:
    """``max |Σ map − f(x)| / max |f(x)|`` on the bias-free twin on ``device``."""
    torch.manual_seed(0)
    twin = bias_free(randomise_batchnorm(make())).double().eval().to(device)
    checked = explain(twin, x.double().to(device), method, 1)
    return float(checked.delta.abs().max() / checked.output[:, 1].abs().max())


def _mark(difference: float, how: str) -> str:
    return f"{'✓' if difference <= PARITY_GOAL else '✗'} {difference:.0e}{how}"


def output_cell(make: Callable[[], nn.Module], x: torch.Tensor, device: str) -> str:
    """How far the model's own output on the GPU is from the CPU's (torch's kernels).

    With autograd on, as the methods run it: without, torch's ``nn.TransformerEncoder`` takes
    another path (its inference fast path).
    """
    with torch.enable_grad():
        outputs = [
            _model_on(where, make)(x.double().to(where)).detach().cpu() for where in ("cpu", device)
        ]
    return f"{_relative(outputs[1], outputs[0]):.0e}"


def kernel_differences(device: str) -> str:
    """torch's float64 Hardsigmoid and Hardswish on ``device`` against the CPU's."""
    x = torch.linspace(-4, 4, 10001, dtype=torch.float64)
    parts = []
    for function in (F.hardsigmoid, F.hardswish):
        cpu, gpu = function(x), function(x.to(device)).cpu()
        shown = cpu.abs() > 1e-3
        relative = float(((gpu - cpu).abs() / cpu.abs())[shown].max())
        parts.append(f"`F.{function.__name__}` {relative:.1e}")
    return ", ".join(parts)


def parity(device: str, out: Path) -> bool:
    """Write the method × model parity table; return whether every cell passed."""
    cases = parity_cases()
    methods = registered_methods()
    rows = ["| method | " + " | ".join(cases) + " |", "|" + " --- |" * (len(cases) + 1)]
    outputs = [output_cell(make, x, device) for make, x in cases.values()]
    rows.append("| (the model's output) | " + " | ".join(outputs) + " |")
    failed = []
    start = time.perf_counter()
    for method in methods:
        cells = [parity_cell(method, case, *cases[case], device) for case in cases]
        for case, cell in zip(cases, cells, strict=True):
            if "✗" in cell:
                failed.append(f"{method} on {case}: {cell}")
        rows.append(f"| `{method}` | " + " | ".join(cells) + " |")
        print(method, f"{time.perf_counter() - start:.0f} s", flush=True)
    name = torch.cuda.get_device_name(0) if device.startswith("cuda") else device
    page = "\n".join(
        [
            f"# Every method on a GPU ({name}) against the CPU, float64",
            "",
            *rows,
            "",
            "Each cell: `max |Δ| / max |map|` between the GPU's and the CPU's map (goal "
            f"≤ {PARITY_GOAL:.0e}), or `refuses` where both refuse with the same message. Where "
            "torch's CUDA kernels compute the model itself differently (the first row: its "
            "output's `max |Δ| / max |output|`), the GPU's map is compared with the zoo's "
            "independent float64 reference (`tests/zoo_references.py`) computed on the GPU "
            "instead; SmoothGrad always is, as its noise comes from a generator there. `with "
            "cuDNN off`: on the GPU the method refuses (one line, naming the way out) because "
            "cuDNN's RNN kernels compute no gradient in eval mode, and runs inside "
            "`torch.backends.cudnn.flags(enabled=False)`. Every map lies on the GPU and leaves "
            "the model's state unchanged. torch's own float64 kernels on this GPU against the "
            f"CPU's (max relative difference where |y| > 1e-3): {kernel_differences(device)} "
            "(float32's rounding of 1/6 is 3.0e-8). "
            f"{len(failed)} cells failed. Measured {date.today().isoformat()}, torch "
            f"{torch.__version__}; reproduce with "
            "`PYTHONPATH=.:plugins:exporters:tests python benchmarks/check_cuda.py "
            "--parts parity`.",
            "",
        ]
    )
    (out / "cuda_parity.md").write_text(page, encoding="utf-8")
    print("\n".join(failed) or "parity: every cell passed")
    return not failed


PRECISION_METHODS = {
    "gradient": {},
    "lrp.epsilon_plus": {},
    "lrp.epsilon_gamma_box": {"low": 0.0, "high": 1.0},
}


def precision(device: str, out: Path) -> None:
    """float32 maps on ``device`` against float64, with TF32 convolutions on and off."""
    model, x, target = build(batch=4, side=224)
    model, x, target = model.to(device), x.to(device), target.to(device)
    exact = copy.deepcopy(model).double()
    references = {
        m: explain(exact, x.double(), m, target, **o).attribution
        for m, o in PRECISION_METHODS.items()
    }
    rows = []
    default_tf32 = torch.backends.cudnn.allow_tf32
    for tf32 in (default_tf32, not default_tf32):
        torch.backends.cudnn.allow_tf32 = tf32
        for method, options in PRECISION_METHODS.items():
            ours = explain(model, x, method, target, **options).attribution.double()
            reference = references[method]
            rows.append(
                {
                    "method": method,
                    "cuDNN TF32": f"{tf32} (default)" if tf32 == default_tf32 else str(tf32),
                    "max |Δ| / max |map|": float(
                        (ours - reference).abs().max() / reference.abs().max()
                    ),
                    "‖Δ‖ / ‖map‖": float((ours - reference).norm() / reference.norm()),
                }
            )
    torch.backends.cudnn.allow_tf32 = default_tf32
    write_results(
        "cuda_precision",
        rows,
        title="float32 maps on the GPU against float64 (ResNet-50 re-creation, 224×224, batch 4)",
        command="PYTHONPATH=.:plugins:exporters:tests python benchmarks/check_cuda.py "
        "--parts precision",
        notes="torch computes float32 convolutions on Ampere and later GPUs in TF32 (10-bit "
        "mantissa) by default (`torch.backends.cudnn.allow_tf32`); the engine leaves that "
        "setting to the user. The float64 maps are the GPU's, equal to the CPU's (parity table).",
        folder=out,
    )


def _synchronised(run: Callable[[], Any], device: torch.device) -> Callable[[], None]:
    def timed() -> None:
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return timed


def _peak_bytes(run: Callable[[], Any], device: torch.device) -> int | None:
    """The peak of the memory allocated on ``device`` while ``run`` runs (``None`` on a CPU)."""
    if device.type != "cuda":
        run()
        return None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def _profiled_ms(run: Callable[[], Any], device: torch.device) -> tuple[float, float | str]:
    """Milliseconds of one call on the host (torch's operators) and in the GPU's kernels."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * (device.type == "cuda")
    with profile(activities=activities) as profiled:
        run()
    events = profiled.key_averages()
    host = sum(event.self_cpu_time_total for event in events) / 1000
    if device.type != "cuda":
        return host, "—"
    return host, sum(event.self_device_time_total for event in events) / 1000


def speed(device: torch.device, batch: int, rounds: int, out: Path) -> None:
    """The ResNet-50 candidates on the GPU: ratios to the gradient and the bound, peak memory."""
    try:
        import torchvision  # noqa: F401

        real = True
    except ImportError:
        real = False
    model, x, target = build(batch, 224, torchvision=real)
    model, x, target = model.to(device), x.to(device), target.to(device)
    runs = {name: _synchronised(run, device) for name, run in candidates(model, x, target).items()}
    gradient_memory = _peak_bytes(runs["gradient"], device)
    host, kernels = _profiled_ms(runs["gradient"], device)
    rows: list[dict[str, Any]] = [
        {"candidate": "gradient", "ms": None, "gradient ms": None, "× gradient time": 1.0,
         "× its lower bound": "—", "× gradient memory": 1.0,
         "host ms (profiled)": host, "kernels ms (profiled)": kernels},
    ]  # fmt: skip
    for name, run in runs.items():
        if name == "gradient" or name in BOUNDS.values():
            continue
        mine, gradient = alternated_times(run, runs["gradient"], rounds)
        row = {
            "candidate": name,
            "ms": 1000 * statistics.median(mine),
            "gradient ms": 1000 * statistics.median(gradient),
            "× gradient time": median_ratio(mine, gradient),
        }
        if name in BOUNDS:
            mine, bound = alternated_times(run, runs[BOUNDS[name]], rounds)
            row["× its lower bound"] = median_ratio(mine, bound)
        else:
            row["× its lower bound"] = "—"
        memory = _peak_bytes(run, device)
        row["× gradient memory"] = memory / gradient_memory if memory and gradient_memory else "—"
        row["host ms (profiled)"], row["kernels ms (profiled)"] = _profiled_ms(run, device)
        rows.append(row)
        print(json.dumps(row), flush=True)
    rows[0]["ms"] = rows[0]["gradient ms"] = statistics.median(r["gradient ms"] for r in rows[1:])
    model_name = "torchvision's resnet50" if real else "the ResNet-50 re-creation"
    write_results(
        "cuda_resnet50_lrp",
        rows,
        title=f"LRP on {model_name} on the GPU: 224×224, batch {batch}, float32",
        command="PYTHONPATH=.:plugins:exporters:tests python benchmarks/check_cuda.py "
        f"--parts speed --batch {batch}",
        notes=f"Candidates of `benchmarks/bench_resnet_lrp.py`, each timed alternately with the "
        f"gradient ({rounds} rounds, ABBA…, synchronised after each call) and the composites with "
        "their lower bound (one gradient plus the convolutions the rule adds); medians of the "
        "per-round ratios. Memory: the peak of `torch.cuda.max_memory_allocated` above the "
        "model and inputs, against the gradient's. Profiled (one call under `torch.profiler`): "
        "the time the host spends in torch's operators and the GPU in kernels; where the first "
        "is the larger, the call waits for Python and kernel launches, not for the GPU. torch's "
        "default settings (TF32 convolutions).",
        folder=out,
    )


EVALUATION_JOBS = {
    "attributions": {"method": "lrp.epsilon_plus"},
    "localisation": {"method": "input_x_gradient"},
    "pixel-removal": {"method": "gradient", "removal_steps": 4},
    "csc": {"method": "lrp.epsilon", "n_vectors": 4},
}


def evaluation(device: str, out: Path) -> bool:
    """``explain_core.distributed.evaluate``'s jobs on ``device`` against the CPU, float64."""
    import tempfile

    from explain_core.distributed import EvaluationData, evaluate, load_attributions, load_dataset

    data = load_dataset("cluttered", canvas_size=16, count=40)
    data = EvaluationData(data.inputs.double(), data.labels, data.masks, data.name)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 8, 3, padding=1),
        nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(128, 10),
    ).double().eval()  # fmt: skip
    rows, passed = [], True
    for job, options in EVALUATION_JOBS.items():
        values = {}
        for where in ("cpu", device):
            with tempfile.TemporaryDirectory() as folder:
                result = evaluate(
                    job, copy.deepcopy(model), data, out_dir=folder, shard_size=16, batch_size=8,
                    device=where, **options,
                )  # fmt: skip
                if job == "attributions":
                    values[where] = {"attribution": load_attributions(folder).attribution}
                else:
                    values[where] = dict(result.per_sample)
        difference = max(
            float((values[device][k].cpu() - v).abs().max() / v.abs().max().clamp(min=1e-300))
            for k, v in values["cpu"].items()
        )
        ok = difference <= PARITY_GOAL
        passed &= ok
        rows.append(
            {
                "job": job,
                "options": ", ".join(f"{k}={v}" for k, v in options.items()),
                "max |Δ| / max |value| (GPU vs CPU)": difference,
                "passes (≤ 1e-9)": ok,
            }
        )
    write_results(
        "cuda_evaluate",
        rows,
        title="explain_core.distributed.evaluate on one GPU against the CPU, float64",
        command="PYTHONPATH=.:plugins:exporters:tests python benchmarks/check_cuda.py "
        "--parts evaluate",
        notes="One process (a machine with one GPU cannot run NCCL over several ranks: NCCL "
        "refuses two ranks on one GPU), 40 cluttered digits 16×16 in shards of 16, batches of 8; "
        "per-sample values (the maps for `attributions`, read back from the shards).",
        folder=out,
    )
    return passed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--parts", default="parity,evaluate,precision,speed")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    parts = args.parts.split(",")
    if "precision" in parts:
        precision(args.device, args.out)
    if "speed" in parts:
        speed(torch.device(args.device), args.batch, args.rounds, args.out)
    passed = True
    if "evaluate" in parts:
        passed &= evaluation(args.device, args.out)
    if "parity" in parts:
        passed &= parity(args.device, args.out)
    if not passed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
