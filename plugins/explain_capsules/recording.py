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

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from explain_core.eager import uncompiled
from explain_core.interfaces.routing import RoutingEvent, record_routing_batches
from explain_core.parse_trees.data import check_record_inputs, routing_parents
from explain_core.quantisation import check_levels, quantise_couplings

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
            ``with quantised_routing(model, levels=K):``
            (:func:`~explain_capsules.rem.quantised_routing`).
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
    check_record_inputs(model, inputs)
    transform = None if levels is None else partial(quantise_couplings, levels=levels)
    routed = record_routing_batches(model, inputs, batch_size=batch_size, transform=transform)
    modules = dict(uncompiled(model).named_modules())
    layers = [_layer_recording(event, modules[name]) for name, event in routed.layers.items()]
    return CapsuleRecording(
        layers=tuple(layers),
        predicted=routed.outputs.argmax(dim=1),
        outputs=routed.outputs,
        levels=levels,
    )


def _layer_recording(event: RoutingEvent, module: nn.Module) -> LayerRecording:
    n_out = int(event.couplings.shape[2])
    return LayerRecording(
        name=event.layer,
        n_in=int(event.couplings.shape[1]),
        n_out=n_out,
        couplings=event.couplings,
        input_activations=event.input_activations,
        output_activations=event.output_activations,
        parents=routing_parents(module, n_out),
    )
