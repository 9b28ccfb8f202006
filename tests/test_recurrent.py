"""LSTM, GRU and Elman RNN layers in the relevance engine: the written-out cells, LRP, refusals.

References: the fused kernels (the written-out cells compute the same), LRP for LSTMs by hand
after Arras et al. 2017 (ε on the linear maps, signal-take-all at the gate products, the tanh of
the candidate and of the cell passed through), LRP and DeepLIFT's Rescale rule for an Elman RNN by
hand, and conservation on bias-free models.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_same_state, state_fingerprint
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from explain_core import (
    Explainer,
    ExplainError,
    InvalidInputError,
    ModelRunError,
    ModelStateError,
    UnsupportedModelError,
    explain,
    explain_inputs,
    explain_tokens,
)
from explain_core.engine.recurrent import CELLS, gru, lstm, rnn_relu, rnn_tanh
from explain_core.plugin_manager import get_registry

MODULES = {
    "lstm": (nn.LSTM, nn.LSTMCell),
    "gru": (nn.GRU, nn.GRUCell),
    "rnn_tanh": (nn.RNN, nn.RNNCell),
    "rnn_relu": (nn.RNN, nn.RNNCell),
}
"""Each recurrent kind → its layer's and its one-step cell's class."""
KINDS = list(MODULES)


def recurrent(kind: str, *args: int, cell: bool = False, **options: object) -> nn.Module:
    """A layer (or, with ``cell``, a one-step cell) of ``kind``."""
    layer, one_step = MODULES[kind]
    if kind == "rnn_relu":
        options["nonlinearity"] = "relu"
    return (one_step if cell else layer)(*args, **options)


class Classifier(nn.Module):
    """A recurrent layer read at the last step by a linear head (the text-like classifiers)."""

    def __init__(self, rnn: nn.Module, bias: bool = True, initial: bool = False) -> None:
        super().__init__()
        self.rnn = rnn
        directions = 2 if rnn.bidirectional else 1
        width = (getattr(rnn, "proj_size", 0) or rnn.hidden_size) * directions
        self.head = nn.Linear(width, 3, bias=bias)
        self.initial = initial  # start from given states (constants: they absorb relevance)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.rnn.batch_first:  # explain() takes the batch first: (batch, steps, features)
            x = x.transpose(0, 1)
        if not self.initial:
            out, _ = self.rnn(x)
        else:
            cells = self.rnn.num_layers * (2 if self.rnn.bidirectional else 1)
            width = getattr(self.rnn, "proj_size", 0) or self.rnn.hidden_size
            batch = x.shape[0 if self.rnn.batch_first else 1]
            h0 = torch.full((cells, batch, width), 0.3, dtype=x.dtype)
            if isinstance(self.rnn, nn.LSTM):
                c0 = torch.full((cells, batch, self.rnn.hidden_size), -0.2, dtype=x.dtype)
                out, _ = self.rnn(x, (h0, c0))
            else:
                out, _ = self.rnn(x, h0)
        last = out[:, -1] if self.rnn.batch_first else out[-1]
        return self.head(last)


def sequences(batch_first: bool = True, batch: int = 3, steps: int = 5) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7)
    shape = (batch, steps, 4) if batch_first else (steps, batch, 4)
    return torch.randn(shape, dtype=torch.float64, generator=generator)


CELL_OPTIONS = {
    "batch-first": {"batch_first": True},
    "2-layers-bidirectional": {"num_layers": 2, "bidirectional": True},
    "projections": {"proj_size": 2, "num_layers": 2, "batch_first": True},
    "bias-free": {"bias": False, "batch_first": True},
}
CASES = [
    pytest.param(kind, options, id=f"{kind}-{name}")
    for kind in KINDS
    for name, options in CELL_OPTIONS.items()
    if kind == "lstm" or "proj_size" not in options  # only LSTMs have projections
]


@pytest.mark.parametrize(("kind", "options"), CASES)
def test_the_written_out_cells_compute_what_the_fused_kernels_do(kind, options):
    torch.manual_seed(0)
    layer = recurrent(kind, 4, 5, **options).double()
    x = sequences(options.get("batch_first", False))
    cells = layer.num_layers * (2 if layer.bidirectional else 1)
    width = getattr(layer, "proj_size", 0) or layer.hidden_size
    h0 = torch.randn(cells, 3, width, dtype=torch.float64)
    common = (layer.bias, layer.num_layers, 0.0, False, layer.bidirectional, layer.batch_first)
    with torch.no_grad():
        if kind == "lstm":
            c0 = torch.randn(cells, 3, 5, dtype=torch.float64)
            fused, (h_n, c_n) = layer(x, (h0, c0))
            written = lstm(x, (h0, c0), layer._flat_weights, *common)
            expected = (fused, h_n, c_n)
        else:
            fused, h_n = layer(x, h0)
            written_out = {"gru": gru, "rnn_tanh": rnn_tanh, "rnn_relu": rnn_relu}[kind]
            written = written_out(x, h0, layer._flat_weights, *common)
            expected = (fused, h_n)
    for got, want in zip(written, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def _stabilised(z: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.where(z >= 0, z + eps, z - eps)


def lrp_lstm_by_hand(
    model: Classifier, x: torch.Tensor, target: int, eps: float, c0: float = 0.0
) -> torch.Tensor:
    """Arras et al.'s LRP for a one-layer, batch-first LSTM read at its last step.

    It starts from ``h = 0`` and ``c = c0``: constants, which keep the relevance they get.
    """
    rnn, head = model.rnn, model.head
    hidden = rnn.hidden_size
    w = torch.cat([rnn.weight_ih_l0, rnn.weight_hh_l0], dim=1)
    b = rnn.bias_ih_l0 + rnn.bias_hh_l0
    batch, steps, _ = x.shape
    h = x.new_zeros(batch, hidden)
    c = x.new_full((batch, hidden), c0)
    saved = []
    for t in range(steps):  # the forward pass, keeping what the relevance pass reads
        inputs = torch.cat([x[:, t], h], dim=1)
        z = inputs @ w.T + b
        i, f, g, o = z.chunk(4, dim=1)
        c_prev = c
        c = torch.sigmoid(f) * c_prev + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        saved.append((inputs, z, torch.sigmoid(f) * c_prev, torch.sigmoid(i) * torch.tanh(g), c))
    y = h @ head.weight.T + head.bias
    relevance_y = torch.zeros_like(y)
    relevance_y[:, target] = y[:, target]
    relevance_h = h * ((relevance_y / _stabilised(y, eps)) @ head.weight)  # ε at the head
    relevance_c = torch.zeros_like(c)
    relevance_x = torch.zeros_like(x)
    for t in reversed(range(steps)):
        inputs, z, kept, new, c = saved[t]
        relevance_c = relevance_c + relevance_h  # h = o ⊙ tanh(c): o constant, tanh passes
        share = relevance_c / c  # c = f⊙c_prev + i⊙g, both gates constant: in proportion
        relevance_g = new * share  # i constant: all of i⊙g's share to g, passed through tanh
        relevance_c = kept * share  # to c_prev
        z_g = z[:, 2 * hidden : 3 * hidden]
        w_g = w[2 * hidden : 3 * hidden]
        relevance_in = inputs * ((relevance_g / _stabilised(z_g, eps)) @ w_g)  # ε at W[x;h]+b
        relevance_x[:, t] = relevance_in[:, : x.shape[2]]
        relevance_h = relevance_in[:, x.shape[2] :]
    return relevance_x


def lrp_gru_by_hand(model: Classifier, x: torch.Tensor, target: int, eps: float) -> torch.Tensor:
    """LRP for a one-layer, batch-first GRU from a zero state, read at its last step.

    As ``recurrent.md`` writes its rules: ε at ``W x + b`` and ``U h + b``, the gates ``r`` and
    ``z`` held (all relevance to the factor they multiply), ``tanh`` passed through, sums
    in proportion. At the first step ``r ⊙ (U_n h_0 + b_n)`` is a constant: it keeps its share.
    """
    rnn, head = model.rnn, model.head
    batch, steps, _ = x.shape
    h = x.new_zeros(batch, rnn.hidden_size)
    saved = []
    for t in range(steps):
        x_r, x_z, x_n = (x[:, t] @ rnn.weight_ih_l0.T + rnn.bias_ih_l0).chunk(3, dim=1)
        h_r, h_z, h_n = (h @ rnn.weight_hh_l0.T + rnn.bias_hh_l0).chunk(3, dim=1)
        r, z = torch.sigmoid(x_r + h_r), torch.sigmoid(x_z + h_z)
        pre = x_n + r * h_n
        n = torch.tanh(pre)
        saved.append((h, x_n, h_n, r, z, pre, n))
        h = (1 - z) * n + z * h
    y = h @ head.weight.T + head.bias
    relevance_y = torch.zeros_like(y)
    relevance_y[:, target] = y[:, target]
    relevance_h = h * ((relevance_y / _stabilised(y, eps)) @ head.weight)
    relevance_x = torch.zeros_like(x)
    hidden = rnn.hidden_size
    w_n, u_n = rnn.weight_ih_l0[2 * hidden :], rnn.weight_hh_l0[2 * hidden :]
    for t in reversed(range(steps)):
        h_prev, x_n, h_n, r, z, pre, n = saved[t]
        share = relevance_h / (n + z * (h_prev - n))  # h = n + z ⊙ (h_prev − n): in proportion
        relevance_n = n * share
        signal = z * (h_prev - n) * share  # z held: all to h_prev − n, in proportion
        relevance_prev = h_prev * signal / (h_prev - n)
        relevance_n = relevance_n - n * signal / (h_prev - n)
        relevance_x_n = x_n * relevance_n / pre  # tanh passes; pre = x_n + r ⊙ h_n
        relevance_h_n = r * h_n * relevance_n / pre  # r held: all to h_n
        relevance_x[:, t] = x[:, t] * ((relevance_x_n / _stabilised(x_n, eps)) @ w_n)
        if t > 0:  # h_0 is a constant: U_n h_0 + b_n keeps its share
            relevance_prev = relevance_prev + h_prev * (
                (relevance_h_n / _stabilised(h_n, eps)) @ u_n
            )
        relevance_h = relevance_prev
    return relevance_x


@pytest.mark.parametrize(
    ("layer", "by_hand"),
    [(nn.LSTM, lrp_lstm_by_hand), (nn.GRU, lrp_gru_by_hand)],
    ids=["lstm", "gru"],
)
@pytest.mark.parametrize("method", ["lrp.epsilon", "lrp.epsilon_plus", "lrp.attn", "lrp.cp"])
def test_lrp_for_recurrent_layers_is_their_rules_by_hand(method, layer, by_hand):
    # AttnLRP too holds the sigmoid gates constant: its uniform rule sent half the relevance
    # into them, and past the identity rule a linear map divided it by pre-activations near 0.
    # A GRU's reset gate multiplies U_n·0 + b_n at the first step, a constant: the gate scaled
    # by it went through the rules as a linear map and passed that share into the gate.
    torch.manual_seed(1)
    model = Classifier(layer(4, 5, batch_first=True)).double().eval()
    x = sequences()
    eps = 0.01
    got = explain(model, x, method, 2, epsilon=eps).attribution
    torch.testing.assert_close(got, by_hand(model, x, 2, eps), rtol=1e-9, atol=1e-12)


class LearnedCellState(nn.Module):
    """An LSTM that starts from a learned cell state ``c_0`` (and ``h_0 = 0``)."""

    def __init__(self, classifier: Classifier) -> None:
        super().__init__()
        self.rnn, self.head = classifier.rnn, classifier.head
        self.c0 = nn.Parameter(torch.full((1, 1, self.rnn.hidden_size), 0.4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c0 = self.c0.expand(1, x.shape[0], -1)
        out, _ = self.rnn(x, (torch.zeros_like(c0), c0))
        return self.head(out[:, -1])


def test_lrp_for_lstms_holds_the_forget_gate_on_a_learned_cell_state():
    torch.manual_seed(1)
    classifier = Classifier(nn.LSTM(4, 5, batch_first=True))
    model = LearnedCellState(classifier).double().eval()
    with torch.no_grad():
        model.c0.fill_(0.4)  # in float64, as the reference's
    x = sequences()
    got = explain(model, x, "lrp.epsilon", 2, epsilon=0.01).attribution
    expected = lrp_lstm_by_hand(model, x, 2, 0.01, c0=0.4)  # type: ignore[arg-type]
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)


def elman_by_hand(
    model: Classifier, x: torch.Tensor, reference: torch.Tensor, target: int, rule: str, eps: float
) -> torch.Tensor:
    """LRP-ε (``rule="lrp"``) or DeepLIFT-Rescale (``"deeplift"``) for a one-layer tanh RNN.

    ``h_t = tanh(z_t)``, ``z_t = W [x_t; h_{t−1}] + b``, read at its last step by the head. LRP:
    ε at the linear maps, relevance through the tanh unchanged. DeepLIFT: the multipliers of
    Shrikumar et al. 2017 — the weights at the linear maps, ``Δtanh / Δz`` at the tanh (its
    derivative where ``Δz = 0``); the map is ``Δx ⊙ m_x``.
    """
    rnn, head = model.rnn, model.head
    w = torch.cat([rnn.weight_ih_l0, rnn.weight_hh_l0], dim=1)
    b = rnn.bias_ih_l0 + rnn.bias_hh_l0

    def run(inputs_x: torch.Tensor) -> tuple[list[tuple[torch.Tensor, ...]], torch.Tensor]:
        h = inputs_x.new_zeros(inputs_x.shape[0], rnn.hidden_size)
        saved = []
        for t in range(inputs_x.shape[1]):
            inputs = torch.cat([inputs_x[:, t], h], dim=1)
            z = inputs @ w.T + b
            h = torch.tanh(z)
            saved.append((inputs, z))
        return saved, h

    saved, h = run(x)
    width = x.shape[2]
    if rule == "lrp":
        y = h @ head.weight.T + head.bias
        score = y[:, target, None]
        relevance = h * (score / _stabilised(score, eps) * head.weight[target])
        maps = torch.zeros_like(x)
        for t in reversed(range(x.shape[1])):
            inputs, z = saved[t]  # the tanh passes relevance to z
            relevance_in = inputs * ((relevance / _stabilised(z, eps)) @ w)
            maps[:, t], relevance = relevance_in[:, :width], relevance_in[:, width:]
        return maps
    saved_ref, _ = run(reference)
    multiplier = head.weight[target].expand(x.shape[0], -1)  # at the last h
    maps = torch.zeros_like(x)
    for t in reversed(range(x.shape[1])):
        (inputs, z), (_, z_ref) = saved[t], saved_ref[t]
        delta = z - z_ref
        slope = torch.where(
            delta.abs() > 1e-12, (torch.tanh(z) - torch.tanh(z_ref)) / delta, 1 - torch.tanh(z) ** 2
        )
        multiplier_in = (multiplier * slope) @ w
        maps[:, t] = (x[:, t] - reference[:, t]) * multiplier_in[:, :width]
        multiplier = multiplier_in[:, width:]
    return maps


def test_lrp_and_deeplift_on_an_elman_rnn_are_their_equations_by_hand():
    torch.manual_seed(6)
    model = Classifier(nn.RNN(4, 5, batch_first=True)).double().eval()
    x = sequences()
    zero = torch.zeros_like(x)
    got = explain(model, x, "lrp.epsilon", 2, epsilon=0.01).attribution
    expected = elman_by_hand(model, x, zero, 2, "lrp", 0.01)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)
    result = explain(model, x, "deeplift.rescale", 2)
    torch.testing.assert_close(
        result.attribution, elman_by_hand(model, x, zero, 2, "deeplift", 0.0), rtol=1e-9, atol=1e-12
    )
    with torch.no_grad():  # and, as DeepLIFT must, it sums to f(x) − f(0)
        difference = model(x)[:, 2] - model(zero)[:, 2]
    torch.testing.assert_close(result.attribution.sum((1, 2)), difference, rtol=1e-9, atol=1e-12)


def guided_bp_by_hand(
    model: Classifier, x: torch.Tensor, target: int, forward_mask: bool = True
) -> torch.Tensor:
    """Guided BP through a one-layer ReLU RNN: each ReLU passes positive signal where ``z > 0``.

    Without ``forward_mask``: Deconv (positive signal wherever ``z`` is).
    """
    rnn, head = model.rnn, model.head
    w = torch.cat([rnn.weight_ih_l0, rnn.weight_hh_l0], dim=1)
    b = rnn.bias_ih_l0 + rnn.bias_hh_l0
    h = x.new_zeros(x.shape[0], rnn.hidden_size)
    pre_activations = []
    for t in range(x.shape[1]):
        z = torch.cat([x[:, t], h], dim=1) @ w.T + b
        h = torch.relu(z)
        pre_activations.append(z)
    signal = head.weight[target].expand(x.shape[0], -1)
    maps = torch.zeros_like(x)
    for t in reversed(range(x.shape[1])):
        passed = signal.clamp(min=0)
        if forward_mask:
            passed = passed * (pre_activations[t] > 0)
        signal_in = passed @ w
        maps[:, t], signal = signal_in[:, : x.shape[2]], signal_in[:, x.shape[2] :]
    return maps


def test_guided_bp_and_deconv_take_a_relu_rnn_and_refuse_a_tanh_rnn_by_name():
    torch.manual_seed(8)
    relu_model = Classifier(recurrent("rnn_relu", 4, 5, batch_first=True)).double().eval()
    x = sequences()
    for method, forward_mask in [("guided_bp", True), ("deconv", False)]:
        expected = guided_bp_by_hand(relu_model, x, 1, forward_mask)
        assert expected.abs().sum() > 0
        got = explain(relu_model, x, method, 1).attribution
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)
    tanh_model = Classifier(nn.RNN(4, 5, batch_first=True)).double().eval()
    refusal = (  # naming the form these methods explain (the advice was the gates' held)
        r"'tanh' of the recurrent layer 'rnn' \(RNN\) is an activation.*an Elman RNN with "
        r"nonlinearity='relu'; explain this one with the LRP presets"
    )
    with pytest.raises(UnsupportedModelError, match=refusal):
        explain(tanh_model, x, "guided_bp", 0)


@pytest.mark.parametrize(("kind", "options"), [c for c in CASES if "bias" not in c.values[1]])
def test_lrp_zero_conserves_on_bias_free_recurrent_nets(kind, options):
    torch.manual_seed(2)
    layer = recurrent(kind, 4, 5, bias=False, **options)
    model = Classifier(layer, bias=False).double().eval()
    result = explain(model, sequences(), "lrp.z", 0)  # the model transposes if it must
    assert result.attribution.abs().sum() > 0
    torch.testing.assert_close(
        result.delta, torch.zeros(3, dtype=torch.float64), atol=1e-10, rtol=0
    )


@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU])
def test_given_initial_states_absorb_relevance_like_biases(kind):
    torch.manual_seed(3)
    model = Classifier(kind(4, 5, bias=False, batch_first=True), bias=False, initial=True)
    model = model.double().eval()
    x = sequences()
    result = explain(model, x, "lrp.z", 1)
    assert result.delta.abs().max() > 1e-6  # the states' share, not the inputs'
    # from zero states the same weights conserve
    model.initial = False
    torch.testing.assert_close(
        explain(model, x, "lrp.z", 1).delta, torch.zeros(3, dtype=torch.float64), atol=1e-10, rtol=0
    )


class EncoderDecoder(nn.Module):
    """An encoder reads the first two steps; the decoder starts from its final states."""

    def __init__(self, encoder: nn.Module, decoder: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.encoder, self.decoder, self.head = encoder, decoder, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, states = self.encoder(x[:, :2])
        out, _ = self.decoder(x[:, 2:], states)
        return self.head(out[:, -1])


@pytest.mark.parametrize("method", ["lrp.epsilon", "lrp.z", "lrp.epsilon_plus", "gradient"])
@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU])
def test_states_handed_to_a_decoder_carry_relevance_back_into_the_encoder(kind, method):
    # A decoder with the encoder's weights, started from its final states, continues the same
    # recurrence: the map must be the one of a single layer over the whole sequence.
    torch.manual_seed(8)
    whole = Classifier(kind(4, 5, num_layers=2, batch_first=True)).double().eval()
    split = EncoderDecoder(whole.rnn, copy.deepcopy(whole.rnn), whole.head).eval()
    x = sequences()
    expected = explain(whole, x, method, 1).attribution
    assert expected[:, :2].abs().sum() > 0  # the encoder's steps are explained, too
    torch.testing.assert_close(
        explain(split, x, method, 1).attribution, expected, atol=1e-14, rtol=0
    )


@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU])
def test_gradient_methods_run_and_the_rest_refuse_clearly(kind):
    torch.manual_seed(4)
    model = Classifier(kind(4, 5, batch_first=True)).double().eval()
    x = sequences()
    ig = explain(model, x, "integrated_gradients", 0, steps=64)
    assert ig.delta.abs().max() < 1e-3
    for method, match in [
        ("deeplift.rescale", r"'mul' of the recurrent layer 'rnn' \(\w+\) multiplies"),  # gates
        ("guided_bp", r"'sigmoid' of the recurrent layer 'rnn' \(\w+\) is an activation"),
    ]:
        with pytest.raises(UnsupportedModelError, match=match):
            explain(model, x, method, 0)


class _RefusedLikeCudnnInEval(torch.autograd.Function):
    """The identity, whose backward raises what torch's cuDNN RNN kernels raise in eval mode."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("cudnn RNN backward can only be called in training mode")


@pytest.mark.parametrize("method", ["gradient", "integrated_gradients", "smoothgrad"])
def test_a_cudnn_rnn_without_backward_in_eval_mode_gives_the_ways_out(method):
    # On a GPU, cuDNN's LSTM/GRU kernels compute no gradient in eval mode (benchmarks/
    # check_cuda.py meets it on the real kernels); here a stand-in raises torch's message.
    torch.manual_seed(6)
    rnn = nn.GRU(4, 5, batch_first=True).double().eval()

    class Refused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn, self.head = rnn, nn.Linear(5, 3).double()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out, _ = self.rnn(_RefusedLikeCudnnInEval.apply(x))
            return self.head(out[:, -1])

    with pytest.raises(ModelRunError, match=r"cuDNN.*cudnn\.flags\(enabled=False\).*LRP method"):
        explain(Refused().eval(), sequences(), method, 0)


LENGTHS = torch.tensor([4, 6, 2])
"""The lengths of the three sequences that ``sequences(steps=6)`` pads."""


@pytest.mark.parametrize(("kind", "options"), [c for c in CASES if "num_layers" in c.values[1]])
def test_the_written_out_layers_compute_what_the_fused_kernels_do_on_packed_sequences(
    kind, options
):
    torch.manual_seed(4)
    layer = recurrent(kind, 4, 5, **options).double()
    x = sequences(layer.batch_first, steps=6)
    packed = pack_padded_sequence(x, LENGTHS, layer.batch_first, enforce_sorted=False)
    cells = layer.num_layers * (2 if layer.bidirectional else 1)
    width = getattr(layer, "proj_size", 0) or layer.hidden_size
    h0 = torch.randn(cells, 3, width, dtype=torch.float64)
    common = (layer.bias, layer.num_layers, 0.0, False, layer.bidirectional)
    data, sizes = packed.data, packed.batch_sizes
    with torch.no_grad():
        if kind == "lstm":
            c0 = torch.randn(cells, 3, 5, dtype=torch.float64)
            fused, (h_n, c_n) = layer(packed, (h0, c0))
            # the module hands the kernel the states in the packed order, and back
            order = packed.sorted_indices
            states = [h0.index_select(1, order), c0.index_select(1, order)]
            written = lstm(data, sizes, states, layer._flat_weights, *common)
            expected = (fused.data, h_n.index_select(1, order), c_n.index_select(1, order))
        else:
            fused, h_n = layer(packed, h0)
            written_out = {"gru": gru, "rnn_tanh": rnn_tanh, "rnn_relu": rnn_relu}[kind]
            state = h0.index_select(1, packed.sorted_indices)
            written = written_out(data, sizes, state, layer._flat_weights, *common)
            expected = (fused.data, h_n.index_select(1, packed.sorted_indices))
    for got, want in zip(written, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


class PackedClassifier(nn.Module):
    """Padded sequences of their own lengths, packed, read at their final states or outputs.

    The lengths are a forward argument, or (for ``explain``) the first ``len(x)`` of
    ``lengths``. With ``packed=False`` the same layers run on the sequences as they are: the
    reference, on each sequence cut to its length.
    """

    def __init__(self, rnn: nn.Module, readout: str, lengths: torch.Tensor, bias: bool = True):
        super().__init__()
        self.rnn, self.readout, self.lengths, self.packed = rnn, readout, lengths, True
        self.padding_value = 0.0
        self.directions = 2 if rnn.bidirectional else 1
        self.head = nn.Linear(rnn.hidden_size * self.directions, 3, bias=bias)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        if self.packed:
            lengths = self.lengths[: len(x)] if lengths is None else lengths
            x = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, state = self.rnn(x)
        if self.readout == "outputs":  # zeros at the padded steps
            if self.packed:
                out, _ = pad_packed_sequence(out, True, padding_value=self.padding_value)
            return self.head(out.sum(1))
        h = state[0] if isinstance(state, tuple) else state  # an LSTM's is (h, c)
        return self.head(torch.cat(list(h[-self.directions :]), dim=-1))


def packed_classifier(kind: str, readout: str, bias: bool = True) -> PackedClassifier:
    torch.manual_seed(6)
    layer = recurrent(kind, 4, 5, num_layers=2, bidirectional=True, batch_first=True, bias=bias)
    return PackedClassifier(layer, readout, LENGTHS, bias).double().eval()


def padded_sequences() -> torch.Tensor:
    x = sequences(steps=6)
    for row, length in enumerate(LENGTHS):
        x[row, length:] = 0
    return x


@pytest.mark.parametrize("method", ["lrp.epsilon", "lrp.z", "gradient"])
@pytest.mark.parametrize("readout", ["final", "outputs"])
@pytest.mark.parametrize("kind", KINDS)
def test_packed_sequences_are_explained_as_each_sequence_alone(kind, readout, method):
    # A known equivalence: packing runs each sequence over its own length, both directions.
    model = packed_classifier(kind, readout)
    x = padded_sequences()
    before = state_fingerprint(model)
    attribution = explain(model, x, method, 1).attribution
    assert_same_state(before, state_fingerprint(model))
    model.packed = False
    for row, length in enumerate(LENGTHS.tolist()):
        alone = explain(model, x[row : row + 1, :length], method, 1).attribution
        torch.testing.assert_close(attribution[row : row + 1, :length], alone)
        assert alone.abs().sum() > 0 and not attribution[row, length:].any()


@pytest.mark.parametrize("kind", KINDS)
def test_lengths_given_as_a_forward_argument_explain_the_same(kind):
    model = packed_classifier(kind, "final")
    x = padded_sequences()
    expected = explain(model, x, "lrp.epsilon", 1).attribution
    model.lengths = None  # the lengths must come with the call
    explainer = Explainer(model, "lrp.epsilon")
    got = explainer.attribute(x, 1, additional_forward_args=LENGTHS)
    torch.testing.assert_close(got, expected)
    # As a list they cannot follow each sample (a raw IndexError came from inside torch)
    listed = (LENGTHS.tolist(),)
    with pytest.raises(ModelRunError, match=r"additional_forward_args\[0\] is a list of 3 values"):
        explainer.attribute(x, 1, additional_forward_args=listed)


@pytest.mark.parametrize("kind", KINDS)
def test_lrp_zero_conserves_on_bias_free_packed_sequences(kind):
    model = packed_classifier(kind, "outputs", bias=False)
    result = explain(model, padded_sequences(), "lrp.z", 0)
    assert result.attribution.abs().sum() > 0
    torch.testing.assert_close(
        result.delta, torch.zeros(3, dtype=torch.float64), atol=1e-10, rtol=0
    )


def test_a_packed_sequence_padded_with_other_values_than_zero_is_refused_by_name():
    model = packed_classifier("lstm", "outputs")
    model.padding_value = 1.0
    match = r"'_pad_packed_sequence' .* pads with padding_value=1\.0"
    with pytest.raises(UnsupportedModelError, match=match):
        explain(model, padded_sequences(), "lrp.epsilon", 1)


@pytest.mark.parametrize("kind", KINDS)
def test_every_method_gives_a_finite_map_or_one_clear_error(kind):
    # the refusals named in docs/recurrent.md; the maps' values are checked by the tests above
    torch.manual_seed(9)
    layer = recurrent(kind, 4, 5, num_layers=2, bidirectional=True, batch_first=True)
    model = Classifier(layer).double().eval()
    x = sequences()
    outcomes = {}
    for method in sorted(get_registry()):
        try:
            attribution = explain(model, x, method, 1).attribution
        except ExplainError as error:
            outcomes[method] = type(error).__name__
        else:
            assert torch.isfinite(attribution).all(), method
            outcomes[method] = "map"
    gated = kind in ("lstm", "gru")
    assert outcomes["lrp.epsilon"] == outcomes["lrp.epsilon_plus"] == "map"
    assert outcomes["integrated_gradients"] == "map"
    assert outcomes["deeplift.rescale"] == ("UnsupportedModelError" if gated else "map")
    relu_only = "map" if kind == "rnn_relu" else "UnsupportedModelError"
    assert outcomes["guided_bp"] == outcomes["deconv"] == outcomes["rectgrad"] == relu_only


class CellLoop(nn.Module):
    """A cell stepped over the sequence by hand, read at its last step (as decoders are written)."""

    def __init__(self, cell: nn.Module, hidden: int = 5) -> None:
        super().__init__()
        self.cell, self.hidden = cell, hidden
        self.head = nn.Linear(hidden, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.new_zeros(x.shape[0], self.hidden)
        state: torch.Tensor | tuple[torch.Tensor, torch.Tensor] = (
            (h, h) if isinstance(self.cell, nn.LSTMCell) else h
        )
        for t in range(x.shape[1]):
            state = self.cell(x[:, t], state)
        return self.head(state[0] if isinstance(state, tuple) else state)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kind", KINDS)
def test_the_written_out_one_step_cells_compute_what_the_fused_cells_do(kind, bias):
    torch.manual_seed(10)
    cell = recurrent(kind, 4, 5, bias=bias, cell=True).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    h = torch.randn(3, 5, dtype=torch.float64)
    state = (h, torch.randn(3, 5, dtype=torch.float64)) if kind == "lstm" else h
    operation = {"lstm": "lstm_cell", "gru": "gru_cell"}.get(kind, f"{kind}_cell")
    with torch.no_grad():
        fused = cell(x, state)
        weights = (cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh)
        written = CELLS[operation](x, state, *weights)
    if kind != "lstm":  # one state tensor, not an (h, c) pair
        written, fused = (written,), (fused,)
    for got, want in zip(written, fused, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("method", ["lrp.epsilon", "lrp.z", "deeplift.rescale"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_cell_stepped_by_hand_is_explained_as_the_layer_with_its_weights(kind, method):
    # The known equivalence: the cell stepped over the sequence is the one-layer recurrent layer;
    # the layer's maps are checked against the papers' equations above.
    torch.manual_seed(11)
    layer = recurrent(kind, 4, 5, batch_first=True)
    layered = Classifier(layer).double().eval()
    stepped = CellLoop(recurrent(kind, 4, 5, cell=True)).double().eval()
    with torch.no_grad():
        for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            getattr(stepped.cell, name).copy_(getattr(layer, f"{name}_l0"))
        stepped.head.load_state_dict(layered.head.state_dict())
    x = sequences()
    if method.startswith("deeplift") and kind in ("lstm", "gru"):  # gates: refused alike
        for model in (layered, stepped):
            with pytest.raises(UnsupportedModelError, match="'mul' of the recurrent layer"):
                explain(model, x, method, 2)
        return
    expected = explain(layered, x, method, 2).attribution
    assert expected.abs().sum() > 0
    torch.testing.assert_close(
        explain(stepped, x, method, 2).attribution, expected, rtol=1e-9, atol=1e-12
    )


class LSTMByHand(nn.Module):
    """An LSTM written out by hand: one Linear on ``[x_t; h]`` called at every step."""

    def __init__(self, lstm: nn.LSTM, head: nn.Linear) -> None:
        super().__init__()
        self.width = lstm.hidden_size
        self.gates = nn.Linear(lstm.input_size + self.width, 4 * self.width).double()
        with torch.no_grad():
            self.gates.weight.copy_(torch.cat([lstm.weight_ih_l0, lstm.weight_hh_l0], 1))
            self.gates.bias.copy_(lstm.bias_ih_l0 + lstm.bias_hh_l0)
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = c = x.new_zeros(x.shape[0], self.width)
        for t in range(x.shape[1]):
            i, f, g, o = self.gates(torch.cat([x[:, t], h], 1)).chunk(4, 1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
        return self.head(h)


class ElmanByHand(nn.Module):
    """An Elman RNN written out by hand: ``h = tanh(ih(x_t) + hh(h))``, two Linears per step."""

    def __init__(self, rnn: nn.RNN, head: nn.Linear) -> None:
        super().__init__()
        self.ih = nn.Linear(rnn.input_size, rnn.hidden_size).double()
        self.hh = nn.Linear(rnn.hidden_size, rnn.hidden_size).double()
        with torch.no_grad():
            for linear, kind in ((self.ih, "ih"), (self.hh, "hh")):
                linear.weight.copy_(getattr(rnn, f"weight_{kind}_l0"))
                linear.bias.copy_(getattr(rnn, f"bias_{kind}_l0"))
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.new_zeros(x.shape[0], self.hh.in_features)
        for t in range(x.shape[1]):
            h = torch.tanh(self.ih(x[:, t]) + self.hh(h))
        return self.head(h)


def assert_by_hand_equals_layer(
    kind: str,
    by_hand: type[nn.Module],
    method: str,
    seed: int,
    constant_state_signal: bool = True,
):
    """``method``'s map of a layer of ``kind`` equals that of ``by_hand`` with its weights.

    ``constant_state_signal=False`` zeroes a GRU's ``b_hn``: from the zero state its reset gate
    then multiplies 0, where a cell written by hand differs from the layer (``recurrent.md``).
    """
    torch.manual_seed(seed)
    layer = recurrent(kind, 4, 5, batch_first=True).double()
    if kind == "gru" and not constant_state_signal:
        with torch.no_grad():
            layer.bias_hh_l0[2 * layer.hidden_size :] = 0
    model = Classifier(layer).double().eval()
    written = by_hand(layer, model.head).eval()
    x = sequences()
    torch.testing.assert_close(written(x), model(x))
    expected = explain(model, x, method, 1).attribution
    assert expected.abs().sum() > 0
    torch.testing.assert_close(explain(written, x, method, 1).attribution, expected)


@pytest.mark.parametrize(
    ("kind", "method"),
    [
        ("lstm", "lrp.epsilon"),
        ("lstm", "lrp.z"),
        ("lstm", "lrp.epsilon_plus"),
        ("lstm", "integrated_gradients"),
        ("rnn_tanh", "lrp.z"),  # two linear maps and an addition: LRP-0 as for one map
        ("rnn_tanh", "deeplift.rescale"),
    ],
)
def test_a_cell_written_by_hand_reusing_its_linear_layers_equals_the_layer(kind, method):
    # A known equivalence: the same weights as one nn.LSTM / nn.RNN (whose written-out cells
    # the tests above compare with Arras et al.'s LRP and DeepLIFT by hand); the by-hand
    # model calls its Linear layers once per step, each call with its own rule.
    assert_by_hand_equals_layer(kind, LSTMByHand if kind == "lstm" else ElmanByHand, method, 6)


class ReLURNNByHand(nn.Module):
    """A ReLU Elman RNN written out by hand: one Linear on ``[x_t; h]`` at every step."""

    def __init__(self, rnn: nn.RNN, head: nn.Linear) -> None:
        super().__init__()
        self.step = nn.Linear(rnn.input_size + rnn.hidden_size, rnn.hidden_size).double()
        with torch.no_grad():
            self.step.weight.copy_(torch.cat([rnn.weight_ih_l0, rnn.weight_hh_l0], 1))
            self.step.bias.copy_(rnn.bias_ih_l0 + rnn.bias_hh_l0)
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.new_zeros(x.shape[0], self.step.out_features)
        for t in range(x.shape[1]):
            h = F.relu(self.step(torch.cat([x[:, t], h], 1)))
        return self.head(h)


@pytest.mark.parametrize("method", ["excitation_bp", "excitation_bp.contrastive"])
def test_excitation_bp_on_a_relu_rnn_is_its_rule_on_the_cell_written_out(method):
    # Contrastive Excitation BP had no rule for the layer's linear maps and refused the RNN,
    # naming 'linear' as an operation without a rule.
    assert_by_hand_equals_layer("rnn_relu", ReLURNNByHand, method, 6)


class GRUAsDocumented(nn.Module):
    """A GRU written out as torch documents it: ``h = (1 − z) ⊙ n + z ⊙ h``, its gate maps as
    two Linears (``W x + b``, ``U h + b``) split into the three gates."""

    def __init__(self, gru: nn.GRU, head: nn.Linear) -> None:
        super().__init__()
        self.ih = nn.Linear(gru.input_size, 3 * gru.hidden_size).double()
        self.hh = nn.Linear(gru.hidden_size, 3 * gru.hidden_size).double()
        with torch.no_grad():
            for linear, kind in ((self.ih, "ih"), (self.hh, "hh")):
                linear.weight.copy_(getattr(gru, f"weight_{kind}_l0"))
                linear.bias.copy_(getattr(gru, f"bias_{kind}_l0"))
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.new_zeros(x.shape[0], self.hh.in_features)
        for t in range(x.shape[1]):
            i_r, i_z, i_n = self.ih(x[:, t]).chunk(3, 1)
            h_r, h_z, h_n = self.hh(h).chunk(3, 1)
            r, z = torch.sigmoid(i_r + h_r), torch.sigmoid(i_z + h_z)
            n = torch.tanh(i_n + r * h_n)
            h = (1 - z) * n + z * h
        return self.head(h)


class LSTMOneSigmoid(LSTMByHand):
    """:class:`LSTMByHand` with its three gates from one sigmoid, split after it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = c = x.new_zeros(x.shape[0], self.width)
        width = self.width
        for t in range(x.shape[1]):
            gates = self.gates(torch.cat([x[:, t], h], 1))
            squashed = torch.sigmoid(torch.cat([gates[:, : 2 * width], gates[:, 3 * width :]], 1))
            i, f, o = squashed.chunk(3, 1)
            c = f * c + i * torch.tanh(gates[:, 2 * width : 3 * width])
            h = o * torch.tanh(c)
        return self.head(h)


@pytest.mark.parametrize("kind", ["gru", "lstm"])
@pytest.mark.parametrize("method", ["lrp.epsilon", "lrp.attn", "lrp.cp"])
def test_gates_written_as_one_minus_or_split_from_one_sigmoid_are_held(kind, method):
    # 1 − z and a sigmoid's output split into gates lost the gate: the other factor (a tanh)
    # was held instead, and relevance went through the sigmoid (sums of −4e6 for a logit of 0.2)
    by_hand = GRUAsDocumented if kind == "gru" else LSTMOneSigmoid
    assert_by_hand_equals_layer(kind, by_hand, method, 13, constant_state_signal=False)


@pytest.mark.parametrize("kind", KINDS)
def test_a_max_over_time_readout_is_max_pooling_and_conserves_bias_free(kind):
    class MaxOverTime(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = recurrent(kind, 4, 5, bidirectional=True, batch_first=True, bias=False)
            self.head = nn.Linear(10, 3, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.rnn(x)[0].max(1).values)

    torch.manual_seed(10)
    model = MaxOverTime().double().eval()
    result = explain(model, sequences(), "lrp.z", 2)
    assert result.attribution.abs().sum() > 0
    torch.testing.assert_close(
        result.delta, torch.zeros(3, dtype=torch.float64), atol=1e-10, rtol=0
    )


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn_tanh"])
def test_dropout_between_layers_in_training_mode_is_refused_and_none_is_not(kind):
    # The gradient methods gave another map on every call (LRP refused the dropout by name).
    torch.manual_seed(11)
    dropping = Classifier(recurrent(kind, 4, 5, num_layers=2, dropout=0.5, batch_first=True))
    dropping = dropping.double().train()
    x = sequences()
    before = state_fingerprint(dropping)
    for method in ("gradient", "integrated_gradients", "lrp.epsilon"):
        with pytest.raises(ModelStateError, match=r"'rnn' is in training mode; call model\.eval"):
            explain(dropping, x, method, 1)
    assert_same_state(before, state_fingerprint(dropping))
    assert dropping.training
    # without dropout between layers (none given, or one layer) the layer computes the same in
    # either mode: explained as it is
    with pytest.warns(UserWarning, match="non-zero dropout expects num_layers greater than 1"):
        one_layer = recurrent(kind, 4, 5, dropout=0.5, batch_first=True)
    for layer in (recurrent(kind, 4, 5, num_layers=2, batch_first=True), one_layer):
        plain = Classifier(layer).double().train()
        for method in ("gradient", "lrp.epsilon"):
            expected = explain(copy.deepcopy(plain).eval(), x, method, 1).attribution
            torch.testing.assert_close(explain(plain, x, method, 1).attribution, expected)


class SequenceFirst(nn.Module):
    """nn.LSTM's default layout, (steps, batch, features), read at the last step."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.head = nn.LSTM(4, 5), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0][-1])


class BatchFirst(nn.Module):
    """The wrapper the error advises: it takes the batch first and moves it back."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x.movedim(0, 1))


def test_sequences_with_the_batch_on_axis_1_are_told_to_move_it_first():
    # The advice was only x.unsqueeze(0), which fails again: (1, steps, batch, features)
    torch.manual_seed(12)
    model = SequenceFirst().double().eval()
    x = torch.randn(6, 3, 4, dtype=torch.float64)  # 6 steps of 3 sequences
    with pytest.raises(ModelRunError, match=r"if the batch is axis 1 .*x\.movedim\(0, 1\)"):
        explain(model, x, "gradient", 1)
    batch_first = x.movedim(1, 0)
    got = explain(BatchFirst(model).eval(), batch_first, "gradient", 1).attribution
    leaf = x.clone().requires_grad_(True)
    (expected,) = torch.autograd.grad(model(leaf)[:, 1].sum(), leaf)
    torch.testing.assert_close(got, expected.movedim(1, 0))


class LengthsFromPadding(nn.Module):
    """An LSTM over packed sequences whose lengths it counts from the input's zero padding."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.LSTM(3, 6, batch_first=True), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        if lengths is None:
            lengths = (x != 0).any(-1).sum(1).clamp(min=1)
        packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
        return self.head(self.rnn(packed)[1][0][-1])


@pytest.mark.parametrize("method", ["lrp.epsilon", "lrp.attn"])
def test_lengths_counted_from_the_input_are_taken_as_given(method):
    # Refused before ('ne' has no rule): the lengths carry no relevance, as they carry no gradient
    torch.manual_seed(0)
    model = LengthsFromPadding().double().eval()
    x = torch.randn(3, 7, 3, dtype=torch.float64)
    x[1, 5:], x[2, 3:] = 0, 0
    lengths = torch.tensor([7, 5, 3])
    got = explain(model, x, method, 1).attribution
    given = explain_inputs(model, {"x": x, "lengths": lengths}, method, 1, explained="x")
    torch.testing.assert_close(got, given.attribution, rtol=0, atol=0)
    assert not got[2, 3:].any()  # the padded steps are never read


def test_a_packed_sequence_as_the_input_is_told_to_pack_inside_forward():
    packed = nn.utils.rnn.pack_padded_sequence(
        sequences(), torch.tensor([5, 2, 4]), batch_first=True, enforce_sorted=False
    )
    with pytest.raises(InvalidInputError, match=r"got a PackedSequence\. Pass the padded batch"):
        explain(nn.GRU(4, 5), packed, "gradient", 0)


class KeepsLastState(nn.Module):
    """Stores its last hidden state on itself (for the caller to read); never reads it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.rnn, self.head = nn.LSTM(4, 5, batch_first=True), nn.Linear(5, 3)
        self.hidden: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, self.hidden = self.rnn(x)
        return self.head(out[:, -1])


class CarriesState(KeepsLastState):
    """Starts each call from the state the last call left (truncated backpropagation)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = self.hidden
        if state is not None and state[0].shape[1] != x.shape[0]:
            state = None
        out, (h, c) = self.rnn(x, state)
        self.hidden = (h.detach(), c.detach())
        return self.head(out[:, -1])


@pytest.mark.parametrize("method", ["gradient", "integrated_gradients", "lrp.epsilon"])
def test_a_model_that_only_stores_its_last_state_is_explained_as_without_it(method):
    model = KeepsLastState().double().eval()
    x = sequences()
    result = explain(model, x, method, 1)
    assert model.hidden is not None  # as after a plain forward: the model's own doing
    plain = Classifier(model.rnn)
    plain.head = model.head
    torch.testing.assert_close(result.attribution, explain(plain, x, method, 1).attribution)


@pytest.mark.parametrize("method", ["gradient", "integrated_gradients", "lrp.epsilon"])
def test_a_state_carried_from_call_to_call_is_refused(method):
    # the LRP pass ran after a one-sample trace that left its own state, Integrated Gradients'
    # path points each from the last one's: maps of other calls than the caller's, unsaid
    model = CarriesState().double().eval()
    x = sequences()
    with torch.no_grad():
        model(x)
    with pytest.raises(ModelStateError, match=r"stores tensors on the model \(<root>\.hidden\)"):
        explain(model, x, method, 1)


class PackedElman(nn.Module):
    """A tanh RNN over sequences packed with the lengths given, sorted or not."""

    def __init__(self, enforce_sorted: bool) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.enforce_sorted = enforce_sorted
        self.rnn, self.head = nn.RNN(4, 5, batch_first=True), nn.Linear(5, 2)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = pack_padded_sequence(x, lengths, True, enforce_sorted=self.enforce_sorted)
        return self.head(self.rnn(packed)[1][-1])


def _padded(lengths: list[int]) -> torch.Tensor:
    x = sequences(batch=len(lengths), steps=max(lengths))
    for row, length in enumerate(lengths):
        x[row, length:] = 0
    return x


def test_sorted_packing_under_copies_of_the_batch_is_told_to_pack_unsorted():
    # the lengths repeated for IG's path points are no longer sorted: torch's error was reported
    # as a forward that depends on the batch size, advising the call that was made
    x, lengths = _padded([6, 3, 2]), torch.tensor([6, 3, 2])
    inputs = {"x": x, "lengths": lengths}
    with pytest.raises(InvalidInputError, match="enforce_sorted=False, which gives the same"):
        explain_inputs(
            PackedElman(True).double().eval(), inputs, "integrated_gradients", 1, explained="x"
        )
    unsorted = PackedElman(False).double().eval()  # as advised: the same weights
    got = explain_inputs(unsorted, inputs, "integrated_gradients", 1, explained="x").attribution
    grouped = Explainer(unsorted, "integrated_gradients").attribute(
        x, 1, additional_forward_args=lengths
    )
    torch.testing.assert_close(got, grouped)


def test_deeplift_on_packed_sequences_of_several_lengths_is_told_to_group_them():
    # a step's rows are the sequences still running: the refusal blamed batch_first
    model = PackedElman(False).double().eval()
    x, lengths = _padded([6, 6, 3, 3]), torch.tensor([6, 6, 3, 3])
    with pytest.raises(
        UnsupportedModelError, match=r"from packed sequences.*additional_forward_args"
    ):
        explain_inputs(model, {"x": x, "lengths": lengths}, "deeplift.rescale", 1, explained="x")
    grouped = Explainer(model, "deeplift.rescale").attribute(x, 1, additional_forward_args=lengths)
    with torch.no_grad():
        difference = model(x, lengths)[:, 1] - model(torch.zeros_like(x), lengths)[:, 1]
    torch.testing.assert_close(grouped.sum((1, 2)), difference)  # what the message advises


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn_tanh"])
@pytest.mark.parametrize("cell", [False, True], ids=["layer", "cell"])
def test_dynamic_contributions_refuse_gates_and_tanh_and_take_a_relu_rnn(kind, cell):
    # Sigmoid gates and tanh are not dynamic-linear: the "exact contributions" were
    # Input×Gradient under another name, and did not sum to a bias-free model's logit.
    torch.manual_seed(14)
    x = sequences()
    model = (
        CellLoop(recurrent(kind, 4, 5, bias=False, cell=True))
        if cell
        else Classifier(recurrent(kind, 4, 5, bias=False, batch_first=True), bias=False)
    ).double()
    match = r"operation '\w+' in module '(rnn|cell)' \(\w+\) is not piecewise .*input_x_gradient"
    for method, options in [
        ("dynamic.contributions", {}),
        ("gradient", {"composite": "explanation_mode"}),
    ]:
        with pytest.raises(UnsupportedModelError, match=match):
            explain(model.eval(), x, method, 1, **options)
    relu = Classifier(recurrent("rnn_relu", 4, 5, bias=False, batch_first=True), bias=False)
    result = explain(relu.double().eval(), x, "dynamic.contributions", 1)
    torch.testing.assert_close(
        result.delta, torch.zeros(3, dtype=torch.float64), atol=1e-12, rtol=0
    )


class GivenState(nn.Module):
    """A two-layer GRU started from a state given to forward as torch takes it: (2, batch, 5)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.GRU(4, 5, num_layers=2, batch_first=True), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor, h0: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x, h0)[0][:, -1])


class GivenStateBatchFirst(GivenState):
    """The wrapper the error advises: it takes the state batch first and moves it back."""

    def forward(self, x: torch.Tensor, h0: torch.Tensor) -> torch.Tensor:
        return super().forward(x, h0.transpose(0, 1).contiguous())


@pytest.mark.parametrize("batch", [3, 2])  # 2: as many samples as layers
def test_a_time_major_state_as_a_forward_argument_is_told_to_go_batch_first(batch):
    # The advice was arg.expand(batch, ...), which fails again; with as many samples as layers
    # the state was cut on its layer axis and torch's hidden-size error blamed the inputs.
    torch.manual_seed(15)
    model = GivenState().double().eval()
    x, h0 = sequences(batch=batch), torch.randn(2, batch, 5, dtype=torch.float64)
    with pytest.raises(InvalidInputError, match=r"batch is axis 1.*h0\.transpose\(0, 1\)"):
        Explainer(model, "lrp.epsilon").attribute(x, 1, additional_forward_args=h0)
    moved = GivenStateBatchFirst().double().eval()
    moved.load_state_dict(model.state_dict())
    got = Explainer(moved, "gradient").attribute(x, 1, additional_forward_args=h0.transpose(0, 1))
    leaf = x.clone().requires_grad_(True)
    (expected,) = torch.autograd.grad(model(leaf, h0)[:, 1].sum(), leaf)
    torch.testing.assert_close(got, expected)


class TokenGRU(nn.Module):
    """A text classifier whose forward takes token ids only (no ``inputs_embeds``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(20, 4)
        self.rnn, self.head = nn.GRU(4, 5, batch_first=True), nn.Linear(5, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embedding(tokens))[0][:, -1])


def test_explain_tokens_on_a_forward_without_inputs_embeds_says_what_it_calls():
    # It blamed the model: "the model's forward raised TypeError(... 'inputs_embeds') ...
    # this is the model's own error".
    torch.manual_seed(16)
    model = TokenGRU().double().eval()
    tokens = torch.randint(0, 20, (2, 6))
    with pytest.raises(InvalidInputError, match=r"inputs_embeds=vectors.*\(tokens\).*explain\(\)"):
        explain_tokens(model, {"input_ids": tokens}, "lrp.epsilon", 1, embedding=model.embedding)


@pytest.mark.parametrize("kind", ["lstm", "rnn_relu"])
def test_dynamic_contributions_follow_packed_sequences_to_the_layer(kind):
    # the lengths packing returns beside the data are no path of the input: an LSTM is refused
    # at its own operation (not at the zeros of its initial state), a ReLU RNN is exact
    model, x = packed_classifier(kind, "final", bias=False).eval(), padded_sequences()
    if kind == "lstm":
        with pytest.raises(UnsupportedModelError, match=r"operation 'lstm' in module 'rnn'"):
            explain(model, x, "dynamic.contributions", 1)
        return
    result = explain(model, x, "dynamic.contributions", 1)
    torch.testing.assert_close(result.attribution.sum((1, 2)), model(x)[:, 1], rtol=0, atol=1e-12)


class CountedBatches:
    """Data that counts the batches read from it."""

    def __init__(self, batches: list[torch.Tensor]) -> None:
        self.batches, self.read = batches, 0

    def __iter__(self):
        for batch in self.batches:
            self.read += 1
            yield batch


@pytest.mark.parametrize("cell", [False, True], ids=["layer", "cell"])
def test_fit_patterns_refuses_a_recurrent_net_before_reading_data(cell):
    # a ReLU RNN was read through the whole data, and PatternNet then refused its layer
    from explain_modbp.pattern import fit_patterns

    torch.manual_seed(17)
    layer = recurrent("rnn_relu", 4, 5, cell=cell, **({} if cell else {"batch_first": True}))
    model = (CellLoop(layer) if cell else Classifier(layer)).double().eval()
    data = CountedBatches([sequences(), sequences()])
    with pytest.raises(UnsupportedModelError, match=r"'(rnn|cell)' \(RNN(Cell)?\) is a recurrent"):
        fit_patterns(model, data)
    assert data.read == 0


class UnclampedLengths(LengthsFromPadding):
    """Its lengths not clamped to 1: an all-zero sequence has no steps to pack."""

    def forward(self, x: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(x, (x != 0).any(-1).sum(1))


def test_a_model_that_cannot_run_on_the_reference_is_told_so():
    # integrated gradients let torch's "Length of all samples has to be greater than 0" through
    torch.manual_seed(18)
    model = UnclampedLengths().double().eval()
    x = torch.randn(3, 7, 3, dtype=torch.float64)
    x[1, 5:], x[2, 3:] = 0, 0
    with pytest.raises(ModelRunError, match=r"raised .*Length.* on the reference input"):
        explain(model, x, "integrated_gradients", 1)
    result = explain(model, x, "integrated_gradients", 1, baselines=x * 1e-3)  # one it runs on
    assert torch.isfinite(result.attribution).all()
