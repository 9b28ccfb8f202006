"""Checkpoints of the original CoDA-Nets code load onto the presets (issue 23, deliverable 6).

The state dicts are built here from the released code's key names and shapes, written out by hand
from github.com/moboehle/CoDA-Nets (``models/simple_coda.py``, ``modules/DAUs.py``,
``experiments/{CIFAR10,Imagenet}/final/experiment_parameters.py``), and saved as its trainer saves
them (``torch.save(model.state_dict(), "model_epoch_200.pkl")``, keys prefixed with ``module.``
when it trained on several GPUs). Outputs are compared with Algorithm 1 computed here in float64
from those original tensors, without explain_coda's modules.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import run_cli
from torch import nn

from explain_coda import CoDANet, coda_contributions, encode_input, load_original_coda
from explain_core import ModelLoadError
from explain_core.loading import load_weights

# The released configurations, as experiment_parameters.py gives them ("norm": the DAUs'
# non-linearity; "T": the logit temperature of the evaluated model, the number in its name).
CIFAR10 = {
    "out_c": [16] * 2 + [32] * 3 + [64] * 3 + [10],
    "ranks": [32] * 2 + [64] * 3 + [64] * 4,
    "kernel_sizes": [3] * 8 + [1],
    "stride": [1, 1, 2, 1, 1, 2, 1, 1, 1],
    "padding": [1] * 8 + [0],
    "T": 1000.0,
}
CONFIGS = {
    "S-CoDA-SQ": {**CIFAR10, "norm": "squash"},
    "S-CoDA-L2": {**CIFAR10, "norm": "l2"},
    "L-CoDA": {
        "out_c": [16] + 2 * [32] + 5 * [64] + [100],
        "ranks": [64] * 3 + [128] * 3 + [256] * 3,
        "kernel_sizes": [7] + 8 * [3],
        "stride": [3, 1, 1, 2, 1, 1, 2, 1, 1],
        "padding": [3] + [1] * 8,
        "T": 100000.0,
        "norm": "squash",
    },
}
EMBEDDING_CHANNELS = 6  # [r, g, b, 1 − r, 1 − g, 1 − b], made by the trainer's AddInverse
LOGIT_BIAS = math.log(0.1 / 0.9)
# Small inputs keep the test fast; the models are fully convolutional (L-CoDA: 30 → 10 → 5 → 3).
INPUT_SIZE = {"S-CoDA-SQ": 32, "S-CoDA-L2": 32, "L-CoDA": 30}


def original_state_dict(variant: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 tensors under the released code's names and shapes."""
    config, generator = CONFIGS[variant], torch.Generator().manual_seed(seed)
    state, channels = {}, EMBEDDING_CHANNELS
    for i, (out, rank, k) in enumerate(
        zip(config["out_c"], config["ranks"], config["kernel_sizes"], strict=True)
    ):
        patch_dim = channels * k * k
        # weighting_f.0: Conv2d(in, rank, k, bias=False); weighting_f.1: Conv2d(rank, out·in·k², 1)
        state[f"{i}.weight_mod.weighting_f.0.weight"] = torch.randn(
            rank, channels, k, k, generator=generator
        ) / math.sqrt(patch_dim)
        state[f"{i}.weight_mod.weighting_f.1.weight"] = torch.randn(
            out * patch_dim, rank, 1, 1, generator=generator
        ) / math.sqrt(rank)
        state[f"{i}.weight_mod.weighting_f.1.bias"] = 0.1 * torch.randn(
            out * patch_dim, generator=generator
        )
        channels = out
    return state


def algorithm_1(
    state: dict[str, torch.Tensor], variant: str, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The last layer's map and the logits, in float64, from original-layout tensors.

    Per layer: ``W(x) = conv1×1(conv_k(x, B), A, b)`` viewed as ``(batch, in·k², out, h, w)``
    (channel ``p·out + j``), applied to the unfolded patches and divided by the non-linearity's
    norm: ``(1 + ‖w‖²)/‖w‖`` (squashing) or ``‖w‖`` (L2). Then sum pooling, ``/T`` and ``b₀``.
    """
    config = CONFIGS[variant]
    x = x.double()
    for i, (out, k, stride, padding) in enumerate(
        zip(
            config["out_c"], config["kernel_sizes"], config["stride"], config["padding"],
            strict=True,
        )
    ):  # fmt: skip
        prefix = f"{i}.weight_mod.weighting_f"
        b_matrix = state[f"{prefix}.0.weight"].double()
        a_matrix, bias = state[f"{prefix}.1.weight"].double(), state[f"{prefix}.1.bias"].double()
        weights = F.conv2d(F.conv2d(x, b_matrix, stride=stride, padding=padding), a_matrix, bias)
        batch, _, h, w = weights.shape
        weights = weights.view(batch, -1, out, h, w)
        patches = F.unfold(x, k, padding=padding, stride=stride).view(batch, -1, 1, h, w)
        norm = weights.norm(dim=1)
        aligned = (patches * weights).sum(1)
        x = aligned / ((1 + norm**2) / norm) if config["norm"] == "squash" else aligned / norm
    return x, x.sum(dim=(2, 3)) / config["T"] + LOGIT_BIAS


@pytest.fixture(scope="module")
def states() -> dict[str, dict[str, torch.Tensor]]:
    """One random original-layout state dict per variant, shared by the tests of this file."""
    return {variant: original_state_dict(variant, seed) for seed, variant in enumerate(CONFIGS)}


def encoded_images(size: int, batch: int = 2) -> torch.Tensor:
    return encode_input(
        torch.rand(batch, 3, size, size, generator=torch.Generator().manual_seed(7))
    )


def save(
    state: dict[str, torch.Tensor], path: Path, *, prefix: str = "", legacy: bool = False
) -> Path:
    """``torch.save`` as the original trainer does: a state dict (``module.`` keys: multi-GPU)."""
    torch.save(
        {prefix + key: value for key, value in state.items()},
        path,
        _use_new_zipfile_serialization=not legacy,
    )
    return path


def assert_equals_algorithm_1(model: CoDANet, state: dict, variant: str) -> None:
    size = INPUT_SIZE[variant]
    model = model.with_input_size(size, size).double()
    if variant == "L-CoDA":
        # Its default (factorised) form spends ~1.6 s on float64 QR factorisations of the large
        # layers; that form equals Algorithm 1 on the S variants here and in test_coda_layers.
        for layer in model.layers:
            layer.form = "direct"
    x = encoded_images(size).double()
    features, logits = algorithm_1(state, variant, x)
    with torch.no_grad():
        ours = model.features(x)
        torch.testing.assert_close(ours, features, rtol=1e-10, atol=1e-12 * features.abs().max())
        torch.testing.assert_close(model(x), logits, rtol=1e-12, atol=1e-14)
    assert features.abs().max() > 1e-3  # a real comparison, not of vanishing numbers


# --- original checkpoints load and compute Algorithm 1 -----------------------------------------


@pytest.mark.parametrize("prefix", ["", "module."], ids=["single-GPU", "multi-GPU"])
@pytest.mark.parametrize("variant", list(CONFIGS))
def test_original_checkpoint_equals_algorithm_1(
    states: dict, tmp_path: Path, variant: str, prefix: str
) -> None:
    path = save(states[variant], tmp_path / "model_epoch_200.pkl", prefix=prefix)
    model = load_original_coda(path, variant)
    assert not model.training
    assert model.temperature == CONFIGS[variant]["T"]
    assert {layer.nonlinearity for layer in model.layers} == {CONFIGS[variant]["norm"]}
    assert model.logit_bias == pytest.approx(LOGIT_BIAS)
    assert_equals_algorithm_1(model, states[variant], variant)


class _DAUWeights(nn.Module):
    """The module names of the original ``DAUWeights``: its tensors and their names only."""

    def __init__(self, channels: int, out: int, rank: int, k: int, stride: int, padding: int):
        super().__init__()
        self.weighting_f = nn.Sequential(
            nn.Conv2d(channels, rank, k, stride, padding, bias=False),
            nn.Conv2d(rank, out * channels * k * k, 1),
        )
        self.norm_func = nn.Module()  # Squashing / L2Norm: no tensors


class _CoDAConv2d(nn.Module):
    def __init__(self, weight_mod: nn.Module):
        super().__init__()
        self.weight_mod = weight_mod


def original_module_tree(variant: str) -> nn.Sequential:
    """An ``nn.Sequential`` named as ``make_coda_net``'s: 9 layers, sum pooling, final layer."""
    config, channels, layers = CONFIGS[variant], EMBEDDING_CHANNELS, []
    for out, rank, k, stride, padding in zip(
        config["out_c"], config["ranks"], config["kernel_sizes"], config["stride"],
        config["padding"], strict=True,
    ):  # fmt: skip
        layers.append(_CoDAConv2d(_DAUWeights(channels, out, rank, k, stride, padding)))
        channels = out
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Identity())


def test_state_dict_of_a_data_parallel_run_in_torch_1_3_format_loads(
    states: dict, tmp_path: Path
) -> None:
    """A real ``state_dict()`` (an OrderedDict with metadata) of a ``DataParallel`` model, saved
    in the legacy (non-zip) format of the torch 1.3.1 the original code pins."""
    network = original_module_tree("S-CoDA-SQ")
    network.load_state_dict(states["S-CoDA-SQ"])
    state = nn.DataParallel(network).state_dict()
    assert set(state) == {f"module.{key}" for key in states["S-CoDA-SQ"]}
    path = tmp_path / "model_epoch_200.pkl"
    torch.save(state, path, _use_new_zipfile_serialization=False)
    assert_equals_algorithm_1(load_original_coda(path), states["S-CoDA-SQ"], "S-CoDA-SQ")


def test_experiment_name_gives_the_temperature(states: dict, tmp_path: Path) -> None:
    path = save(states["S-CoDA-SQ"], tmp_path / "last_model_epoch_200.pkl", legacy=True)
    model = load_original_coda(path, "9L-S-CoDA-SQ-50")
    assert model.temperature == 50.0
    assert load_original_coda(path, "S-CoDA-SQ", temperature=10).temperature == 10.0
    # The same weights whatever the temperature: it only divides the pooled map.
    x = encoded_images(32, batch=1)
    with torch.no_grad():
        features = model.features(x)
        torch.testing.assert_close(features, load_original_coda(path).features(x))
        torch.testing.assert_close(model(x), features.sum(dim=(2, 3)) / 50.0 + LOGIT_BIAS)


def test_any_coda_net_reads_the_original_layout(states: dict, tmp_path: Path) -> None:
    """A user's own factory (here: another temperature) loads the files through load_weights."""
    path = save(states["S-CoDA-L2"], tmp_path / "model_epoch_200.pkl", prefix="module.")
    model = CoDANet.from_preset("S", temperature=1000.0, nonlinearity="l2")
    assert load_weights(model, path) is model
    assert_equals_algorithm_1(model.eval(), states["S-CoDA-L2"], "S-CoDA-L2")


def test_files_in_this_librarys_layout_load_too(states: dict, tmp_path: Path) -> None:
    reference = load_original_coda(save(states["S-CoDA-SQ"], tmp_path / "original.pkl"))
    ours = {f"module.{k}": v for k, v in reference.state_dict().items()}
    model = load_original_coda(save(ours, tmp_path / "ours.pt"))
    for key, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


def test_cli_explains_with_an_original_checkpoint(
    states: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str], restore_showwarning: None
) -> None:
    weights = save(
        states["S-CoDA-SQ"], tmp_path / "model_epoch_200.pkl", prefix="module.", legacy=True
    )
    x = encoded_images(32, batch=1)
    np.save(tmp_path / "x.npy", x[0].numpy())
    code, out, err = run_cli(
        [
            "attribute", str(tmp_path / "x.npy"), "--model", "explain_coda.original:s_coda_sq",
            "--weights", str(weights), "--method", "coda.contributions",
            "--out", str(tmp_path / "maps"),
        ],
        capsys,
    )  # fmt: skip
    assert code == 0, err
    assert "coda.contributions" in out
    expected = coda_contributions(load_original_coda(weights), x).contributions[0]
    np.testing.assert_allclose(
        np.load(tmp_path / "maps" / "x.npy"), expected.detach().numpy(), rtol=1e-4, atol=1e-6
    )


# --- refusals ----------------------------------------------------------------------------------


def test_whole_pickled_model_is_refused_never_unpickled(tmp_path: Path) -> None:
    """The original trainer saves state dicts; a whole model object is refused, not executed."""
    path = tmp_path / "model_epoch_200.pkl"
    torch.save(original_module_tree("S-CoDA-SQ"), path)
    with pytest.raises(ModelLoadError) as info:
        load_original_coda(path)
    message = str(info.value)
    assert "refusing" in message and "model_epoch_200.pkl" in message
    assert "state_dict()" in message


def test_cli_names_the_variant_that_fits(
    states: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str], restore_showwarning: None
) -> None:
    weights = save(states["S-CoDA-SQ"], tmp_path / "model_epoch_200.pkl")
    np.save(tmp_path / "x.npy", np.zeros((6, 240, 240), dtype=np.float32))
    code, _, err = run_cli(
        [
            "attribute", str(tmp_path / "x.npy"), "--model", "explain_coda.original:l_coda",
            "--weights", str(weights), "--method", "coda.contributions",
            "--out", str(tmp_path / "maps"),
        ],
        capsys,
    )  # fmt: skip
    assert code == 1
    assert "model_epoch_200.pkl" in err and "do not fit" in err
    assert "0.weight_mod.weighting_f.0.weight: file (32, 6, 3, 3), model (64, 6, 7, 7)" in err
    assert "S-CoDA-SQ" in err and "explain_coda.original:s_coda_sq" in err
    assert not (tmp_path / "maps").exists()


def test_missing_layer_tensor_is_named(states: dict, tmp_path: Path) -> None:
    state = dict(states["S-CoDA-SQ"])
    del state["8.weight_mod.weighting_f.1.bias"]
    with pytest.raises(ModelLoadError) as info:
        load_original_coda(save(state, tmp_path / "model_epoch_200.pkl"))
    message = str(info.value)
    assert "model_epoch_200.pkl" in message
    assert "missing 8.weight_mod.weighting_f.1.bias" in message
    assert "fit none of the released variants" in message


def test_other_shapes_name_the_variant_and_the_keys(states: dict, tmp_path: Path) -> None:
    state = dict(states["S-CoDA-SQ"])
    state["3.weight_mod.weighting_f.0.weight"] = torch.zeros(16, 32, 3, 3)  # a rank ablation
    with pytest.raises(ModelLoadError) as info:
        load_original_coda(save(state, tmp_path / "model_epoch_200.pkl"), "S-CoDA-L2")
    message = str(info.value)
    assert "3.weight_mod.weighting_f.0.weight: file (16, 32, 3, 3), model (64, 32, 3, 3)" in message
    assert "LayerSpec" in message


def test_keys_of_neither_layout_are_refused(states: dict, tmp_path: Path) -> None:
    state = dict(states["S-CoDA-SQ"])
    state["0.weight_mod.weighting_f.0.bias"] = torch.zeros(32)  # the first convolution has none
    with pytest.raises(ModelLoadError, match=r"mixes the original.*weighting_f\.0\.bias"):
        load_original_coda(save(state, tmp_path / "model_epoch_200.pkl"))


def test_keys_with_and_without_module_prefix_are_refused(states: dict, tmp_path: Path) -> None:
    state = dict(states["S-CoDA-SQ"])
    state["module.0.weight_mod.weighting_f.0.weight"] = state["0.weight_mod.weighting_f.0.weight"]
    with pytest.raises(ModelLoadError, match=r"twice, with and without a 'module\.' prefix"):
        load_original_coda(save(state, tmp_path / "model_epoch_200.pkl"))


def test_unknown_variant_lists_the_known_ones(states: dict, tmp_path: Path) -> None:
    path = save(states["S-CoDA-SQ"], tmp_path / "model_epoch_200.pkl")
    with pytest.raises(ModelLoadError, match=r"unknown CoDA-Nets variant 'M-CoDA'.*S-CoDA-L2"):
        load_original_coda(path, "M-CoDA")
