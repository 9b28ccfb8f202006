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

On a packed sequence (``pack_padded_sequence``) each sequence runs over its own length, as in
the fused kernels; the output is packed too.

The composite's rules then apply to them as to a cell written by hand: LRP's presets hold the
sigmoid gates constant (all relevance to the signal: "signal-take-all"), pass relevance through
the tanh of the candidate and of the cell, and take their dense rule at the linear maps. Where
the signal a gate multiplies comes from a constant state alone (the first step from a zero,
learned or given initial state: an LSTM's ``f ⊙ c_0``, a GRU's ``r ⊙ (U_n h_0 + b_hn)``), the gate
is held there too, by the cell itself: the product is a constant, whose relevance stays there as
a bias's does, where a rule would otherwise see a gate scaled by a constant (a linear map) and pass
the relevance into the gate. The pass tells the cells which tensors depend on the input
(:func:`input_dependence`). The values equal the fused kernels' up to float rounding; the model
and ``torch`` are not changed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F

from explain_core.engine.ops import without_function_modes
from explain_core.errors import UnsupportedModelError

__all__ = ["CELLS", "gru", "input_dependence", "lstm", "rnn_relu", "rnn_tanh"]

_DEPENDS_ON_INPUT: ContextVar[Callable[[torch.Tensor], bool] | None] = ContextVar(
    "depends_on_input", default=None
)


@contextmanager
def input_dependence(test: Callable[[torch.Tensor], bool]) -> Iterator[None]:
    """Inside the block the cells ask ``test`` whether a state depends on the input.

    An engine pass (or trace) sets it around the layers it writes out; without it every state
    counts as input-dependent and every gate is left to the rules (a plain gradient's graph).
    """
    token = _DEPENDS_ON_INPUT.set(test)
    try:
        yield
    finally:
        _DEPENDS_ON_INPUT.reset(token)


def _gate_on(gate: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """``gate``, or a constant copy of it where ``state``, its signal's source, is constant.

    The copy is made unseen by the pass, so the product is a constant for every rule.
    """
    test = _DEPENDS_ON_INPUT.get()
    if test is None or test(state):
        return gate
    with without_function_modes():
        return gate.detach()


def _check(kind: str, dropout: float, train: bool, num_layers: int) -> None:
    if dropout and train and num_layers > 1:  # one layer: no dropout between layers to apply
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


State = tuple[torch.Tensor, ...]
Step = Callable[[tuple[torch.Tensor | None, ...], torch.Tensor, State], State]


def _rows(state: State, start: int, stop: int) -> State:
    """Rows ``start:stop`` (sequences) of each tensor of ``state``; itself where that is all."""
    if start == 0 and stop == len(state[0]):
        return state
    return tuple(tensor[start:stop] for tensor in state)


def _joined(parts: list[State]) -> State:
    """The states of consecutive groups of sequences, as one state."""
    if len(parts) == 1:
        return parts[0]
    return tuple(torch.cat(tensors) for tensors in zip(*parts, strict=True))


def _packed_step(
    step: Step,
    weights: tuple[torch.Tensor | None, ...],
    x: torch.Tensor,
    state: State,
    initial: State,
) -> tuple[torch.Tensor, State]:
    """One time step of a packed batch: the output of its sequences, the state of all so far.

    ``x`` holds the inputs of the first ``len(x)`` sequences, ``state`` the state of those
    started so far (the first ``len(state[0])``). Sequences whose first step this is (backwards
    in time: whose last step) start from ``initial`` in a call of ``step`` of their own, not as
    rows of the running state, so that a constant initial state stays a constant for the
    rules, as in a padded batch. Sequences that have ended keep their final state.
    """
    rows, started = len(x), len(state[0])
    going = min(rows, started)
    parts = []
    if going:
        parts.append(step(weights, x if going == rows else x[:going], _rows(state, 0, going)))
    if rows > going:
        parts.append(step(weights, x[going:] if going else x, _rows(initial, going, rows)))
    advanced = _joined(parts)
    if started > rows:
        return advanced[0], _joined([advanced, _rows(state, rows, started)])
    return advanced[0], advanced


def _unrolled(
    steps: list[torch.Tensor],
    packed: bool,
    weights: list[tuple[torch.Tensor | None, ...]],
    initial: list[State],
    step: Step,
    num_layers: int,
    bidirectional: bool,
) -> tuple[list[torch.Tensor], list[State]]:
    """Run ``step(weights, x_t, state) → state`` (``state[0]`` the output) over the sequence.

    ``steps[t]`` holds the inputs at time ``t``: of every sequence for a padded batch; for a
    packed one (sorted by length, longest first, as ``pack_padded_sequence`` packs them) of
    the first ``len(steps[t])``, those at least ``t + 1`` long, so that each sequence runs over
    its own length: forwards from its first step, backwards from its last, its final state the
    one after its own last step. Per layer and direction (``weights[i]`` and ``initial[i]`` for
    cell ``i``); the directions' outputs are concatenated as the next layer's input. Returns
    the last layer's outputs per time step and each cell's final state.
    """
    directions = 2 if bidirectional else 1
    last = []
    for layer in range(num_layers):
        outputs = []
        for direction in range(directions):
            index = layer * directions + direction
            # packed: the sequences started so far (none); padded: every one, from the start
            state = _rows(initial[index], 0, 0) if packed else initial[index]
            times = range(len(steps)) if direction == 0 else reversed(range(len(steps)))
            sequence = list(steps)
            for t in times:
                if packed:
                    sequence[t], state = _packed_step(
                        step, weights[index], steps[t], state, initial[index]
                    )
                else:  # no sizes compared: an export keeps the batch size symbolic
                    state = step(weights[index], steps[t], state)
                    sequence[t] = state[0]
            outputs.append(sequence)
            last.append(state)
        if directions == 2:
            steps = [torch.cat(pair, dim=-1) for pair in zip(*outputs, strict=True)]
        else:
            steps = outputs[0]
    return steps, last


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
    c = _gate_on(torch.sigmoid(f), c) * c + torch.sigmoid(i) * torch.tanh(g)
    h = torch.sigmoid(o) * torch.tanh(c)
    w_hr = weights[4]
    return (h if w_hr is None else F.linear(h, w_hr)), c


def _gru_step(weights: tuple[torch.Tensor | None, ...], x: torch.Tensor, state: State) -> State:
    w_ih, w_hh, b_ih, b_hh, _ = weights
    (h,) = state
    x_r, x_z, x_n = F.linear(x, w_ih, b_ih).chunk(3, dim=-1)  # type: ignore[arg-type]
    h_r, h_z, h_n = F.linear(h, w_hh, b_hh).chunk(3, dim=-1)  # type: ignore[arg-type]
    r, z = torch.sigmoid(x_r + h_r), torch.sigmoid(x_z + h_z)
    n = torch.tanh(x_n + _gate_on(r, h) * h_n)
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
    ``(output, h_n)`` or ``(output, h_n, c_n)``, as the operation does: on a packed sequence
    (``data, batch_sizes`` in place of ``input``) ``output`` is packed too.

    Raises:
        UnsupportedModelError: For dropout in training mode.
    """

    def layer(*args: Any) -> tuple[torch.Tensor, ...]:
        # Packed, the operation takes (data, batch_sizes, hx, params, has_biases, num_layers,
        # dropout, train, bidirectional); padded, (input, hx, params, …, batch_first). hx is a
        # list for an LSTM, one tensor otherwise: what follows input is a tensor only packed.
        packed = isinstance(args[1 if states > 1 else 2], torch.Tensor)
        if packed:
            data, batch_sizes, hx, params, has_biases, num_layers, dropout, train, bidi = args
            steps = list(data.split(batch_sizes.tolist()))
        else:
            data, hx, params, has_biases, num_layers, dropout, train, bidi, batch_first = args
            steps = list(data.unbind(1 if batch_first else 0))
        _check(kind, dropout, train, num_layers)
        initial = tuple(hx) if states > 1 else (hx,)
        cells = num_layers * (2 if bidi else 1)
        weights = _layer_weights(params, has_biases, cells)
        per_cell = [tuple(state[i] for state in initial) for i in range(cells)]
        outputs, last = _unrolled(steps, packed, weights, per_cell, step, num_layers, bidi)
        # packed: the steps one after another; padded: stacked along the time dimension
        output = torch.cat(outputs) if packed else torch.stack(outputs, dim=int(batch_first))
        final = (torch.stack(state) for state in zip(*last, strict=True))
        return output, *final

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
