"""The model guard leaves the user's model exactly as it was: buffer values (BatchNorm's running
statistics, which its kernel updates without moving their version counter), parameter gradients
and ``requires_grad`` flags, also when a (third-party) method raises.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import assert_same_state, state_fingerprint
from torch import nn

import explain_core.plugin_manager as plugin_manager
from explain_core import Method, MethodResult, MethodSpec, ModelGuard, explain, hookimpl
from explain_core.errors import ModelStateError
from explain_core.plugin_manager import PluginManager
from explain_core.targets import select_target

# --- a third-party plugin whose methods change the model -----------------------------------


def _gradient(model: nn.Module, inputs: torch.Tensor, target: torch.Tensor | None):
    x = inputs.detach().requires_grad_(True)
    with torch.enable_grad():
        output = model(x)
        chosen = select_target(output, target)
        (gradient,) = torch.autograd.grad(output.gather(1, chosen[:, None]).sum(), x)
    return gradient, output.detach(), chosen


@dataclasses.dataclass
class TrainModePasses(Method):
    """MC-dropout style: runs the model in train mode (BatchNorm updates its statistics)."""

    def attribute(self, model, inputs, target, baselines):
        model.train()
        for _ in range(3):
            gradient, output, chosen = _gradient(model, inputs, target)
        return MethodResult(gradient, output, chosen)


@dataclasses.dataclass
class TrainModeThenRaises(Method):
    """Switches to train mode and fails: the library's diagnostic forward then runs in it."""

    def attribute(self, model, inputs, target, baselines):
        model.train()
        raise RuntimeError("late failure")


@dataclasses.dataclass
class UsesBackward(Method):
    """Calls ``.backward()``, which accumulates into the parameters' ``.grad``."""

    def attribute(self, model, inputs, target, baselines):
        x = inputs.detach().requires_grad_(True)
        with torch.enable_grad():
            output = model(x)
            chosen = select_target(output, target)
            output.gather(1, chosen[:, None]).sum().backward()
        return MethodResult(x.grad, output.detach(), chosen)


@dataclasses.dataclass
class FlipsRequiresGrad(Method):
    """Freezes every parameter and unfreezes frozen ones, then optionally raises."""

    fail: bool = False

    def attribute(self, model, inputs, target, baselines):
        for parameter in model.parameters():
            parameter.requires_grad_(not parameter.requires_grad)
        with torch.enable_grad():
            model(inputs.detach().requires_grad_(True)).sum().backward()
        if self.fail:
            raise RuntimeError("after flipping")
        gradient, output, chosen = _gradient(model, inputs, target)
        return MethodResult(gradient, output, chosen)


@dataclasses.dataclass
class EditsWeights(Method):
    """The method itself (not the model's forward) scales a weight in place."""

    def attribute(self, model, inputs, target, baselines):
        with torch.no_grad():
            model[0].weight.mul_(2.0)
        gradient, output, chosen = _gradient(model, inputs, target)
        return MethodResult(gradient, output, chosen)


class _ThirdParty:
    @hookimpl
    def explain_register_methods(self) -> list[MethodSpec]:
        return [
            MethodSpec("tp.train_mode", TrainModePasses, "test", "train mode"),
            MethodSpec("tp.train_then_raise", TrainModeThenRaises, "test", "raises"),
            MethodSpec("tp.backward", UsesBackward, "test", "backward()"),
            MethodSpec("tp.flip", FlipsRequiresGrad, "test", "requires_grad"),
            MethodSpec("tp.edits", EditsWeights, "test", "writes a weight"),
        ]


@pytest.fixture
def third_party(monkeypatch: pytest.MonkeyPatch) -> PluginManager:
    manager = PluginManager()
    manager.load(builtins=("explain_gradients",), entry_points=False)
    manager.register(_ThirdParty(), "tp")
    monkeypatch.setattr(plugin_manager, "get_plugin_manager", lambda: manager)
    return manager


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(48, 4)
    )
    with torch.no_grad():  # statistics far from what a batch gives, so an update shows
        model[1].running_mean.fill_(0.5)
        model[1].running_var.fill_(2.0)
    return model.eval()


def inputs() -> torch.Tensor:
    return torch.rand(5, 1, 4, 4, generator=torch.Generator().manual_seed(1))


# --- buffers ---------------------------------------------------------------------------------


def test_guard_restores_batchnorm_statistics_updated_in_train_mode() -> None:
    model = bn_model()
    x = inputs()
    before = state_fingerprint(model)
    with ModelGuard(model, restore=True):
        model.train()
        model(x)  # the kernel writes running_mean/var without moving their version
    assert_same_state(before, state_fingerprint(model))
    torch.testing.assert_close(model[1].running_mean, torch.full((3,), 0.5), rtol=0, atol=0)
    torch.testing.assert_close(model[1].running_var, torch.full((3,), 2.0), rtol=0, atol=0)


def test_a_method_running_the_model_in_train_mode_leaves_it_unchanged(third_party) -> None:
    model = bn_model()
    x = inputs()
    expected_output = model(x).detach()
    before = state_fingerprint(model)
    explain(model, x, "tp.train_mode", 0)
    assert_same_state(before, state_fingerprint(model))
    assert torch.equal(model(x), expected_output)


def test_the_diagnostic_forward_after_a_failure_in_train_mode_leaves_no_trace(third_party):
    model = bn_model()
    x = inputs()
    before = state_fingerprint(model)
    with pytest.raises(Exception, match="late failure"):
        explain(model, x, "tp.train_then_raise", 0)
    assert_same_state(before, state_fingerprint(model))
    assert not any(module.training for module in model.modules())


def test_nan_in_a_buffer_is_compared_as_a_value() -> None:
    model = nn.Linear(2, 2)
    model.register_buffer("table", torch.tensor([math.nan, 1.0, 2.0]))
    with ModelGuard(model, restore=True):
        pass
    assert model.table._version == 0  # unchanged NaN: nothing written back
    with ModelGuard(model, restore=True):
        model.table.data[0] = 7.0  # through .data: the version counter does not see it
        model.table.data[2] = math.nan
    assert torch.equal(model.table.isnan(), torch.tensor([True, False, False]))
    assert model.table[1:].tolist() == [1.0, 2.0]


# --- gradients and requires_grad -------------------------------------------------------------


def test_a_method_calling_backward_leaves_the_gradients_as_they_were(third_party) -> None:
    model = bn_model()
    x = inputs()
    model(x).sum().backward()  # the user's own gradients, e.g. from a training step
    model[4].bias.grad = None  # and one parameter without
    grads = {name: p.grad for name, p in model.named_parameters()}
    values = {name: g.clone() for name, g in grads.items() if g is not None}
    result = explain(model, x, "tp.backward", 1)
    for name, parameter in model.named_parameters():
        assert parameter.grad is grads[name], name  # the same object, or None
        if name in values:
            assert torch.equal(parameter.grad, values[name]), name  # nothing added into it
    expected, _, _ = _gradient(model, x, torch.full((5,), 1))
    torch.testing.assert_close(result.attribution, expected)


@pytest.mark.parametrize("fail", [False, True], ids=["returns", "raises"])
def test_requires_grad_flags_are_restored(third_party, fail: bool) -> None:
    model = bn_model()
    model[0].weight.requires_grad_(False)  # the user froze one layer
    flags = [p.requires_grad for p in model.parameters()]
    before = state_fingerprint(model)
    if fail:
        with pytest.raises(Exception, match="after flipping"):
            explain(model, inputs(), "tp.flip", 0, fail=True)
    else:
        explain(model, inputs(), "tp.flip", 0)
    assert [p.requires_grad for p in model.parameters()] == flags
    assert all(p.grad is None for p in model.parameters())
    assert_same_state(before, state_fingerprint(model))


# --- parameters changed in place by a third-party method -------------------------------------


def test_weights_edited_by_a_third_party_method_do_not_blame_the_forward(third_party) -> None:
    model = bn_model()
    with pytest.raises(ModelStateError) as raised:
        explain(model, inputs(), "tp.edits", 0)
    message = str(raised.value)
    assert message.startswith(
        "parameter(s) 0.weight changed in place during explain(..., 'tp.edits') (plugin 'tp'): "
        "by the model's forward or by the method"
    ), message
    assert "the model's forward modified" not in message
