"""Faithfulness metrics: CSC, random-logit SSIM, cascading randomisation, the matrix chain."""

import copy

import numpy as np
import pytest
import torch
from modbp_nets import conv_net
from torch import nn

from explain_core import InvalidInputError, explain
from explain_core.metrics import (
    CSCResult,
    UnsupportedMethodError,
    cascading_randomisation,
    cosine_similarity_convergence,
    layer_propagator,
    map_ssim,
    matrix_chain_convergence,
    random_logit_ssim,
    randomisation_layers,
    relevance_cosines,
    signal_ssim,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def chain(weights, relu=True):
    layers = []
    for w in weights:
        linear = nn.Linear(w.shape[1], w.shape[0], bias=False).double()
        linear.weight.data.copy_(w)
        layers += [linear, nn.ReLU()] if relu else [linear]
    return nn.Sequential(*(layers[:-1] if relu else layers)).eval()


def small_cnn():
    torch.manual_seed(0)
    return conv_net((1, 4, 6), 4, (12, 5))


# ------------------------------------------------------------------------------------ CSC
def test_zplus_on_nonnegative_chain_converges_to_one():
    torch.manual_seed(0)
    model = chain([torch.rand(16, 16, dtype=torch.float64) for _ in range(8)])
    x = torch.rand(4, 16, dtype=torch.float64)
    result = cosine_similarity_convergence(model, x, "lrp.zplus")
    assert isinstance(result, CSCResult)
    assert result.layers[0] == result.start == "14"
    median = result.median
    assert median["0"] > 0.999  # seven non-negative matrices below the random vector
    assert median["0"] >= median["12"]  # more matrices, more aligned


@pytest.mark.parametrize("method", ["gradient", "lrp.z", "input_x_gradient"])
def test_gradient_and_lrp0_on_orthogonal_layers_stay_low(method):
    torch.manual_seed(0)
    weights = [torch.linalg.qr(torch.randn(32, 32, dtype=torch.float64))[0] for _ in range(6)]
    model = chain(weights, relu=False)
    x = torch.randn(8, 32, dtype=torch.float64)
    result = cosine_similarity_convergence(model, x, method, n_vectors=5)
    median = result.median
    if method == "lrp.z":
        # Relevance v set at the output is divided by z once (v/z spikes where |z| is small,
        # which aligns the vectors somewhat), then flows as the gradient: no growth with depth.
        assert max(median.values()) < 0.8 and abs(median["0"] - median["5"]) < 0.1
    else:
        for name, value in median.items():
            assert value < 0.3, (name, value)  # |cos| of random 32-d vectors: median ≈ 0.12
    if method == "gradient":  # orthogonal maps preserve angles: the cosines of the v's
        signed = cosine_similarity_convergence(model, x, method, absolute=False)
        values = signed.cosines["0"]
        assert abs(np.mean(values)) < 0.1 and 0.1 < np.std(values) < 0.3


def test_one_layer_zplus_by_hand():
    w = torch.tensor([[1.0, -2.0, 3.0], [0.5, 1.0, -1.0]], dtype=torch.float64)
    model = chain([w])
    x = torch.tensor([[1.0, 2.0, 0.5]], dtype=torch.float64)
    wp = w.clamp(min=0)
    zp = x @ wp.T  # (1, 2)

    def by_hand(v):  # R_i = Σ_j x_i w⁺_ji / z⁺_j · v_j
        return x * ((v / zp) @ wp)

    propagator = layer_propagator(model, x, "lrp.zplus")
    v = torch.tensor([[0.3, -1.2]], dtype=torch.float64)
    torch.testing.assert_close(propagator.propagate("0", v)["0"], by_hand(v))
    result = cosine_similarity_convergence(
        model, x, "lrp.zplus", n_vectors=3, seed=7, absolute=False
    )
    generator = torch.Generator().manual_seed(7)
    vs = [torch.randn((1, 2), generator=generator, dtype=torch.float64) for _ in range(3)]
    expected = []
    for i, j in [(0, 1), (0, 2), (1, 2)]:
        a, b = by_hand(vs[i]).flatten(), by_hand(vs[j]).flatten()
        expected.append(float(a @ b / (a.norm() * b.norm())))
    np.testing.assert_allclose(result.cosines["0"], expected, rtol=1e-10)


def test_cosines_per_spatial_location():
    a = torch.zeros(1, 2, 2, 2)
    b = torch.zeros(1, 2, 2, 2)
    a[0, :, 0, 0], b[0, :, 0, 0] = torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0])
    a[0, :, 1, 1], b[0, :, 1, 1] = torch.tensor([1.0, 2.0]), torch.tensor([-2.0, -4.0])
    cos = relevance_cosines(a, b)
    assert cos.shape == (1, 4)
    assert cos[0, 0] == pytest.approx(2**-0.5) and cos[0, 3] == pytest.approx(-1.0)
    assert torch.isnan(cos[0, 1]) and torch.isnan(cos[0, 2])  # zero vectors: undefined
    one_channel = relevance_cosines(torch.ones(2, 1, 3, 3), -torch.ones(2, 1, 3, 3))
    assert one_channel.shape == (2, 1) and torch.allclose(one_channel, -torch.ones(2, 1).double())


@pytest.mark.parametrize(
    "method",
    [
        *("gradient", "input_x_gradient", "lrp.epsilon", "lrp.zplus", "lrp.w2", "excitation_bp"),
        *("guided_bp", "rectgrad", "deeplift.rescale", "deeplift.reveal_cancel"),
    ],
)
def test_propagating_the_explained_output_gives_the_attribution(method):
    model = small_cnn()
    x = torch.rand(3, 1, 8, 8)
    target = torch.tensor([0, 3, 4])
    propagator = layer_propagator(model, x, method)
    last = propagator.layers[-1]
    output = model(x).detach()
    start = torch.zeros_like(output).scatter_(1, target[:, None], 1.0)
    if method.startswith("lrp") or method == "excitation_bp":
        start = start * output  # relevance f_k(x) at the output
    if method == "excitation_bp":
        start = start / output  # relevance 1
    got = propagator.propagate(last, start)[propagator.layers[0]]
    expected = explain(model, x, method, target).attribution
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


def test_csc_from_an_intermediate_layer_and_all_layers():
    model = small_cnn()
    x = torch.rand(4, 1, 8, 8)
    result = cosine_similarity_convergence(model, x, "lrp.alpha2beta1", start="3")
    assert result.layers == ("3", "0")
    assert all(-1 <= v <= 1 for v in result.median.values())
    assert set(result.undefined) == {"3", "0"}


def test_csc_errors():
    model = small_cnn()
    x = torch.rand(2, 1, 8, 8)
    with pytest.raises(UnsupportedMethodError, match="layer_propagator"):
        cosine_similarity_convergence(model, x, "integrated_gradients")
    with pytest.raises(UnsupportedMethodError, match="output layer"):
        cosine_similarity_convergence(model, x, "deeplift.reveal_cancel", start="3")
    with pytest.raises(ValueError, match="no layer"):
        cosine_similarity_convergence(model, x, "lrp.z", start="nope")
    with pytest.raises(ValueError, match="n_vectors"):
        cosine_similarity_convergence(model, x, "lrp.z", n_vectors=1)


# ----------------------------------------------------------------------------- random logit
def test_random_logit_ssim_is_one_for_a_method_ignoring_the_target():
    model = small_cnn()
    x = torch.rand(5, 1, 8, 8)
    targets = torch.tensor([0, 1, 2, 3, 4])

    def ignores_target(model, inputs, targets):
        return inputs[:, 0] * 2

    result = random_logit_ssim(model, ignores_target, x, targets)
    np.testing.assert_allclose(result.ssim, 1.0)
    assert (result.random_targets != targets).all()
    sensitive = random_logit_ssim(model, "gradient", x, targets)
    assert sensitive.ssim.shape == (5,) and sensitive.mean_ssim < 0.9


# ---------------------------------------------------------------------- randomisation
def test_cascading_randomisation_on_a_known_case():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 3), nn.ReLU(), nn.Linear(3, 2)).eval()
    x = torch.rand(4, 1, 8, 8)
    targets = torch.tensor([0, 1, 0, 1])
    assert randomisation_layers(model) == ["3", "1"]

    def fixed(model, inputs, targets):  # ignores the parameters: never changes
        return inputs[:, 0]

    steps = cascading_randomisation(model, fixed, x, targets, ["3", "1"])
    for step in steps:
        np.testing.assert_allclose(step.ssim, 1.0)
    steps = cascading_randomisation(model, "gradient", x, targets, randomisation_layers(model))
    assert [s.layers for s in steps] == [("3",), ("3", "1")]
    assert steps[-1].mean_ssim < 0.5  # every weight replaced: the gradient map changes


def test_map_ssim_absolute_sign():
    maps = torch.randn(3, 8, 8)
    assert map_ssim(maps, -maps).max() < 0.9  # a flipped map is not similar by SSIM
    np.testing.assert_allclose(map_ssim(maps, -maps, absolute_sign=True), 1.0)


# ------------------------------------------------------------------ 1-d signals (N, C, L)
def signal_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv1d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 16, 5)
    ).eval()


def skimage_signal_ssim(first: torch.Tensor, second: torch.Tensor) -> np.ndarray:
    """Per sample: the mean over channels of skimage's 1-d SSIM along the length (window 7)."""
    from skimage.metrics import structural_similarity

    def unit(t: torch.Tensor) -> np.ndarray:
        a = t.detach().double().numpy()
        return a / np.abs(a).max()

    return np.array(
        [
            np.mean(
                [
                    structural_similarity(u, v, data_range=2.0, win_size=7)
                    for u, v in zip(unit(a), unit(b), strict=True)  # channel by channel
                ]
            )
            for a, b in zip(first, second, strict=True)
        ]
    )


def test_signal_ssim_compares_each_channel_along_its_length():
    first, second = torch.randn(3, 4, 20), torch.randn(3, 4, 20)
    np.testing.assert_allclose(signal_ssim(first, second), skimage_signal_ssim(first, second))
    np.testing.assert_allclose(signal_ssim(first, first), 1.0)
    np.testing.assert_allclose(signal_ssim(first, -first, absolute_sign=True), 1.0)
    one_channel = signal_ssim(first[:, 0], second[:, 0])  # (N, L): one channel
    np.testing.assert_allclose(one_channel, skimage_signal_ssim(first[:, :1], second[:, :1]))


def test_random_logit_ssim_on_signals_uses_1d_ssim():
    model, x, targets = signal_net(), torch.rand(4, 3, 16), torch.tensor([0, 1, 2, 3])
    result = random_logit_ssim(model, "gradient", x, targets)
    original = explain(model, x, "gradient", targets).attribution
    other = explain(model, x, "gradient", result.random_targets).attribution
    np.testing.assert_allclose(result.ssim, skimage_signal_ssim(original, other))


def test_cascading_randomisation_on_signals_uses_1d_ssim():
    model, x, targets = signal_net(), torch.rand(4, 3, 16), torch.tensor([0, 1, 2, 3])
    (step,) = cascading_randomisation(model, "input_x_gradient", x, targets, ["3"], seed=2)
    randomised = copy.deepcopy(model)
    torch.manual_seed(2)
    randomised[3].reset_parameters()
    original = explain(model, x, "input_x_gradient", targets).attribution
    current = explain(randomised, x, "input_x_gradient", targets).attribution
    np.testing.assert_allclose(step.ssim, skimage_signal_ssim(original, current))


def test_signal_metrics_refuse_short_signals_and_flat_inputs():
    with pytest.raises(InvalidInputError, match=r"at least 3 samples.*got length 2"):
        signal_ssim(torch.rand(2, 3, 2), torch.rand(2, 3, 2))
    with pytest.raises(InvalidInputError, match=r"must have shape \(N, C, L\)"):
        signal_ssim(torch.rand(2, 3, 4, 4), torch.rand(2, 3, 4, 4))
    flat = nn.Sequential(nn.Linear(6, 3)).eval()
    with pytest.raises(InvalidInputError, match=r"not flat \(N, features\) vectors"):
        random_logit_ssim(flat, "gradient", torch.rand(2, 6), 0)
    with pytest.raises(InvalidInputError, match=r"\(N, C, L\) signal inputs return one \(C, L\)"):
        random_logit_ssim(
            signal_net(), lambda m, i, t: torch.rand(4, 2, 3, 3), torch.rand(4, 3, 16), 0
        )


# ----------------------------------------------------------------------------- matrix chain
def test_matrix_chain_nonnegative_converges_monotonically_to_one():
    widths = (48,) * 9
    curve = matrix_chain_convergence("nonnegative", widths, repeats=2)
    assert curve.lengths.tolist() == list(range(1, 9))
    assert curve.median_cosine[-1] > 0.999
    assert np.all(np.diff(curve.median_cosine) > -1e-3)  # monotone up to rounding
    assert curve.median_cosine[0] < 0.8
    vanilla = matrix_chain_convergence("vanilla", widths, repeats=2)
    assert np.all(np.abs(vanilla.median_cosine) < 0.2)
    strong_negative = matrix_chain_convergence("alpha_beta", widths, beta=20.0, repeats=2)
    assert strong_negative.median_cosine[-1] < curve.median_cosine[-1]
    with pytest.raises(ValueError, match="kind"):
        matrix_chain_convergence("nope", widths)  # type: ignore[arg-type]
