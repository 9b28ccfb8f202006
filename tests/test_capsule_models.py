"""Capsule models and training: margin loss, shapes, routing names, training, resume, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from explain_capsules.models import DRCapsNet, MultiLayerCapsNet, capsule_weight_std, margin_loss
from explain_capsules.training import (
    CHECKPOINT_NAME,
    CapsuleTrainConfig,
    load_capsule_checkpoint,
    train_capsnet,
)
from explain_core.data.digits import load_digits
from explain_core.errors import InvalidInputError, ModelLoadError
from explain_core.interfaces.routing import record_routing
from explain_core.training import accuracy


def tiny_drcapsnet(**kwargs) -> DRCapsNet:
    """28×28 DR-CapsNet with narrow layers: 6×6×4 = 144 primary capsules, fast on a CPU."""
    torch.manual_seed(0)
    options = {"conv_channels": 16, "primary_types": 4, "primary_dim": 8, "class_dim": 8}
    return DRCapsNet(**{**options, **kwargs})


@pytest.fixture(scope="module")
def digits():
    split = load_digits(image_size=28)
    return split.train_images[:256], split.train_labels[:256]


def test_margin_loss_matches_hand_computation():
    lengths = torch.tensor([[0.95, 0.3, 0.05], [0.5, 0.2, 0.8]])
    labels = torch.tensor([0, 2])
    # Sample 0: true 0.95 ≥ 0.9 → 0; class 1: 0.5·(0.3−0.1)² = 0.02; class 2: 0.05 < 0.1 → 0.
    # Sample 1: true 0.8 → (0.1)² = 0.01; class 0: 0.5·0.4² = 0.08; class 1: 0.5·0.1² = 0.005.
    expected = (0.02 + (0.01 + 0.08 + 0.005)) / 2
    assert margin_loss(lengths, labels).item() == pytest.approx(expected)
    custom = margin_loss(lengths, labels, m_plus=1.0, m_minus=0.0, lam=1.0)
    by_hand = ((0.05**2 + 0.3**2 + 0.05**2) + (0.5**2 + 0.2**2 + 0.2**2)) / 2
    assert custom.item() == pytest.approx(by_hand)


@pytest.mark.parametrize(
    ("lengths", "labels"),
    [
        (torch.zeros(2, 3), torch.tensor([0, 3])),
        (torch.zeros(2, 3), torch.tensor([-1, 0])),
        (torch.zeros(2, 3), torch.tensor([0.0, 1.0])),
        (torch.zeros(2, 3), torch.tensor([0])),
        (torch.zeros(6), torch.tensor([0])),
    ],
)
def test_margin_loss_rejects_bad_inputs(lengths, labels):
    with pytest.raises(InvalidInputError, match="expected"):
        margin_loss(lengths, labels)


def test_default_drcapsnet_shapes():
    model = DRCapsNet()
    x = torch.rand(2, 1, 28, 28)
    with torch.no_grad():
        primary = model.primary_capsules(x)
        v = model.class_capsules(primary)
        lengths = model(x)
    assert model.num_primary == 1152 and model.primary_grid == (6, 6, 32)
    assert primary.shape == (2, 1152, 8)
    assert v.shape == (2, 10, 16)
    assert lengths.shape == (2, 10)
    assert torch.allclose(lengths, v.norm(dim=-1), atol=1e-3)
    assert bool(((lengths >= 0) & (lengths < 1)).all())
    assert isinstance(model.primary, nn.Module) and model.class_capsules.in_caps == 1152


def test_tiny_drcapsnet_routing_and_grad():
    model = tiny_drcapsnet(classes=5, iterations=2, detach_intermediate_votes=True)
    x = torch.rand(3, 1, 28, 28)
    with record_routing(model) as rec:
        lengths = model(x)
        assert rec.layers == ["class_capsules"]
        assert rec.couplings("class_capsules").shape == (3, 144, 5)
    assert lengths.shape == (3, 5) and model.capsules(x).shape == (3, 5, 8)
    lengths.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_multilayer_capsnet_shapes_and_routing_names():
    model = MultiLayerCapsNet(in_features=(1, 28, 28))
    x = torch.rand(4, 1, 28, 28)
    with record_routing(model) as rec:
        lengths = model(x)
        names = rec.layers
        shapes = [tuple(rec.couplings(n).shape) for n in names]
        activations = [tuple(a.shape for a in rec.activations(n)) for n in names]
    assert lengths.shape == (4, 10)
    assert names == ["routing.0", "routing.1", "routing.2", "routing.3"]
    assert shapes == [(4, 16, 16)] * 3 + [(4, 16, 10)]
    assert activations[-1] == ((4, 16), (4, 10))
    assert model.primary_capsules(x).shape == (4, 16, 8)
    assert model.class_capsules is model.routing[3]
    # Flattened inputs are accepted too, and give the same scores.
    assert torch.allclose(model(x.flatten(1)), lengths)
    flat = MultiLayerCapsNet(in_features=64, hidden_layers=1, classes=3, dim=4)
    assert flat(torch.rand(2, 64)).shape == (2, 3) and len(flat.routing) == 2


def test_reconstruction_decoder_shape_and_masking():
    model = tiny_drcapsnet(reconstruction=True)
    x = torch.rand(2, 1, 28, 28)
    labels = torch.tensor([3, 7])
    with torch.no_grad():
        lengths, recon = model.lengths_and_reconstruction(x, labels)
        assert recon.shape == (2, 1, 28, 28)
        assert bool(((recon >= 0) & (recon <= 1)).all())
        # Masking by the prediction equals masking by the argmax label.
        predicted = lengths.argmax(1)
        assert torch.equal(model.reconstruct(x), model.reconstruct(x, predicted))
        # Only the chosen capsule reaches the decoder: feed the masked vector by hand.
        v = model.capsules(x)
        masked = torch.zeros_like(v)
        masked[torch.arange(2), labels] = v[torch.arange(2), labels]
        assert torch.allclose(model.decoder(masked.flatten(1)).view(2, 1, 28, 28), recon)
    ml = MultiLayerCapsNet(in_features=(1, 28, 28), reconstruction=True)
    assert ml.reconstruct(x).shape == (2, 1, 28, 28)
    with pytest.raises(InvalidInputError, match="reconstruction=False"):
        tiny_drcapsnet().reconstruct(x)
    with pytest.raises(InvalidInputError, match=r"labels in \[0, 9\]"):
        model.reconstruct(x, torch.tensor([0, 10]))


def test_bad_inputs_are_rejected():
    model = tiny_drcapsnet()
    for bad in (torch.rand(2, 28, 28), torch.rand(2, 3, 28, 28), torch.rand(2, 1, 12, 12)):
        with pytest.raises(InvalidInputError, match=r"expected input of shape \(batch, 1, 28, 28"):
            model(bad)
    with pytest.raises(InvalidInputError, match="expected input of shape"):
        MultiLayerCapsNet()(torch.rand(2, 100))
    with pytest.raises(ValueError, match="smaller than"):
        DRCapsNet(image_size=12)
    with pytest.raises(ValueError, match="positive int"):
        DRCapsNet(conv_channels=0)
    with pytest.raises(ValueError, match="hidden_layers"):
        MultiLayerCapsNet(hidden_layers=-1)
    with pytest.raises(ValueError, match="epochs"):
        CapsuleTrainConfig(epochs=0)
    with pytest.raises(InvalidInputError, match="labels"):
        train_capsnet(model, torch.rand(4, 1, 28, 28), torch.zeros(3, dtype=torch.long),
                      CapsuleTrainConfig(epochs=1))  # fmt: skip


def test_training_improves_loss_and_accuracy(digits):
    images, labels = digits
    model = tiny_drcapsnet(reconstruction=True)
    history = train_capsnet(
        model,
        images,
        labels,
        CapsuleTrainConfig(epochs=2, batch_size=32, lr=3e-3),
        evaluate=lambda m: accuracy(m, images, labels),
    )
    assert len(history.loss) == 2 and len(history.accuracy) == 2
    assert history.loss[1] < history.loss[0]
    assert history.accuracy[-1] > 0.3  # chance is 0.1
    assert accuracy(model, images, labels, batch_size=100) == history.accuracy[-1]


def test_multilayer_capsnet_init_keeps_lengths_and_gradients():
    # The old init (std 0.01 everywhere) gave class lengths ~1e-18 and all-zero gradients.
    split = load_digits()
    images, labels = split.train_images[:128], split.train_labels[:128]
    torch.manual_seed(0)
    model = MultiLayerCapsNet(in_features=(1, 8, 8))
    assert [layer.weight.std().item() for layer in model.routing] == pytest.approx(
        [capsule_weight_std(16, 16, 8)] * 3 + [capsule_weight_std(16, 10, 8)], rel=0.05
    )
    u = model.primary_capsules(images)
    lengths = [u.norm(dim=-1).mean().item()]
    for layer in model.routing:
        u = layer(u)
        lengths.append(u.norm(dim=-1).mean().item())
    assert lengths[0] > 0.5 and lengths[-1] > 0.05, lengths
    assert lengths[-1] < 0.6  # not saturated either
    margin_loss(u.norm(dim=-1), labels).backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.norm() > 1e-4, name


def test_multilayer_capsnet_learns_digits():
    # Paper sizes (16 primary, 3 × 16 hidden, 10 classes, 8D, 3 iterations) on 8×8 digits.
    split = load_digits()
    torch.manual_seed(0)
    model = MultiLayerCapsNet(in_features=(1, 8, 8))
    history = train_capsnet(
        model,
        split.train_images[:512],
        split.train_labels[:512],
        CapsuleTrainConfig(epochs=3, batch_size=32, lr=3e-3),
    )
    # The old init stayed at 0.9² = 0.81 with chance accuracy.
    assert history.loss[-1] < 0.3, history.loss
    assert accuracy(model, split.test_images, split.test_labels) > 0.6
    with torch.no_grad(), record_routing(model) as rec:
        model(split.test_images[:128])
        couplings = [rec.couplings(name) for name in rec.layers]
    for c in couplings:  # parse trees need structure: neither uniform nor input-independent
        n_out = c.shape[-1]
        assert c.max(dim=-1).values.mean() > 1.3 / n_out
        assert c.std(dim=0).mean() > 0.01


def test_deterministic_and_exact_resume(digits, tmp_path):
    images, labels = digits[0][:128], digits[1][:128]
    config = CapsuleTrainConfig(epochs=2, batch_size=32, lr_decay=0.5)

    straight = tiny_drcapsnet()
    history = train_capsnet(straight, images, labels, config)
    again = tiny_drcapsnet()
    train_capsnet(again, images, labels, config)

    resumed = tiny_drcapsnet()
    train_capsnet(resumed, images, labels, config, checkpoint_dir=tmp_path, stop_after_epoch=1)
    assert not torch.equal(resumed.primary.conv.weight, straight.primary.conv.weight)
    fresh = tiny_drcapsnet()  # a new process: only the checkpoint carries the state
    resumed_history = train_capsnet(fresh, images, labels, config, checkpoint_dir=tmp_path)

    for name, tensor in straight.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[name]), name
        assert torch.equal(tensor, fresh.state_dict()[name]), name
    assert resumed_history.loss == history.loss

    epoch, saved = load_capsule_checkpoint(
        tmp_path / CHECKPOINT_NAME, tiny_drcapsnet(), config=config
    )
    assert epoch == 2 and saved.loss == history.loss
    with pytest.raises(ModelLoadError, match="another training configuration"):
        load_capsule_checkpoint(tmp_path / CHECKPOINT_NAME, tiny_drcapsnet(),
                                config=CapsuleTrainConfig(epochs=3))  # fmt: skip


def test_checkpoint_mismatch_is_refused(digits, tmp_path):
    images, labels = digits[0][:32], digits[1][:32]
    model = tiny_drcapsnet()
    model.register_buffer("class_mask", torch.ones(3))  # stands in for a pruning mask
    train_capsnet(model, images, labels, CapsuleTrainConfig(epochs=1, batch_size=32),
                  checkpoint_dir=tmp_path)  # fmt: skip
    path = tmp_path / CHECKPOINT_NAME

    # Buffers are saved and restored with the weights.
    same = tiny_drcapsnet()
    same.register_buffer("class_mask", torch.zeros(3))
    load_capsule_checkpoint(path, same)
    assert torch.equal(same.class_mask, torch.ones(3))

    without_mask = tiny_drcapsnet()
    before = without_mask.primary.conv.weight.clone()
    with pytest.raises(ModelLoadError, match=r"masks do not match the model.*class_mask"):
        load_capsule_checkpoint(path, without_mask)
    assert torch.equal(without_mask.primary.conv.weight, before)  # left untouched

    wider = tiny_drcapsnet(conv_channels=8)
    wider.register_buffer("class_mask", torch.ones(3))
    with pytest.raises(ModelLoadError, match=r"shape mismatch.*conv\.0\.weight"):
        load_capsule_checkpoint(path, wider)

    (tmp_path / "junk.safetensors").write_bytes(b"not a checkpoint")
    with pytest.raises(ModelLoadError, match="not a readable checkpoint"):
        load_capsule_checkpoint(tmp_path / "junk.safetensors", model)
