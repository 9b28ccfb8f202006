import gc
import weakref

import pytest
import torch
from torch import nn

from explain_core import RoutingLayer, record_routing


class ToyRouting(RoutingLayer):
    """Fully connected capsules with dynamic routing (test double of the interface)."""

    def __init__(self, n_in: int, n_out: int, dim: int, iterations: int = 3) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out, dim, dim) * 0.3)
        self.iterations = iterations

    def forward(self, u):  # u: (B, n_in, dim)
        votes = torch.einsum("iojd,bid->bioj", self.weight, u)
        logits = torch.zeros(votes.shape[:3])
        for _ in range(self.iterations):
            couplings = logits.softmax(dim=2)
            s = torch.einsum("bio,bioj->boj", couplings, votes)
            q = (s**2).sum(-1, keepdim=True)
            v = s * q / (1 + q) / torch.sqrt(q + 1e-8)
            logits = logits + torch.einsum("bioj,boj->bio", votes, v)
        self.emit_routing(couplings, u.norm(dim=-1), v.norm(dim=-1))
        self.last_couplings_for_test = couplings.detach().clone()
        return v


def model():
    return nn.Sequential(ToyRouting(6, 4, 3), ToyRouting(4, 2, 3)).eval()


def test_recording_hands_out_the_final_couplings_and_activations():
    net = model()
    x = torch.randn(5, 6, 3)
    with record_routing(net) as recording:
        out = net(x)
        assert recording.layers == ["0", "1"]
        couplings = recording.couplings("0")
        inputs, outputs = recording.activations("1")
        torch.testing.assert_close(couplings, net[0].last_couplings_for_test)
        assert couplings.shape == (5, 6, 4)
        torch.testing.assert_close(couplings.sum(2), torch.ones(5, 6))
        torch.testing.assert_close(outputs, out.norm(dim=-1))
        assert inputs.shape == (5, 4)


def test_transform_is_applied_and_calls_are_counted():
    net = model()
    quantise = lambda c: (c * 10).round() / 10  # noqa: E731
    with record_routing(net, transform=quantise) as recording:
        net(torch.randn(2, 6, 3))
        net(torch.randn(3, 6, 3))
        events = recording.drain()
        assert [(e.layer, e.call) for e in events] == [("0", 0), ("1", 0), ("0", 1), ("1", 1)]
        for event in events:
            assert torch.equal(event.couplings, (event.couplings * 10).round() / 10)
        assert recording.events == []
        net(torch.randn(1, 6, 3))
        assert recording.couplings("0").shape[0] == 1


def test_nothing_is_held_after_the_context_closes():
    net = model()
    with record_routing(net) as recording:
        net(torch.randn(2, 6, 3))
        ref = weakref.ref(recording.events[0].couplings)
    gc.collect()
    assert ref() is None
    assert all("_routing_recorders" not in layer.__dict__ for layer in net)
    with pytest.raises(RuntimeError, match="closed"):
        recording.couplings("0")


def test_layers_do_not_emit_outside_a_recording_and_nested_recordings_both_receive():
    net = model()
    net(torch.randn(1, 6, 3))  # no error, no recording
    with record_routing(net) as outer:
        with record_routing(net) as inner:
            net(torch.randn(1, 6, 3))
            assert len(inner.events) == 2
        net(torch.randn(1, 6, 3))
        assert len(outer.events) == 4
        assert net[0].is_recording
    assert not net[0].is_recording


def test_errors():
    with pytest.raises(ValueError, match="no RoutingLayer"), record_routing(nn.Linear(2, 2)):
        pass
    net = model()
    with record_routing(net) as recording:
        with pytest.raises(KeyError, match="not a routing layer"):
            recording.couplings("9")
        with pytest.raises(KeyError, match="recorded nothing"):
            recording.couplings("0")
        with pytest.raises(ValueError, match="input activations"):
            net[0].emit_routing(torch.ones(1, 2, 3), torch.ones(1, 3), torch.ones(1, 3))
