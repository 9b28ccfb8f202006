"""Magnitude pruning of capsule nets: thresholds, schedules, masks, checkpoints, training."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from explain_capsules.models import DRCapsNet, MultiLayerCapsNet
from explain_capsules.pruning import (
    MagnitudePruner,
    PruningSchedule,
    apply_masks,
    default_prunable,
    masks,
    remove_masks,
    train_with_pruning,
)
from explain_capsules.training import (
    CHECKPOINT_NAME,
    CapsuleTrainConfig,
    load_capsule_checkpoint,
    train_capsnet,
)
from explain_core.errors import ModelLoadError


def small_net() -> MultiLayerCapsNet:
    torch.manual_seed(0)
    model = MultiLayerCapsNet(in_features=20, primary_caps=6, hidden_layers=1, hidden_caps=5,
                              classes=3, dim=4)  # fmt: skip
    return model


def data(n: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(n, 20, generator=generator), torch.randint(0, 3, (n,), generator=generator)


def test_default_prunable_excludes_biases():
    model = small_net()
    assert default_prunable(model) == ["primary.weight", "routing.0.weight", "routing.1.weight"]
    torch.manual_seed(0)
    dr = DRCapsNet(conv_channels=4, primary_types=2, primary_dim=4, class_dim=4)
    assert default_prunable(dr) == ["conv.0.weight", "primary.conv.weight",
                                    "class_capsules.weight"]  # fmt: skip


def test_global_threshold_is_kth_smallest_magnitude():
    model = small_net()
    names = default_prunable(model)
    params = dict(model.named_parameters())
    weights = np.concatenate([params[n].detach().numpy().ravel() for n in names])
    k = round(0.6 * weights.size)
    threshold = np.sort(np.abs(weights))[k - 1]  # k-th smallest |w|
    expected = {n: np.abs(params[n].detach().numpy()) > threshold for n in names}
    report = MagnitudePruner(model, 0.6).prune_to(0.6)
    for name, mask in masks(model).items():
        np.testing.assert_array_equal(mask.numpy(), expected[name])
        assert torch.all(params[name][~mask] == 0)
    assert report.zeros == k and report.total == weights.size
    assert report.overall == pytest.approx(k / weights.size)
    # Layers end up with different sparsities under one global threshold.
    assert len({round(v, 3) for v in report.per_layer.values()}) > 1


def test_layer_floor_keeps_the_largest_weights_of_a_small_layer():
    model = small_net()
    params = dict(model.named_parameters())
    with torch.no_grad():
        params["routing.1.weight"].mul_(1e-4)  # tiny magnitudes: one threshold would empty it
    assert MagnitudePruner(copy.deepcopy(model), 0.8).prune_to(0.8).per_layer[
        "routing.1.weight"
    ] == pytest.approx(1.0)
    weight = params["routing.1.weight"].detach().clone()
    report = MagnitudePruner(model, 0.8, layer_floor=0.1).prune_to(0.8)
    kept = math.ceil(0.1 * weight.numel())
    assert report.per_layer["routing.1.weight"] == pytest.approx(1 - kept / weight.numel())
    # The kept ones are the layer's largest magnitudes; the target is still met overall.
    expected = weight.abs().flatten() >= weight.abs().flatten().topk(kept).values[-1]
    torch.testing.assert_close(masks(model)["routing.1.weight"].flatten(), expected)
    assert report.overall == pytest.approx(round(0.8 * report.total) / report.total)


def test_layer_floor_must_leave_room_for_the_target():
    with pytest.raises(ValueError, match="layer_floor must be in"):
        MagnitudePruner(small_net(), 0.9, layer_floor=0.2)


def test_layer_scope_prunes_every_layer_equally():
    model = small_net()
    report = MagnitudePruner(model, 0.5, scope="layer").step(0)
    params = dict(model.named_parameters())
    for name, mask in masks(model).items():
        w = params[name].detach()
        assert int((~mask).sum()) == round(0.5 * w.numel())
        assert report.per_layer[name] == pytest.approx(round(0.5 * w.numel()) / w.numel())
        # Per layer: every kept magnitude ≥ every pruned original magnitude.
    torch.manual_seed(0)
    fresh = dict(small_net().named_parameters())
    for name, mask in masks(model).items():
        original = fresh[name].detach().abs()
        assert original[mask].min() >= original[~mask].max()


def test_schedules_hand_checked():
    it = PruningSchedule.iterative(0.75, steps=2, start=1, every=2)
    assert [it.sparsity_at(e) for e in range(6)] == pytest.approx([0, 0.5, 0.5, 0.75, 0.75, 0.75])
    # 0.875 in 3 steps: prune half the remaining weights each time.
    it3 = PruningSchedule.iterative(0.875, steps=3)
    assert [it3.sparsity_at(e) for e in range(4)] == pytest.approx([0.5, 0.75, 0.875, 0.875])
    gradual = PruningSchedule.gradual(0.8, start=0, end=4)
    # 0.8 − 0.8·(1 − e/4)³: 0, 0.8·(1 − 27/64), 0.8·(1 − 1/8), 0.8·(1 − 1/64), 0.8.
    assert [gradual.sparsity_at(e) for e in range(6)] == pytest.approx(
        [0.0, 0.4625, 0.7, 0.7875, 0.8, 0.8]
    )
    assert PruningSchedule.gradual(0.8, start=2, end=4, initial=0.2).sparsity_at(3) == (
        pytest.approx(0.8 - 0.6 / 8)
    )
    shot = PruningSchedule.one_shot(0.3, epoch=2)
    assert [shot.sparsity_at(e) for e in range(4)] == [0.0, 0.0, 0.3, 0.3]


def test_masks_are_monotone_and_never_revive():
    model = small_net()
    pruner = MagnitudePruner(model, 0.8, schedule=PruningSchedule.gradual(0.8, end=3))
    previous = {k: v.clone() for k, v in masks(model).items()}
    for epoch in range(4):
        pruner.step(epoch)
        with torch.no_grad():  # Perturb: pruned weights must not come back by magnitude.
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        apply_masks(model)
        for name, mask in masks(model).items():
            assert not torch.any(mask & ~previous[name])
            previous[name] = mask.clone()
    assert pruner.sparsity().overall == pytest.approx(0.8, abs=1e-3)
    # A lower sparsity afterwards keeps the existing masks.
    assert pruner.prune_to(0.1).overall == pytest.approx(0.8, abs=1e-3)


def test_masks_survive_state_dict_through_safetensors(tmp_path):
    model = small_net()
    MagnitudePruner(model, 0.5).step(0)
    path = tmp_path / "m.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    other = small_net()
    MagnitudePruner(other, 0.5)  # registers all-True masks of the right shapes
    other.load_state_dict(load_file(str(path)))
    for name, mask in masks(other).items():
        assert mask.dtype == torch.bool
        torch.testing.assert_close(mask, masks(model)[name])
    assert "routing.0.weight_mask" in model.state_dict()


def test_checkpoint_with_masks_refused_by_unmasked_model(tmp_path):
    model = small_net()
    images, labels = data()
    config = CapsuleTrainConfig(epochs=1, batch_size=8)
    MagnitudePruner(model, 0.5).step(0)
    train_capsnet(model, images, labels, config, checkpoint_dir=tmp_path)
    with pytest.raises(ModelLoadError, match="masks do not match the model"):
        load_capsule_checkpoint(tmp_path / CHECKPOINT_NAME, small_net())


def test_weights_stay_zero_during_training_and_resume(tmp_path):
    images, labels = data()
    config = CapsuleTrainConfig(epochs=4, batch_size=8, lr=1e-2)
    schedule = PruningSchedule.iterative(0.75, steps=2, every=2)  # 0.5 at 0–1, 0.75 from 2
    model = small_net()
    pruner = MagnitudePruner(model, 0.75, scope="layer", schedule=schedule)
    seen: list[float] = []

    def evaluate(m):
        # Called after each epoch, after the masks for the next epoch were set.
        for name, mask in masks(m).items():
            assert torch.all(dict(m.named_parameters())[name][~mask] == 0)
        seen.append(pruner.sparsity().overall)
        return 0.0

    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    train_with_pruning(model, images, labels, config, pruner, evaluate=evaluate)
    assert seen == pytest.approx([0.5, 0.75, 0.75, 0.75], abs=2e-3)
    params = dict(model.named_parameters())
    for name, mask in masks(model).items():
        assert torch.all(params[name][~mask] == 0)
        assert not torch.equal(params[name][mask], before[name][mask])  # it did train

    # Interrupted after 1 epoch and resumed: identical to the uninterrupted run.
    resumed = small_net()
    pruner2 = MagnitudePruner(resumed, 0.75, scope="layer", schedule=schedule)
    train_with_pruning(resumed, images, labels, config, pruner2, checkpoint_dir=tmp_path,
                       stop_after_epoch=1)  # fmt: skip
    resumed = small_net()
    pruner2 = MagnitudePruner(resumed, 0.75, scope="layer", schedule=schedule)
    train_with_pruning(resumed, images, labels, config, pruner2, checkpoint_dir=tmp_path)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[key], value)


def test_enforce_hook_keeps_zeros_under_adam_and_is_removed():
    model = small_net()
    images, _ = data()
    pruner = MagnitudePruner(model, 0.5)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

    def train_step():
        optimizer.zero_grad()
        model(images).sum().backward()
        optimizer.step()

    train_step()  # Adam moments now non-zero everywhere
    pruner.step(0)
    with pruner.enforce():
        for _ in range(3):
            train_step()
            for name, mask in masks(model).items():
                assert torch.all(dict(model.named_parameters())[name][~mask] == 0)
    train_step()  # hook removed: Adam's momentum moves pruned weights again
    name, mask = next(iter(masks(model).items()))
    assert torch.any(dict(model.named_parameters())[name][~mask] != 0)


def test_remove_masks_gives_a_plain_model():
    model = small_net()
    MagnitudePruner(model, 0.5).step(0)
    removed = remove_masks(model)
    assert set(removed) == set(default_prunable(model))
    assert masks(model) == {} and not any(k.endswith("_mask") for k in model.state_dict())
    assert set(small_net().state_dict()) == set(model.state_dict())


def test_validation_errors():
    model = small_net()
    for bad in (1.0, -0.1, True, "0.5"):
        with pytest.raises(ValueError, match=r"in \[0, 1\)"):
            MagnitudePruner(model, bad)
    with pytest.raises(ValueError, match="scope must be one of"):
        MagnitudePruner(model, 0.5, scope="channel")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown parameter names"):
        MagnitudePruner(model, 0.5, parameters=["routing.7.weight"])
    with pytest.raises(ValueError, match="schedule target must equal"):
        MagnitudePruner(model, 0.5, schedule=PruningSchedule.one_shot(0.4))
    with pytest.raises(ValueError, match="steps must be an int"):
        PruningSchedule.iterative(0.5, steps=0)
    with pytest.raises(ValueError, match="end must be an int"):
        PruningSchedule.gradual(0.5, start=3, end=1)
    with pytest.raises(ValueError, match="epoch must be an int"):
        PruningSchedule.one_shot(0.5).sparsity_at(-1)
    with pytest.raises(ValueError, match="train_with_pruning: expected a pruner"):
        train_with_pruning(small_net(), *data(), CapsuleTrainConfig(epochs=1),
                           MagnitudePruner(model, 0.5))  # fmt: skip


def test_only_selected_parameters_are_pruned():
    model = small_net()
    report = MagnitudePruner(model, 0.5, parameters=["routing.1.weight"]).step(0)
    assert list(masks(model)) == ["routing.1.weight"]
    assert report.per_layer == {"routing.1.weight": 0.5}
    assert torch.all(model.primary.weight != 0)
