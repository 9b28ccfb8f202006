"""explain_core.vjp: torch.autograd.grad's values, without its first-call import of SymPy."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from explain_core.errors import InvalidInputError
from explain_core.vjp import vjp


def _graph() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(3, 5, requires_grad=True)
    unused = torch.randn(2, requires_grad=True)
    net = nn.Sequential(nn.Linear(5, 7), nn.SiLU(), nn.Linear(7, 4))
    hidden = net[1](net[0](x))
    return x, unused, hidden, net[2](hidden)


def test_the_products_equal_torch_autograd_grad_bit_for_bit():
    x, unused, hidden, out = _graph()
    grads = (torch.randn_like(out), torch.randn_like(hidden))
    expected = torch.autograd.grad((out, hidden), (x, unused), grads, True, allow_unused=True)
    got = vjp((out, hidden), (x, unused), grads, retain_graph=True, allow_unused=True)
    assert torch.equal(got[0], expected[0]) and got[1] is None and expected[1] is None
    # one output, a float64 signal for a float32 output (autograd casts it), graph kept above
    (expected_single,) = torch.autograd.grad(out, x, grads[0].double(), retain_graph=True)
    assert torch.equal(vjp(out, x, grads[0].double())[0], expected_single)


def test_products_inside_a_backward_pass_where_grad_mode_is_off():
    x, _, _, out = _graph()
    grad = torch.randn_like(out)
    (expected,) = torch.autograd.grad(out, x, grad, retain_graph=True)
    with torch.no_grad():
        (got,) = vjp(out, x, grad)
    assert torch.equal(got, expected)


def test_create_graph_gives_the_same_second_derivatives():
    x, _, _, out = _graph()
    grad = torch.randn_like(out)
    (first,) = vjp(out, x, grad, create_graph=True)
    (expected_first,) = torch.autograd.grad(out, x, grad, create_graph=True)
    assert torch.equal(first, expected_first)
    probe = torch.randn_like(x)
    (second,) = torch.autograd.grad((first * probe).sum(), x, retain_graph=True)
    (expected_second,) = torch.autograd.grad((expected_first * probe).sum(), x)
    assert torch.allclose(second, expected_second, rtol=1e-6, atol=1e-7)


def test_mismatched_signals_are_refused_as_torch_refuses_them():
    x, _, hidden, out = _graph()
    with pytest.raises(InvalidInputError, match=r"grad_outputs\[0\] has shape \(4,\), but output"):
        vjp(out, x, torch.ones(4))  # broadcastable, but not the output's shape
    with pytest.raises(InvalidInputError, match="2 outputs but 1 grad_outputs"):
        vjp((out, hidden), x, (torch.ones_like(out),))
    with pytest.raises(RuntimeError, match="does not require grad"):
        vjp(out.detach(), x, torch.ones_like(out))


def test_a_first_explanation_in_a_fresh_process_does_not_import_sympy():
    code = """
import sys
import torch
from torch import nn
from explain_core import explain
model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.SiLU(), nn.Flatten(), nn.Linear(3 * 6 * 6, 4)).eval()
x = torch.randn(2, 1, 8, 8)
for method in ["gradient", "lrp.epsilon_plus", "lrp.epsilon_gamma", "deeplift.rescale",
               "integrated_gradients"]:
    explain(model, x, method, target=1)
print("sympy" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
