"""Routing layers: capsule layers whose coupling coefficients can be recorded.

A routing layer computes coupling coefficients ``c_ij`` between its ``n_in`` input capsules and
``n_out`` output capsules. Inside :func:`record_routing` every forward pass of every routing layer
(in the recording's thread or asyncio task only) hands its final couplings and capsule activations
to the recording; outside it, layers keep no reference to them. When the context closes, the
recording is emptied, so nothing from inside the context is kept alive by the library: copy what you
need (e.g. counts of quantised keys) while the context is open, or :meth:`RoutingRecording.drain`
events batch by batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from explain_core.eager import eager_mode, uncompiled
from explain_core.errors import InvalidInputError
from explain_core.model_guard import ModelGuard, require_eval_mode
from explain_core.scoped import scoped_setting, scoped_settings

__all__ = [
    "CouplingTransform",
    "RoutedBatches",
    "RoutingEvent",
    "RoutingLayer",
    "RoutingRecording",
    "record_routing",
    "record_routing_batches",
    "routing_in_eval_mode",
]

CouplingTransform = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class RoutingEvent:
    """What one routing layer computed in one forward pass.

    Attributes:
        layer: Qualified name of the layer inside the recorded model (``""`` for the root).
        call: Index of this forward call of the layer within the recording.
        couplings: Final coupling coefficients, shape ``(batch, n_in, n_out)``; for convolutional
            capsules ``n_in`` and ``n_out`` enumerate grid positions times capsule types.
        input_activations: Activation probability ``‖u_i‖`` of each input capsule,
            shape ``(batch, n_in)``.
        output_activations: Activation probability ``‖v_j‖`` of each output capsule,
            shape ``(batch, n_out)``.
    """

    layer: str
    call: int
    couplings: torch.Tensor
    input_activations: torch.Tensor
    output_activations: torch.Tensor


class RoutingLayer(nn.Module):
    """Base class of capsule layers with routing; subclasses call :meth:`emit_routing`."""

    @property
    def is_recording(self) -> bool:
        """Whether a recording listens in this context (lets layers skip work done only for it)."""
        return bool(self._recordings())

    @property
    def routes_in_training_mode(self) -> bool:
        """Whether this layer routes as in training mode here (see :func:`routing_in_eval_mode`).

        Its training flag, unless :func:`routing_in_eval_mode` holds in this context.
        """
        return self.training and not scoped_setting(self, _EVAL_ROUTING, False)

    def _recordings(self) -> tuple[RoutingRecording, ...]:
        return scoped_setting(self, _RECORDINGS, ())

    def emit_routing(
        self,
        couplings: torch.Tensor,
        input_activations: torch.Tensor,
        output_activations: torch.Tensor,
    ) -> None:
        """Hand the final couplings and activations of this forward pass to active recordings.

        Args:
            couplings: ``(batch, n_in, n_out)`` coupling coefficients.
            input_activations: ``(batch, n_in)`` input capsule lengths.
            output_activations: ``(batch, n_out)`` output capsule lengths.

        Raises:
            ValueError: If the shapes do not agree with each other.
        """
        recordings = self._recordings()
        if not recordings:
            return
        batch, n_in, n_out = couplings.shape
        if input_activations.shape != (batch, n_in) or output_activations.shape != (batch, n_out):
            raise ValueError(
                f"{type(self).__name__}.emit_routing: couplings {tuple(couplings.shape)} need "
                f"input activations ({batch}, {n_in}) and output activations ({batch}, {n_out}); "
                f"got {tuple(input_activations.shape)} and {tuple(output_activations.shape)}"
            )
        for recording in recordings:
            recording._receive(self, couplings, input_activations, output_activations)


class RoutingRecording:
    """Events recorded from the routing layers of one model; see :func:`record_routing`."""

    def __init__(
        self,
        names: dict[RoutingLayer, str],
        transform: CouplingTransform | None,
        keep_on_device: bool,
    ) -> None:
        self._names = names
        self._transform = transform
        self._keep_on_device = keep_on_device
        self._events: list[RoutingEvent] = []
        self._calls: dict[str, int] = {}
        self._open = True

    @property
    def layers(self) -> list[str]:
        """Names of the routing layers being recorded, in module order."""
        return list(self._names.values())

    @property
    def events(self) -> list[RoutingEvent]:
        """Events recorded since the last :meth:`drain`, oldest first."""
        self._require_open()
        return list(self._events)

    def drain(self) -> list[RoutingEvent]:
        """Return and forget the events recorded so far (for streaming over many batches)."""
        self._require_open()
        events, self._events = self._events, []
        return events

    def couplings(self, layer: str) -> torch.Tensor:
        """Couplings of one layer from all undrained calls, concatenated over the batch axis.

        Raises:
            KeyError: If the layer is not a routing layer of the model or recorded nothing.
        """
        return torch.cat([e.couplings for e in self._events_of(layer)])

    def activations(self, layer: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Input and output capsule activations of one layer, concatenated over the batch axis."""
        events = self._events_of(layer)
        return (
            torch.cat([e.input_activations for e in events]),
            torch.cat([e.output_activations for e in events]),
        )

    def _events_of(self, layer: str) -> list[RoutingEvent]:
        self._require_open()
        if layer not in self._names.values():
            raise KeyError(f"{layer!r} is not a routing layer; recorded layers: {self.layers}")
        events = [e for e in self._events if e.layer == layer]
        if not events:
            raise KeyError(f"routing layer {layer!r} recorded nothing yet; run the model first")
        return events

    def _receive(
        self,
        layer: RoutingLayer,
        couplings: torch.Tensor,
        input_activations: torch.Tensor,
        output_activations: torch.Tensor,
    ) -> None:
        name = self._names[layer]
        call = self._calls.get(name, 0)
        self._calls[name] = call + 1
        couplings = couplings.detach()
        if self._transform is not None:
            couplings = self._transform(couplings)
        tensors = [couplings, input_activations.detach(), output_activations.detach()]
        if not self._keep_on_device:
            tensors = [t.cpu() for t in tensors]
        self._events.append(RoutingEvent(name, call, *tensors))

    def _close(self) -> None:
        self._events = []
        self._names = {}
        self._open = False

    def _require_open(self) -> None:
        if not self._open:
            raise RuntimeError(
                "this routing recording is closed and holds no tensors any more; read the "
                "couplings inside the `with record_routing(model)` block"
            )


@contextmanager
def record_routing(
    model: nn.Module,
    *,
    transform: CouplingTransform | None = None,
    keep_on_device: bool = False,
) -> Iterator[RoutingRecording]:
    """Record the couplings and activations of every routing layer in ``model``.

    Args:
        model: A model containing :class:`RoutingLayer` submodules.
        transform: Optional step applied to the couplings before they are stored, e.g. a
            quantiser into K levels.
        keep_on_device: Keep recorded tensors on the model's device instead of moving them to
            the CPU.

    Yields:
        The recording, readable while the context is open.

    Raises:
        ValueError: If the model contains no routing layer.
    """
    modules = uncompiled(model).named_modules()
    names = {m: name for name, m in modules if isinstance(m, RoutingLayer)}
    if not names:
        raise ValueError(
            f"{type(model).__name__} contains no RoutingLayer; only capsule layers deriving from "
            "explain_core.RoutingLayer can be recorded"
        )
    recording = RoutingRecording(names, transform, keep_on_device)

    joined = {layer: (*layer._recordings(), recording) for layer in names}
    try:
        # In this context only: other threads running the model record nothing. A compiled
        # model would not run the recorders' Python code.
        with scoped_settings(_RECORDINGS, joined), eager_mode():
            yield recording
    finally:
        recording._close()


_RECORDINGS = "routing_recordings"
_EVAL_ROUTING = "routing_in_eval_mode"


@contextmanager
def routing_in_eval_mode(model: nn.Module) -> Iterator[None]:
    """Route every :class:`RoutingLayer` of ``model`` as in eval mode, in this context only.

    Writing ``model.eval()`` would switch the layers for every thread using the model (a
    training thread would route with eval-only coupling transforms) and, put back afterwards,
    undo a switch another thread made meanwhile; the layers read this setting instead
    (:attr:`RoutingLayer.routes_in_training_mode`). Other mode-dependent layers are not
    covered: check them with :func:`~explain_core.model_guard.require_eval_mode`.
    """
    layers = [m for m in uncompiled(model).modules() if isinstance(m, RoutingLayer)]
    with scoped_settings(_EVAL_ROUTING, dict.fromkeys(layers, True)):
        yield


@dataclass(frozen=True)
class RoutedBatches:
    """Every routing layer's events over a data set, from :func:`record_routing_batches`.

    Attributes:
        layers: Layer name → its concatenated event (couplings and activations of all samples,
            on the CPU), in the order the forward pass calls the layers.
        outputs: The model's scores ``(N, n_outputs)`` on the CPU.
    """

    layers: dict[str, RoutingEvent]
    outputs: torch.Tensor


def record_routing_batches(
    model: nn.Module,
    inputs: torch.Tensor,
    *,
    batch_size: int = 256,
    transform: CouplingTransform | None = None,
) -> RoutedBatches:
    """Run ``model`` over ``inputs`` in batches and record every routing layer's couplings.

    The one capsule recorder: parse-tree data and REM's dictionaries are built from it. The model
    runs under ``torch.no_grad`` on the device of its parameters, its routing layers as in eval
    mode (so eval-only coupling transforms such as REM's quantiser apply; their training flags
    are not touched). The model is only read, so other threads may use it meanwhile; what a
    forward pass sets on it (e.g. a capsule grid's shape) stays, as after a plain forward. Every
    forward pass must call each routing layer exactly once, in the same order.

    Args:
        model: A model with :class:`RoutingLayer` submodules returning ``(batch, n_outputs)``.
        inputs: ``(N, ...)`` inputs.
        batch_size: Samples per forward pass.
        transform: Applied to the *recorded* couplings only (e.g. a quantiser); the model routes
            with its own.

    Raises:
        InvalidInputError: For a bad ``batch_size``, a model without routing layers, an output
            that is not ``(batch, n_outputs)``, or routing layers called twice in one pass or
            differently from batch to batch.
        ModelStateError: If another mode-dependent layer (BatchNorm, Dropout) is in training
            mode: call ``model.eval()`` first.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidInputError(f"batch_size must be a positive int; got {batch_size!r}")
    device = next((p.device for p in model.parameters()), inputs.device)
    per_batch: list[dict[str, RoutingEvent]] = []
    outputs = []
    require_eval_mode(model)
    with (
        ModelGuard(model),  # reads only: other threads may use the model meanwhile
        torch.no_grad(),
        routing_in_eval_mode(model),
        record_routing(model, transform=transform) as recording,
    ):
        for start in range(0, inputs.shape[0], batch_size):
            output = model(inputs[start : start + batch_size].to(device))
            if not isinstance(output, torch.Tensor) or output.dim() != 2:
                shape = tuple(output.shape) if isinstance(output, torch.Tensor) else output
                raise InvalidInputError(
                    f"{type(model).__name__} must return (batch, n_outputs) scores; got "
                    f"{shape if isinstance(shape, tuple) else type(shape).__name__}"
                )
            events = _one_event_per_layer(recording.drain())
            if per_batch and list(events) != list(per_batch[0]):
                raise InvalidInputError(
                    f"routing layers {list(events)} ran for the batch starting at {start}, "
                    f"but {list(per_batch[0])} for the first batch; every forward pass must "
                    "call each routing layer exactly once, in the same order"
                )
            per_batch.append(events)
            outputs.append(output.detach().cpu().clone())
    layers = {
        name: RoutingEvent(
            name,
            0,
            torch.cat([batch[name].couplings for batch in per_batch]),
            torch.cat([batch[name].input_activations for batch in per_batch]),
            torch.cat([batch[name].output_activations for batch in per_batch]),
        )
        for name in (per_batch[0] if per_batch else {})
    }
    return RoutedBatches(layers, torch.cat(outputs) if outputs else torch.empty(0, 0))


def _one_event_per_layer(events: list[RoutingEvent]) -> dict[str, RoutingEvent]:
    """One event per layer of one forward pass, in call order; routing twice is an error."""
    found: dict[str, RoutingEvent] = {}
    for event in events:
        if event.layer in found:
            raise InvalidInputError(
                f"routing layer {event.layer!r} ran more than once in one forward pass; "
                "parse-tree data needs each routing layer called exactly once per pass"
            )
        found[event.layer] = event
    return found
