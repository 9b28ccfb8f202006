"""The metrics and capsule analyses beside other threads using the same model and torch's RNG.

Each test parks the analysis at a known point (its thread waits on an Event inside the model's
forward or the maps function) while the test's thread uses the model, so the interleaving is
the same on every run.
"""

import copy
import threading

import pytest
import torch
from conftest import assert_same_state, state_fingerprint
from torch import nn

from explain_capsules import FullyConnectedCapsules, PrimaryCapsules, record_parse_tree_data
from explain_capsules.saliency import capsule_saliency
from explain_core.metrics import (
    cascading_randomisation,
    deletion_insertion,
    pixel_removal_curve,
    random_logit_ssim,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

X = torch.rand(2, 1, 8, 8, generator=torch.Generator().manual_seed(1))
MAPS = torch.rand(2, 8, 8, generator=torch.Generator().manual_seed(2))
TIMEOUT = 30


class Parking(nn.Module):
    """Parks the first forward call of the thread named ``"parked"`` until ``go`` is set."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.entered, self.go = threading.Event(), threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if threading.current_thread().name == "parked" and not self.entered.is_set():
            self.entered.set()
            assert self.go.wait(TIMEOUT)
        return self.net(x)


def start_parked(call, entered: threading.Event) -> tuple[threading.Thread, list]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as error:  # reported by the test
            errors.append(error)

    thread = threading.Thread(target=run, name="parked")
    thread.start()
    assert entered.wait(TIMEOUT)
    return thread, errors


def linear_maps(model, inputs, targets):
    inputs = inputs.clone().requires_grad_(True)
    model(inputs).gather(1, targets[:, None]).sum().backward()
    return inputs.grad.sum(1)


def test_cascading_randomisation_draws_from_its_own_generator():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(256, 3)
    ).eval()
    targets = torch.tensor([0, 1])
    entered, go = threading.Event(), threading.Event()
    weights = []

    def maps(m, inputs, targets):
        if m is not model:
            weights.append([p.detach().clone() for p in m.parameters()])
            if threading.current_thread().name == "parked" and not entered.is_set():
                entered.set()
                assert go.wait(TIMEOUT)
        return linear_maps(m, inputs, targets)

    alone = cascading_randomisation(model, maps, X, targets, ["3", "0"], seed=5)
    # The weights torch.manual_seed(seed) gives reset_parameters, as before.
    with torch.random.fork_rng():
        torch.manual_seed(5)
        twin = copy.deepcopy(model)
        twin[3].reset_parameters()
        twin[0].reset_parameters()
    for got, want in zip(weights[-1], twin.parameters(), strict=True):
        assert torch.equal(got, want)

    torch.manual_seed(123)
    stream = torch.rand(6)
    torch.manual_seed(123)
    before = torch.rand(3)
    steps: list = []
    thread, errors = start_parked(
        lambda: steps.extend(cascading_randomisation(model, maps, X, targets, ["3", "0"], seed=5)),
        entered,
    )
    during = torch.rand(3)  # another thread draws while the metric re-initialises layers
    go.set()
    thread.join(TIMEOUT)
    assert not errors
    # The other thread's stream goes on undisturbed, neither seeded nor rewound by the metric,
    assert torch.equal(torch.cat([before, during]), stream)
    # and its draws do not change the metric's result.
    for step, reference in zip(steps, alone, strict=True):
        assert step.layers == reference.layers
        assert (step.ssim == reference.ssim).all()


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda m: pixel_removal_curve(m, X, MAPS, 1, steps=2), id="pixel_removal"),
        pytest.param(lambda m: deletion_insertion(m, X, MAPS, 1, steps=2), id="deletion"),
        pytest.param(
            lambda m: random_logit_ssim(
                m, lambda _, x, t: x[:, 0] * (1 + t.view(-1, 1, 1)), X, torch.tensor([0, 1])
            ),
            id="random_logit",
        ),
    ],
)
def test_metrics_leave_other_threads_gradients_hooks_and_flags(call):
    torch.manual_seed(0)
    model = Parking(nn.Sequential(nn.Flatten(), nn.Linear(64, 4))).eval()
    weight = model.net[1].weight
    model(X).sum().backward()
    first = weight.grad.clone()
    thread, errors = start_parked(lambda: call(model), model.entered)
    # The metric runs its forwards; meanwhile this thread trains and monitors the model.
    assert weight.grad is not None and torch.equal(weight.grad, first)
    model(X).sum().backward()
    handle = model.net[1].register_forward_hook(lambda *args: None)
    model.train()
    model.go.set()
    thread.join(TIMEOUT)
    assert not errors
    torch.testing.assert_close(weight.grad, 2 * first)  # both backward passes count
    assert handle.id in model.net[1]._forward_hooks
    assert model.training and model.net[1].training
    handle.remove()


class TinyCapsNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(2, 8, 3)
        self.primary = PrimaryCapsules(8, 3, 4, kernel_size=3, stride=2)
        self.classes = FullyConnectedCapsules(4 * 5 * 3, 3, 4, 6, weight_std=0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classes(self.primary(torch.relu(self.conv(x)))).norm(dim=-1)


CAPSULE_INPUTS = torch.randn(2, 2, 12, 14, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda m: capsule_saliency(m, CAPSULE_INPUTS, 1), id="saliency"),
        pytest.param(lambda m: record_parse_tree_data(m, CAPSULE_INPUTS), id="record"),
    ],
)
def test_capsule_analyses_never_switch_the_models_training_flags(call):
    model = Parking(TinyCapsNet()).train()
    reference = call(Parking(TinyCapsNet()).eval())  # routes as in eval mode, as before
    model(CAPSULE_INPUTS).sum().backward()
    first = model.net.conv.weight.grad.clone()
    before = state_fingerprint(model)
    result: list = []
    thread, errors = start_parked(lambda: result.append(call(model)), model.entered)
    # A training thread still sees training mode and its gradients, and its step counts.
    assert model.training and model.net.classes.training
    assert model.net.conv.weight.grad is not None
    model(CAPSULE_INPUTS).sum().backward()
    model.go.set()
    thread.join(TIMEOUT)
    assert not errors
    torch.testing.assert_close(model.net.conv.weight.grad, 2 * first)
    assert_same_state(before, state_fingerprint(model))
    if isinstance(reference, tuple):  # saliency: (maps, output, target)
        torch.testing.assert_close(result[0][0], reference[0])
    else:
        torch.testing.assert_close(
            result[0].layer("net.classes").couplings, reference.layer("net.classes").couplings
        )


def test_concurrent_capsule_saliency_leaves_a_training_model_in_training_mode():
    model = Parking(TinyCapsNet()).train()
    first, errors = start_parked(lambda: capsule_saliency(model, CAPSULE_INPUTS, 1), model.entered)
    second_entered, second_go = threading.Event(), threading.Event()

    def park_second(module, args):
        if threading.current_thread().name == "second":
            second_entered.set()
            assert second_go.wait(TIMEOUT)

    handle = model.net.conv.register_forward_pre_hook(park_second)
    second = threading.Thread(
        target=lambda: capsule_saliency(model, CAPSULE_INPUTS, 1), name="second"
    )
    second.start()
    assert second_entered.wait(TIMEOUT)
    model.go.set()  # the first call leaves before the second
    first.join(TIMEOUT)
    second_go.set()
    second.join(TIMEOUT)
    handle.remove()
    assert not errors
    assert model.training and model.net.classes.training
