"""SmoothGrad against the gradient (where they must agree) and Captum's NoiseTunnel."""

import pytest
import torch
from conftest import assert_same_state, state_fingerprint
from torch import nn

from explain_core import explain
from explain_core.errors import InvalidInputError


def gradient(model: nn.Module, x: torch.Tensor, target: int) -> torch.Tensor:
    x = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(model(x)[:, target].sum(), x)
    return grad


def tanh_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double().eval()


def test_on_a_linear_model_and_without_noise_it_is_the_gradient():
    torch.manual_seed(0)
    linear = nn.Linear(6, 3).double().eval()  # constant gradient: noise cannot change it
    x = torch.randn(4, 6, dtype=torch.float64)
    got = explain(linear, x, "smoothgrad", target=2, samples=7).attribution
    torch.testing.assert_close(got, gradient(linear, x, 2))
    model = tanh_net()
    quiet = explain(model, x, "smoothgrad", target=1, noise_level=0.0, samples=3).attribution
    torch.testing.assert_close(quiet, gradient(model, x, 1))
    times = explain(model, x, "smoothgrad", target=1, noise_level=0.0, times_input=True)
    torch.testing.assert_close(times.attribution, x * gradient(model, x, 1))


def test_matches_captum_noise_tunnel_in_expectation():
    from captum.attr import NoiseTunnel, Saliency

    model = tanh_net()
    x = torch.rand(5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x[:, 0], x[:, 1] = 0.0, 1.0  # every sample spans [0, 1]: one σ for all, as Captum takes
    ours = explain(model, x, "smoothgrad", target=0, samples=4000, noise_level=0.5).attribution
    torch.manual_seed(2)
    theirs = NoiseTunnel(Saliency(model)).attribute(
        x, nt_type="smoothgrad", nt_samples=4000, stdevs=0.5, target=0, abs=False
    )
    # Two Monte-Carlo means of the same expectation: their standard error here is < 1%.
    assert (ours - theirs).abs().max() <= 0.03 * theirs.abs().max()
    assert (ours - gradient(model, x, 0)).abs().max() > 0.1 * theirs.abs().max()  # noise matters


def test_seeded_reproducible_and_leaves_model_and_global_rng_alone():
    model = tanh_net()
    x = torch.randn(3, 6, dtype=torch.float64)
    before = state_fingerprint(model)
    rng = torch.get_rng_state()
    a = explain(model, x, "smoothgrad", target=0, samples=8).attribution
    b = explain(model, x, "smoothgrad", target=0, samples=8, internal_batch_size=5).attribution
    c = explain(model, x, "smoothgrad", target=0, samples=8, seed=1).attribution
    assert torch.equal(torch.get_rng_state(), rng)
    torch.testing.assert_close(a, b)  # the same noise however it is batched
    assert not torch.allclose(a, c)
    assert_same_state(before, state_fingerprint(model))


@pytest.mark.parametrize(
    "options", [{"samples": 0}, {"noise_level": -0.1}, {"noise_level": float("nan")}]
)
def test_bad_options_are_refused(options):
    with pytest.raises(InvalidInputError):
        explain(tanh_net(), torch.randn(2, 6, dtype=torch.float64), "smoothgrad", **options)


def test_a_samples_map_does_not_depend_on_the_rest_of_the_batch():
    # the noise was drawn for the whole batch: a sample's map changed with its companions and
    # its position (by up to 80% of the map's largest value)
    model = tanh_net()
    x = torch.randn(4, 6, dtype=torch.float64)
    together = explain(model, x, "smoothgrad", target=1, samples=6).attribution
    for index in range(4):
        alone = explain(model, x[index : index + 1], "smoothgrad", target=1, samples=6)
        torch.testing.assert_close(alone.attribution[0], together[index])
    reversed_batch = explain(model, x.flip(0), "smoothgrad", target=1, samples=6).attribution
    torch.testing.assert_close(reversed_batch.flip(0), together)
