"""The plan cache: a cached trace never skips a rule and never outlives the model's structure."""

import pytest
import torch
from conftest import assert_same_state, state_fingerprint
from modbp_nets import conv_net
from torch import nn

from explain_core import explain
from explain_core.engine import backprop as engine
from explain_core.engine import plan_cache
from explain_modbp.composites import lrp_epsilon, lrp_epsilon_plus

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def _fresh_cache():
    plan_cache.clear_plan_cache()
    yield
    plan_cache.clear_plan_cache()


def cnn():
    torch.manual_seed(0)
    return conv_net((3, 4, 4), 4, (5,), batchnorm=True)


def count_traces(monkeypatch):
    calls = []
    original = plan_cache.trace

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(plan_cache, "trace", counting)
    return calls


def test_second_call_reuses_the_trace_with_identical_results(monkeypatch):
    traces = count_traces(monkeypatch)
    model, x = cnn(), torch.rand(3, 3, 8, 8)
    before = state_fingerprint(model)
    first = explain(model, x, "lrp.epsilon_plus", 1).attribution
    second = explain(model, x, "lrp.epsilon_plus", 1).attribution
    assert len(traces) == 1
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    assert_same_state(before, state_fingerprint(model))
    explain(model, torch.rand(2, 3, 8, 8), "lrp.epsilon_plus", 1)  # other batch size: same plan
    assert len(traces) == 1
    explain(model, torch.rand(2, 3, 12, 12)[..., :8, :8].contiguous(), "lrp.zplus", 1)
    assert len(traces) == 2  # another composite shape traces again


def test_rule_options_are_taken_from_the_current_call():
    model, x = cnn(), torch.rand(2, 3, 8, 8)
    small = explain(model, x, "lrp.epsilon", 0, epsilon=1e-9).attribution
    large = explain(model, x, "lrp.epsilon", 0, epsilon=10.0).attribution
    fresh = engine.ModifiedBackprop(lrp_epsilon(10.0), cache=False).forward(model, x)
    assert not torch.allclose(small, large)
    signal = torch.zeros_like(fresh.output)
    signal[:, 0] = 1
    expected = x * fresh.backward(signal * fresh.output.detach()).input_signal
    torch.testing.assert_close(large, expected)


def test_replaced_module_or_new_hook_invalidates(monkeypatch):
    traces = count_traces(monkeypatch)
    model, x = cnn(), torch.rand(2, 3, 8, 8)
    explain(model, x, "lrp.epsilon_plus", 0)
    model[7] = nn.Linear(64, 5)
    reference = engine.ModifiedBackprop(lrp_epsilon_plus(), cache=False)
    explain(model, x, "lrp.epsilon_plus", 0)
    assert len(traces) == 2
    reference.forward(model, x)  # cache=False always traces
    assert len(traces) == 3
    handle = model[0].register_forward_hook(lambda m, a, o: None)
    explain(model, x, "lrp.epsilon_plus", 0)
    assert len(traces) == 4
    handle.remove()


class Branchy(nn.Module):
    """Data-dependent control flow: a different layer runs for negative-sum inputs."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(4, 3)
        self.c = nn.Linear(3, 2)

    def forward(self, x):
        hidden = self.a(x) if float(x.sum()) >= 0 else self.b(x)
        return self.c(torch.relu(hidden))


@pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")
def test_a_module_the_plan_did_not_see_is_never_left_without_its_rule(monkeypatch):
    traces = count_traces(monkeypatch)
    torch.manual_seed(0)
    model = Branchy().eval()
    positive = torch.rand(2, 4)
    negative = torch.tensor([[0.5, -1.0, 0.2, -0.3], [-0.4, 0.3, -0.9, 0.1]])
    explain(model, positive, "lrp.zplus", 0)
    cached = explain(model, negative, "lrp.zplus", 0).attribution
    assert len(traces) == 2  # cached plan ran b instead of a: dropped and traced again
    plan_cache.clear_plan_cache()
    fresh = explain(model, negative, "lrp.zplus", 0).attribution
    torch.testing.assert_close(cached, fresh, rtol=0, atol=0)
    gradient_like = explain(model, negative, "lrp.z", 0).attribution
    assert not torch.allclose(cached, gradient_like)  # z⁺ on b, not the gradient
