"""Recording the parse-tree data of a capsule network: couplings and activations of every layer.

:func:`record_parse_tree_data` runs a model over a data set batch by batch inside
:func:`~explain_core.interfaces.routing.record_routing` and returns plain CPU copies of what every
routing layer computed (couplings, optionally rounded into ``K`` levels as REM's ``c̃``, and the
input/output capsule activations), together with the predictions. The returned
:class:`CapsuleRecording` holds no reference to the model or to the (closed) routing recording.

Rounding the *recorded* couplings does not change how the model routes. REM's "+Q" model routes
with quantised couplings; record it inside :func:`~explain_capsules.rem.quantised_routing`::

    with quantised_routing(model, levels=11):
        recording = record_parse_tree_data(model, inputs, levels=11)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from explain_core.eager import uncompiled
from explain_core.interfaces.routing import RoutingEvent, record_routing
from explain_core.model_guard import ModelGuard
from explain_core.parse_trees.data import check_record_inputs, routing_parents
from explain_core.quantisation import check_levels, quantise_couplings
from explain_core.targets import select_target

__all__ = ["CapsuleRecording", "LayerRecording", "record_parse_tree_data"]


@dataclass(frozen=True)
class LayerRecording:
    """What one routing layer computed for all ``N`` recorded samples (CPU tensors).

    Attributes:
        name: Qualified module name of the layer in the model (``""`` for the root).
        n_in: Number of input (lower) capsules.
        n_out: Number of output (upper) capsules.
        couplings: Final coupling coefficients ``(N, n_in, n_out)``; quantised to ``k / (K-1)``
            values when the recording was made with ``levels=K``.
        input_activations: Input capsule lengths ``‖u_i‖``, ``(N, n_in)``.
        output_activations: Output capsule lengths ``‖v_j‖``, ``(N, n_out)``.
        parents: Over how many parents the routing softmax normalises each input capsule's
            couplings: ``n_out`` for fully connected layers, ``out_types`` for
            :class:`~explain_capsules.layers.ConvolutionalCapsules` (one window's capsules);
            ``None``: ``n_out``. Parse trees take its uniform coupling as default threshold.
    """

    name: str
    n_in: int
    n_out: int
    couplings: torch.Tensor
    input_activations: torch.Tensor
    output_activations: torch.Tensor
    parents: int | None = None


@dataclass(frozen=True)
class CapsuleRecording:
    """Parse-tree data of ``N`` samples: every routing layer in module order, plus predictions.

    All tensors are detached CPU copies.

    Attributes:
        layers: One :class:`LayerRecording` per routing layer that ran, in the order the
            forward pass calls them (which parse trees take as the order of the capsule layers);
            routing layers never called in the forward pass are left out.
        predicted: Predicted class per sample, ``argmax`` of the model output, int64 ``(N,)``.
        outputs: Model outputs ``(N, n_outputs)``.
        levels: Number of quantisation levels ``K`` applied to the couplings, or ``None``.
    """

    layers: tuple[LayerRecording, ...]
    predicted: torch.Tensor
    outputs: torch.Tensor
    levels: int | None = None

    @property
    def names(self) -> list[str]:
        """Names of the recorded routing layers, in the order the forward pass calls them."""
        return [layer.name for layer in self.layers]

    @property
    def n_samples(self) -> int:
        """Number of recorded samples ``N``."""
        return int(self.predicted.shape[0])

    def layer(self, name: str) -> LayerRecording:
        """The recording of one routing layer by name.

        Raises:
            KeyError: If no routing layer of that name was recorded.
        """
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(f"no routing layer {name!r} was recorded; recorded layers: {self.names}")


@contextmanager
def inference_mode_of(model: nn.Module) -> Iterator[None]:
    """Eval mode and ``torch.no_grad`` for the block; every module's training flag is restored."""
    flags = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module, flag in flags:
            module.training = flag


def _model_device(model: nn.Module, fallback: torch.device) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    return fallback


def _events_by_layer(events: list[RoutingEvent]) -> dict[str, RoutingEvent]:
    """One event per layer for one forward pass, in call order; routing twice is an error."""
    found: dict[str, RoutingEvent] = {}
    for event in events:
        if event.layer in found:
            raise ValueError(
                f"routing layer {event.layer!r} ran more than once in one forward pass; "
                "parse-tree data needs each routing layer called exactly once per pass"
            )
        found[event.layer] = event
    return found


def record_parse_tree_data(
    model: nn.Module,
    inputs: torch.Tensor,
    *,
    levels: int | None = None,
    batch_size: int = 256,
) -> CapsuleRecording:
    """Run ``model`` over ``inputs`` and record the couplings and activations of every layer.

    The model runs in eval mode under ``torch.no_grad`` (so eval-only coupling transforms such as
    REM's quantiser apply) and is left exactly as it was: training flags and what a forward pass
    sets (e.g. ``PrimaryCapsules.grid_shape``) are restored, also on error. Batches are moved to
    the device of the model's parameters; everything recorded is copied to the CPU while the
    recording is open, so nothing refers to it once it closes. Layers are recorded in the order
    the forward pass calls them.

    Args:
        model: A capsule network with :class:`~explain_core.interfaces.routing.RoutingLayer`
            submodules, returning ``(batch, n_outputs)`` scores (e.g. class capsule lengths).
        inputs: ``(N, ...)`` floating-point inputs of the model's dtype.
        levels: Round the *recorded* couplings into ``K = levels`` uniform levels
            (:func:`~explain_capsules.rem.quantise_couplings`, REM's ``c̃``); ``None`` keeps
            them as computed. Only the copies are rounded: the model still routes with its own
            couplings (continuous unless a layer has a ``coupling_transform``), so predictions,
            activations and the couplings of later layers are those of the unquantised model.
            To record REM's "+Q" model, which routes with quantised couplings, call this inside
            ``with quantised_routing(model, levels=K):`` (:func:`~explain_capsules.rem.
            quantised_routing`).
        batch_size: Samples per forward pass.

    Returns:
        The recording of all ``N`` samples.

    Raises:
        ValueError: On empty, non-floating or wrongly typed inputs (``InvalidInputError``), a
            bad ``levels`` or ``batch_size``, a model without routing layers, a routing layer
            running more than once per forward pass, or routing layers that ran for some batches
            only or in another order.
    """
    check_levels(levels, optional=True)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int; got {batch_size!r}")
    check_record_inputs(model, inputs)
    transform = None if levels is None else partial(quantise_couplings, levels=levels)
    device = _model_device(model, inputs.device)
    per_layer: dict[str, list[RoutingEvent]] | None = None
    outputs: list[torch.Tensor] = []
    with (
        ModelGuard(model, restore=True),
        inference_mode_of(model),
        record_routing(model, transform=transform) as recording,
    ):
        for start in range(0, inputs.shape[0], batch_size):
            output = model(inputs[start : start + batch_size].to(device))
            select_target(output, None)  # checks the (batch, n_outputs) shape
            events = _events_by_layer(recording.drain())
            if per_layer is None:
                per_layer = {name: [] for name in events}
            if list(events) != list(per_layer):
                raise ValueError(
                    f"routing layers {list(events)} ran for batch starting at {start}, but "
                    f"{list(per_layer)} for the first batch; the forward pass must call the "
                    "same routing layers in the same order for every batch"
                )
            for name, event in events.items():
                per_layer[name].append(event)
            outputs.append(output.detach().cpu().clone())
    assert per_layer is not None  # at least one batch ran
    modules = dict(uncompiled(model).named_modules())
    layers = [_layer_recording(name, events, modules[name]) for name, events in per_layer.items()]
    all_outputs = torch.cat(outputs)
    return CapsuleRecording(
        layers=tuple(layers),
        predicted=all_outputs.argmax(dim=1),
        outputs=all_outputs,
        levels=levels,
    )


def _layer_recording(name: str, events: list[RoutingEvent], module: nn.Module) -> LayerRecording:
    couplings = torch.cat([e.couplings for e in events])
    n_out = int(couplings.shape[2])
    return LayerRecording(
        name=name,
        n_in=int(couplings.shape[1]),
        n_out=n_out,
        couplings=couplings,
        input_activations=torch.cat([e.input_activations for e in events]),
        output_activations=torch.cat([e.output_activations for e in events]),
        parents=routing_parents(module, n_out),
    )
