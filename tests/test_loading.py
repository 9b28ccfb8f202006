from __future__ import annotations

import os
import pickle
import uuid
from pathlib import Path

import pytest
import torch
from conftest import write_user_module
from safetensors.torch import save_file
from torch import nn

from explain_core.errors import ModelLoadError
from explain_core.loading import load_factory, load_model, load_state_dict

MODULE_SOURCE = """
from torch import nn


def build():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))


def small():
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 10))


def not_a_module():
    return {"weight": 1}


def broken():
    raise RuntimeError("no GPU here")


class Namespace:
    @staticmethod
    def build():
        return nn.Linear(3, 2)


NOT_CALLABLE = 42
"""


@pytest.fixture
def models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Write a uniquely named model module into tmp_path and make it importable."""
    return write_user_module(tmp_path, monkeypatch, "tinymodels", MODULE_SOURCE)


def _reference_weights(seed: int = 1) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "1.weight": torch.randn(10, 64, generator=generator),
        "1.bias": torch.randn(10, generator=generator),
    }


def _assert_loaded(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    assert isinstance(model, nn.Sequential)
    assert not model.training
    assert all(not m.training for m in model.modules())
    state = model.state_dict()
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(state[key], value), key


# --- successful loads -------------------------------------------------------------------------


def test_load_factory_builds_fresh_model(models: str) -> None:
    model = load_factory(f"{models}:build")
    assert isinstance(model, nn.Sequential)
    assert model[1].weight.shape == (10, 64)


def test_load_factory_dotted_attribute(models: str) -> None:
    model = load_factory(f"{models}:Namespace.build")
    assert isinstance(model, nn.Linear)
    assert model.weight.shape == (2, 3)


def test_load_model_without_weights_is_in_eval_mode(models: str) -> None:
    model = load_model(f"{models}:build")
    assert not model.training


def test_load_model_safetensors(models: str, tmp_path: Path) -> None:
    weights = _reference_weights()
    save_file(weights, str(tmp_path / "w.safetensors"))
    _assert_loaded(load_model(f"{models}:build", tmp_path / "w.safetensors"), weights)


def test_load_model_safetensors_string_path(models: str, tmp_path: Path) -> None:
    weights = _reference_weights(seed=5)
    save_file(weights, str(tmp_path / "w.safetensors"))
    _assert_loaded(load_model(f"{models}:build", str(tmp_path / "w.safetensors")), weights)


@pytest.mark.parametrize("suffix", [".pt", ".pth", ".pkl"])
def test_load_model_torch_state_dict(models: str, tmp_path: Path, suffix: str) -> None:
    weights = _reference_weights(seed=2)
    torch.save(weights, tmp_path / f"w{suffix}")
    _assert_loaded(load_model(f"{models}:build", tmp_path / f"w{suffix}"), weights)


@pytest.mark.parametrize("key", ["state_dict", "model_state_dict"])
def test_load_model_checkpoint_with_state_dict(models: str, tmp_path: Path, key: str) -> None:
    weights = _reference_weights(seed=3)
    torch.save({key: weights, "epoch": 7, "lr": 0.1}, tmp_path / "ckpt.pt")
    _assert_loaded(load_model(f"{models}:build", tmp_path / "ckpt.pt"), weights)


def test_load_state_dict_returns_plain_tensors(tmp_path: Path) -> None:
    weights = _reference_weights(seed=4)
    torch.save(weights, tmp_path / "w.pt")
    state = load_state_dict(tmp_path / "w.pt")
    assert set(state) == {"1.weight", "1.bias"}
    assert torch.equal(state["1.bias"], weights["1.bias"])


# --- refusals: weights files ------------------------------------------------------------------


def test_whole_pickled_model_is_refused(models: str, tmp_path: Path) -> None:
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    torch.save(model, tmp_path / "m.pt")
    with pytest.raises(ModelLoadError) as info:
        load_model(f"{models}:build", tmp_path / "m.pt")
    message = str(info.value)
    assert "refusing" in message
    assert "m.pt" in message
    assert "state_dict" in message


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("suffix", [".pt", ".pth", ".bin", ".ckpt", ".pkl"])
def test_malicious_pickle_is_not_executed(models: str, tmp_path: Path, suffix: str) -> None:
    marker = tmp_path / "pwned"
    evil = tmp_path / f"evil{suffix}"
    with open(evil, "wb") as handle:
        pickle.dump(_Evil(marker), handle)
    with pytest.raises(ModelLoadError, match="refusing"):
        load_model(f"{models}:build", evil)
    assert not marker.exists()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_malicious_object_inside_torch_zip_is_not_executed(models: str, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    torch.save({"1.weight": _Evil(marker)}, evil)
    with pytest.raises(ModelLoadError, match="refusing"):
        load_model(f"{models}:build", evil)
    assert not marker.exists()


def test_unknown_suffix_is_refused_without_reading(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "weights.joblib"
    with open(path, "wb") as handle:
        pickle.dump(_Evil(marker), handle)
    with pytest.raises(ModelLoadError) as info:
        load_state_dict(path)
    message = str(info.value)
    assert "refusing" in message and "weights.joblib" in message
    assert ".safetensors" in message
    assert not marker.exists()


def test_missing_weights_file(models: str, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist") as info:
        load_model(f"{models}:build", tmp_path / "nope.safetensors")
    assert "nope.safetensors" in str(info.value)


def test_corrupt_safetensors(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    path.write_bytes(b"not a safetensors file at all")
    with pytest.raises(ModelLoadError, match="not a valid safetensors file"):
        load_state_dict(path)


def test_corrupt_torch_file(tmp_path: Path) -> None:
    path = tmp_path / "w.pt"
    path.write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"w\.pt"):
        load_state_dict(path)


def test_torch_file_without_state_dict(tmp_path: Path) -> None:
    torch.save([torch.zeros(2)], tmp_path / "list.pt")
    with pytest.raises(ModelLoadError, match="does not hold a state dict"):
        load_state_dict(tmp_path / "list.pt")
    torch.save({"1.weight": torch.zeros(2), "epoch": 3}, tmp_path / "mixed.pt")
    with pytest.raises(ModelLoadError, match="does not hold a state dict"):
        load_state_dict(tmp_path / "mixed.pt")


# --- refusals: model references ---------------------------------------------------------------


@pytest.mark.parametrize("reference", ["nocolon", "a:b:c", ":build", "module:", "1abc:build"])
def test_malformed_reference(reference: str) -> None:
    with pytest.raises(ModelLoadError) as info:
        load_factory(reference)
    message = str(info.value)
    assert repr(reference) in message
    assert "package.module:factory" in message


def test_module_import_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = "import torch\nraise ImportError('needs foo')\n"
    name = write_user_module(tmp_path, monkeypatch, "brokenmodels", source)
    with pytest.raises(ModelLoadError) as info:
        load_model(f"{name}:build")
    message = str(info.value)
    assert "cannot import" in message and name in message
    assert "needs foo" in message


def test_module_not_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    name = f"absent_{uuid.uuid4().hex}"
    with pytest.raises(ModelLoadError, match="cannot import") as info:
        load_model(f"{name}:build")
    assert "ModuleNotFoundError" in str(info.value)


def test_module_with_syntax_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = write_user_module(tmp_path, monkeypatch, "syntaxmodels", "def build(:\n")
    with pytest.raises(ModelLoadError, match="SyntaxError"):
        load_model(f"{name}:build")


def test_missing_attribute(models: str) -> None:
    with pytest.raises(ModelLoadError) as info:
        load_model(f"{models}:missing_factory")
    message = str(info.value)
    assert "has no attribute" in message and "missing_factory" in message


def test_not_callable(models: str) -> None:
    with pytest.raises(ModelLoadError, match="not callable"):
        load_model(f"{models}:NOT_CALLABLE")


def test_factory_not_returning_module(models: str) -> None:
    with pytest.raises(ModelLoadError) as info:
        load_model(f"{models}:not_a_module")
    message = str(info.value)
    assert "returned dict" in message and "torch.nn.Module" in message


def test_factory_raising(models: str) -> None:
    with pytest.raises(ModelLoadError) as info:
        load_model(f"{models}:broken")
    message = str(info.value)
    assert "failed" in message and "RuntimeError" in message and "no GPU here" in message
    assert "without arguments" in message


# --- refusals: weights that do not fit --------------------------------------------------------


def test_state_dict_key_mismatch(models: str, tmp_path: Path) -> None:
    weights = _reference_weights()
    weights["head.weight"] = weights.pop("1.weight")
    save_file(weights, str(tmp_path / "w.safetensors"))
    with pytest.raises(ModelLoadError) as info:
        load_model(f"{models}:build", tmp_path / "w.safetensors")
    message = str(info.value)
    assert "do not match" in message
    assert "missing 1.weight" in message
    assert "unexpected head.weight" in message


def test_state_dict_only_unexpected_keys(models: str, tmp_path: Path) -> None:
    weights = _reference_weights()
    weights["extra"] = torch.zeros(1)
    torch.save(weights, tmp_path / "w.pt")
    with pytest.raises(ModelLoadError) as info:
        load_model(f"{models}:build", tmp_path / "w.pt")
    message = str(info.value)
    assert "missing none" in message and "unexpected extra" in message


def test_state_dict_many_missing_keys_are_abbreviated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = write_user_module(
        tmp_path,
        monkeypatch,
        "deepmodels",
        "from torch import nn\n\ndef build():\n"
        "    return nn.Sequential(*[nn.Linear(2, 2) for _ in range(3)])\n",
    )
    save_file({"other": torch.zeros(1)}, str(tmp_path / "w.safetensors"))
    with pytest.raises(ModelLoadError) as info:
        load_model(f"{name}:build", tmp_path / "w.safetensors")
    # 6 missing keys: three are named, the rest counted.
    assert "0.bias, 0.weight, 1.bias and 3 more" in str(info.value)


def test_state_dict_shape_mismatch(models: str, tmp_path: Path) -> None:
    small = nn.Sequential(nn.Flatten(), nn.Linear(16, 10))
    save_file(small.state_dict(), str(tmp_path / "small.safetensors"))
    with pytest.raises(ModelLoadError) as info:
        load_model(f"{models}:build", tmp_path / "small.safetensors")
    message = str(info.value)
    assert "do not fit" in message
    assert "size mismatch" in message and "1.weight" in message
    assert "\n" not in message


def test_the_working_folder_is_not_left_on_sys_path(tmp_path: Path, monkeypatch) -> None:
    """Issue 22: a package planted in the working folder must not be imported later."""
    import sys
    import uuid

    name = f"usermodels_{uuid.uuid4().hex}"
    (tmp_path / f"{name}.py").write_text(MODULE_SOURCE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    before = list(sys.path)
    assert isinstance(load_factory(f"{name}:build"), nn.Module)
    assert sys.path == before
    with pytest.raises(ModelLoadError):
        load_factory("no_such_module_here:build")
    assert sys.path == before
