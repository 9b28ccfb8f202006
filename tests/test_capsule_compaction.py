"""Compaction of pruned capsule networks: dead channels/types removed, outputs unchanged."""

from __future__ import annotations

import pytest
import torch

from explain_capsules.compaction import (
    FullyConnectedCapsulesPruner,
    PrimaryCapsulesPruner,
    compact,
    count_parameters,
    dead_capsules,
    dead_channels,
    dead_primary_types,
)
from explain_capsules.layers import FullyConnectedCapsules
from explain_capsules.models import DRCapsNet


def small_capsule_net() -> DRCapsNet:
    torch.manual_seed(0)
    return DRCapsNet(
        image_size=16,
        conv_channels=8,
        primary_types=4,
        primary_dim=4,
        class_dim=8,
        classes=3,
        conv_kernel=5,
        primary_kernel=5,
        primary_stride=2,
    ).eval()


def _pruned() -> DRCapsNet:
    net = small_capsule_net()
    with torch.no_grad():
        conv = net.conv[0]
        conv.weight[[1, 3]] = 0
        conv.bias[[1, 3]] = 0
        conv.weight[5] = 0  # zero weights, positive bias: a constant non-zero map, kept
        conv.bias[5] = 0.5
        d = net.primary.capsule_dim
        for t in (0, 2):  # two primary types entirely zero
            net.primary.conv.weight[t * d : (t + 1) * d] = 0
            net.primary.conv.bias[t * d : (t + 1) * d] = 0
        # Scattered zero routing rows of type 1 (not all positions: type kept).
        net.class_capsules.weight[[1, 5, 9]] = 0
    return net


def test_detection() -> None:
    net = _pruned()
    assert dead_channels(net) == [1, 3]
    assert dead_primary_types(net) == [0, 2]
    assert dead_capsules(net.class_capsules) == [1, 5, 9]


def test_negative_bias_channel_is_dead_after_relu() -> None:
    net = small_capsule_net()
    with torch.no_grad():
        net.conv[0].weight[2] = 0
        net.conv[0].bias[2] = -0.3
    assert dead_channels(net) == [2]


def test_type_with_all_zero_routing_weights_is_dead() -> None:
    net = small_capsule_net()
    m, n, o = net.primary_grid
    with torch.no_grad():
        net.class_capsules.weight[[p * o + 3 for p in range(m * n)]] = 0
    assert dead_primary_types(net) == [3]
    compacted, report = compact(net, torch.randn(2, 1, 16, 16))
    assert report.removed_types == [3]
    x = torch.randn(6, 1, 16, 16)
    torch.testing.assert_close(compacted(x), net(x), atol=1e-5, rtol=0)


def test_compact_preserves_outputs_and_shrinks() -> None:
    net = _pruned()
    original = {k: v.clone() for k, v in net.state_dict().items()}
    torch.manual_seed(1)
    x = torch.randn(16, 1, 16, 16)
    expected = net(x)
    compacted, report = compact(net, x[:2])

    torch.testing.assert_close(compacted(x), expected, atol=1e-5, rtol=0)
    assert report.params_after == count_parameters(compacted) < count_parameters(net)
    assert report.params_before == count_parameters(net)
    assert report.removed_channels == [1, 3]
    assert report.removed_types == [0, 2]
    m, n, _ = net.primary_grid
    assert report.removed_capsules == 2 * m * n
    # Shapes and bookkeeping of the compacted layers.
    assert compacted.conv[0].out_channels == 6 and compacted.conv[0].weight.shape[0] == 6
    assert compacted.primary.in_channels == compacted.primary.conv.in_channels == 6
    assert compacted.primary.capsule_types == 2
    assert compacted.primary.conv.weight.shape[:2] == (8, 6)
    assert compacted.primary_grid == (m, n, 2)
    assert compacted.num_primary == compacted.class_capsules.in_caps == 2 * m * n
    # The positive-bias, zero-weight channel 5 survives (now at index 3).
    assert float(compacted.conv[0].bias[3].detach()) == pytest.approx(0.5)
    # The user's model is untouched.
    for k, v in net.state_dict().items():
        assert torch.equal(v, original[k]), k
    assert net.primary.capsule_types == 4 and net.class_capsules.in_caps == 4 * m * n
    torch.testing.assert_close(net(x), expected, atol=0, rtol=0)
    # Still trainable after compaction.
    compacted.train()
    compacted(x).sum().backward()
    assert compacted.class_capsules.weight.grad is not None


def test_compact_nothing_dead_returns_equal_copy() -> None:
    net = small_capsule_net()
    compacted, report = compact(net, torch.randn(2, 1, 16, 16))
    assert compacted is not net
    assert report.params_after == report.params_before
    assert not report.removed_channels and not report.removed_types


def test_compact_rejects_all_dead() -> None:
    net = small_capsule_net()
    with torch.no_grad():
        net.primary.conv.weight.zero_()
        net.primary.conv.bias.zero_()
    with pytest.raises(ValueError, match=r"every .* is dead"):
        compact(net, torch.randn(2, 1, 16, 16))


@pytest.mark.parametrize("zero_input_capsules", [True, False])
def test_routing_invariant_to_zero_vote_input_capsules(zero_input_capsules: bool) -> None:
    """Removing input capsules with zero votes leaves dynamic routing's outputs unchanged."""
    torch.manual_seed(2)
    layer = FullyConnectedCapsules(12, 5, 4, 6, iterations=3, weight_std=0.5).eval()
    u = torch.randn(7, 12, 4)
    drop = [0, 4, 5, 11]
    if zero_input_capsules:
        u[:, drop] = 0  # zero capsules (e.g. a dead primary type): zero votes
    else:
        with torch.no_grad():
            layer.weight[drop] = 0  # zero routing weights: zero votes
    expected = layer(u)
    keep = [i for i in range(12) if i not in drop]
    small = FullyConnectedCapsulesPruner().prune_in_channels(
        FullyConnectedCapsules(12, 5, 4, 6, iterations=3), drop
    )
    with torch.no_grad():
        small.weight.copy_(layer.weight[keep])
    assert small.in_caps == 8 and small.weight.shape == (8, 5, 6, 4)
    torch.testing.assert_close(small(u[:, keep]), expected, atol=1e-6, rtol=0)


def test_removing_nonzero_capsule_changes_routing() -> None:
    """Control: the invariance is specific to zero votes."""
    torch.manual_seed(3)
    layer = FullyConnectedCapsules(6, 3, 4, 4, weight_std=0.5).eval()
    u = torch.randn(2, 6, 4)
    small = FullyConnectedCapsulesPruner().prune_in_channels(
        FullyConnectedCapsules(6, 3, 4, 4), [0]
    )
    with torch.no_grad():
        small.weight.copy_(layer.weight[1:])
    assert not torch.allclose(small(u[:, 1:]), layer(u), atol=1e-5)


def test_fc_pruner_out_channels_and_primary_type_mapping() -> None:
    layer = FullyConnectedCapsules(4, 5, 2, 3)
    w = layer.weight.detach().clone()
    FullyConnectedCapsulesPruner().prune_out_channels(layer, [1, 3])
    assert layer.out_caps == 3 and torch.equal(layer.weight, w[:, [0, 2, 4]])

    pruner = PrimaryCapsulesPruner()
    caps = pruner.types_to_capsules((2, 3, 4), [1])
    assert caps == [1, 5, 9, 13, 17, 21]  # (m*N + n)*O + o for every position
    net = small_capsule_net()
    net(torch.randn(1, 1, 16, 16))
    with pytest.raises(ValueError, match="every position"):
        pruner.capsules_to_types(net.primary, [1, 5])


def test_compact_cuts_rem_masks_like_their_parameters() -> None:
    """A compacted REM model keeps its masks (cut like the weights), so pruning can go on."""
    from explain_capsules.pruning import MagnitudePruner, apply_masks, masks

    net = _pruned()
    MagnitudePruner(net, 0.5, scope="layer").prune_to(0.5)
    with torch.no_grad():  # the dead units' masks are off too, as after REM's pruning
        net.conv[0].weight_mask[[1, 3]] = False
        d = net.primary.capsule_dim
        for t in (0, 2):
            net.primary.conv.weight_mask[t * d : (t + 1) * d] = False
    apply_masks(net)
    before = masks(net)
    x = torch.rand(3, 1, 16, 16)
    small, report = compact(net, x[:2])
    after = masks(small)
    assert report.removed_channels == [1, 3] and report.removed_types == [0, 2]
    assert after.keys() == before.keys()
    kept_channels = [c for c in range(8) if c not in (1, 3)]
    kept_type_rows = [t * d + k for t in (1, 3) for k in range(d)]
    m, n, _ = net.primary_grid
    kept_caps = [p * 4 + t for p in range(m * n) for t in (1, 3)]
    assert torch.equal(after["conv.0.weight"], before["conv.0.weight"][kept_channels])
    assert torch.equal(
        after["primary.conv.weight"],
        before["primary.conv.weight"][kept_type_rows][:, kept_channels],
    )
    assert torch.equal(after["class_capsules.weight"], before["class_capsules.weight"][kept_caps])
    with torch.no_grad():
        expected = net(x)
        apply_masks(small)  # fits, and changes nothing
        torch.testing.assert_close(small(x), expected, rtol=1e-5, atol=1e-6)
    MagnitudePruner(small, 0.7, scope="layer").prune_to(0.7)  # pruning goes on


def test_compaction_rescales_rem_saliency_by_the_ratio_of_types() -> None:
    # Documented in compact() and capsule_saliency(): Eq. 16 averages over the types left.
    from explain_capsules import capsule_saliency

    net = _pruned()  # types 0 and 2 are zero capsules: 4 types -> 2
    x = torch.rand(3, 1, 16, 16)
    small, _ = compact(net, x[:1])
    assert small.primary.capsule_types == 2
    torch.testing.assert_close(small(x), net(x), atol=1e-6, rtol=1e-5)
    original, _, target = capsule_saliency(net, x, levels=11)
    compacted, _, same_target = capsule_saliency(small, x, levels=11)
    assert torch.equal(target, same_target)
    torch.testing.assert_close(compacted, original * 4 / 2, atol=1e-6, rtol=1e-5)
