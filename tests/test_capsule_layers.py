"""Capsule routing and layers: checks against a plain-loop Algorithm 1 and hand gradients."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from explain_capsules.layers import ConvolutionalCapsules, FullyConnectedCapsules, PrimaryCapsules
from explain_capsules.routing import capsule_length, dynamic_routing, squash
from explain_core.interfaces.routing import record_routing


def loop_routing(
    votes: torch.Tensor, iterations: int, eps: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Algorithm 1 written with explicit Python loops and scalar math (float64).

    ``eps`` goes inside the square root of the squash, as in the library's definition.
    """
    batch, n_in, n_out, dim = votes.shape
    u = votes.tolist()
    v_all, c_all = [], []
    for b in range(batch):
        logits = [[0.0] * n_out for _ in range(n_in)]
        for r in range(iterations):
            c = []
            for i in range(n_in):
                m = max(logits[i])
                e = [math.exp(x - m) for x in logits[i]]
                c.append([x / sum(e) for x in e])
            v = []
            for j in range(n_out):
                s = [sum(c[i][j] * u[b][i][j][d] for i in range(n_in)) for d in range(dim)]
                q = sum(x * x for x in s)
                v.append([x * q / (1 + q) / math.sqrt(q + eps) for x in s])
            if r < iterations - 1:
                for i in range(n_in):
                    for j in range(n_out):
                        logits[i][j] += sum(u[b][i][j][d] * v[j][d] for d in range(dim))
        v_all.append(v)
        c_all.append(c)
    return torch.tensor(v_all, dtype=torch.float64), torch.tensor(c_all, dtype=torch.float64)


def quantise(c: torch.Tensor, levels: int = 11) -> torch.Tensor:
    return torch.round(c.clamp(0, 1) * (levels - 1)) / (levels - 1)


@pytest.mark.parametrize("iterations", [1, 2, 3, 5])
def test_routing_matches_loop_algorithm(iterations):
    gen = torch.Generator().manual_seed(iterations)
    votes = torch.randn(2, 5, 3, 4, generator=gen, dtype=torch.float64)
    v, c = dynamic_routing(votes, iterations, layer_name="t")
    v_ref, c_ref = loop_routing(votes, iterations, eps=1e-8)
    assert v.shape == (2, 3, 4) and c.shape == (2, 5, 3)
    torch.testing.assert_close(v, v_ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(c, c_ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(c.sum(dim=2), torch.ones(2, 5, dtype=torch.float64))


def test_routing_matches_loop_exactly_without_eps(monkeypatch):
    import explain_capsules.routing as routing

    monkeypatch.setattr(routing, "squash", lambda s: squash(s, eps=0.0))
    votes = torch.randn(2, 4, 3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    v, c = routing.dynamic_routing(votes, 3)
    v_ref, c_ref = loop_routing(votes, 3)
    torch.testing.assert_close(v, v_ref, atol=1e-10, rtol=0)
    torch.testing.assert_close(c, c_ref, atol=1e-10, rtol=0)


def test_squash_and_length_finite_at_zero():
    s = torch.zeros(3, 4, dtype=torch.float64, requires_grad=True)
    out = squash(s)
    length = capsule_length(s)
    assert torch.isfinite(out).all() and torch.isfinite(length).all()
    (out.sum() + length.sum()).backward()
    assert torch.isfinite(s.grad).all()
    s32 = torch.zeros(2, 8, requires_grad=True)
    (squash(s32).sum() + capsule_length(s32).sum()).backward()
    assert torch.isfinite(s32.grad).all()


def test_squash_norm():
    s = torch.randn(10, 6, dtype=torch.float64) * torch.logspace(-2, 2, 10).unsqueeze(1).double()
    q = (s * s).sum(-1)
    torch.testing.assert_close(squash(s, eps=0.0).norm(dim=-1), q / (1 + q), atol=1e-12, rtol=0)
    torch.testing.assert_close(squash(s).norm(dim=-1), q / (1 + q), rtol=1e-4, atol=1e-10)
    torch.testing.assert_close(capsule_length(s, eps=0.0), s.norm(dim=-1))
    torch.testing.assert_close(
        squash(s.T, dim=0, eps=0.0).norm(dim=0), q / (1 + q), atol=1e-12, rtol=0
    )


def test_constant_couplings_gradient_matches_fixed_c():
    votes = torch.randn(2, 4, 3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    weights = torch.randn(2, 3, 5, dtype=torch.float64)
    x = votes.clone().requires_grad_(True)
    v, c = dynamic_routing(x, 3, constant_couplings=True)
    (v * weights).sum().backward()
    # Hand check: with c fixed, v_j = squash(Σ_i c_ij û_{j|i}) so dL/dû_{j|i} = c_ij · dL/ds_j.
    s = torch.einsum("bij,bijd->bjd", c.detach(), votes).requires_grad_(True)
    (squash(s) * weights).sum().backward()
    expected = c.detach().unsqueeze(-1) * s.grad.unsqueeze(1)
    torch.testing.assert_close(x.grad, expected, atol=1e-12, rtol=0)
    # Without the flag the gradient also flows through the couplings and differs.
    y = votes.clone().requires_grad_(True)
    v2, _ = dynamic_routing(y, 3)
    (v2 * weights).sum().backward()
    torch.testing.assert_close(v2, v)
    assert not torch.allclose(y.grad, x.grad)


def test_detach_intermediate_votes_changes_grad_not_output():
    votes = torch.randn(2, 4, 3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    a = votes.clone().requires_grad_(True)
    b = votes.clone().requires_grad_(True)
    va, ca = dynamic_routing(a, 3)
    vb, cb = dynamic_routing(b, 3, detach_intermediate_votes=True)
    torch.testing.assert_close(va, vb)
    torch.testing.assert_close(ca, cb)
    va.pow(2).sum().backward()
    vb.pow(2).sum().backward()
    assert not torch.allclose(a.grad, b.grad)
    # With one iteration there are no intermediate rounds: identical gradients.
    a.grad = b.grad = None
    dynamic_routing(a, 1)[0].pow(2).sum().backward()
    dynamic_routing(b, 1, detach_intermediate_votes=True)[0].pow(2).sum().backward()
    torch.testing.assert_close(a.grad, b.grad)


def test_coupling_transform_applied_to_final_couplings():
    votes = torch.randn(1, 6, 3, 4, dtype=torch.float64)
    v, c = dynamic_routing(votes, 3, coupling_transform=quantise)
    _, c_raw = dynamic_routing(votes, 3)
    torch.testing.assert_close(c, quantise(c_raw))
    torch.testing.assert_close(v, squash(torch.einsum("bij,bijd->bjd", c, votes)))
    with pytest.raises(ValueError, match="keep shape"):
        dynamic_routing(votes, 2, coupling_transform=lambda c: c[:, :1])


def test_iterations_and_vote_shape_validation():
    votes = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="routing iterations must be ≥ 1; got 0"):
        dynamic_routing(votes, 0)
    with pytest.raises(ValueError, match="got True"):
        dynamic_routing(votes, True)
    with pytest.raises(ValueError, match=r"\(batch, n_in, n_out, d_out\).*\(2, 3, 4\)"):
        dynamic_routing(votes[0], 3)
    with pytest.raises(ValueError, match="routing iterations must be ≥ 1; got 0"):
        FullyConnectedCapsules(4, 3, 2, 5, iterations=0)
    with pytest.raises(ValueError, match="routing iterations must be ≥ 1; got -1"):
        ConvolutionalCapsules(2, 4, 3, 5, kernel_size=2, iterations=-1)


def test_nan_couplings_name_the_layer():
    layer = FullyConnectedCapsules(4, 3, 2, 5, name="class_caps")
    with torch.no_grad():
        layer.weight[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"FullyConnectedCapsules\('class_caps'\).*NaN"):
        layer(torch.randn(2, 4, 2))
    with pytest.raises(ValueError, match=r"in hidden.*NaN"):
        dynamic_routing(torch.full((1, 2, 2, 3), float("inf")), 2, layer_name="hidden")


def test_fc_weight_layout_and_votes():
    layer = FullyConnectedCapsules(4, 3, 2, 5).double()
    assert layer.weight.shape == (4, 3, 5, 2)
    u = torch.randn(2, 4, 2, dtype=torch.float64)
    votes = layer.votes(u)
    assert votes.shape == (2, 4, 3, 5)
    for i, j in [(0, 0), (3, 2), (1, 2)]:
        torch.testing.assert_close(votes[1, i, j], layer.weight[i, j] @ u[1, i])
    v = layer(u)
    assert v.shape == (2, 3, 5)
    torch.testing.assert_close(v, dynamic_routing(votes, 3)[0])


def test_fc_input_validation():
    layer = FullyConnectedCapsules(4, 3, 2, 5)
    with pytest.raises(ValueError, match=r"expected input capsules \(batch, 4, 2\); got shape"):
        layer(torch.randn(2, 4, 3))
    with pytest.raises(ValueError, match=r"\(batch, 4, 2\).*\(2, 5, 2\)"):
        layer(torch.randn(2, 5, 2))
    with pytest.raises(ValueError, match="out_dim must be a positive int; got 0"):
        FullyConnectedCapsules(4, 3, 2, 0)


def test_fc_record_routing_shapes_and_eval_only_transform():
    model = nn.Sequential(
        FullyConnectedCapsules(6, 4, 3, 5, weight_std=0.5),
        FullyConnectedCapsules(4, 2, 5, 8, weight_std=0.5),
    )
    for layer in model:
        layer.coupling_transform = quantise
    u = squash(torch.randn(3, 6, 3))
    with record_routing(model) as rec:
        model.train()
        out_train = model(u)
        c_train = rec.couplings("0")
        model.eval()
        out_eval = model(u)
        events = rec.drain()
        assert rec.layers == ["0", "1"]
    assert len(events) == 4
    c0 = events[0].couplings
    assert c0.shape == (3, 6, 4)
    assert events[0].input_activations.shape == (3, 6)
    assert events[0].output_activations.shape == (3, 4)
    assert events[1].couplings.shape == (3, 4, 2)
    torch.testing.assert_close(c0.sum(dim=2), torch.ones(3, 6))
    torch.testing.assert_close(events[0].input_activations, u.norm(dim=-1))
    torch.testing.assert_close(events[1].output_activations, out_train.detach().norm(dim=-1))
    torch.testing.assert_close(c_train, c0)
    # Training: continuous couplings; eval: quantised couplings recorded and used.
    assert not torch.equal(quantise(c0), c0)
    c_eval = events[2].couplings
    torch.testing.assert_close(c_eval, quantise(c0))
    torch.testing.assert_close(c_eval * 10, torch.round(c_eval * 10))
    assert not torch.allclose(out_eval, out_train)
    model[1].coupling_transform = None
    model[0].coupling_transform = None
    torch.testing.assert_close(model(u), out_train)


def test_primary_capsules_grid_and_order():
    layer = PrimaryCapsules(3, capsule_types=4, capsule_dim=5, kernel_size=3, stride=2)
    x = torch.randn(2, 3, 9, 11)
    assert layer.output_grid(9, 11) == (4, 5, 4)
    caps = layer(x)
    assert caps.shape == (2, 4 * 5 * 4, 5)
    assert layer.grid_shape == (4, 5, 4)
    assert (caps.norm(dim=-1) < 1).all()
    conv = layer.conv(x)  # (B, types*dim, M, N)
    m, n, o = 2, 3, 1
    raw = conv[1, o * 5 : (o + 1) * 5, m, n]
    torch.testing.assert_close(caps[1, (m * 5 + n) * 4 + o], squash(raw))
    torch.testing.assert_close(caps.view(2, 4, 5, 4, 5)[1, m, n, o], squash(raw))
    with pytest.raises(ValueError, match=r"expected input \(batch, 3, H, W\); got shape"):
        layer(torch.randn(2, 4, 9, 9))
    with pytest.raises(ValueError, match="smaller than the kernel"):
        layer(torch.randn(1, 3, 2, 9))


def test_conv_capsules_shapes_and_window_routing():
    torch.manual_seed(0)
    layer = ConvolutionalCapsules(2, 3, 4, 5, kernel_size=2, stride=1, weight_std=0.5).double()
    assert layer.weight.shape == (2 * 2 * 2, 4, 5, 3)
    h, w = 3, 4
    grid = torch.randn(2, h, w, 2, 3, dtype=torch.float64)
    out = layer(grid)
    assert out.shape == (2, 2 * 3 * 4, 5)
    assert layer.grid_shape == (2, 3, 4)
    flat = grid.reshape(2, h * w * 2, 3)
    torch.testing.assert_close(layer(flat, grid_hw=(h, w)), out)
    # One window by hand: output position (1, 2) reads input rows 1..2, cols 2..3.
    win = grid[:, 1:3, 2:4].reshape(2, 2 * 2 * 2, 3)  # (kh, kw, t) order
    votes = torch.einsum("ijdk,bik->bijd", layer.weight, win)
    v_ref, c_ref = dynamic_routing(votes, 3)
    pos = 1 * 3 + 2
    torch.testing.assert_close(out.view(2, 6, 4, 5)[:, pos], v_ref)
    with record_routing(nn.Sequential(layer)) as rec:
        layer(grid)
        (event,) = rec.events
    n_in, n_out = h * w * 2, 6 * 4
    assert event.couplings.shape == (2, n_in, n_out)
    assert event.input_activations.shape == (2, n_in)
    assert event.output_activations.shape == (2, n_out)
    torch.testing.assert_close(event.input_activations, flat.norm(dim=-1))
    rows = [
        ((1 + kh) * w + (2 + kw)) * 2 + t for kh in range(2) for kw in range(2) for t in range(2)
    ]
    block = event.couplings[:, rows, pos * 4 : (pos + 1) * 4]
    torch.testing.assert_close(block, c_ref)
    # Each input capsule's row sums to the number of windows covering its position.
    cover = torch.zeros(h, w, dtype=torch.float64)
    for oh in range(2):
        for ow in range(3):
            cover[oh : oh + 2, ow : ow + 2] += 1
    expected = cover.repeat_interleave(2).reshape(1, -1).expand(2, -1)
    torch.testing.assert_close(event.couplings.sum(dim=2), expected)


def test_conv_capsules_stride_and_validation():
    layer = ConvolutionalCapsules(2, 3, 4, 5, kernel_size=3, stride=2)
    prim = PrimaryCapsules(1, 2, 3, kernel_size=3)
    caps = prim(torch.randn(1, 1, 9, 9))
    m, n, _ = prim.grid_shape
    out = layer(caps, grid_hw=(m, n))
    assert layer.grid_shape == (3, 3, 4) and out.shape == (1, 36, 5)
    with pytest.raises(ValueError, match=r"expected flat capsules"):
        layer(caps, grid_hw=(m, n + 1))
    with pytest.raises(ValueError, match=r"expected a capsule grid \(batch, H, W, 2, 3\)"):
        layer(torch.randn(1, 5, 5, 3, 3))
    with pytest.raises(ValueError, match="grid_hw=None"):
        layer(caps)
    with pytest.raises(ValueError, match="smaller than the kernel"):
        layer(torch.randn(1, 2, 5, 2, 3))
