"""Capsule saliency (REM Eq. 16) against plain loops, and parse-tree data recording."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import explain_core.api as api
from explain_capsules import (
    CapsuleRecording,
    FullyConnectedCapsules,
    PrimaryCapsules,
    capsule_saliency,
    find_grid_capsules,
    quantise_couplings,
    record_parse_tree_data,
    saliency_grid,
)
from explain_core.errors import InvalidInputError
from explain_core.plugin_manager import PluginManager

H, W = 12, 14  # conv 3×3 → 10×12, primary 3×3 stride 2 → grid 4×5 (M ≠ N catches transposes)
GRID = (4, 5, 3)
N_CAPS = GRID[0] * GRID[1] * GRID[2]


class TinyCapsNet(nn.Module):
    """Conv + ReLU → PrimaryCapsules → (optional hidden FC capsules) → class capsule lengths."""

    def __init__(self, in_channels: int = 2, classes: int = 3, hidden: int | None = None) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, 8, 3)
        self.primary = PrimaryCapsules(8, GRID[2], 4, kernel_size=3, stride=2)
        self.hidden = None
        n_in = N_CAPS
        if hidden is not None:
            self.hidden = FullyConnectedCapsules(n_in, hidden, 4, 4, weight_std=0.5, name="h")
            n_in = hidden
        self.classes = FullyConnectedCapsules(n_in, classes, 4, 6, weight_std=0.5, name="cls")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = self.primary(torch.relu(self.conv(x)))
        if self.hidden is not None:
            u = self.hidden(u)
        return self.classes(u).norm(dim=-1)


def loop_saliency(recording: CapsuleRecording, target: torch.Tensor, levels: int | None):
    """Eq. 16 with explicit loops over samples, rows m, columns n and capsule types o."""
    layer = recording.layer("classes")
    m_size, n_size, o_size = GRID
    out = torch.zeros(len(target), m_size, n_size, dtype=torch.float64)
    for b in range(len(target)):
        j = int(target[b])
        for m in range(m_size):
            for n in range(n_size):
                total = 0.0
                for o in range(o_size):
                    i = (m * n_size + n) * o_size + o
                    c = float(layer.couplings[b, i, j])
                    if levels is not None:
                        c = round(c * (levels - 1)) / (levels - 1)
                    total += float(layer.input_activations[b, i]) * c
                out[b, m, n] = total / o_size
    return out


@pytest.fixture
def model() -> TinyCapsNet:
    return TinyCapsNet().eval()


@pytest.fixture
def inputs() -> torch.Tensor:
    return torch.randn(3, 2, H, W)


def _upsample(grid: torch.Tensor) -> torch.Tensor:
    return F.interpolate(grid[:, None], size=(H, W), mode="bilinear", align_corners=False)[:, 0]


@pytest.mark.parametrize("levels", [None, 3, 11])
def test_saliency_matches_loop_eq16(model, inputs, levels):
    maps, output, target = capsule_saliency(model, inputs, levels=levels)
    recording = record_parse_tree_data(model, inputs)
    expected_grid = loop_saliency(recording, target, levels).float()
    assert maps.shape == (3, H, W)
    torch.testing.assert_close(maps, _upsample(expected_grid), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(output, recording.outputs)


def test_quantisation_changes_the_map(model, inputs):
    plain, _, _ = capsule_saliency(model, inputs)
    coarse, _, _ = capsule_saliency(model, inputs, levels=2)
    assert not torch.allclose(plain, coarse)


def test_saliency_grid_and_upsampling(model, inputs):
    maps, _, target = capsule_saliency(model, inputs, levels=5)
    layer = record_parse_tree_data(model, inputs).layer("classes")
    couplings = layer.couplings[torch.arange(3), :, target]
    grid = saliency_grid(layer.input_activations, couplings, GRID, levels=5)
    assert grid.shape == (3, 4, 5)
    torch.testing.assert_close(maps, _upsample(grid))
    with pytest.raises(ValueError, match="grid 4×5×3"):
        saliency_grid(layer.input_activations[:, :10], couplings, GRID)


def test_target_defaults_to_prediction(model, inputs):
    maps, output, target = capsule_saliency(model, inputs)
    assert torch.equal(target, output.argmax(dim=1))
    again, _, _ = capsule_saliency(model, inputs, target=target)
    torch.testing.assert_close(maps, again)
    other = (target + 1) % 3
    maps_other, _, target_other = capsule_saliency(model, inputs, target=other)
    assert torch.equal(target_other, other)
    assert not torch.allclose(maps, maps_other)
    _, _, single = capsule_saliency(model, inputs, target=2)
    assert single.tolist() == [2, 2, 2]
    with pytest.raises(InvalidInputError, match="target must lie"):
        capsule_saliency(model, inputs, target=3)


def test_saliency_restores_training_flags(inputs):
    model = TinyCapsNet().train()
    model.primary.eval()
    capsule_saliency(model, inputs)
    assert model.training and model.classes.training and not model.primary.training
    assert "_routing_recorders" not in model.classes.__dict__


def test_registered_and_explain(model, inputs, monkeypatch):
    manager = PluginManager()
    manager.load(builtins=("explain_capsules",), entry_points=False)
    assert "capsules.saliency" in manager.registry
    spec = manager.registry["capsules.saliency"]
    assert spec.options() == {"levels": None}
    with pytest.raises(InvalidInputError, match="levels"):
        spec.create(levels=1)
    monkeypatch.setattr(api, "get_registry", lambda: manager.registry)
    result = api.explain(model, inputs, "capsules.saliency", levels=4)
    maps, output, target = capsule_saliency(model, inputs, levels=4)
    # Attribution has the inputs' shape; channels share the map, summing back to it.
    assert result.attribution.shape == inputs.shape
    for channel in range(inputs.shape[1]):
        torch.testing.assert_close(result.attribution[:, channel], maps / inputs.shape[1])
    torch.testing.assert_close(result.spatial_map(), maps)
    torch.testing.assert_close(result.extras["saliency"], maps)
    assert result.extras["grid"].shape == (3, 4, 5)
    assert (result.extras["primary"], result.extras["layer"]) == ("primary", "classes")
    assert torch.equal(result.target, target)
    torch.testing.assert_close(result.output, output)
    assert "grid_shape" in model.primary.__dict__


def test_find_grid_capsules_and_errors(inputs):
    assert find_grid_capsules(TinyCapsNet(hidden=5))[::2] == ("primary", "hidden")

    no_primary = nn.Sequential(nn.Flatten(), FullyConnectedCapsules(4, 3, 2, 2))
    with pytest.raises(InvalidInputError, match=r"exactly one PrimaryCapsules.*found 0: none"):
        capsule_saliency(no_primary, inputs)

    two = TinyCapsNet()
    two.extra = PrimaryCapsules(8, 2, 4, kernel_size=3)
    with pytest.raises(InvalidInputError, match="found 2: 'primary', 'extra'"):
        capsule_saliency(two, inputs)

    # The primary capsules feed a hidden layer of 5 capsules, not the 3 class capsules.
    with pytest.raises(InvalidInputError, match="route to the class capsules"):
        capsule_saliency(TinyCapsNet(hidden=5).eval(), inputs)
    with pytest.raises(InvalidInputError, match="image inputs"):
        capsule_saliency(TinyCapsNet(), inputs[:, 0])
    with pytest.raises(ValueError, match="levels"):
        capsule_saliency(TinyCapsNet(), inputs, levels=1)


# ------------------------------------------------------------------------------- recording


def test_recording_shapes_names_and_predictions(inputs):
    model = TinyCapsNet(hidden=5).eval()
    data = torch.cat([inputs, torch.randn(4, 2, H, W)])
    recording = record_parse_tree_data(model, data, batch_size=3)
    assert recording.names == ["hidden", "classes"]
    assert recording.n_samples == 7 and recording.levels is None
    sizes = [(layer.n_in, layer.n_out) for layer in recording.layers]
    assert sizes == [(N_CAPS, 5), (5, 3)]
    for layer in recording.layers:
        assert layer.couplings.shape == (7, layer.n_in, layer.n_out)
        assert layer.input_activations.shape == (7, layer.n_in)
        assert layer.output_activations.shape == (7, layer.n_out)
        torch.testing.assert_close(layer.couplings.sum(2), torch.ones(7, layer.n_in))
    with torch.no_grad():
        expected = model(data)
    torch.testing.assert_close(recording.outputs, expected)
    assert torch.equal(recording.predicted, expected.argmax(1))
    torch.testing.assert_close(recording.layer("classes").output_activations, recording.outputs)
    torch.testing.assert_close(
        recording.layer("hidden").output_activations,
        recording.layer("classes").input_activations,
    )
    with pytest.raises(KeyError, match="recorded layers"):
        recording.layer("nope")
    single = record_parse_tree_data(model, data, batch_size=256)
    for a, b in zip(single.layers, recording.layers, strict=True):
        torch.testing.assert_close(a.couplings, b.couplings)


def test_recording_quantised(model, inputs):
    plain = record_parse_tree_data(model, inputs)
    quantised = record_parse_tree_data(model, inputs, levels=5)
    assert quantised.levels == 5
    layer = quantised.layer("classes")
    assert torch.equal(layer.couplings, quantise_couplings(plain.layer("classes").couplings, 5))
    assert set((layer.couplings * 4).round().unique().tolist()) <= {0.0, 1.0, 2.0, 3.0, 4.0}
    torch.testing.assert_close(layer.input_activations, plain.layer("classes").input_activations)
    with pytest.raises(ValueError, match="levels"):
        record_parse_tree_data(model, inputs, levels=1)
    with pytest.raises(ValueError, match="batch_size"):
        record_parse_tree_data(model, inputs, batch_size=0)


def test_recording_holds_plain_copies_and_restores_flags(inputs):
    model = TinyCapsNet(hidden=5).train()
    model.hidden.eval()
    recording = record_parse_tree_data(model, inputs)
    assert model.training and model.classes.training and not model.hidden.training
    for module in model.modules():
        assert "_routing_recorders" not in module.__dict__
    with pytest.raises(dataclasses.FrozenInstanceError):
        recording.levels = 3  # type: ignore[misc]
    tensors = [recording.outputs, recording.predicted]
    for layer in recording.layers:
        tensors += [layer.couplings, layer.input_activations, layer.output_activations]
    for tensor in tensors:
        assert tensor.device.type == "cpu" and tensor.grad_fn is None
        assert not tensor.requires_grad
    # Copies: a second recording (same model, same data) is unaffected by writes to the first.
    before = recording.layer("classes").couplings.clone()
    recording.layer("classes").couplings.zero_()
    model.eval()
    again = record_parse_tree_data(model, inputs)
    torch.testing.assert_close(again.layer("classes").couplings, before)


def test_recording_errors(inputs):
    with pytest.raises(ValueError, match="contains no RoutingLayer"):
        record_parse_tree_data(nn.Conv2d(2, 2, 1), inputs)
    with pytest.raises(ValueError, match="at least one sample"):
        record_parse_tree_data(TinyCapsNet(), inputs[:0])
    with pytest.raises(ValueError, match=r"floating point; got dtype torch\.int64"):
        record_parse_tree_data(TinyCapsNet(), (inputs * 255).long())

    class Twice(TinyCapsNet):
        def __init__(self) -> None:
            super().__init__()
            self.again = FullyConnectedCapsules(3, 3, 6, 6)

        def forward(self, x):
            v = self.classes(self.primary(torch.relu(self.conv(x))))
            return self.again(self.again(v)).norm(dim=-1)

    with pytest.raises(ValueError, match="ran more than once"):
        record_parse_tree_data(Twice(), inputs)


# ------------------------------------------------------------------------------- the model is kept


def grid_shapes(model: nn.Module) -> dict[str, object]:
    return {name: m.__dict__.get("grid_shape") for name, m in model.named_modules()}


@pytest.mark.parametrize("analysis", ["saliency", "record", "collect"])
def test_analyses_leave_a_model_that_never_ran_as_it_was(inputs, analysis):
    from conftest import assert_same_state, state_fingerprint

    from explain_core.parse_trees import collect_parse_tree_data

    run = {
        "saliency": capsule_saliency,
        "record": record_parse_tree_data,
        "collect": collect_parse_tree_data,
    }[analysis]
    model = TinyCapsNet().train()
    before, shapes = state_fingerprint(model), grid_shapes(model)
    assert shapes["primary"] is None  # set by a forward pass only
    run(model, inputs)
    # No analysis writes to the model (other threads may use it meanwhile): what its forward
    # sets on itself stays, as after a plain forward pass in eval mode.
    twin = copy.deepcopy(model).eval()
    with torch.no_grad():
        twin(inputs)
    shapes = grid_shapes(twin)
    assert shapes["primary"] is not None
    assert grid_shapes(model) == shapes
    assert_same_state(before, state_fingerprint(model))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_inputs_of_another_dtype_are_a_clear_error(inputs, dtype):
    from explain_core.errors import InvalidInputError
    from explain_core.parse_trees import collect_parse_tree_data

    model = TinyCapsNet().eval()
    message = rf"inputs are {dtype} but the parameters of TinyCapsNet are torch\.float32"
    for record in (record_parse_tree_data, collect_parse_tree_data):
        with pytest.raises(InvalidInputError, match=message + r".*inputs\.to\(torch\.float32\)"):
            record(model, inputs.to(dtype))
    with pytest.raises(InvalidInputError, match=r"floating point; got dtype torch\.int64"):
        collect_parse_tree_data(model, (inputs * 255).long())


@pytest.mark.parametrize("method", ["capsules.saliency", "gradient"])
def test_inputs_that_overflow_the_routing_get_a_clear_error(model, inputs, method):
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(InvalidInputError) as caught:
        api.explain(model, inputs * 1e30, method)  # finite inputs whose votes overflow
    message = str(caught.value)
    assert "dynamic_routing in FullyConnectedCapsules('cls')" in message
    assert "votes are NaN or infinite" in message and "scale the inputs" in message
    assert isinstance(caught.value, ValueError)  # what the routing raised before
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name])
