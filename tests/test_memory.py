"""Memory: internal_batch_size bounds every pass; rules free their tensors as autograd does; running
out of memory is one clear error."""

import weakref

import pytest
import torch
from conftest import assert_same_state, state_fingerprint
from torch import nn

from explain_core import Composite, OutOfMemoryError, explain
from explain_core.engine import ModifiedBackprop
from explain_modbp import Epsilon, composites


class RowCounter(nn.Module):
    """A small non-linear model that records the rows of every forward pass."""

    def __init__(self) -> None:
        super().__init__()
        # a ReLU: dynamic-linear, as the explanation_mode composite needs
        self.body = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
        self.rows: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.rows.append(x.shape[0])
        return self.body(x)


class Hungry(nn.Module):
    """Fails to allocate (as a real allocator does) on passes of more than ``limit`` rows."""

    def __init__(self, limit: int, device_error: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 3)
        self.limit = limit
        self.device_error = device_error

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.limit:
            if self.device_error:  # what CUDA's caching allocator raises
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
            torch.empty(2**50)  # 8 PiB: the CPU allocator refuses it at once
        return self.linear(x)


@pytest.mark.parametrize(
    ("method", "options"),
    [
        ("integrated_gradients", {"steps": 6}),
        ("smoothgrad", {"samples": 5}),
        ("integrated_gradients", {"steps": 6, "composite": "explanation_mode"}),
    ],
)
@pytest.mark.parametrize("rows", [4, 7])
def test_internal_batch_size_bounds_every_pass_also_for_larger_batches(method, options, rows):
    model = RowCounter().double().eval()
    x = torch.randn(10, 5, dtype=torch.float64)
    whole = explain(model, x, method, target=1, internal_batch_size=1000, **options)
    model.rows.clear()
    bounded = explain(model, x, method, target=1, internal_batch_size=rows, **options)
    assert max(model.rows) <= rows  # the batch of 10 is split, not run whole per pass
    torch.testing.assert_close(bounded.attribution, whole.attribution, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(bounded.output, whole.output, rtol=1e-12, atol=1e-12)
    if whole.delta is not None:
        torch.testing.assert_close(bounded.delta, whole.delta, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device_error", [False, True])
@pytest.mark.parametrize(
    ("method", "option"),
    [("gradient", None), ("lrp.epsilon", None), ("integrated_gradients", "internal_batch_size")],
)
def test_running_out_of_memory_names_the_batch_size_and_the_option(device_error, method, option):
    model = Hungry(limit=8, device_error=device_error).eval()
    before = state_fingerprint(model)
    with pytest.raises(OutOfMemoryError) as caught:
        explain(model, torch.randn(32, 5), method)
    message = str(caught.value)
    assert "out of memory explaining a batch of 32 samples" in message
    assert "explain fewer samples per call (e.g. 16 at a time)" in message
    assert "enforce fail" not in message
    if option is None:
        assert "internal_batch_size" not in message
    else:
        assert f"lower {option} (now 64)" in message
    assert isinstance(caught.value, RuntimeError)  # code catching torch's error still does
    assert caught.value.__cause__ is not None
    assert_same_state(before, state_fingerprint(model))


def test_lowering_the_named_option_is_enough():
    model = Hungry(limit=8, device_error=False).eval()
    x = torch.randn(32, 5)
    with pytest.raises(OutOfMemoryError, match="internal_batch_size"):
        explain(model, x, "integrated_gradients", steps=4)
    result = explain(model, x, "integrated_gradients", steps=4, internal_batch_size=8)
    expected = x * model.linear.weight[result.target]  # a linear model: IG is x ⊙ w_target
    torch.testing.assert_close(result.attribution, expected)


def test_one_sample_that_does_not_fit_says_so():
    with pytest.raises(OutOfMemoryError, match="one sample does not fit"):
        explain(Hungry(limit=0, device_error=True).eval(), torch.randn(1, 5), "gradient")


class _Watched(Epsilon):
    """LRP-ε that notes, when each layer's backward runs, which layers' calls are still alive."""

    def __init__(self) -> None:
        super().__init__(0.01)
        self.calls: list[weakref.ref] = []
        self.alive: list[list[bool]] = []
        self.last: list[bool] = []  # call.last_backward as each backward saw it

    def forward(self, call):
        self.calls.append(weakref.ref(call))
        return super().forward(call)

    def backward(self, call, grad_output):
        self.alive.append([ref() is not None for ref in self.calls])
        self.last.append(call.last_backward)
        return super().backward(call, grad_output)


def _three_layers() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3))
    x = torch.randn(2, 6, dtype=torch.float64)
    return model.double().eval(), x, torch.eye(3, dtype=torch.float64)[[0, 2]]


def test_a_rules_tensors_are_freed_once_its_backward_has_run():
    model, x, start = _three_layers()
    rule = _Watched()
    forward = ModifiedBackprop(Composite([(nn.Linear, rule)])).forward(model, x)
    forward.backward(start)
    # backward runs from the top: each layer sees the calls above it freed, as autograd frees
    # what it saved, and the spent pass holds no records
    assert rule.alive == [[True, True, True], [True, True, False], [True, False, False]]
    assert forward.records == {}
    assert all(ref() is None for ref in rule.calls)


def test_a_kept_graph_keeps_the_rules_tensors_for_another_pass():
    model, x, start = _three_layers()
    rule = _Watched()
    forward = ModifiedBackprop(Composite([(nn.Linear, rule)])).forward(model, x)
    first = forward.backward(start, retain_graph=True).input_signal
    assert rule.alive == [[True] * 3] * 3
    assert rule.last == [False] * 3  # the ratios must survive: nothing is written into them
    second = forward.backward(start).input_signal
    assert rule.last == [False] * 3 + [True] * 3  # the last pass may write into them
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    expected = explain(model, x, "lrp.epsilon", target=torch.tensor([0, 2]), epsilon=0.01)
    torch.testing.assert_close(x * first, expected.attribution)


class _Noted(nn.Module):
    """A module that keeps weak references to the tensors it returns."""

    def __init__(self, module: nn.Module, notes: dict[str, weakref.ref], name: str) -> None:
        super().__init__()
        self.module, self.notes, self.name = module, notes, name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.module(x)
        self.notes[self.name] = weakref.ref(y)
        return y


def _noted_cnn(notes: dict[str, weakref.ref]) -> nn.Module:
    """conv → ReLU → conv → ReLU → flatten → linear, noting each output (ReLUs out of place)."""
    torch.manual_seed(0)
    layers = [
        ("conv1", nn.Conv2d(2, 4, 3, padding=1)),
        ("relu1", nn.ReLU()),
        ("conv2", nn.Conv2d(4, 4, 3, padding=1)),
        ("relu2", nn.ReLU()),
    ]
    noted = [_Noted(module, notes, name) for name, module in layers]
    return nn.Sequential(*noted, nn.Flatten(), nn.Linear(4 * 5 * 5, 3)).double().eval()


@pytest.mark.parametrize(
    "composite",
    [
        composites.lrp_epsilon_plus(),
        composites.lrp_epsilon(0.01),
        composites.lrp_alpha_beta(2.0, 1.0),
        composites.lrp_gamma(0.25),
    ],
    ids=lambda composite: composite.name,
)
def test_until_backward_a_pass_keeps_no_layer_output_and_no_input_its_rule_does_not_read(
    composite,
):
    """Nor what the gradient would not keep: on a layer only a ReLU reads, a rule computes its
    factors in backward from the ReLU's output, which the gradient keeps too (the rule holds it
    by a reference of its own, not this tensor object: the model's is freed)."""
    notes: dict[str, weakref.ref] = {}
    model = _noted_cnn(notes)
    x = torch.randn(2, 2, 5, 5, dtype=torch.float64)
    start = torch.eye(3, dtype=torch.float64)[[0, 2]]
    # Recording keeps every layer's input and output (to inject or read signals there).
    recorded = ModifiedBackprop(composite, record=True).forward(model, x)
    assert all(ref() is not None for ref in notes.values())
    expected = recorded.backward(start).input_signal
    del recorded
    # A plain pass keeps no layer's output and only the inputs its rules read: z⁺, αβ and γ
    # compute their denominators again in backward from a rectified layer's input (relu1 for
    # conv2; conv1's is the model input, which the caller holds); ε reads only their shapes.
    # The gradient would keep both ReLUs' outputs.
    forward = ModifiedBackprop(composite).forward(model, x)
    read = [] if composite.name == "lrp.epsilon" else ["relu1"]
    assert [name for name, ref in notes.items() if ref() is not None] == read
    signal = forward.backward(start).input_signal
    torch.testing.assert_close(signal, expected, rtol=0, atol=0)
