"""CoDA-Net models, contributions, training and faithfulness (issue deliverables 4–6, 8, 10)."""

import math

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from explain_coda import (
    PRESETS,
    CoDANet,
    DAUConv2d,
    LayerSpec,
    TrainConfig,
    bce_one_vs_all,
    coda_contributions,
    encode_input,
    explicit_matrix,
    train_coda,
)
from explain_coda.training import load_checkpoint, weight_regulariser
from explain_core import InvalidInputError, ModelLoadError, explain, explanation_mode
from explain_core.data import load_digits
from explain_core.metrics.randomisation import cascading_randomisation
from explain_core.training import accuracy


def small_model(**options) -> CoDANet:
    specs = [LayerSpec(6, 4, 3, 1), LayerSpec(8, 5, 3, 2), LayerSpec(4, 6, 1, 1)]
    return CoDANet(specs, (2, 7, 9), **options).eval()


def test_presets_follow_table_c1():
    shape, specs = PRESETS["S"]
    assert shape == (6, 32, 32)
    assert [s.out_channels for s in specs] == [16, 16, 32, 32, 32, 64, 64, 64, 10]
    assert [s.rank for s in specs] == [32, 32, 64, 64, 64, 64, 64, 64, 64]
    assert [s.kernel_size for s in specs] == [3] * 8 + [1]
    assert [s.stride for s in specs] == [1, 1, 2, 1, 1, 2, 1, 1, 1]
    assert [s.rank for s in PRESETS["M"][1]] == [64, 64, 128, 128, 128, 256, 256, 256, 256]
    assert PRESETS["L"][0] == (6, 240, 240) and PRESETS["L"][1][0] == LayerSpec(16, 64, 7, 3)
    assert PRESETS["XL"][1][-1] == LayerSpec(200, 256, 3, 2)
    model = CoDANet.from_preset("S")
    first, last = model.layers[0], model.layers[-1]
    assert (first.in_channels, first.out_channels, first.rank, first.padding) == (6, 16, 32, 1)
    assert last.weightings.weight.shape == (10 * 64, 64, 1, 1)
    assert model(torch.rand(1, 6, 32, 32)).shape == (1, 10)
    with pytest.raises(ValueError, match="unknown preset"):
        CoDANet.from_preset("XXL")


def test_forward_is_temperature_scaled_sum_pool_plus_fixed_bias():
    model = small_model(temperature=3.0).double()
    x = torch.rand(2, 2, 7, 9, dtype=torch.float64)
    expected = model.layers(x).sum(dim=(2, 3)) / 3.0 + math.log(0.1 / 0.9)
    torch.testing.assert_close(model(x), expected)
    torch.testing.assert_close(encode_input(torch.zeros(1, 3, 2, 2))[:, 3:], torch.ones(1, 3, 2, 2))


def test_bce_one_vs_all_matches_the_formula():
    logits = torch.randn(4, 5, dtype=torch.float64)
    labels = torch.tensor([0, 4, 2, 2])
    y = F.one_hot(labels, 5).double()
    p = torch.sigmoid(logits)
    expected = -(y * p.log() + (1 - y) * (1 - p).log()).sum() / 4
    torch.testing.assert_close(bce_one_vs_all(logits, labels), expected)
    with pytest.raises(InvalidInputError, match=r"labels must lie in \[0, 4\]"):
        bce_one_vs_all(logits, torch.tensor([0, 5, 1, 1]))


def test_contributions_are_complete_for_every_class_in_one_call():
    model = small_model(temperature=2.0).double()
    x = encode_input(torch.rand(3, 1, 7, 9, dtype=torch.float64))
    every = coda_contributions(model, x, classes="all")
    assert every.contributions.shape == (3, 4, 2, 7, 9)
    torch.testing.assert_close(
        every.contributions.flatten(2).sum(2), every.output - model.logit_bias, rtol=1e-12, atol=0
    )
    for k in range(4):
        single = coda_contributions(model, x, torch.full((3,), k))
        torch.testing.assert_close(single.contributions, every.contributions[:, k])
    subset = coda_contributions(model, x, classes=[3, 1])
    torch.testing.assert_close(subset.contributions, every.contributions[:, [3, 1]])
    rows = explicit_matrix(model, x)
    torch.testing.assert_close(rows * x[:, None] / model.temperature, every.contributions)


def test_intermediate_layer_contributions_sum_to_the_unit():
    model = small_model().double()
    x = encode_input(torch.rand(2, 1, 7, 9, dtype=torch.float64))
    hidden = model.layers[:2](x)
    at = coda_contributions(model, x, layer=1, unit=(3, 1, 2))
    # one unit keeps its unit axis, as the output (the unit's values) does
    assert at.contributions.shape == (2, 1, *x.shape[1:]) and at.output.shape == (2, 1)
    assert at.targets.shape == (2, 1)
    torch.testing.assert_close(at.contributions.flatten(2).sum(2), at.output)
    torch.testing.assert_close(at.output[:, 0], hidden[:, 3, 1, 2])
    channel = coda_contributions(model, x, layer=1, unit=5)
    torch.testing.assert_close(
        channel.contributions.flatten(2).sum(2)[:, 0], hidden[:, 5].sum((1, 2))
    )
    both = coda_contributions(model, x, layer=-2, unit=[5, (3, 1, 2)])
    torch.testing.assert_close(both.contributions[:, :1], channel.contributions)
    torch.testing.assert_close(both.contributions[:, 1:], at.contributions)
    torch.testing.assert_close(both.contributions.flatten(2).sum(2), both.output)
    # the receptive field: a unit at the first layer sees only its 3×3 patch (both channels)
    first = coda_contributions(model, x, layer=0, unit=(0, 3, 4)).contributions[:, 0]
    outside = first.clone()
    outside[:, :, 2:5, 3:6] = 0
    assert outside.abs().max() == 0 and first.abs().max() > 0


def test_registered_method_reports_completeness_delta():
    model = small_model(temperature=5.0).double()
    x = encode_input(torch.rand(3, 1, 7, 9, dtype=torch.float64))
    result = explain(model, x, "coda.contributions")
    assert result.delta.abs().max() < 1e-12
    assert torch.equal(result.target, model(x).argmax(1))
    unit = explain(model, x, "coda.contributions", layer=0, unit=2)
    assert unit.delta.abs().max() < 1e-12
    assert unit.attribution.shape == x.shape  # explain() keeps the inputs' shape
    with pytest.raises(InvalidInputError, match=r"option 'unit'.* a tuple of 3 integers or None"):
        explain(model, x, "coda.contributions", layer=0, unit=[2, 1])


def test_regulariser_is_mean_absolute_entry_of_true_and_wrong_rows():
    model = small_model(temperature=2.0).double().train()
    x = encode_input(torch.rand(3, 1, 7, 9, dtype=torch.float64))
    labels = torch.tensor([0, 1, 3])
    penalty = weight_regulariser(model, x, labels, torch.Generator().manual_seed(0))
    offset = torch.randint(1, 4, (3,), generator=torch.Generator().manual_seed(0))
    wrong = (labels + offset) % 4
    rows = explicit_matrix(model.eval(), x)
    expected = torch.cat([rows[torch.arange(3), labels], rows[torch.arange(3), wrong]]).abs().mean()
    torch.testing.assert_close(penalty, expected)
    penalty.backward()
    first = model.layers[0].weightings.weight
    assert first.grad is not None and first.grad.abs().sum() > 0


@pytest.fixture(scope="module")
def digits():
    data = load_digits()
    return data, encode_input(data.train_images), encode_input(data.test_images)


@pytest.fixture(scope="module")
def trained(digits):
    data, train, _ = digits
    torch.manual_seed(0)
    model = CoDANet.from_preset("digits", temperature=8.0)
    train_coda(model, train, data.train_labels, TrainConfig(epochs=4, seed=0))
    return model


def test_training_reaches_high_accuracy(trained, digits):
    data, _, test = digits
    assert accuracy(trained, test, data.test_labels) >= 0.95


def test_trained_model_is_complete_in_float32_for_all_classes(trained, digits):
    _, _, test = digits
    every = coda_contributions(trained, test, classes="all")
    explained = every.output - trained.logit_bias  # (N, 10)
    summed = every.contributions.flatten(2).sum(2)
    # relative to each sample's logit vector (a logit can sit arbitrarily close to b₀)
    relative = (summed - explained).norm(dim=1) / explained.norm(dim=1)
    assert relative.max() < 1e-4
    # and in float64 the decomposition is exact
    exact = coda_contributions(trained.double(), test[:20].double(), classes="all")
    torch.testing.assert_close(
        exact.contributions.flatten(2).sum(2),
        exact.output - trained.logit_bias,
        rtol=1e-10,
        atol=1e-10,
    )
    trained.float()


def test_input_x_gradient_in_explanation_mode_equals_contributions(trained, digits):
    data, _, test = digits
    x, labels = test[:16], data.test_labels[:16]
    contributions = coda_contributions(trained, x, labels).contributions
    with explanation_mode(trained):
        ixg = explain(trained, x, "input_x_gradient", labels).attribution
    torch.testing.assert_close(ixg, contributions, rtol=1e-5, atol=1e-7)
    plain = explain(trained, x, "input_x_gradient", labels).attribution
    assert not torch.allclose(plain, contributions, rtol=1e-2, atol=1e-3)


def test_cascading_randomisation_destroys_the_maps(trained, digits):
    data, _, test = digits
    x, labels = test[:24], data.test_labels[:24]

    def maps(model, inputs, targets):
        return coda_contributions(model, inputs, targets).contributions.sum(1)

    names = [f"layers.{i}" for i in reversed(range(len(trained.layers)))]
    steps = cascading_randomisation(trained, maps, x, labels, names)
    assert [s.layers[-1] for s in steps] == names
    assert steps[-1].mean_ssim < 0.5
    assert steps[-1].mean_ssim < steps[0].mean_ssim
    # the trained model itself was not touched
    assert accuracy(trained, test, data.test_labels) >= 0.95


def test_training_is_deterministic_and_resumes_exactly(tmp_path, digits):
    data, train, _ = digits
    images, labels = train[:96], data.train_labels[:96] % 4
    config = TrainConfig(epochs=2, batch_size=32, seed=3, regularisation=0.01)

    def fresh():
        torch.manual_seed(1)
        return small_model().with_input_size(8, 8)

    straight = fresh()
    train_coda(straight, images, labels, config)
    again = fresh()
    train_coda(again, images, labels, config)
    for a, b in zip(straight.state_dict().values(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b)

    interrupted = fresh()
    history = train_coda(interrupted, images, labels, config, checkpoint_dir=tmp_path,
                         stop_after_epoch=1)  # fmt: skip
    assert len(history.loss) == 1
    resumed = fresh()
    history = train_coda(resumed, images, labels, config, checkpoint_dir=tmp_path)
    assert len(history.loss) == 2
    for a, b in zip(straight.state_dict().values(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b)

    checkpoint = tmp_path / "checkpoint.safetensors"
    with safe_open(str(checkpoint), framework="pt") as handle:  # plain tensors, no pickle
        assert "model.layers.0.weightings.weight" in handle.keys()  # noqa: SIM118
    with pytest.raises(ModelLoadError, match="another training configuration"):
        train_coda(fresh(), images, labels, TrainConfig(epochs=3, seed=4), checkpoint_dir=tmp_path)
    (tmp_path / "bad.safetensors").write_bytes(b"not a checkpoint")
    with pytest.raises(ModelLoadError, match="not a readable checkpoint"):
        load_checkpoint(tmp_path / "bad.safetensors", fresh())


def test_bad_input_names_what_was_expected():
    model = CoDANet.from_preset("S").eval()
    with pytest.raises(InvalidInputError, match=r"\(batch, 6, 32, 32\).*encode_input"):
        model(torch.rand(1, 3, 32, 32))
    with pytest.raises(InvalidInputError, match="spatial size 32×32; got 28×28"):
        model(torch.rand(1, 6, 28, 28))
    small = small_model()
    x = encode_input(torch.rand(1, 1, 7, 9))
    with pytest.raises(InvalidInputError, match="NaN"):
        explain(small, x.clone().fill_(float("inf")), "coda.contributions")
    with pytest.raises(InvalidInputError, match=r"NaN or infinite"):
        encode_input(torch.full((1, 1, 7, 9), float("nan")))
    with pytest.raises(InvalidInputError, match=r"\[0, 3\]"):
        explain(small, x, "coda.contributions", target=4)
    with pytest.raises(InvalidInputError, match=r"classes must lie in \[0, 3\]"):
        coda_contributions(small, x, classes=[1, 7])
    with pytest.raises(InvalidInputError, match="unit must be"):
        coda_contributions(small, x, layer=0, unit=(9, 0, 0))
    with pytest.raises(InvalidInputError, match=r"layer must lie in \[-3, 2\]"):
        coda_contributions(small, x, layer=3, unit=0)
    mixed = nn.Sequential(DAUConv2d(2, 3, 2, 3), nn.Conv2d(3, 2, 1), nn.Flatten(1)).eval()
    with pytest.raises(InvalidInputError, match=r"module '1' is a Conv2d"):
        explain(mixed, x, "coda.contributions")
    with pytest.raises(InvalidInputError, match="contains no DAU layer"):
        explain(nn.Sequential(nn.Flatten(), nn.Linear(126, 3)).eval(), x, "coda.contributions")
    with pytest.raises(ValueError, match="temperature"):
        small_model(temperature=0.0)
