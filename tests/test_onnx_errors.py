"""Clear errors from the ONNX exporter and runtime: bad models, paths, methods, environments."""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
import sys

import numpy as np
import pytest
import torch
import torch.backends.opt_einsum
import torch.nn.functional as F
from torch import nn

for _module in ("onnx", "onnxscript", "onnxruntime"):
    pytest.importorskip(_module, reason="the onnx extra is not installed")

from explain_coda import DAUConv2d  # noqa: E402
from explain_core import explain  # noqa: E402
from explain_core.errors import (  # noqa: E402
    ExportError,
    InvalidInputError,
    MissingDependencyError,
    ModelStateError,
    ParityError,
    RuntimeConflictError,
    UnknownMethodError,
    UnsupportedOperatorError,
)
from explain_onnx import (  # noqa: E402
    OnnxSession,
    _deps,
    available_explainers,
    check_parity,
    choose_providers,
    export_onnx,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(8, 3)).eval()


@pytest.fixture(scope="module")
def tiny_onnx(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny.onnx"
    model = tiny()
    export_onnx(model, torch.rand(2, 2, 4), path)
    return model, path


def test_training_mode_is_refused(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(), nn.Linear(4, 2))
    model.eval()
    model[1].train()
    with pytest.raises(ModelStateError, match=r"training mode \(module '1'\).*model\.eval\(\)"):
        export_onnx(model, torch.rand(2, 4), tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx").exists()


@pytest.mark.skipif(
    os.geteuid() == 0 if hasattr(os, "geteuid") else False,
    reason="root may write into read-only folders",
)
def test_read_only_folder_is_refused(tmp_path):  # pragma: no cover - CI runs as root
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(InvalidInputError, match="permission denied"):
            export_onnx(tiny(), torch.rand(2, 8), folder / "m.onnx")
    finally:
        folder.chmod(0o700)


def test_unwritable_paths_are_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(InvalidInputError, match="cannot create the output folder"):
        export_onnx(tiny(), torch.rand(2, 8), blocker / "sub" / "m.onnx")
    with pytest.raises(InvalidInputError, match="is a folder"):
        export_onnx(tiny(), torch.rand(2, 8), tmp_path)


def test_unsupported_operator_names_operator_and_module(tmp_path):
    # ONNX has no QR: DAUConv2d's factorised form uses one (its "auto" form avoids it).
    model = nn.Sequential(nn.Identity(), DAUConv2d(2, 4, 3, 3, form="factorised")).eval()
    with pytest.raises(UnsupportedOperatorError) as raised:
        export_onnx(model, torch.rand(2, 2, 6, 6), tmp_path / "m.onnx")
    assert raised.value.operator == "aten.linalg_qr.default"
    assert raised.value.module == "'1' (DAUConv2d)"
    assert "aten.linalg_qr.default" in str(raised.value) and "'1' (DAUConv2d)" in str(raised.value)
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_value_dependent_branch_names_the_line(tmp_path):
    class Checks(nn.Module):
        def forward(self, x):
            if (x < 0).any():
                raise ValueError("negative")
            return x.flatten(1)

    with pytest.raises(
        ExportError,
        match=r"branches on tensor values at test_onnx_errors\.py:\d+ in forward: "
        r"`if \(x < 0\)\.any\(\):`",
    ):
        export_onnx(Checks().eval(), torch.rand(2, 3), tmp_path / "m.onnx")


class ConstantBatch(nn.Module):
    def forward(self, x):
        return x.reshape(2, -1)


class ThreeFactorProduct(nn.Module):
    """``x A B`` as one einsum of three operands."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(4, 5))
        self.b = nn.Parameter(torch.randn(5, 3))

    def forward(self, x):
        return torch.einsum("bi,ij,jk->bk", x, self.a, self.b)


def test_a_constant_batch_size_is_named(tmp_path):
    no_einsum_hint = torch.backends.opt_einsum.flags(enabled=False)
    with no_einsum_hint, pytest.raises(ExportError) as raised:
        export_onnx(ConstantBatch().eval(), torch.rand(2, 4, 3), tmp_path / "m.onnx")
    # torch 2.8's error carries the model's frame, which the message quotes; 2.13's has none
    lines, first = inspect.getsourcelines(ConstantBatch.forward)
    line = first + len(lines) - 1
    where = f" at test_onnx_errors.py:{line} in forward: `return x.reshape(2, -1)`"
    assert str(raised.value) in {
        f"ConstantBatch fixes the batch size{site}; use x.shape[0] or -1 in reshapes instead of a "
        "constant batch size"
        for site in ("", where)
    }


class PackedLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.head = nn.LSTM(3, 4, batch_first=True), nn.Linear(4, 2)

    def forward(self, x):
        lengths = torch.full((x.shape[0],), x.shape[1])
        _, (h, _) = self.lstm(nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True))
        return self.head(h[-1])


@pytest.mark.parametrize("method", [None, "lrp.epsilon_plus", "input_x_gradient"])
def test_a_packed_sequence_is_named_with_the_way_out(tmp_path, method):
    match = r"^PackedLSTM runs a recurrent layer on a PackedSequence.* on padded sequences"
    with pytest.raises(ExportError, match=match):
        export_onnx(PackedLSTM().eval(), torch.rand(2, 5, 3), tmp_path / "m.onnx", explain=method)


def test_the_models_line_is_found_among_native_frames():
    """torch 2.8 lists C++ and CPython frames after the model's own; the message quotes the
    model's line, not ``??:0 in torch``."""
    from explain_onnx.export import _tracing_error

    lines, first = inspect.getsourcelines(ConstantBatch.forward)
    line = first + len(lines) - 1
    trace = os.path.join(os.path.dirname(torch.__file__), "export", "_trace.py")
    text = "\n".join(
        [
            "Constraints violated (batch)! The code specialized it to be a constant (2).",
            f'  File "{trace}", line 1979, in _non_strict_export',
            f'  File "{__file__}", line {line}, in forward',
            '  File "??", line 0, in torch::handle_torch_function_no_python_arg_parser(char)',
            '  File "/build/Python-3.11.7/Objects/call.c", line 214, in _PyObject_MakeTpCall',
            '  File "", line 0, in pybind11::cpp_function::dispatcher(_object*)',
            '  File "??", line 0, in torch::unwind::unwind()',
        ]
    )
    with torch.backends.opt_einsum.flags(enabled=False):
        message = str(_tracing_error(RuntimeError(text), "ConstantBatch"))
    assert message == (
        f"ConstantBatch fixes the batch size at test_onnx_errors.py:{line} in forward: "
        "`return x.reshape(2, -1)`; use x.shape[0] or -1 in reshapes instead of a constant batch "
        "size"
    )


def test_an_einsum_planned_by_opt_einsum_is_named_with_the_way_out(tmp_path):
    """torch plans an einsum of three operands from concrete sizes where opt_einsum is installed
    (a dev dependency): the batch size is fixed though the model's code never fixes it."""
    assert torch.backends.opt_einsum.is_available()
    torch.manual_seed(0)
    model = ThreeFactorProduct().eval()
    with pytest.raises(
        ExportError, match=r"three or more operands .*backends\.opt_einsum\.enabled = False"
    ):
        export_onnx(model, torch.rand(3, 4), tmp_path / "m.onnx")
    with torch.backends.opt_einsum.flags(enabled=False):  # the advice, followed
        result = export_onnx(model, torch.rand(3, 4), tmp_path / "m.onnx")
    assert result.parity is not None and result.parity.passed


def test_unsupported_decomposed_operator_names_the_module(tmp_path):
    """The translation fails on prims.bessel_j0, the graph holds aten.special_bessel_j0."""

    class Bessel(nn.Module):
        def forward(self, x):
            return torch.special.bessel_j0(x)

    model = nn.Sequential(nn.Linear(4, 4), Bessel(), nn.Linear(4, 2)).eval()
    with pytest.raises(UnsupportedOperatorError, match=r"bessel_j0.*'1' \(Bessel\)"):
        export_onnx(model, torch.rand(2, 4), tmp_path / "m.onnx")


def test_unknown_method_and_bad_options(tmp_path):
    # A typo is an unknown method first; a registered method that does not export says so.
    with pytest.raises(UnknownMethodError, match=r"did you mean 'coda\.contributions'"):
        export_onnx(tiny(), torch.rand(2, 8), tmp_path / "m.onnx", explain="coda.contribution")
    with pytest.raises(InvalidInputError, match=r"'gradient' cannot be exported .* exportable"):
        export_onnx(tiny(), torch.rand(2, 8), tmp_path / "m.onnx", explain="gradient")
    with pytest.raises(InvalidInputError, match=r"needs an explain_coda\.CoDANet"):
        export_onnx(tiny(), torch.rand(2, 8), tmp_path / "m.onnx", explain="coda.contributions")
    with pytest.raises(InvalidInputError, match="takes no option"):
        export_onnx(tiny(), torch.rand(2, 8), tmp_path / "m.onnx", explain="input_x_gradient",
                    steps=3)  # fmt: skip
    with pytest.raises(InvalidInputError, match="needs an explanation method"):
        export_onnx(tiny(), torch.rand(2, 8), tmp_path / "m.onnx", target_input=True)
    assert set(available_explainers()) >= {
        "coda.contributions", "capsules.saliency", "input_x_gradient"
    }  # fmt: skip


def test_both_runtimes_installed_is_refused(monkeypatch, tmp_path):
    versions = {"onnxruntime": "1.31.1", "onnxruntime-gpu": "1.31.1"}
    monkeypatch.setattr(_deps, "_distribution_version", versions.get)
    with pytest.raises(
        RuntimeConflictError, match=r"onnxruntime 1\.31\.1, onnxruntime-gpu 1\.31\.1"
    ):
        export_onnx(tiny(), torch.rand(2, 8), tmp_path / "m.onnx")
    with pytest.raises(RuntimeConflictError, match="pip uninstall"):
        OnnxSession(tmp_path / "m.onnx")


def test_missing_dependency_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxscript", None)  # import fails as if not installed
    with pytest.raises(MissingDependencyError, match=r"pip install 'explain-torch\[onnx\]'"):
        _deps.require("onnxscript")


def test_session_reports_the_provider_it_uses(tiny_onnx):
    model, path = tiny_onnx
    session = OnnxSession(path)
    assert session.providers == session.session.get_providers()
    assert session.provider in ("CPUExecutionProvider", "CUDAExecutionProvider")
    assert choose_providers("cpu") == ["CPUExecutionProvider"]
    x = np.random.default_rng(0).random((3, 2, 4), dtype=np.float32)
    (logits,) = session.run(input=x)
    with torch.no_grad():
        np.testing.assert_allclose(logits, model(torch.from_numpy(x)).numpy(), atol=1e-5)
    with pytest.raises(InvalidInputError, match="missing"):
        session.run(wrong=x)
    with pytest.raises(InvalidInputError, match="ONNX file"):
        OnnxSession(path.with_name("missing.onnx"))


def test_cuda_request_with_the_cpu_build_says_to_install_the_gpu_build():
    import explain_onnx.runtime as runtime

    if runtime.cuda_status().listed:
        pytest.skip("onnxruntime-gpu is installed here")
    with pytest.raises(InvalidInputError, match=r"has no CUDA provider.*install onnxruntime-gpu"):
        choose_providers("cuda")
    assert choose_providers("auto") == ["CPUExecutionProvider"]


class _GpuBuildWithoutCuda:
    """onnxruntime-gpu where CUDA's libraries are missing, as it behaves: it lists CUDA, writes
    its log lines from native code to file descriptor 2 and falls back to the CPU (the real
    package on this machine kind: benchmarks/check_onnxruntime_gpu_without_cuda.py)."""

    __version__ = "1.31.1"
    LOG = (
        "\x1b[1;31m2026-11-25 [E:onnxruntime:Default, provider_bridge_ort.cc:2458 operator()] "
        "FAIL : Failed to load library libonnxruntime_providers_cuda.so with error: "
        "libcublasLt.so.13: cannot open shared object file: No such file or directory\n\x1b[m"
        "\x1b[0;93m2026-11-25 [W:onnxruntime:Default, onnxruntime_pybind_state.cc:1295] Failed "
        "to create CUDAExecutionProvider. Require cuDNN 9.* and CUDA 13.*. Please install all "
        "dependencies as mentioned in the GPU requirements page\x1b[m\n"
    )

    def __init__(self, real):
        self.SessionOptions = real.SessionOptions

    def get_available_providers(self):
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]

    def InferenceSession(self, *args, **kwargs):  # noqa: N802 - onnxruntime's name
        os.write(2, self.LOG.encode())

        class Session:
            def get_providers(self):
                return ["CPUExecutionProvider"]

        return Session()


@contextlib.contextmanager
def onnxruntime_replaced_by(fake, monkeypatch):
    """``fake`` as the onnxruntime that ``explain_onnx.runtime`` sees, CUDA probed afresh."""
    import explain_onnx.runtime as runtime

    require = runtime.require
    monkeypatch.setattr(
        runtime, "require", lambda name: fake if name == "onnxruntime" else require(name)
    )
    runtime.cuda_status.cache_clear()
    try:
        yield runtime
    finally:
        runtime.cuda_status.cache_clear()


def test_gpu_build_without_cuda_libraries_is_probed_quietly_and_named(monkeypatch, capfd):
    import onnxruntime

    with onnxruntime_replaced_by(_GpuBuildWithoutCuda(onnxruntime), monkeypatch) as runtime:
        status = runtime.cuda_status()
        assert capfd.readouterr() == ("", "")  # the native log lines were captured, not printed
        assert not status.usable and status.listed
        assert status.reason == (
            "libcublasLt.so.13: cannot open shared object file: No such file or directory; "
            "it requires cuDNN 9.* and CUDA 13.*"
        )
        assert choose_providers("auto") == ["CPUExecutionProvider"]
        with pytest.raises(InvalidInputError) as caught:
            choose_providers("cuda")
        message = str(caught.value)
        assert "lists its CUDA provider, but it cannot start here: libcublasLt.so.13" in message
        assert "install onnxruntime-gpu (extra" not in message  # it is installed already
        assert "use device='cpu'" in message


class _GpuBuildWithCuda:
    """onnxruntime-gpu where CUDA works: records the providers each session is asked for."""

    def __init__(self, real):
        self.SessionOptions = real.SessionOptions
        self.requested = []

    def get_available_providers(self):
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]

    def InferenceSession(self, path, sess_options=None, providers=()):  # noqa: N802
        self.requested.append(providers)

        class Output:
            name, shape = "logits", ["batch", 3]

        class Session:
            def get_providers(self):
                return ["CUDAExecutionProvider", "CPUExecutionProvider"]

            def get_inputs(self):
                return [type("Input", (), {"name": "input"})]

            def get_outputs(self):
                return [Output]

        return Session()


@pytest.mark.parametrize("tf32", [False, True])
def test_cuda_sessions_compute_float32_unless_tf32_is_asked_for(tiny_onnx, monkeypatch, tf32):
    """onnxruntime's CUDA provider uses TF32 by default (on an H100, a ResNet-50's Input×Gradient
    map then differed by 3e-3 from PyTorch's): sessions turn it off unless asked."""
    import onnxruntime

    fake = _GpuBuildWithCuda(onnxruntime)
    with onnxruntime_replaced_by(fake, monkeypatch):
        session = OnnxSession(tiny_onnx[1], tf32=tf32) if tf32 else OnnxSession(tiny_onnx[1])
        assert session.provider == "CUDAExecutionProvider"
        expected = {"use_tf32": "1" if tf32 else "0"}
        assert fake.requested[-1] == [("CUDAExecutionProvider", expected), "CPUExecutionProvider"]
        OnnxSession(tiny_onnx[1], device="cpu", tf32=tf32)
        assert fake.requested[-1] == ["CPUExecutionProvider"]


def test_cpu_only_session_prints_no_error_lines(tiny_onnx, capfd):
    OnnxSession(tiny_onnx[1], device="auto").run(np.zeros((1, 2, 4), np.float32))
    out, err = capfd.readouterr()
    assert "error" not in (out + err).lower()


def test_parity_failure_reports_the_differences(tiny_onnx):
    model, path = tiny_onnx

    def off_by_a_bit(x, target):
        with torch.no_grad():
            return [model(x) + 1e-3]

    with pytest.raises(ParityError, match=r"logits max abs diff 0\.001 \(limit 0\.0001\)"):
        check_parity(path, off_by_a_bit, torch.rand(2, 2, 4), num_classes=3)
    report = check_parity(
        path, off_by_a_bit, torch.rand(2, 2, 4), num_classes=3, raise_on_failure=False
    )
    assert not report.passed and report.logits_max_abs == pytest.approx(1e-3, rel=1e-2)


@pytest.fixture(scope="module")
def explained_tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("explained") / "tiny.onnx"
    torch.manual_seed(0)
    model = tiny()
    export_onnx(model, torch.rand(2, 2, 4), path, explain="input_x_gradient")
    return model, path


def shifted_reference(model: nn.Module, shift: float, dtype: torch.dtype = torch.float32):
    """Input×Gradient of ``model`` with every map entry moved by ``shift`` × the map's largest."""
    calls = []
    net = copy.deepcopy(model).to(dtype)

    def reference(x, target):
        calls.append(x.dtype)
        result = explain(net, x.to(dtype), "input_x_gradient")
        attribution = result.attribution
        scale = attribution.abs().flatten(1).amax(1).view(-1, 1, 1)
        return [result.output, attribution + shift * scale]

    return reference, calls


def test_parity_allows_a_map_as_far_off_as_pytorchs_own_float32(explained_tiny):
    """A map 5e-3 from PyTorch's passes where PyTorch's float32 map is 5e-3 from float64's."""
    model, path = explained_tiny
    reference, _ = shifted_reference(model, 5e-3)
    exact, calls = shifted_reference(model, 0.0, torch.float64)
    report = check_parity(
        path, reference, torch.rand(2, 2, 4), num_classes=3, explained=True, reference64=exact
    )
    assert report.passed and report.explanation_max_rel == pytest.approx(5e-3, rel=0.01)
    assert report.explanation_noise == pytest.approx(5e-3, rel=0.01)
    assert set(calls) == {torch.float64} and len(calls) == len(report.cases)
    assert "or 10× PyTorch's own float32 error 0.005 where larger" in report.summary()


def test_parity_fails_a_map_further_off_than_pytorchs_float32(explained_tiny):
    model, path = explained_tiny
    reference, _ = shifted_reference(model, 5e-3)
    exact, _ = shifted_reference(model, 4.9e-3, torch.float64)  # PyTorch's own error: 1e-4
    with pytest.raises(ParityError, match=r"explanation max rel diff 0\.005 \(limit 0\.001, or"):
        check_parity(
            path, reference, torch.rand(2, 2, 4), num_classes=3, explained=True, reference64=exact
        )


def test_parity_says_why_pytorchs_float32_error_was_not_measured(explained_tiny):
    model, path = explained_tiny
    reference, _ = shifted_reference(model, 5e-3)

    tries = []

    def cannot_run(x, target):
        tries.append(x)
        raise RuntimeError("expected scalar type Float but found Double")

    report = check_parity(
        path,
        reference,
        torch.rand(2, 2, 4),
        num_classes=3,
        explained=True,
        reference64=cannot_run,
        raise_on_failure=False,
    )
    assert not report.passed and report.explanation_noise is None
    assert "float32 error not measured: RuntimeError: expected scalar type" in report.summary()
    assert len(tries) == 1  # every batch failed; the float64 run was tried once


def test_parity_measures_float32_error_only_where_a_map_needs_it(explained_tiny):
    model, path = explained_tiny
    reference, _ = shifted_reference(model, 0.0)
    exact, calls = shifted_reference(model, 0.0, torch.float64)
    report = check_parity(
        path, reference, torch.rand(2, 2, 4), num_classes=3, explained=True, reference64=exact
    )
    assert report.passed and not calls and report.explanation_noise is None


def test_export_measures_float32_error_on_a_float64_copy(tmp_path, monkeypatch):
    """The export's float64 reference is the model's float64 copy; the model stays float32."""
    import explain_onnx.export as export_module

    seen = {}

    def capture(*args, **kwargs):
        seen["reference64"] = kwargs["reference64"]
        return check_parity(*args, **kwargs)

    monkeypatch.setattr(export_module, "check_parity", capture)
    torch.manual_seed(0)
    model = tiny()
    export_onnx(model, torch.rand(2, 2, 4), tmp_path / "m.onnx", explain="input_x_gradient")
    x = torch.rand(3, 2, 4, dtype=torch.float64)
    logits, attribution = seen["reference64"](x, None)
    expected = explain(copy.deepcopy(model).double(), x, "input_x_gradient")
    assert attribution.dtype == torch.float64
    torch.testing.assert_close(logits, expected.output, rtol=0, atol=0)
    torch.testing.assert_close(attribution, expected.attribution, rtol=0, atol=0)
    assert all(p.dtype == torch.float32 for p in model.parameters())


# --- bad inputs: example tensors, models, opsets, batch sizes and paths ------------------------


def conv() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.Flatten(), nn.Linear(32, 3)).eval()


class ReturnsPair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = tiny()

    def forward(self, x):
        return self.net(x), x


@pytest.mark.parametrize(
    ("model", "example", "message"),
    [
        (conv, lambda: torch.rand(2, 1, 4, 4).half(), r"float16 but the model's parameters are "),
        (conv, lambda: torch.rand(2, 3, 4, 4), r"cannot run on example_inputs of shape \(2, 3, "),
        (
            conv,
            lambda: torch.rand(2, 1, 1, 4, 4),
            r"cannot run on example_inputs of shape \(2, 1, 1",
        ),
        (lambda: ReturnsPair().eval(), lambda: torch.rand(2, 8), r"one tensor of scores.*tuple"),
    ],
    ids=["float16", "wrong-channels", "rank-5", "tuple-output"],
)
def test_inputs_the_model_cannot_take_are_clear_errors(tmp_path, model, example, message):
    network = model()
    before = {k: v.clone() for k, v in network.state_dict().items()}
    with pytest.raises(InvalidInputError, match=message):
        export_onnx(network, example(), tmp_path / "m.onnx")
    assert all(torch.equal(before[k], v) for k, v in network.state_dict().items())
    assert not list(tmp_path.iterdir())


def test_non_finite_weights_are_refused(tmp_path):
    model = tiny()
    with torch.no_grad():
        model[1].weight[0, 0] = float("nan")
    with pytest.raises(InvalidInputError, match="NaN or infinite values; check its weights"):
        export_onnx(model, torch.rand(2, 8), tmp_path / "m.onnx")


@pytest.mark.parametrize("opset", [3, 6, 14, 10_000, "18", 18.0, True])
def test_opset_outside_the_supported_range_is_refused(tmp_path, opset):
    with pytest.raises(InvalidInputError, match=r"opset must be an int from 15 to \d+"):
        export_onnx(tiny(), torch.rand(2, 8), tmp_path / "m.onnx", opset=opset)


def test_newest_runtime_opset_is_what_onnxruntime_loads(tmp_path):
    import onnx

    from explain_onnx.export import newest_runtime_opset

    newest = newest_runtime_opset()
    assert 18 <= newest <= onnx.defs.onnx_opset_version()
    result = export_onnx(tiny(), torch.rand(2, 8), tmp_path / "m.onnx", opset=newest)
    assert result.opset == newest and result.parity is not None  # onnxruntime ran it
    if newest < onnx.defs.onnx_opset_version():
        with pytest.raises(InvalidInputError, match=f"{newest} is the newest onnxruntime"):
            export_onnx(tiny(), torch.rand(2, 8), tmp_path / "n.onnx", opset=newest + 1)


@pytest.mark.parametrize("sizes", [(0,), (), (1, -3), (1.5,), 3])
def test_bad_batch_sizes_are_refused(tmp_path, sizes):
    with pytest.raises(InvalidInputError, match=r"batch_sizes must be one or more positive ints"):
        export_onnx(tiny(), torch.rand(2, 8), tmp_path / "m.onnx", batch_sizes=sizes)


def test_unwritable_folder_names_the_users_path(tmp_path, monkeypatch):
    import tempfile

    def refuse(*args, **kwargs):  # as /proc does, which root cannot write either
        raise FileNotFoundError(2, "No such file or directory", kwargs.get("dir"))

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    with pytest.raises(InvalidInputError) as raised:
        export_onnx(tiny(), torch.rand(2, 8), tmp_path / "m.onnx")
    message = str(raised.value)
    assert f"cannot write {tmp_path / 'm.onnx'}" in message and ".m.onnx-" not in message
    assert "exists (or can be created) and is writable" in message


def test_requested_opset_is_honoured_in_the_file(tmp_path):
    import onnx

    result = export_onnx(tiny(), torch.rand(2, 8), tmp_path / "m.onnx", opset=17)
    written = {e.domain: e.version for e in onnx.load(str(result.path)).opset_import}
    assert result.opset == 17 and written.get("", written.get("ai.onnx")) == 17


def test_opset_the_exporter_cannot_convert_to_is_an_error(tmp_path):
    # torch.onnx builds opset 18 and converts down; Pad has no adapter to opset 17, and
    # torch.onnx then keeps 18 and only logs it.
    model = nn.Sequential(nn.ZeroPad2d(1), nn.Flatten(), nn.Linear(16, 3)).eval()
    with pytest.raises(ExportError, match=r"could not convert Sequential to opset 17.*opset 18 or"):
        export_onnx(model, torch.rand(2, 1, 2, 2), tmp_path / "m.onnx", opset=17)
    assert not list(tmp_path.iterdir())


class _GridSampled(nn.Module):
    """GridSample has no down-conversion below opset 16 (its version there): 16 and 17 work."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grid = torch.zeros(x.shape[0], 4, 4, 2)
        return self.linear(F.grid_sample(x, grid, align_corners=False).flatten(1))


def test_the_advised_opset_is_the_lowest_that_converts(tmp_path):
    model = _GridSampled().eval()
    with pytest.raises(ExportError, match=r"to opset 15 .* choose opset 16 or higher"):
        export_onnx(model, torch.rand(2, 1, 4, 4), tmp_path / "m.onnx", opset=15)
    result = export_onnx(model, torch.rand(2, 1, 4, 4), tmp_path / "m.onnx", opset=16)
    assert result.opset == 16 and result.parity is not None  # the advice works


def test_graph_onnxruntime_cannot_load_is_an_export_error(tmp_path, monkeypatch):
    import explain_onnx.export as export_module

    class Refusing:
        def __init__(self, path):
            raise RuntimeError("[ONNXRuntimeError] : 1 : FAIL : opset 99 is not supported")

    monkeypatch.setattr(export_module, "OnnxSession", Refusing)
    with pytest.raises(ExportError, match=r"onnxruntime .* cannot load the exported graph"):
        export_onnx(tiny(), torch.rand(2, 8), tmp_path / "m.onnx")
    assert not list(tmp_path.iterdir())


def test_a_long_onnxruntime_error_is_shortened_between_words(tmp_path, monkeypatch):
    import explain_onnx.export as export_module

    words = [f"word{i}" for i in range(300)]

    class Refusing:
        def __init__(self, path):
            raise RuntimeError(" ".join(words))

    monkeypatch.setattr(export_module, "OnnxSession", Refusing)
    with pytest.raises(ExportError) as raised:
        export_onnx(tiny(), torch.rand(2, 8), tmp_path / "m.onnx")
    quoted = str(raised.value).split("): ", 1)[1].rsplit("; ", 1)[0]
    shown = quoted.split()
    assert shown[-1] == "…" and shown[:-1] == words[: len(shown) - 1]  # whole words only
    assert len(quoted) <= 300


def test_a_float64_convolution_is_told_to_export_in_float32(tmp_path):
    # onnxruntime's CPU provider has no float64 Conv: the advice was a lower opset, circularly
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 3)).double().eval()
    with pytest.raises(ExportError, match=r"Conv.*export in float32 \(model\.float\(\)"):
        export_onnx(model, torch.rand(2, 1, 4, 4, dtype=torch.float64), tmp_path / "m.onnx")


@pytest.mark.parametrize(
    "pool, explained, named",
    [
        (nn.AvgPool2d(3, 2, ceil_mode=True), "input_x_gradient", "average pooling with ceil_mode"),
        (nn.AdaptiveMaxPool2d(2), None, r"adaptive max pooling \(write it as nn\.MaxPool2d"),
    ],
)
def test_a_pooling_without_an_onnx_form_is_named_with_the_way_to_write_it(
    tmp_path, pool, explained, named
):
    # the explained export named the library's own wrapper module and advised standard layers
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), pool, nn.Flatten(), nn.Linear(8, 3))
    with pytest.raises(UnsupportedOperatorError, match=named) as refused:
        export_onnx(model.eval(), torch.rand(2, 1, 7, 7), tmp_path / "m.onnx", explain=explained)
    assert "TracedGradientGraph" not in str(refused.value)
