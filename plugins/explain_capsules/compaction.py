"""Physical compaction of pruned capsule networks (after REM masking).

REM pruning zeroes weights through masks; the zeroed units still cost memory and time. This
module finds the units pruning left *dead* and removes them, so the compacted model computes the
same outputs with fewer parameters:

* a first-convolution output channel of :class:`~explain_capsules.models.DRCapsNet` whose
  ``ReLU(conv)`` output is identically zero (all-zero weights and a bias ``≤ 0``), or which no
  primary-capsule weight reads (all-zero input slice of the primary convolution). A channel with
  zero weights but a positive bias is a constant non-zero map and is kept;
* a primary capsule type whose ``capsule_dim`` convolution channels are all zero (weights and
  bias), so every capsule of that type is the zero vector, or whose routing weights ``W[i]`` in
  the class capsule layer are all zero for every capsule ``i`` of the type.

Removing a zero-vote input capsule ``i`` from dynamic routing leaves the outputs unchanged: its
votes ``û_{j|i}`` are zero, so it adds nothing to ``s_j = Σ_i c_ij û_{j|i}``, its logit updates
``û_{j|i}·v_j`` are zero, and the softmax that forms ``c_ij`` runs over parents ``j`` per input
capsule ``i``, so no other capsule's couplings depend on it.

The outputs stay, but REM's saliency maps (:mod:`explain_capsules.saliency`, Eq. 16) do not: they
average over the capsule types the model has, and the compacted model does not keep the original
count. Maps of a model whose removed types had zero capsules are ``O/O′`` times the original's
(``O′`` types remain); a type removed because no routing weight reads it also takes its term
``‖u‖/J`` with it (its couplings stay uniform).

The channel/capsule bookkeeping runs through torch-pruning's ``DependencyGraph`` with custom
pruners for :class:`PrimaryCapsules` (its output "channels" are the ``M*N*O`` capsules; pruning
removes whole types) and :class:`FullyConnectedCapsules` (input capsules = weight dim 0, output
capsules = weight dim 1).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from explain_capsules.layers import FullyConnectedCapsules, PrimaryCapsules
from explain_capsules.models import DRCapsNet
from explain_capsules.pruning import MASK_SUFFIX, masks
from explain_core.extras import require

tp = require("torch_pruning", "compacting pruned capsule networks")

__all__ = [
    "CompactionReport",
    "FullyConnectedCapsulesPruner",
    "PrimaryCapsulesPruner",
    "compact",
    "count_parameters",
    "dead_capsules",
    "dead_channels",
    "dead_primary_types",
]


def count_parameters(model: nn.Module) -> int:
    """Number of parameter elements of ``model``."""
    return sum(p.numel() for p in model.parameters())


def _keep(n: int, idxs: Sequence[int]) -> torch.Tensor:
    drop = set(int(i) for i in idxs)
    return torch.tensor([i for i in range(n) if i not in drop], dtype=torch.long)


def _sliced(param: nn.Parameter, dim: int, keep: torch.Tensor) -> nn.Parameter:
    data = param.data.index_select(dim, keep.to(param.device)).clone()
    return nn.Parameter(data, requires_grad=param.requires_grad)


class FullyConnectedCapsulesPruner(tp.pruner.BasePruningFunc):
    """torch-pruning pruner for :class:`FullyConnectedCapsules`.

    Input channels are input capsules (``weight`` dim 0), output channels are output capsules
    (``weight`` dim 1). Only removing zero-vote input capsules preserves the routing outputs;
    removing output capsules changes every coupling softmax.
    """

    TARGET_MODULES = (FullyConnectedCapsules,)

    def prune_out_channels(self, layer: nn.Module, idxs: Sequence[int]) -> nn.Module:
        """Remove the output channels ``idxs`` in place; returns ``layer``."""
        keep = _keep(layer.out_caps, idxs)
        layer.weight = _sliced(layer.weight, 1, keep)
        layer.out_caps = len(keep)
        return layer

    def prune_in_channels(self, layer: nn.Module, idxs: Sequence[int]) -> nn.Module:
        """Remove the input channels ``idxs`` in place; returns ``layer``."""
        keep = _keep(layer.in_caps, idxs)
        layer.weight = _sliced(layer.weight, 0, keep)
        layer.in_caps = len(keep)
        return layer

    def get_out_channels(self, layer: nn.Module) -> int:
        """Number of output channels (capsules) of ``layer``."""
        return layer.out_caps

    def get_in_channels(self, layer: nn.Module) -> int:
        """Number of input channels of ``layer``."""
        return layer.in_caps


class PrimaryCapsulesPruner(tp.pruner.BasePruningFunc):
    """torch-pruning pruner for :class:`PrimaryCapsules`.

    Input channels are the convolution's input channels. Output channels are the ``M*N*O``
    output capsules (positions × types order, ``index = (m*N + n)*O + o``); since the
    convolution is shared over positions, only whole types can go: the capsule indices passed
    must cover every position of each removed type, and the type's ``capsule_dim`` convolution
    channels ``o*dim … (o+1)*dim - 1`` are removed.
    """

    TARGET_MODULES = (PrimaryCapsules,)

    @staticmethod
    def _grid(layer: PrimaryCapsules) -> tuple[int, int, int]:
        if layer.grid_shape is None:
            raise ValueError(
                "PrimaryCapsulesPruner: the layer has no grid_shape yet; run a forward pass first"
            )
        return layer.grid_shape

    @staticmethod
    def types_to_capsules(grid: tuple[int, int, int], types: Sequence[int]) -> list[int]:
        """Capsule indices ``(m*N + n)*O + o`` of every position of the given types."""
        m, n, o = grid
        return sorted(p * o + t for p in range(m * n) for t in types)

    def capsules_to_types(self, layer: PrimaryCapsules, idxs: Sequence[int]) -> list[int]:
        """Types covered by capsule indices ``idxs``; raises if a type is only partly covered."""
        grid = self._grid(layer)
        o = grid[2]
        types = sorted({int(i) % o for i in idxs})
        if sorted(set(int(i) for i in idxs)) != self.types_to_capsules(grid, types):
            raise ValueError(
                "PrimaryCapsulesPruner: expected capsule indices covering every position of "
                "each removed type (the convolution is shared over positions)"
            )
        return types

    def prune_out_channels(self, layer: nn.Module, idxs: Sequence[int]) -> nn.Module:
        """Remove the output channels ``idxs`` in place; returns ``layer``."""
        types = self.capsules_to_types(layer, idxs)
        d = layer.capsule_dim
        channels = [t * d + k for t in types for k in range(d)]
        keep = _keep(layer.conv.out_channels, channels)
        conv = layer.conv
        conv.weight = _sliced(conv.weight, 0, keep)
        if conv.bias is not None:
            conv.bias = _sliced(conv.bias, 0, keep)
        conv.out_channels = len(keep)
        layer.capsule_types -= len(types)
        m, n, _ = self._grid(layer)
        layer.grid_shape = (m, n, layer.capsule_types)
        return layer

    def prune_in_channels(self, layer: nn.Module, idxs: Sequence[int]) -> nn.Module:
        """Remove the input channels ``idxs`` in place; returns ``layer``."""
        keep = _keep(layer.conv.in_channels, idxs)
        layer.conv.weight = _sliced(layer.conv.weight, 1, keep)
        layer.conv.in_channels = len(keep)
        layer.in_channels = len(keep)
        return layer

    def get_out_channels(self, layer: nn.Module) -> int:
        """Number of output channels (capsules) of ``layer``."""
        m, n, o = self._grid(layer)
        return m * n * o

    def get_in_channels(self, layer: nn.Module) -> int:
        """Number of input channels of ``layer``."""
        return layer.in_channels


def _is_zero(t: torch.Tensor | None) -> bool:
    return t is None or not bool(t.detach().ne(0).any())


@torch.no_grad()
def dead_channels(model: DRCapsNet) -> list[int]:
    """Output channels of ``model.conv[0]`` whose removal leaves the outputs unchanged.

    Dead: ``ReLU(conv)`` is identically zero (all-zero weight slice and bias ``≤ 0``), or the
    primary convolution's weights reading the channel are all zero. A channel with zero
    weights and a positive bias (a constant non-zero map that is read) is kept.
    """
    conv, primary = model.conv[0], model.primary.conv
    dead = []
    for c in range(conv.out_channels):
        bias = 0.0 if conv.bias is None else float(conv.bias[c])
        relu_zero = _is_zero(conv.weight[c]) and bias <= 0.0
        unread = _is_zero(primary.weight[:, c])
        if relu_zero or unread:
            dead.append(c)
    return dead


@torch.no_grad()
def dead_capsules(layer: FullyConnectedCapsules) -> list[int]:
    """Input capsules ``i`` of ``layer`` with all-zero routing weights ``W[i]`` (zero votes)."""
    w = layer.weight.detach().reshape(layer.in_caps, -1)
    return w.ne(0).any(dim=1).logical_not().nonzero().flatten().tolist()


@torch.no_grad()
def dead_primary_types(model: DRCapsNet) -> list[int]:
    """Primary capsule types of ``model`` that only ever produce zero votes.

    A type is dead when its ``capsule_dim`` convolution channels have all-zero weights and bias
    (its capsules are zero vectors, ``squash(0) = 0``), or when the class capsule routing weights
    of every capsule of that type (all positions) are zero.
    """
    primary = model.primary
    d, o = primary.capsule_dim, primary.capsule_types
    conv = primary.conv
    zero_caps = set(dead_capsules(model.class_capsules))
    m, n, _ = model.primary_grid
    dead = []
    for t in range(o):
        rows = slice(t * d, (t + 1) * d)
        conv_zero = _is_zero(conv.weight[rows]) and (conv.bias is None or _is_zero(conv.bias[rows]))
        unread = all(p * o + t in zero_caps for p in range(m * n))
        if conv_zero or unread:
            dead.append(t)
    return dead


@dataclass
class CompactionReport:
    """What :func:`compact` removed."""

    params_before: int
    params_after: int
    removed_channels: list[int] = field(default_factory=list)
    removed_types: list[int] = field(default_factory=list)
    removed_capsules: int = 0

    @property
    def params_removed(self) -> int:
        """Parameters removed by the compaction."""
        return self.params_before - self.params_after


def compact(model: DRCapsNet, example_inputs: torch.Tensor) -> tuple[DRCapsNet, CompactionReport]:
    """Remove dead conv channels and primary capsule types from a copy of ``model``.

    Args:
        model: A (REM-pruned) :class:`DRCapsNet`; left untouched.
        example_inputs: One input batch, used to trace the dependency graph.

    Returns:
        ``(compacted copy, report)``. The copy computes the same outputs as ``model`` (up to
        floating-point summation order) with fewer parameters when anything was dead. Its REM
        saliency maps average over the remaining ``O′`` primary types, so they are ``O/O′`` times
        the original's where the removed types had zero capsules (see the module docstring).

    Raises:
        TypeError: If ``model`` is not a :class:`DRCapsNet`.
        ValueError: If every channel or every primary type is dead (nothing would remain).
    """
    if not isinstance(model, DRCapsNet):
        raise TypeError(f"compact: expected a DRCapsNet; got {type(model).__name__}")
    out = copy.deepcopy(model)
    before = count_parameters(out)
    channels = dead_channels(out)
    types = dead_primary_types(out)
    if len(channels) == out.conv[0].out_channels:
        raise ValueError("compact: every first-convolution channel is dead; nothing would remain")
    if len(types) == out.primary.capsule_types:
        raise ValueError("compact: every primary capsule type is dead; nothing would remain")
    report = CompactionReport(before, before, channels, types, 0)
    if not channels and not types:
        return out, report

    primary_pruner = PrimaryCapsulesPruner()
    fc_pruner = FullyConnectedCapsulesPruner()
    was_training = out.training
    out.eval()
    example_inputs = example_inputs.to(next(out.parameters()).device)
    with torch.enable_grad(), warnings.catch_warnings():
        # torch-pruning's shape inference warns on the capsule reshape; harmless here.
        warnings.filterwarnings("ignore", message="Maximum recursive depth reached")
        graph = tp.DependencyGraph().build_dependency(
            out,
            example_inputs=example_inputs,
            customized_pruners={PrimaryCapsules: primary_pruner, FullyConnectedCapsules: fc_pruner},
        )
        caps: list[int] = []
        if types:
            caps = primary_pruner.types_to_capsules(out.primary.grid_shape, types)
            group = graph.get_pruning_group(out.primary, primary_pruner.prune_out_channels, caps)
            group.prune()
            report.removed_capsules = len(caps)
        if channels:
            group = graph.get_pruning_group(out.conv[0], tp.prune_conv_out_channels, channels)
            group.prune()
    d = out.primary.capsule_dim
    type_channels = [t * d + k for t in types for k in range(d)]
    _slice_masks(
        out,
        {
            (out.conv[0], "weight"): {0: channels},
            (out.conv[0], "bias"): {0: channels},
            (out.primary.conv, "weight"): {0: type_channels, 1: channels},
            (out.primary.conv, "bias"): {0: type_channels},
            (out.class_capsules, "weight"): {0: caps},
        },
    )
    out.primary_grid = out.primary.output_grid(*_conv_hw(out))
    out.num_primary = out.class_capsules.in_caps
    out.train(was_training)
    report.params_after = count_parameters(out)
    return out, report


def _slice_masks(
    model: nn.Module, removed: dict[tuple[nn.Module, str], dict[int, list[int]]]
) -> None:
    """Cut REM's ``<param>_mask`` buffers like their parameters, so pruning can go on.

    Args:
        model: The compacted copy.
        removed: ``(module, parameter name)`` → dimension → indices removed along it (indices
            into the parameter as it was before compaction).

    Raises:
        RuntimeError: If a mask still does not fit its parameter afterwards.
    """
    for (module, leaf), by_dim in removed.items():
        mask = module._buffers.get(leaf + MASK_SUFFIX)
        if mask is None:
            continue
        for dim, indices in by_dim.items():
            if indices:
                mask = mask.index_select(dim, _keep(mask.shape[dim], indices).to(mask.device))
        module._buffers[leaf + MASK_SUFFIX] = mask.clone()
    for name, mask in masks(model).items():
        parameter = model.get_parameter(name)
        if mask.shape != parameter.shape:
            raise RuntimeError(
                f"compact: mask of {name} of shape {tuple(mask.shape)} no longer fits its "
                f"parameter {tuple(parameter.shape)}; please report this"
            )


def _conv_hw(model: DRCapsNet) -> tuple[int, int]:
    conv = model.conv[0]
    side = (model.image_size - conv.kernel_size[0]) // conv.stride[0] + 1
    return side, side
