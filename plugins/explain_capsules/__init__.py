"""Built-in plugin: capsule networks with dynamic routing and routing-entropy minimisation (REM).

Provides capsule layers (:class:`PrimaryCapsules`, :class:`FullyConnectedCapsules`,
:class:`ConvolutionalCapsules`), dynamic routing, REM's quantised couplings and parse-tree
dictionaries, the DR-CapsNet and multi-layer capsule models with margin loss and a resumable
training loop, recording of parse-tree data (:func:`record_parse_tree_data`) and REM saliency
maps of grid capsules (Eq. 16), registered as ``capsules.saliency``; magnitude pruning with
schedules and mask buffers, and compaction of pruned DR-CapsNets with torch-pruning
(``explain_capsules.compaction``, imported on demand so loading the plugin stays light). The REM
reproduction lives in ``benchmarks/reproduce_rem.py``.
"""

from __future__ import annotations

from explain_capsules.layers import ConvolutionalCapsules, FullyConnectedCapsules, PrimaryCapsules
from explain_capsules.models import DRCapsNet, MultiLayerCapsNet, margin_loss
from explain_capsules.pruning import (
    MagnitudePruner,
    PruningSchedule,
    apply_masks,
    masks,
    remove_masks,
    train_with_pruning,
)
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
from explain_core.cli.command import Command
from explain_core.distributed.jobs import Job
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
    "MagnitudePruner",
    "MultiLayerCapsNet",
    "ParseTreeDictionary",
    "PrimaryCapsules",
    "PruningSchedule",
    "apply_masks",
    "capsule_length",
    "capsule_saliency",
    "dynamic_routing",
    "find_grid_capsules",
    "lowest_lossless_levels",
    "margin_loss",
    "masks",
    "quantise_couplings",
    "quantise_to_levels",
    "record_parse_tree_data",
    "remove_masks",
    "saliency_grid",
    "squash",
    "train_capsnet",
    "train_with_pruning",
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


@hookimpl
def explain_demo_steps() -> list[object]:
    """The capsule and parse-tree sections of ``explain demo``."""
    from explain_capsules.demo import CapsulesREMDemoStep, ParseTreesDemoStep

    return [CapsulesREMDemoStep(), ParseTreesDemoStep()]


@hookimpl
def explain_register_commands() -> list[Command]:
    """``explain parse-tree``."""
    from explain_capsules import cli

    return [Command.from_module(cli)]


@hookimpl
def explain_register_jobs() -> list[Job]:
    """``rem-dictionary``: REM parse-tree dictionaries over a data set, merged over ranks."""
    from explain_capsules.jobs import RemDictionaryJob

    return [RemDictionaryJob()]
