"""Several threads explaining one model object at once (a threaded web server, Gradio).

Reference: the same calls made one after another. Every registered method runs in 4 threads at
once, each thread in another order, while a fifth thread runs plain forwards and a sixth trains
the model's gradients with ordinary autograd; all maps must equal the sequential ones and no hook,
attribute or buffer may remain. float64 models, so that only a wrong map (not the order of a
reduction) can fail the comparison.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import assert_same_state, state_fingerprint
from torch import nn
from torch.nn.modules import module as module_globals

from explain_capsules.layers import FullyConnectedCapsules, PrimaryCapsules
from explain_coda import CoDANet, LayerSpec
from explain_core import explain, get_registry
from explain_core.scoped import is_own_hook
from explain_modbp import composites
from explain_modbp.pattern import fit_patterns
from explain_modbp.rules import Epsilon

THREADS = 4


class SmallCNN(nn.Module):
    """Conv + merged BatchNorm, in-place ReLU reused, max pooling, a residual sum, a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2, 5, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(5)
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(5, 5, 3, padding=1)
        self.fc = nn.Linear(5 * 4 * 4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pool(self.relu(self.bn1(self.conv1(x))))
        h = self.relu(self.conv2(h)) + h
        return self.fc(torch.flatten(h, 1))


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    model = SmallCNN()
    with torch.no_grad():
        model.bn1.running_mean.normal_(0, 0.2)
        model.bn1.running_var.uniform_(0.5, 2.0)
    return model.double().eval()


class TinyCapsNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 8, 3)
        self.primary = PrimaryCapsules(8, 3, 4, kernel_size=3, stride=2)
        self.classes = FullyConnectedCapsules(4 * 5 * 3, 3, 4, 6, weight_std=0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classes(self.primary(torch.relu(self.conv(x)))).norm(dim=-1)


def method_options(model: nn.Module, x: torch.Tensor) -> dict[str, dict[str, Any]]:
    """Options the methods that need some get (the others run with their defaults)."""
    patterns = fit_patterns(model, torch.randn(64, *x.shape[1:], dtype=x.dtype))
    custom = composites.lrp_epsilon_plus().with_rules((nn.Linear, Epsilon(0.01)))
    return {
        "lrp.zb": {"low": -4.0, "high": 4.0},
        "lrp.epsilon_gamma_box": {"low": -4.0, "high": 4.0},
        "lrp.custom": {"composite": custom},
        "patternnet": {"patterns": patterns},
        "pattern_attribution": {"patterns": patterns},
        "integrated_gradients": {"steps": 8},
        "smoothgrad": {"samples": 4},
    }


def run_concurrently(
    model: nn.Module,
    x: torch.Tensor,
    calls: dict[str, Callable[[], torch.Tensor]],
) -> None:
    """Every call in 4 threads (rotated orders) beside a forward thread and a training thread."""
    reference = {name: call() for name, call in calls.items()}
    expected_logits = model(x).detach()
    errors: list[str] = []
    results: dict[str, list[torch.Tensor]] = {name: [] for name in calls}
    done = threading.Event()
    # Ordinary autograd on the same parameters: a twin tells what the summed gradients must be.
    twin = copy.deepcopy(model)
    train_steps = 0

    def explain_all(offset: int) -> None:
        names = list(calls)
        for name in names[offset:] + names[:offset]:
            try:
                results[name].append(calls[name]())
            except Exception as error:  # reported below with the method's name
                errors.append(f"{name}: {type(error).__name__}: {error}")

    def forwards() -> None:
        while not done.is_set():
            with torch.no_grad():
                logits = model(x)
            if not torch.equal(logits, expected_logits):
                errors.append("a plain forward in another thread gave other logits")

    def training() -> None:
        nonlocal train_steps
        while not done.is_set():
            model(x).square().sum().backward()
            train_steps += 1

    workers = [threading.Thread(target=explain_all, args=(i * 3,)) for i in range(THREADS)]
    helpers = [threading.Thread(target=forwards), threading.Thread(target=training)]
    for thread in helpers + workers:
        thread.start()
    for thread in workers:
        thread.join()
    done.set()
    for thread in helpers:
        thread.join()

    assert not errors, errors[:5]
    for name, maps in results.items():
        assert len(maps) == THREADS
        for attribution in maps:
            torch.testing.assert_close(attribution, reference[name], rtol=1e-9, atol=1e-12)
    # The training thread's gradients are exactly what its own steps sum to.
    assert train_steps > 0
    twin(x).square().sum().backward()
    for (name, parameter), (_, single) in zip(
        model.named_parameters(), twin.named_parameters(), strict=True
    ):
        torch.testing.assert_close(parameter.grad, single.grad * train_steps, msg=name)
        parameter.grad = None


def assert_nothing_left(model: nn.Module, before: dict) -> None:
    assert_same_state(before, state_fingerprint(model))
    own = [h for h in module_globals._global_forward_hooks.values() if is_own_hook(h)]
    own += [h for h in module_globals._global_forward_pre_hooks.values() if is_own_hook(h)]
    assert not own, "the process-wide listener hooks were not removed"


def test_every_method_in_four_threads_equals_sequential_calls():
    model = small_cnn()
    x = torch.randn(3, 2, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    options = method_options(model, x)
    skip = {"coda.contributions", "capsules.saliency"}  # other architectures: tests below
    names = [name for name in get_registry() if name not in skip]
    assert len(names) >= 25
    calls = {
        name: (lambda name=name: explain(model, x, name, 1, **options.get(name, {})).attribution)
        for name in names
    }
    before = state_fingerprint(model)
    run_concurrently(model, x, calls)
    assert_nothing_left(model, before)


def test_coda_contributions_in_four_threads_equal_sequential_calls():
    torch.manual_seed(0)
    specs = [LayerSpec(6, 4, 3, 1), LayerSpec(8, 5, 3, 2), LayerSpec(4, 6, 1, 1)]
    model = CoDANet(specs, (2, 7, 9)).double().eval()
    x = torch.rand(3, 2, 7, 9, dtype=torch.float64)
    calls = {
        "coda.contributions": lambda: explain(model, x, "coda.contributions", 2).attribution,
        "gradient": lambda: explain(model, x, "gradient", 2).attribution,
    }
    before = state_fingerprint(model)
    run_concurrently(model, x, calls)
    assert_nothing_left(model, before)


def test_capsule_saliency_in_four_threads_equals_sequential_calls():
    torch.manual_seed(0)
    model = TinyCapsNet().double().eval()
    x = torch.randn(3, 2, 12, 14, dtype=torch.float64)
    model(x)  # the layers record their grid shape on a first forward pass, as a plain one does
    calls = {
        "capsules.saliency": lambda: explain(model, x, "capsules.saliency", 1).attribution,
        "quantised": lambda: explain(model, x, "capsules.saliency", 1, levels=5).attribution,
        "gradient": lambda: explain(model, x, "gradient", 1).attribution,
    }
    before = state_fingerprint(model)
    run_concurrently(model, x, calls)
    assert_nothing_left(model, before)


@pytest.mark.parametrize("method", ["lrp.epsilon_plus", "guided_bp", "deeplift.rescale"])
def test_a_listener_sees_its_own_thread_only(method):
    # A plain gradient in one thread while LRP runs in another (the engine's rules must not
    # reach it): both equal their sequential results, checked many times over.
    model = small_cnn()
    x = torch.randn(2, 2, 8, 8, dtype=torch.float64)
    gradient = explain(model, x, "gradient", 0).attribution
    relevance = explain(model, x, method, 0).attribution
    wrong: list[str] = []

    def repeat(name: str, expected: torch.Tensor) -> None:
        for _ in range(15):
            if not torch.allclose(explain(model, x, name, 0).attribution, expected, rtol=1e-9):
                wrong.append(name)

    threads = [
        threading.Thread(target=repeat, args=("gradient", gradient)),
        threading.Thread(target=repeat, args=(method, relevance)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not wrong
