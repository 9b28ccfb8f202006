"""Parse-tree defaults and arguments: the uniform-coupling thresholds (quantised couplings, one
parent, convolutional capsules), the order of the recorded layers, and what `parse_tree` accepts
as a class, a sample, a threshold and labels."""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest
import torch
from torch import nn

from explain_capsules import (
    ConvolutionalCapsules,
    FullyConnectedCapsules,
    MultiLayerCapsNet,
    PrimaryCapsules,
    capsule_length,
    record_parse_tree_data,
    squash,
)
from explain_core.errors import InvalidInputError
from explain_core.parse_trees import (
    ParseTreeData,
    build_parse_tree,
    class_parse_tree,
    collect_parse_tree_data,
    default_thresholds,
    parse_tree,
)

# --- thresholds of quantised couplings ---------------------------------------------------------


def test_quantised_default_is_the_level_of_the_uniform_coupling():
    # K = 11: 1/16 = 0.0625 -> 0.1 and 1/10 -> 0.1; 1/2 is a level. K = 3: 1/4 = 0.25 lies on
    # the edge between 0 and 0.5 and rounds up to 0.5. K = 2: 1/2 rounds up to 1, capped at 0.
    assert default_thresholds([4, 16, 10, 2], levels=11) == [0.1, 0.1, 0.5]
    assert default_thresholds([3, 4], levels=3) == [0.5]
    assert default_thresholds([3, 2], levels=2) == [0.0]
    assert default_thresholds([4, 16, 10]) == [0.0625, 0.1]  # unquantised: 1/|parents|
    with pytest.raises(InvalidInputError, match="levels must be an int ≥ 2"):
        build_parse_tree([torch.full((2, 3), 1 / 3)], [torch.ones(2), torch.ones(3)], [0], levels=1)


def test_uniform_quantised_couplings_give_no_edges():
    # 16 parents, perfectly uniform routing: quantised to 0.1, which is the quantised uniform.
    c1 = torch.full((1, 4, 16), 1 / 16)
    c2 = torch.zeros(1, 16, 2)
    c2[..., 0], c2[..., 1] = 0.9, 0.1
    acts = [torch.full((1, 4), 0.5), torch.full((1, 16), 0.5), torch.tensor([[0.9, 0.1]])]
    tree = parse_tree(ParseTreeData.from_tensors([c1, c2], acts, levels=11), sample=0)
    assert tree.graph["thresholds"] == "0.1,0.5" and tree.graph["levels"] == 11
    assert not [u for u, _ in tree.edges if u.startswith("L1:")]
    # An explicit threshold is used as given, on the quantised couplings (0.1 > 0.05).
    given = parse_tree(
        ParseTreeData.from_tensors([c1, c2], acts, levels=11), sample=0, threshold=0.05
    )
    assert given.graph["thresholds"] == "0.05,0.05"
    assert {u for u, _ in given.edges if u.startswith("L1:")} == {f"L1:C{i}" for i in range(4)}


def test_quantised_edges_need_more_than_the_rounded_uniform():
    # 10 parents, K = 11: threshold 0.1. 0.149 rounds to 0.1 (not above), 0.151 to 0.2 (above).
    c = torch.full((1, 3, 10), 0.05)
    c[0, 0, 0], c[0, 1, 0], c[0, 2, 0] = 0.149, 0.151, 0.25
    acts = [torch.full((1, 3), 0.5), torch.tensor([[0.9] + [0.1] * 9])]
    tree = parse_tree(ParseTreeData.from_tensors([c], acts, levels=11), sample=0)
    assert set(tree.edges) == {("L1:C1", "L2:C0"), ("L1:C2", "L2:C0")}
    assert tree.edges["L1:C1", "L2:C0"]["weight"] == pytest.approx(0.2)
    # 0.25 lies below REM's computed edge 0.25000000000000006: level 0.2, as REM's code bins it
    assert tree.edges["L1:C2", "L2:C0"]["weight"] == pytest.approx(0.2)


# --- one parent ----------------------------------------------------------------------------------


@pytest.mark.parametrize("levels", [None, 11])
def test_a_single_parent_takes_every_coupling_above_zero(levels):
    # Layer 2 has one capsule: every coupling into it is exactly 1.
    c1 = torch.ones(3, 1)
    c2 = torch.tensor([[0.8, 0.2]])
    acts = [torch.tensor([0.9, 0.5, 0.1]), torch.tensor([0.7]), torch.tensor([0.6, 0.3])]
    tree = build_parse_tree([c1, c2], acts, [0], levels=levels)
    assert tree.graph["thresholds"] == "0,0.5"
    assert set(tree.edges) == {
        ("L1:C0", "L2:C0"),
        ("L1:C1", "L2:C0"),
        ("L1:C2", "L2:C0"),
        ("L2:C0", "L3:C0"),
    }
    # A class layer of one capsule: its couplings are edges too.
    single_class = build_parse_tree([torch.ones(2, 1)], [torch.ones(2), torch.ones(1)], [0])
    assert set(single_class.edges) == {("L1:C0", "L2:C0"), ("L1:C1", "L2:C0")}


def test_models_with_one_parent_capsule_have_trees():
    torch.manual_seed(0)
    model = MultiLayerCapsNet(in_features=64, hidden_layers=1, hidden_caps=1).eval()
    recording = record_parse_tree_data(model, torch.rand(4, 64))
    tree = parse_tree(recording, sample=0)
    assert tree.graph["thresholds"].split(",")[0] == "0"
    # Every primary capsule couples with 1 to the hidden capsule; it is above 1/10 to a class.
    predicted = int(recording.predicted[0])
    into_class = float(recording.layers[1].couplings[0, 0, predicted])
    expected = {f"L1:C{i}" for i in range(16)} if into_class > 0.1 else set()
    assert {u for u, v in tree.edges if v == "L2:C0"} == expected


# --- convolutional capsules ----------------------------------------------------------------------


class ConvCapsNet(nn.Module):
    """8×8 → primary 6×6×4 (144 capsules) → conv capsules 4×4×2 (32) → 3 classes."""

    def __init__(self, iterations: int = 1) -> None:
        super().__init__()
        self.primary = PrimaryCapsules(1, 4, 4, 3)
        self.conv_caps = ConvolutionalCapsules(4, 4, 2, 4, 3, iterations=iterations)
        self.classes = FullyConnectedCapsules(32, 3, 4, 4, weight_std=1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = self.conv_caps(self.primary(x), grid_hw=self.primary.grid_shape[:2])
        return capsule_length(self.classes(u))


def test_convolutional_capsules_take_the_uniform_coupling_of_a_window():
    model = ConvCapsNet().eval()
    x = torch.rand(2, 1, 8, 8)
    recording = record_parse_tree_data(model, x)
    assert [layer.parents for layer in recording.layers] == [2, 3]
    collected = collect_parse_tree_data(model, x)
    assert collected.parents == (2, 3) == ParseTreeData.from_recording(recording).parents
    # One routing iteration: every window's couplings are 1/2 exactly, no preference at all.
    couplings = recording.layers[0].couplings
    assert couplings[couplings > 0].unique().tolist() == [0.5]
    tree = parse_tree(recording, sample=0)
    assert tree.graph["thresholds"].split(",")[0] == "0.5"
    assert not [u for u, _ in tree.edges if u.startswith("L1:")]


def test_parents_give_the_threshold_of_hand_made_windows():
    # Two windows of two capsule types each: parents 0, 1 (window A) and 2, 3 (window B).
    # Capsule 0 lies in window A only, capsule 1 in both.
    c = torch.tensor([[0.7, 0.3, 0.0, 0.0], [0.5, 0.5, 0.4, 0.6]])
    acts = [torch.ones(2), torch.ones(4)]
    tree = build_parse_tree([c], acts, [0, 1, 2, 3], parents=[2])
    assert tree.graph["thresholds"] == "0.5"
    assert set(tree.edges) == {("L1:C0", "L2:C0"), ("L1:C1", "L2:C3")}
    # With 1/4 (four parents) every coupling but the structural zeros would be an edge.
    assert len(build_parse_tree([c], acts, [0, 1, 2, 3]).edges) == 6
    with pytest.raises(InvalidInputError, match=r"parents of routing layer 1 must be an int in"):
        ParseTreeData.from_tensors([c], acts, parents=[5])


# --- the order of the recorded layers ------------------------------------------------------------


class DeclaredOutOfOrder(nn.Module):
    """Routing layers declared second, first, classes; called first, second, classes."""

    def __init__(self) -> None:
        super().__init__()
        self.primary = nn.Linear(64, 16 * 8)
        self.second = FullyConnectedCapsules(12, 16, 8, 8, weight_std=0.35)
        self.first = FullyConnectedCapsules(16, 12, 8, 8, weight_std=0.35)
        self.classes = FullyConnectedCapsules(16, 10, 8, 8, weight_std=0.35)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = squash(self.primary(x).view(-1, 16, 8))
        return capsule_length(self.classes(self.second(self.first(u))))


def test_recording_follows_the_call_order():
    torch.manual_seed(0)
    model = DeclaredOutOfOrder().eval()
    assert [n for n, m in model.named_modules() if isinstance(m, FullyConnectedCapsules)] == [
        "second",
        "first",
        "classes",
    ]
    x = torch.rand(8, 64)
    recording = record_parse_tree_data(model, x, batch_size=3)
    assert recording.names == ["first", "second", "classes"]
    with torch.no_grad():
        primary = squash(model.primary(x).view(-1, 16, 8)).norm(dim=-1)
    torch.testing.assert_close(recording.layers[0].input_activations, primary)
    data = ParseTreeData.from_recording(recording)
    assert data.sizes == [16, 12, 16, 10]
    collected = collect_parse_tree_data(model, x, batch_size=3)  # the same float sums
    a = parse_tree(data, sample=0, threshold=0.0)
    b = parse_tree(collected, sample=0, threshold=0.0)
    assert nx.utils.graphs_equal(a, b)


# --- arguments -----------------------------------------------------------------------------------


def small_data() -> ParseTreeData:
    c1 = torch.tensor(
        [[[0.7, 0.3], [0.2, 0.8]], [[0.6, 0.4], [0.1, 0.9]], [[0.5, 0.5], [0.9, 0.1]]]
    )
    acts = [torch.full((3, 2), 0.5), torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.7, 0.3]])]
    return ParseTreeData.from_tensors([c1], acts)  # predicted 0, 1, 0


@pytest.mark.parametrize("cls", [0.0, 2.7, "0", True, torch.tensor(0.0), torch.tensor([0])])
def test_a_class_must_be_an_integer(cls):
    with pytest.raises(InvalidInputError, match=r"^cls must be an integer \(an int, a NumPy"):
        parse_tree(small_data(), cls=cls)


@pytest.mark.parametrize("sample", [1.0, "1", True, np.float32(1), torch.tensor([1])])
def test_a_sample_must_be_an_integer(sample):
    with pytest.raises(InvalidInputError, match=r"^sample index must be an integer"):
        parse_tree(small_data(), sample=sample)


def test_numpy_and_tensor_integers_and_numbers_are_accepted():
    data = small_data()
    expected_class = parse_tree(data, cls=1)
    for cls in (np.int64(1), np.int32(1), torch.tensor(1), torch.tensor(1, dtype=torch.uint8)):
        tree = parse_tree(data, cls=cls)
        assert tree.graph["class_index"] == 1 and nx.utils.graphs_equal(tree, expected_class)
    expected_sample = parse_tree(data, sample=2, threshold=0.55)
    assert set(expected_sample.edges) == {("L1:C1", "L2:C0")}  # hand: only 0.9 > 0.55 into 0
    for sample in (np.int64(2), torch.tensor(2), -1):
        for threshold in (np.float32(0.55), np.float64(0.55), torch.tensor(0.55)):
            tree = parse_tree(data, sample=sample, threshold=threshold)
            assert tree.graph["sample"] == 2 and set(tree.edges) == set(expected_sample.edges)
    with pytest.raises(InvalidInputError, match=r"threshold must be a number.*got True"):
        parse_tree(data, sample=0, threshold=True)


def test_labels_must_be_integer_classes():
    data = small_data()
    by_label = class_parse_tree(data, 1, labels=np.array([1, 1, 0]))
    assert by_label.graph["n_samples"] == 2
    with pytest.raises(InvalidInputError, match=r"integer class indices.*dtype torch\.float32"):
        class_parse_tree(data, 1, labels=torch.tensor([1.0, 1.0, 0.0]))
    with pytest.raises(InvalidInputError, match=r"integer class indices.*dtype torch\.bool"):
        class_parse_tree(data, 1, labels=torch.tensor([True, True, False]))
    with pytest.raises(InvalidInputError, match=r"got list holding '1'\. Map class names"):
        class_parse_tree(data, 1, labels=["1", "1", "0"])
    with pytest.raises(InvalidInputError, match=r"got ndarray holding .*Map class names"):
        class_parse_tree(data, 1, labels=np.array(["one", "one", "zero"]))
    with pytest.raises(InvalidInputError, match=r"one per sample \(3\); got 2 labels"):
        class_parse_tree(data, 1, labels=[1, 0])
