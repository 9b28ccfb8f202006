"""REM quantiser, parse-tree dictionary and K selection, against independent reference code."""

from __future__ import annotations

import json
import math
import threading
from collections import Counter

import numpy as np
import pytest
import torch
from torch import nn

from explain_capsules.rem import (
    ParseTreeDictionary,
    lowest_lossless_levels,
    quantise_couplings,
    quantise_to_levels,
)

# ------------------------------------------------------------------ independent reference code


def digitize_levels_k11(x: np.ndarray) -> np.ndarray:
    """The public REM code's K=11 binning: edges linspace(-0.05, 1.05, 12), values clamped."""
    bins = np.linspace(-0.05, 1.05, 12)
    return np.digitize(np.clip(x, 0.0, 1.0), bins) - 1


def naive_dictionary(couplings: torch.Tensor, predicted: torch.Tensor, levels: int):
    """Per-sample string keys joined with ',', Counter per class, math.log2 entropy."""
    n_classes = couplings.shape[2]
    counters = [Counter() for _ in range(n_classes)]
    c = couplings.double().numpy()
    half = 0.5 / (levels - 1)
    bins = np.linspace(-half, 1 + half, levels + 1)  # K bins centred on k / (K - 1)
    for b, j in enumerate(predicted.tolist()):
        idx = np.digitize(np.clip(c[b, :, j], 0.0, 1.0), bins) - 1
        counters[j][",".join(str(int(i)) for i in idx)] += 1
    entropies = []
    for counter in counters:
        total = sum(counter.values())
        entropies.append(
            -sum((n / total) * math.log2(n / total) for n in counter.values()) if total else 0.0
        )
    return counters, entropies


def as_string_counter(d: ParseTreeDictionary, cls: int) -> Counter:
    return Counter({",".join(map(str, k)): n for k, n in d.counts_dict(cls).items()})


def random_couplings(batch: int, n_lower: int, n_classes: int, peak: float = 4.0) -> torch.Tensor:
    return torch.softmax(peak * torch.randn(batch, n_lower, n_classes), dim=2)


# ------------------------------------------------------------------ quantiser


def test_quantiser_k11_hand_checked_with_clamping():
    x = torch.tensor([-0.2, 0.0, 0.04, 0.06, 0.14, 0.16, 0.5, 0.94, 0.96, 1.0, 1.3])
    expected = torch.tensor([0.0, 0.0, 0.0, 0.1, 0.1, 0.2, 0.5, 0.9, 1.0, 1.0, 1.0])
    q = quantise_couplings(x, 11)
    assert q.dtype == x.dtype
    assert torch.equal(q, expected)
    idx = quantise_to_levels(x, 11)
    assert idx.dtype == torch.uint8
    assert idx.tolist() == [0, 0, 0, 1, 1, 2, 5, 9, 10, 10, 10]


def test_quantiser_k11_centres_exact():
    centres = quantise_couplings(torch.linspace(0, 1, 11, dtype=torch.float64), 11)
    assert centres.tolist() == [k / 10 for k in range(11)]
    assert sorted(set(quantise_couplings(torch.rand(5000), 11).tolist())) == [
        float(torch.tensor(k / 10, dtype=torch.float32)) for k in range(11)
    ]


def test_quantiser_k11_matches_digitize():
    x = torch.rand(20000, dtype=torch.float64) * 1.6 - 0.3  # includes values outside [0, 1]
    ours = quantise_to_levels(x, 11).numpy().astype(np.int64)
    assert np.array_equal(ours, digitize_levels_k11(x.numpy()))
    # float32 input as couplings usually come
    x32 = torch.softmax(3 * torch.randn(500, 10), dim=1)
    ours32 = quantise_to_levels(x32, 11).numpy().astype(np.int64)
    assert np.array_equal(ours32, digitize_levels_k11(x32.double().numpy()))


def rem_levels(x: np.ndarray, levels: int) -> np.ndarray:
    """REM's public code, for any K: float64 linspace edges, np.digitize, values clamped."""
    half = 0.5 / (levels - 1)
    return np.digitize(np.clip(x, 0.0, 1.0), np.linspace(-half, 1 + half, levels + 1)) - 1


def test_quantiser_follows_rems_float64_edges_exactly():
    # On a nominal half-way point the computed edge decides: 0.25 is below linspace's
    # 0.25000000000000006 (level 2 of 11, the coupling of a capsule with zero votes under 4
    # parents), and 0.5 below the K=6 edge 0.5000000000000001 (level 2; rounding gave 3).
    assert quantise_to_levels(torch.tensor([0.25]), 11).tolist() == [2]
    assert quantise_couplings(torch.tensor([0.25]), 11).tolist() == [pytest.approx(0.2)]
    assert quantise_to_levels(torch.tensor([0.5]), 6).tolist() == [2]
    assert quantise_to_levels(torch.tensor([0.05, 0.75], dtype=torch.float64), 11).tolist() == [
        int(rem_levels(np.array([0.05]), 11)[0]),
        int(rem_levels(np.array([0.75]), 11)[0]),
    ]
    for levels in (2, 3, 4, 5, 6, 7, 11, 16, 21):
        half = 0.5 / (levels - 1)
        edges = np.linspace(-half, 1 + half, levels + 1)
        # every edge, its float32 neighbours and the nominal half-way points, in both dtypes
        nominal = (np.arange(levels) + 0.5) / (levels - 1)
        points = np.concatenate(
            [edges, nominal, np.nextafter(edges, 2), np.nextafter(edges, -2), [0.0, 1.0]]
        )
        for dtype in (torch.float64, torch.float32):
            x = torch.tensor(points, dtype=dtype)
            reference = rem_levels(x.double().numpy(), levels)
            ours = quantise_to_levels(x, levels).numpy().astype(np.int64)
            assert np.array_equal(ours, reference), (levels, dtype)


def test_quantiser_matches_rem_on_every_float32_coupling_near_the_edges():
    # all float32 values within 64 ulps of each K=11 and K=5 edge
    for levels in (5, 11):
        half = 0.5 / (levels - 1)
        edges = torch.tensor(np.linspace(-half, 1 + half, levels + 1), dtype=torch.float32)
        steps = torch.arange(-64, 65, dtype=torch.int32)
        bits = edges.view(torch.int32)[:, None] + steps[None, :]
        x = bits.view(torch.float32).flatten()
        x = x[torch.isfinite(x)]
        reference = rem_levels(x.double().numpy(), levels)
        assert np.array_equal(quantise_to_levels(x, levels).numpy().astype(np.int64), reference)


def test_quantiser_k2():
    x = torch.tensor([-1.0, 0.0, 0.49, 0.51, 1.0, 2.0])
    assert quantise_couplings(x, 2).tolist() == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert quantise_to_levels(x, 2).tolist() == [0, 0, 0, 1, 1, 1]


def test_quantiser_keeps_shape_and_large_k_dtype():
    x = torch.rand(3, 4, 5)
    assert quantise_couplings(x, 7).shape == x.shape
    assert quantise_to_levels(x, 300).dtype == torch.int32
    assert int(quantise_to_levels(torch.tensor([1.0]), 300)) == 299


@pytest.mark.parametrize("levels", [1, 0, -3, 2.0, True])
def test_quantiser_rejects_bad_levels(levels):
    with pytest.raises(ValueError, match="K must be ≥ 2"):
        quantise_couplings(torch.rand(3), levels)


def test_quantiser_rejects_nan():
    with pytest.raises(ValueError, match="NaN"):
        quantise_couplings(torch.tensor([0.1, float("nan")]), 11)
    with pytest.raises(ValueError, match="NaN"):
        ParseTreeDictionary().update(torch.full((1, 2, 2), float("nan")), torch.tensor([0]), 11)


# ------------------------------------------------------------------ dictionary


@pytest.mark.parametrize("levels", [2, 5, 11])
def test_dictionary_matches_naive_on_random_couplings(levels):
    couplings = random_couplings(300, 6, 4, peak=6.0)
    predicted = torch.randint(0, 4, (300,))
    d = ParseTreeDictionary()
    d.update(couplings, predicted, levels)
    counters, entropies = naive_dictionary(couplings, predicted, levels)
    for j in range(4):
        assert as_string_counter(d, j) == counters[j]
    assert d.keys_per_class().tolist() == [len(c) for c in counters]
    assert d.samples_per_class().tolist() == [sum(c.values()) for c in counters]
    assert torch.allclose(d.entropy(), torch.tensor(entropies, dtype=torch.float64), atol=1e-12)
    assert d.mean_entropy() == pytest.approx(sum(entropies) / 4, abs=1e-12)
    # keys repeat at all at this size (otherwise the test would not exercise counting)
    assert any(n > 1 for c in counters for n in c.values())


def test_dictionary_known_entropies_by_hand():
    # 4 lower capsules, 3 classes. Class 0: all samples share one key -> H=0, 1 key.
    # Class 1: two keys, two samples each -> H=1, 2 keys. Class 2: never predicted.
    a = [[1.0, 0.0, 0.0]] * 4  # couplings column 0 = (1, 1, 1, 1)
    b = [[0.0, 0.98, 0.02]] * 4  # column 1 = 0.98 -> level 10
    c = [[0.3, 0.33, 0.37]] * 4  # column 1 = 0.33 -> level 3
    couplings = torch.tensor([a, a, a, b, c, b, c], dtype=torch.float32)
    predicted = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    d = ParseTreeDictionary(n_classes=3)
    d.update(couplings, predicted, 11)
    assert d.counts_dict(0) == {(10, 10, 10, 10): 3}
    assert d.counts_dict(1) == {(10, 10, 10, 10): 2, (3, 3, 3, 3): 2}
    assert d.counts_dict(2) == {}
    assert d.keys_per_class().tolist() == [1, 2, 0]
    assert d.samples_per_class().tolist() == [3, 4, 0]
    assert d.entropy().tolist() == [0.0, 1.0, 0.0]  # empty class defined as 0, never NaN
    assert d.mean_entropy() == 0.5  # mean over the two classes that have samples
    keys, counts = d.counts(1)
    assert keys.tolist() == [[3, 3, 3, 3], [10, 10, 10, 10]] and counts.tolist() == [2, 2]


def test_dictionary_four_equiprobable_keys_two_bits():
    cols = torch.tensor([[0.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    couplings = torch.stack([cols, 1 - cols], dim=2).repeat(5, 1, 1)  # (20, 2, 2)
    d = ParseTreeDictionary()
    d.update(couplings, torch.zeros(20, dtype=torch.long), 2)
    assert d.entropy().tolist() == [2.0, 0.0]
    assert d.keys_per_class().tolist() == [4, 0]


def test_batch_split_and_merge_invariance():
    couplings = random_couplings(257, 8, 5, peak=8.0)
    predicted = torch.randint(0, 5, (257,))
    whole = ParseTreeDictionary()
    whole.update(couplings, predicted, 3)
    batched = ParseTreeDictionary()
    for start in range(0, 257, 40):
        batched.update(couplings[start : start + 40], predicted[start : start + 40], 3)
    left, right = ParseTreeDictionary(), ParseTreeDictionary()
    left.update(couplings[:100], predicted[:100], 3)
    right.update(couplings[100:], predicted[100:], 3)
    merged = left.merge(right)
    for other in (batched, merged):
        assert other == whole
        assert torch.equal(other.entropy(), whole.entropy())
        assert torch.equal(other.keys_per_class(), whole.keys_per_class())
        for j in range(5):
            k1, c1 = whole.counts(j)
            k2, c2 = other.counts(j)
            assert torch.equal(k1, k2) and torch.equal(c1, c2)
    # merging an empty dictionary changes nothing
    assert ParseTreeDictionary().merge(whole) == whole
    assert whole.merge(ParseTreeDictionary()).to_state() == merged.to_state()


def test_state_round_trip_through_json():
    d = ParseTreeDictionary()
    d.update(random_couplings(50, 5, 3), torch.randint(0, 3, (50,)), 11)
    state = json.loads(json.dumps(d.to_state()))
    back = ParseTreeDictionary.from_state(state)
    assert back == d
    assert torch.equal(back.entropy(), d.entropy())
    back.update(random_couplings(10, 5, 3), torch.randint(0, 3, (10,)), 11)  # still usable
    assert int(back.samples_per_class().sum()) == 60
    with pytest.raises(ValueError):
        ParseTreeDictionary.from_state({**state, "version": 99})


def test_many_classes_and_large_k():
    # > 256 classes and K > 256 take the wide-key path; still identical to the naive counts.
    couplings = random_couplings(200, 3, 300, peak=1.0)
    predicted = torch.randint(0, 300, (200,))
    for levels in (11, 400):
        d = ParseTreeDictionary()
        d.update(couplings, predicted, levels)
        counters, entropies = naive_dictionary(couplings, predicted, levels)
        for j in set(predicted.tolist()):
            assert as_string_counter(d, j) == counters[j]
        assert torch.allclose(d.entropy(), torch.tensor(entropies, dtype=torch.float64))


def test_dictionary_errors():
    d = ParseTreeDictionary()
    with pytest.raises(ValueError):
        d.mean_entropy()
    d.update(random_couplings(4, 3, 2), torch.tensor([0, 1, 0, 1]), 11)
    with pytest.raises(ValueError, match="does not match"):
        d.update(random_couplings(4, 3, 2), torch.tensor([0, 1, 0, 1]), 5)
    with pytest.raises(ValueError, match="does not match"):
        d.update(random_couplings(4, 4, 2), torch.tensor([0, 1, 0, 1]), 11)
    with pytest.raises(ValueError, match="predicted"):
        d.update(random_couplings(4, 3, 2), torch.tensor([0, 2, 0, 1]), 11)
    with pytest.raises(ValueError):
        d.update(random_couplings(4, 3, 2), torch.tensor([0, 1]), 11)
    with pytest.raises(ValueError, match="class indices"):  # scores would be truncated silently
        d.update(random_couplings(4, 3, 2), torch.tensor([0.7, 1.2, 0.0, 1.0]), 11)
    with pytest.raises(IndexError):
        d.counts(2)


# ------------------------------------------------------------------ choice of K


def test_lowest_lossless_levels():
    accuracy = {2: 0.80, 3: 0.95, 4: 0.989, 5: 0.991, 6: 0.985, 7: 0.992}
    calls = []

    def evaluate(k: int) -> float:
        calls.append(k)
        return accuracy[k]

    assert lowest_lossless_levels(evaluate, range(2, 8), reference=0.99) == 5
    assert calls == [2, 3, 4, 5]  # stops at the first passing K
    assert lowest_lossless_levels(evaluate, [7, 4, 2], reference=0.99, tolerance=0.002) == 4
    assert lowest_lossless_levels(evaluate, range(2, 8), reference=0.80) == 2
    with pytest.raises(ValueError, match="best K=7"):
        lowest_lossless_levels(evaluate, range(2, 8), reference=0.999)
    with pytest.raises(ValueError, match="K must be ≥ 2"):
        lowest_lossless_levels(evaluate, [1, 2], reference=0.5)
    with pytest.raises(ValueError):
        lowest_lossless_levels(evaluate, [], reference=0.5)
    with pytest.raises(ValueError):
        lowest_lossless_levels(evaluate, [2], reference=0.5, tolerance=-1.0)


def test_a_refused_first_update_leaves_the_dictionary_unconfigured():
    d = ParseTreeDictionary()
    with pytest.raises(ValueError, match=r"predicted classes must lie in \[0, 10\)"):
        d.update(random_couplings(4, 16, 10), torch.tensor([0, 1, 2, 99]), levels=11)
    with pytest.raises(ValueError, match="NaN"):
        d.update(torch.full((2, 16, 10), float("nan")), torch.tensor([0, 1]), levels=11)
    with pytest.raises(ValueError, match="K must be"):
        d.update(random_couplings(2, 16, 10), torch.tensor([0, 1]), levels=1)
    assert (d.n_classes, d.n_lower, d.levels) == (None, None, None)
    # Another shape and K are still welcome, and count as in a fresh dictionary.
    couplings, predicted = random_couplings(6, 32, 4), torch.tensor([0, 1, 2, 3, 0, 1])
    d.update(couplings, predicted, levels=5)
    fresh = ParseTreeDictionary()
    fresh.update(couplings, predicted, levels=5)
    assert d == fresh and (d.n_classes, d.n_lower, d.levels) == (4, 32, 5)
    # Once configured, a refused update changes nothing either.
    with pytest.raises(ValueError, match="predicted classes"):
        d.update(random_couplings(2, 32, 4), torch.tensor([0, 7]), levels=5)
    assert d == fresh


# ------------------------------------------------------------------ quantised routing


def one_layer(iterations: int = 1):
    from explain_capsules.layers import FullyConnectedCapsules

    layer = FullyConnectedCapsules(2, 3, 2, 2, iterations=iterations)
    with torch.no_grad():  # W_ij = (i + 1) · I for every parent j
        layer.weight.copy_(torch.stack([torch.eye(2).expand(3, 2, 2) * (i + 1) for i in range(2)]))
    return layer.eval()


def test_quantised_routing_routes_with_k_levels_inside_the_block():
    from explain_capsules import squash
    from explain_capsules.rem import quantised_routing

    layer = one_layer()
    u = torch.tensor([[[0.3, 0.4], [0.6, -0.8]]])
    votes = u[:, 0] * 1 + u[:, 1] * 2  # Σ_i û_{j|i}, the same for every parent j
    # One iteration: couplings 1/3; K = 3 rounds them to 0.5 (0.667 + 0.5 floors to 1).
    plain = squash(votes / 3).expand(3, 2)
    quantised = squash(votes * 0.5).expand(3, 2)
    with torch.no_grad():
        torch.testing.assert_close(layer(u)[0], plain)
        with quantised_routing(layer, levels=3) as model:
            assert model is layer
            torch.testing.assert_close(layer(u)[0], quantised)
            layer.train()  # training always routes with continuous couplings
            torch.testing.assert_close(layer(u)[0], plain)
            layer.eval()
        torch.testing.assert_close(layer(u)[0], plain)
    assert layer.coupling_transform is None


def test_quantised_routing_puts_back_the_previous_transforms_also_on_errors():
    from explain_capsules import MultiLayerCapsNet
    from explain_capsules.rem import quantised_routing
    from explain_core.errors import InvalidInputError

    model = MultiLayerCapsNet(in_features=64, hidden_layers=1).eval()

    def own(c):
        return c

    model.routing[0].coupling_transform = own
    before = dict(model.routing[1].__dict__)
    seen_by_another_thread = []
    with pytest.raises(RuntimeError, match="inside"), quantised_routing(model, levels=11):
        assert all(
            layer.active_coupling_transform.keywords == {"levels": 11} for layer in model.routing
        )
        # The layers themselves are untouched: another thread routes as before.
        assert model.routing[0].coupling_transform is own
        thread = threading.Thread(
            target=lambda: seen_by_another_thread.append(model.routing[0].active_coupling_transform)
        )
        thread.start()
        thread.join()
        raise RuntimeError("inside")
    assert seen_by_another_thread == [own]
    assert model.routing[0].active_coupling_transform is own
    assert model.routing[0].coupling_transform is own
    assert model.routing[1].__dict__ == before
    no_routing = "no routing layer with a coupling_transform"
    with pytest.raises(InvalidInputError, match=no_routing), quantised_routing(nn.Linear(2, 2), 11):
        pass
    with pytest.raises(ValueError, match="K must be"), quantised_routing(model, levels=1):
        pass
    assert model.routing[0].coupling_transform is own


def test_quantised_routing_records_the_plus_q_model():
    from functools import partial

    from explain_capsules import MultiLayerCapsNet, record_parse_tree_data
    from explain_capsules.rem import quantised_routing

    torch.manual_seed(0)
    model = MultiLayerCapsNet(in_features=64, hidden_layers=2).eval()
    x = torch.rand(16, 64)
    with quantised_routing(model, levels=3):
        inside = record_parse_tree_data(model, x, levels=3)
    # Independently: the +Q model set up by hand, as REM's reproduction does.
    for layer in model.routing:
        layer.coupling_transform = partial(quantise_couplings, levels=3)
    by_hand = record_parse_tree_data(model, x, levels=3)
    for layer in model.routing:
        layer.coupling_transform = None
    plain = record_parse_tree_data(model, x, levels=3)
    torch.testing.assert_close(inside.outputs, by_hand.outputs)
    for a, b in zip(inside.layers, by_hand.layers, strict=True):
        assert torch.equal(a.couplings, b.couplings)
    assert torch.equal(inside.layers[0].couplings, plain.layers[0].couplings)  # same inputs
    assert not torch.equal(inside.layers[-1].couplings, plain.layers[-1].couplings)
