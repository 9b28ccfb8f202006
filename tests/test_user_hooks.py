"""Hooks the user registered on the model (Grad-CAM utilities, monitoring) and attribution.

Observing hooks neither break nor change a map; the result does not depend on whether the model
was explained before the hooks were added (the plan cache); a hook that computes something the
engine has no rule for is named in the error.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from explain_core import UnsupportedModelError, explain

METHODS = [
    *("lrp.epsilon_plus", "lrp.zplus", "lrp.z", "guided_bp", "gradient"),
    *("deeplift.rescale", "deeplift.reveal_cancel", "deeplift.ablation"),
]


def cnn() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(4, 6, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(6 * 4 * 4, 5),
    )
    with torch.no_grad():
        model[1].running_var.uniform_(0.5, 2.0)
    return model.double().eval()


X = torch.randn(3, 1, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))


def add_observers(model: nn.Module, seen: list[str]) -> None:
    """What Grad-CAM utilities and monitoring register: full backward and reading forward hooks."""
    model[4].register_full_backward_hook(lambda m, gi, go: seen.append("backward conv"))
    # on a convolution and the BatchNorm merged into it: their outputs come wrapped (aliases)
    model[0].register_full_backward_hook(lambda m, gi, go: seen.append("backward merged conv"))
    model[1].register_full_backward_pre_hook(lambda m, go: seen.append("backward pre norm"))
    model[2].register_full_backward_hook(lambda m, gi, go: seen.append("backward relu"))
    model[5].register_forward_hook(lambda m, i, o: seen.append(f"norm {float(o.detach().norm())}"))
    model[0].register_forward_pre_hook(lambda m, i: seen.append("pre"))
    model.register_full_backward_hook(lambda m, gi, go: seen.append("backward root"))
    # on the output layer, whose output RevealCancel splits into parts (it raised torch's error)
    model[7].register_full_backward_hook(lambda m, gi, go: seen.append("backward head"))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("explained_before", [False, True])
def test_observing_hooks_neither_break_nor_change_a_map(method, explained_before):
    plain = explain(cnn(), X, method, 1).attribution
    model = cnn()
    if explained_before:  # a cached plan must not hide the hooks
        explain(model, X, method, 1)
    seen: list[str] = []
    add_observers(model, seen)
    with_hooks = explain(model, X, method, 1).attribution
    torch.testing.assert_close(with_hooks, plain, rtol=1e-12, atol=1e-14)
    assert "pre" in seen
    if method not in ("deeplift.reveal_cancel", "deeplift.ablation"):  # signal through parts
        assert "backward conv" in seen and "backward root" in seen and "backward pre norm" in seen
    again = explain(model, X, method, 1).attribution  # and from the cache
    torch.testing.assert_close(again, plain, rtol=1e-12, atol=1e-14)


def test_the_hooks_see_the_methods_backward_signal():
    # A Grad-CAM hook on the last convolution receives what the method propagates there.
    model = cnn()
    grads: list[torch.Tensor] = []
    model[4].register_full_backward_hook(lambda m, gi, go: grads.append(go[0]))
    explain(model, X, "guided_bp", 1)
    (signal,) = grads
    assert signal.shape == (3, 6, 4, 4)
    assert bool((signal >= 0).all())  # Guided BP rectifies every ReLU's signal


def test_a_hook_that_computes_what_has_no_rule_is_named():
    model = cnn()

    def squares(module, inputs, output):
        return output * output  # a product of two input-dependent tensors

    model[4].register_forward_hook(squares)
    with pytest.raises(UnsupportedModelError) as raised:
        explain(model, X, "lrp.epsilon_plus", 1)
    message = str(raised.value)
    assert "forward hook" in message and "squares" in message
    assert "module '4' (Conv2d)" in message


def test_a_pre_hook_that_changes_a_layers_input_is_named():
    # the refusal guessed "a forward hook that changes its output", which the engine handles
    model = cnn()
    model[4].register_forward_pre_hook(lambda m, args: (args[0] * 0.5,))
    with pytest.raises(UnsupportedModelError, match=r"'4' \(Conv2d\).*forward pre-hook of its own"):
        explain(model, X, "lrp.epsilon_plus", 1)
    assert len(model[4]._forward_pre_hooks) == 1  # the user's hook stays
