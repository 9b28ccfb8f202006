"""CoDA plugin: clear errors for bad input, and no resume into a differently built model."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from explain_coda import (
    CoDANet,
    LayerSpec,
    TrainConfig,
    coda_contributions,
    encode_input,
    explicit_matrix,
    train_coda,
)
from explain_coda.training import load_checkpoint
from explain_core import InvalidInputError, ModelLoadError, explain
from explain_core.checkpoints import load_training_checkpoint, save_training_checkpoint


def small_model(stride: int = 2, **options) -> CoDANet:
    """4 classes on encoded 8×8 inputs; ``stride`` changes no parameter shape."""
    torch.manual_seed(1)
    specs = [LayerSpec(6, 4, 3, 1), LayerSpec(8, 5, 3, stride), LayerSpec(4, 6, 1, 1)]
    return CoDANet(specs, (2, 8, 8), **options).eval()


@pytest.fixture(scope="module")
def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    images = encode_input(torch.rand(24, 1, 8, 8, generator=generator))
    return images, torch.arange(24) % 4


CONFIG = TrainConfig(epochs=2, batch_size=8, seed=3)


def checkpoint_epoch(folder: Path) -> int:
    with safe_open(str(folder / "checkpoint.safetensors"), framework="pt") as handle:
        return int(handle.metadata()["epoch"])


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y)


# --- 1. resuming with another model ------------------------------------------------------------


@pytest.mark.parametrize(
    ("changed", "message"),
    [
        (lambda: small_model(temperature=1.0), r"temperature: checkpoint 8\.0, model 1\.0"),
        (lambda: small_model(temperature=8.0, logit_bias=0.0), r"logit_bias: checkpoint -2\.19"),
        (
            lambda: small_model(temperature=8.0, stride=1),
            r'layers\.1: checkpoint "stride=2, .*model "stride=1',
        ),
        (lambda: small_model(temperature=8.0, nonlinearity="l2"), r"nonlinearity='l2'"),
        (
            lambda: small_model(temperature=8.0).with_input_size(10, 10),
            r"input_shape: checkpoint \[2, 8, 8\], model \[2, 10, 10\]",
        ),
    ],
)
def test_resume_refuses_a_model_built_with_other_settings(tmp_path, data, changed, message):
    images, labels = data
    train_coda(small_model(temperature=8.0), images, labels, CONFIG, checkpoint_dir=tmp_path,
               stop_after_epoch=1)  # fmt: skip
    model = changed()
    untouched = {k: v.clone() for k, v in model.state_dict().items()}
    if model.input_shape[1:] != (8, 8):
        images = encode_input(torch.rand(24, 1, 10, 10))
    with pytest.raises(ModelLoadError, match=message) as error:
        train_coda(model, images, labels, CONFIG, checkpoint_dir=tmp_path)
    assert "new checkpoint folder" in str(error.value)
    # refused before anything was loaded or trained: no mixed history, model as built
    assert checkpoint_epoch(tmp_path) == 1
    for key, value in model.state_dict().items():
        assert torch.equal(value, untouched[key])


def test_resume_refuses_another_model_class(tmp_path, data):
    class OtherNet(CoDANet):
        pass

    images, labels = data
    train_coda(small_model(), images, labels, CONFIG, checkpoint_dir=tmp_path, stop_after_epoch=1)
    other = small_model()
    other.__class__ = OtherNet  # the very same tensors, so only the class can tell
    with pytest.raises(ModelLoadError, match="written by a CoDANet, not a OtherNet"):
        train_coda(other, images, labels, CONFIG, checkpoint_dir=tmp_path)
    with pytest.raises(ModelLoadError, match="not a OtherNet"):
        load_checkpoint(tmp_path / "checkpoint.safetensors", other)


def test_resume_with_the_same_settings_is_bitwise_identical(tmp_path, data):
    images, labels = data
    straight = small_model(temperature=8.0)
    expected = train_coda(straight, images, labels, CONFIG)
    train_coda(small_model(temperature=8.0), images, labels, CONFIG, checkpoint_dir=tmp_path,
               stop_after_epoch=1)  # fmt: skip
    resumed = small_model(temperature=8.0)
    history = train_coda(resumed, images, labels, CONFIG, checkpoint_dir=tmp_path)
    assert history.loss == expected.loss
    assert_same_weights(straight, resumed)
    with safe_open(str(tmp_path / "checkpoint.safetensors"), framework="pt") as handle:
        recorded = json.loads(handle.metadata()["model_settings"])
    assert recorded["temperature"] == 8.0
    assert recorded["input_shape"] == [2, 8, 8]


def test_checkpoints_without_settings_still_load_and_other_callers_are_unchecked(tmp_path):
    """Files written before settings were recorded resume; callers that pass no settings (the
    capsules plugin) keep the old behaviour and check only tensors and configuration."""
    model = small_model(temperature=8.0)
    optimizer = torch.optim.Adam(model.parameters())
    old = tmp_path / "old.safetensors"
    save_training_checkpoint(old, model, optimizer, epoch=1, config={}, history={"loss": [1.0]})
    assert load_checkpoint(old, small_model(temperature=1.0))[0] == 1

    class OtherNet(CoDANet):
        pass

    other = small_model()
    other.__class__ = OtherNet
    new = tmp_path / "new.safetensors"
    save_training_checkpoint(new, model, optimizer, epoch=2, config={}, history={},
                             model_settings=model.settings())  # fmt: skip
    assert load_training_checkpoint(new, other)[0] == 2
    assert load_training_checkpoint(new, small_model(temperature=1.0))[0] == 2


# --- 2. checkpoint_dir as str or os.PathLike ---------------------------------------------------


class FolderPath(os.PathLike):
    """An os.PathLike that is not a pathlib.Path."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __fspath__(self) -> str:
        return str(self.path)


def test_checkpoint_dir_may_be_a_str_or_any_path_like(tmp_path, data):
    images, labels = data
    straight = small_model()
    expected = train_coda(straight, images, labels, CONFIG)
    folder = tmp_path / "runs" / "coda"
    first = train_coda(small_model(), images, labels, CONFIG, checkpoint_dir=str(folder),
                       stop_after_epoch=1)  # fmt: skip
    assert len(first.loss) == 1
    assert checkpoint_epoch(folder) == 1
    resumed = small_model()
    history = train_coda(resumed, images, labels, CONFIG, checkpoint_dir=FolderPath(folder))
    assert history.loss == expected.loss
    assert_same_weights(straight, resumed)


def test_checkpoint_dir_that_is_no_folder_path_is_refused(tmp_path, data):
    images, labels = data
    with pytest.raises(InvalidInputError, match=r"checkpoint_dir must be a folder path.*got int"):
        train_coda(small_model(), images, labels, CONFIG, checkpoint_dir=3)
    file = tmp_path / "notes.txt"
    file.write_text("")
    with pytest.raises(InvalidInputError, match="is a file; give a folder"):
        train_coda(small_model(), images, labels, CONFIG, checkpoint_dir=file)


# --- 3. raw torch errors become clear messages -------------------------------------------------


def test_a_target_list_of_another_length_points_to_classes(data):
    x = data[0][:4]
    with pytest.raises(InvalidInputError, match=r"one class per sample \(4\); got 2 values") as e:
        coda_contributions(small_model(), x, [1, 2])
    assert 'classes="all"' in str(e.value)
    # the advice works: both classes for every sample
    both = coda_contributions(small_model(), x, classes=[1, 2])
    assert both.contributions.shape == (4, 2, 2, 8, 8)


@pytest.mark.parametrize(("inputs", "model"), [(torch.float64, torch.float32),
                                               (torch.float32, torch.float64)])  # fmt: skip
def test_inputs_of_another_dtype_than_the_model_are_refused_as_explain_does(data, inputs, model):
    x = data[0][:4].to(inputs)
    net = small_model().to(model)
    with pytest.raises(InvalidInputError) as ours:
        coda_contributions(net, x, 1)
    with pytest.raises(InvalidInputError) as theirs:
        explain(net, x, "coda.contributions", 1)
    assert str(ours.value) == str(theirs.value)
    assert f"inputs are {inputs} but the model's parameters are {model}" in str(ours.value)
    with pytest.raises(InvalidInputError, match=f"inputs are {inputs}"):
        explicit_matrix(net, x)


def test_layer_must_be_an_integer(data):
    x = data[0][:2]
    with pytest.raises(InvalidInputError, match=r"layer must be an int .*got 1\.0 \(float\)"):
        coda_contributions(small_model(), x, layer=1.0, unit=0)
    with pytest.raises(InvalidInputError, match="layer must be an int"):
        coda_contributions(small_model(), x, layer=True, unit=0)
    with pytest.raises(InvalidInputError, match=r"'layer' .* must be an integer"):
        explain(small_model(), x, "coda.contributions", layer=1.0, unit=0)


def test_integer_tensor_units_count_as_ints_and_floats_are_refused(data):
    x = data[0][:3]
    model = small_model()
    # channel 3 of layer 1, summed over positions: the layer's own output, by completeness
    single = coda_contributions(model, x, layer=1, unit=torch.tensor(3))
    with torch.no_grad():
        expected = model.layers[:2](x)[:, 3].sum(dim=(1, 2))
    assert single.contributions.shape == (3, 1, 2, 8, 8)
    torch.testing.assert_close(single.contributions.flatten(1).sum(1), expected)
    several = coda_contributions(model, x, layer=1, unit=torch.tensor([3, 0]))
    assert several.contributions.shape == (3, 2, 2, 8, 8)
    torch.testing.assert_close(several.contributions[:, :1], single.contributions)
    position = coda_contributions(model, x, layer=1, unit=(np.int64(3), 1, torch.tensor(2)))
    with torch.no_grad():
        torch.testing.assert_close(position.output[:, 0], model.layers[:2](x)[:, 3, 1, 2])
    for bad in (3.0, torch.tensor(3.0), "3", [1, 2.5], [], (3, 1, 2.0)):
        with pytest.raises(InvalidInputError, match="unit must be a channel"):
            coda_contributions(model, x, layer=1, unit=bad)


def test_inside_inference_mode_says_where_to_call_it(data):
    x = data[0][:2]
    model = small_model()
    with torch.inference_mode():
        frozen = x.clone()
        with pytest.raises(InvalidInputError, match=r"inside torch\.inference_mode\(\)"):
            coda_contributions(model, x, 1)
        with pytest.raises(InvalidInputError, match=r"inside torch\.inference_mode\(\)"):
            explicit_matrix(model, x)
        with pytest.raises(InvalidInputError, match=r"inside torch\.inference_mode\(\)"):
            train_coda(model, *data, CONFIG)
    # an inference tensor used outside works, as do no_grad calls
    with torch.no_grad():
        plain = coda_contributions(model, x, 1)
    torch.testing.assert_close(coda_contributions(model, frozen, 1).contributions,
                               plain.contributions)  # fmt: skip


def test_training_data_that_does_not_fit_is_refused_before_training(tmp_path, data):
    images, labels = data
    with pytest.raises(InvalidInputError, match=r"one class index per image: shape \(24,\)"):
        train_coda(small_model(), images, labels[:20], CONFIG, checkpoint_dir=tmp_path)
    assert not any(tmp_path.iterdir())  # no epoch was trained
    with pytest.raises(InvalidInputError, match=r"integer class indices; got dtype torch\.float32"):
        train_coda(small_model(), images, labels.float(), CONFIG)
    with pytest.raises(InvalidInputError, match=r"labels must lie in \[0, 3\].*from 0 to 4"):
        train_coda(small_model(), images, labels + (labels == 3), CONFIG)
    with pytest.raises(InvalidInputError, match=r"images are torch\.float64"):
        train_coda(small_model(), images.double(), labels, CONFIG)
    with pytest.raises(InvalidInputError, match="must be torch tensors; got Tensor and list"):
        train_coda(small_model(), images, labels.tolist(), CONFIG)


def test_int32_labels_train_exactly_like_int64(data):
    images, labels = data
    a, b = small_model(), small_model()
    history = train_coda(a, images, labels.int(), CONFIG)
    assert history.loss == train_coda(b, images, labels, CONFIG).loss
    assert_same_weights(a, b)


# --- 4. float targets are refused, not truncated -----------------------------------------------


@pytest.mark.parametrize("target", [2.7, 2.0, torch.tensor([2.7, 2.7]), np.array([2.0, 1.0])])
def test_float_targets_are_refused_like_explain(data, target):
    x = data[0][:2]
    with pytest.raises(InvalidInputError, match="target must"):
        coda_contributions(small_model(), x, target)
    with pytest.raises(InvalidInputError, match="target must"):
        explain(small_model(), x, "coda.contributions", target)


@pytest.mark.parametrize(
    "classes", [[2.7], [2.0], [1, 2.5], torch.tensor([2.0]), 2.7, [True], np.array([1.0])]
)
def test_float_classes_are_refused_not_truncated(data, classes):
    x = data[0][:2]
    with pytest.raises(InvalidInputError, match='classes must be a list of ints or "all"'):
        coda_contributions(small_model(), x, classes=classes)
    with pytest.raises(InvalidInputError, match='classes must be a list of ints or "all"'):
        explicit_matrix(small_model(), x, classes=classes)


def test_integer_classes_in_any_container_explain_those_classes(data):
    x = data[0][:2]
    model = small_model()
    every = coda_contributions(model, x, classes="all").contributions
    for classes in ([2, 0], np.array([2, 0]), torch.tensor([2, 0]), (np.int64(2), 0)):
        torch.testing.assert_close(
            coda_contributions(model, x, classes=classes).contributions, every[:, [2, 0]]
        )
    with pytest.raises(InvalidInputError, match="at least one class"):
        coda_contributions(model, x, classes=[])
