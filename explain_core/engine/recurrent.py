"""Recurrent layers written out step by step, so that rules see their gates and products.

``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` reach the engine as single fused operations
(``torch.lstm``, ``torch.gru``, ``torch.rnn_tanh``, ``torch.rnn_relu``), and so do their cells
``nn.LSTMCell``, ``nn.GRUCell`` and ``nn.RNNCell`` (``torch.lstm_cell`` …, one time step). Inside
the engine's pass they are computed instead as the operations they stand for, per layer,
direction and time step, with the layer's own weights:

- LSTM: ``z = W [x_t; h_{t−1}] + b`` (one linear map, as Arras et al. 2017 write it), the gates
  ``i, f, o = σ(z_i), σ(z_f), σ(z_o)``, the candidate ``g = tanh(z_g)``,
  ``c_t = f ⊙ c_{t−1} + i ⊙ g`` and ``h_t = o ⊙ tanh(c_t)`` (times ``W_hr`` with projections).
- GRU: ``r, z = σ(W_r x + b_r + U_r h), σ(…)``, ``n = tanh(W_n x + b_n + r ⊙ (U_n h + b_hn))``
  and ``h_t = n + z ⊙ (h_{t−1} − n)``, which is ``(1 − z) ⊙ n + z ⊙ h_{t−1}`` written so that the
  gate ``z`` multiplies one tensor.
- Elman RNN: ``h_t = act(W [x_t; h_{t−1}] + b)`` with ``act`` tanh or ReLU (one linear map, as for
  the LSTM).

The composite's rules then apply to them as to a cell written by hand: LRP's presets hold the
sigmoid gates constant (all relevance to the signal: "signal-take-all"), pass relevance through
the tanh of the candidate and of the cell, and take their dense rule at the linear maps. The
values equal the fused kernels' up to float rounding; the model and ``torch`` are not changed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from explain_core.errors import UnsupportedModelError

__all__ = ["CELLS", "gru", "lstm", "rnn_relu", "rnn_tanh"]


def _check(kind: str, packed: bool, dropout: float, train: bool) -> None:
    if packed:
        raise UnsupportedModelError(
            f"the {kind} runs on a PackedSequence, which the relevance engine does not unpack; "
            "pad the sequences instead (torch.nn.utils.rnn.pad_packed_sequence, or pass the "
            "padded batch), and mask the padded steps in the explained output"
        )
    if dropout and train:
        raise UnsupportedModelError(
            f"the {kind} runs with dropout={dropout} between layers in training mode: explain "
            "the model in eval mode (model.eval())"
        )


def _layer_weights(
    params: Sequence[torch.Tensor], has_biases: bool, cells: int
) -> list[tuple[torch.Tensor, ...]]:
    """Per layer and direction: ``(w_ih, w_hh, b_ih, b_hh, w_hr)`` (``None`` where absent)."""
    per = len(params) // cells
    projected = per == (5 if has_biases else 3)
    weights = []
    for cell in range(cells):
        own = list(params[cell * per : (cell + 1) * per])
        w_hr = own.pop() if projected else None
        b_ih, b_hh = (own[2], own[3]) if has_biases else (None, None)
        weights.append((own[0], own[1], b_ih, b_hh, w_hr))
    return weights


def _sequence_first(x: torch.Tensor, batch_first: bool) -> torch.Tensor:
    return x.transpose(0, 1) if batch_first else x


State = tuple[torch.Tensor, ...]
Step = Callable[[tuple[torch.Tensor | None, ...], torch.Tensor, State], State]


def _unrolled(
    x: torch.Tensor,
    weights: list[tuple[torch.Tensor | None, ...]],
    initial: list[State],
    step: Step,
    num_layers: int,
    bidirectional: bool,
) -> tuple[torch.Tensor, list[State]]:
    """Run ``step(weights, x_t, state) → state`` (``state[0]`` the output) over the sequence.

    Per layer and direction (``weights[i]`` and ``initial[i]`` for cell ``i``), forwards in time
    or backwards; the directions' outputs are concatenated as the next layer's input.
    """
    directions = 2 if bidirectional else 1
    last = []
    for layer in range(num_layers):
        outputs = []
        for direction in range(directions):
            index = layer * directions + direction
            state = initial[index]
            steps = range(x.shape[0]) if direction == 0 else reversed(range(x.shape[0]))
            sequence: list[torch.Tensor] = [x[0]] * x.shape[0]
            for t in steps:
                state = step(weights[index], x[t], state)
                sequence[t] = state[0]
            outputs.append(torch.stack(sequence))
            last.append(state)
        x = torch.cat(outputs, dim=-1) if directions == 2 else outputs[0]
    return x, last


def _joint_linear(
    weights: tuple[torch.Tensor | None, ...], x: torch.Tensor, h: torch.Tensor
) -> torch.Tensor:
    """``W [x_t; h_{t−1}] + b``: one linear map, as Arras et al. write the LSTM's gates."""
    w_ih, w_hh, b_ih, b_hh, _ = weights
    weight = torch.cat([w_ih, w_hh], dim=1)  # type: ignore[list-item]
    bias = None if b_ih is None else b_ih + b_hh
    return F.linear(torch.cat([x, h], dim=-1), weight, bias)


def _lstm_step(weights: tuple[torch.Tensor | None, ...], x: torch.Tensor, state: State) -> State:
    h, c = state
    i, f, g, o = _joint_linear(weights, x, h).chunk(4, dim=-1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    h = torch.sigmoid(o) * torch.tanh(c)
    w_hr = weights[4]
    return (h if w_hr is None else F.linear(h, w_hr)), c


def _gru_step(weights: tuple[torch.Tensor | None, ...], x: torch.Tensor, state: State) -> State:
    w_ih, w_hh, b_ih, b_hh, _ = weights
    (h,) = state
    x_r, x_z, x_n = F.linear(x, w_ih, b_ih).chunk(3, dim=-1)  # type: ignore[arg-type]
    h_r, h_z, h_n = F.linear(h, w_hh, b_hh).chunk(3, dim=-1)  # type: ignore[arg-type]
    r, z = torch.sigmoid(x_r + h_r), torch.sigmoid(x_z + h_z)
    n = torch.tanh(x_n + r * h_n)
    return (n + z * (h - n),)


def _elman_step(activation: Callable[[torch.Tensor], torch.Tensor]) -> Step:
    def step(weights: tuple[torch.Tensor | None, ...], x: torch.Tensor, state: State) -> State:
        (h,) = state
        return (activation(_joint_linear(weights, x, h)),)

    return step


FusedLayer = Callable[..., tuple[torch.Tensor, ...]]


def _fused_layer(kind: str, operation: str, step: Step, states: int) -> FusedLayer:
    """A fused recurrent layer (``torch.lstm``, ``torch.gru`` …) written out as ``step``.

    With the fused operation's argument order; ``hx`` is the initial state (``(h_0, c_0)`` for
    an LSTM's two states), each tensor stacked over layers and directions. It returns
    ``(output, h_n)`` or ``(output, h_n, c_n)``, as the operation does.

    Raises:
        UnsupportedModelError: For packed sequences or dropout in training mode.
    """

    def layer(
        input: torch.Tensor,
        hx: Sequence[torch.Tensor] | torch.Tensor,
        params: Sequence[torch.Tensor] | torch.Tensor,
        has_biases: bool = True,
        num_layers: int = 1,
        dropout: float = 0.0,
        train: bool = False,
        bidirectional: bool = False,
        batch_first: bool = False,
        *rest: object,
    ) -> tuple[torch.Tensor, ...]:
        # Packed, the operation takes (data, batch_sizes, hx, params, …): one tensor more first
        packed = isinstance(hx, torch.Tensor) if states > 1 else isinstance(params, torch.Tensor)
        _check(kind, packed, dropout, train)
        initial = tuple(hx) if states > 1 else (hx,)
        cells = num_layers * (2 if bidirectional else 1)
        weights = _layer_weights(params, has_biases, cells)  # type: ignore[arg-type]
        per_cell = [tuple(state[i] for state in initial) for i in range(cells)]
        x = _sequence_first(input, batch_first)  # type: ignore[arg-type]
        x, last = _unrolled(x, weights, per_cell, step, num_layers, bidirectional)
        final = (torch.stack(state) for state in zip(*last, strict=True))
        return _sequence_first(x, batch_first), *final

    layer.__name__ = operation
    finals = "h_n, c_n" if states > 1 else "h_n"
    layer.__doc__ = f"``torch.{operation}`` as its cell equations: ``(output, {finals})``."
    return layer


lstm = _fused_layer("LSTM", "lstm", _lstm_step, states=2)
gru = _fused_layer("GRU", "gru", _gru_step, states=1)
rnn_tanh = _fused_layer("RNN", "rnn_tanh", _elman_step(torch.tanh), states=1)
rnn_relu = _fused_layer("RNN", "rnn_relu", _elman_step(torch.relu), states=1)


def _cell(step: Step, states: int) -> Callable[..., tuple[torch.Tensor, ...] | torch.Tensor]:
    """A fused one-step cell (``torch.lstm_cell`` …) as ``step``, with its argument order."""

    def cell(
        input: torch.Tensor,
        hx: Sequence[torch.Tensor] | torch.Tensor,
        w_ih: torch.Tensor,
        w_hh: torch.Tensor,
        b_ih: torch.Tensor | None = None,
        b_hh: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...] | torch.Tensor:
        state = tuple(hx) if states > 1 else (hx,)
        new = step((w_ih, w_hh, b_ih, b_hh, None), input, state)  # type: ignore[arg-type]
        return new if states > 1 else new[0]

    return cell


CELLS: dict[str, Callable[..., tuple[torch.Tensor, ...] | torch.Tensor]] = {
    "lstm_cell": _cell(_lstm_step, 2),
    "gru_cell": _cell(_gru_step, 1),
    "rnn_tanh_cell": _cell(_elman_step(torch.tanh), 1),
    "rnn_relu_cell": _cell(_elman_step(torch.relu), 1),
}
"""Fused cells (``nn.LSTMCell``, ``nn.GRUCell``, ``nn.RNNCell``) → their equations."""
