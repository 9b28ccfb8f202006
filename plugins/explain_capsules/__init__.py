"""Built-in plugin: capsule networks with dynamic routing and routing-entropy minimisation (REM).

Provides capsule layers (:class:`PrimaryCapsules`, :class:`FullyConnectedCapsules`,
:class:`ConvolutionalCapsules`), dynamic routing, REM's quantised couplings and parse-tree
dictionaries, the DR-CapsNet and multi-layer capsule models with margin loss and a resumable
training loop, recording of parse-tree data (:func:`record_parse_tree_data`) and REM saliency
maps of grid capsules (Eq. 16), registered as ``capsules.saliency``. Pruning, compaction and the
REM reproduction are not here yet.
"""

from __future__ import annotations

from explain_capsules.layers import ConvolutionalCapsules, FullyConnectedCapsules, PrimaryCapsules
from explain_capsules.models import DRCapsNet, MultiLayerCapsNet, margin_loss
from explain_capsules.recording import CapsuleRecording, LayerRecording, record_parse_tree_data
from explain_capsules.rem import (
    ParseTreeDictionary,
    lowest_lossless_levels,
    quantise_couplings,
    quantise_to_levels,
)
from explain_capsules.routing import capsule_length, dynamic_routing, squash
from explain_capsules.saliency import (
    CapsuleSaliency,
    capsule_saliency,
    find_grid_capsules,
    saliency_grid,
)
from explain_capsules.training import CapsuleTrainConfig, train_capsnet
from explain_core.hookspecs import hookimpl
from explain_core.registry import MethodSpec

__all__ = [
    "CapsuleRecording",
    "CapsuleSaliency",
    "CapsuleTrainConfig",
    "ConvolutionalCapsules",
    "DRCapsNet",
    "FullyConnectedCapsules",
    "LayerRecording",
    "MultiLayerCapsNet",
    "ParseTreeDictionary",
    "PrimaryCapsules",
    "capsule_length",
    "capsule_saliency",
    "dynamic_routing",
    "find_grid_capsules",
    "lowest_lossless_levels",
    "margin_loss",
    "quantise_couplings",
    "quantise_to_levels",
    "record_parse_tree_data",
    "saliency_grid",
    "squash",
    "train_capsnet",
]


@hookimpl
def explain_register_methods() -> list[MethodSpec]:
    """The capsule family."""
    return [
        MethodSpec(
            "capsules.saliency",
            CapsuleSaliency,
            "capsules",
            "REM saliency of grid capsules: ‖u‖ × (quantised) coupling to the class, averaged "
            "over capsule types, upsampled bilinearly (Eq. 16)",
        )
    ]
