"""Magnitude pruning during training (REM's pruning stage, Section 3.1.1).

REM prunes the capsule weights while training so that votes ``û_{j|i} = W_ij u_i`` become
exactly zero, which lowers the entropy of the parse trees. The paper uses iterative magnitude
pruning; here a :class:`MagnitudePruner` sets binary masks from weight magnitudes (one global
threshold, or the same sparsity per layer) following a :class:`PruningSchedule`.

Design:

* Masks are boolean buffers named ``<param>_mask`` on the module owning the parameter (e.g.
  ``class_capsules.weight_mask``), so they travel with ``state_dict`` and with the training
  checkpoints (which refuse a checkpoint whose masks do not match the model).
* The model's ``forward`` is untouched (no parametrisation, no forward hook): masks are enforced
  by multiplying the weights in place when the masks change and after every optimizer step. The
  weights themselves are therefore zero, so exports and explanations of the model stay plain.
* ``train_capsnet`` has no per-step callback, so :meth:`MagnitudePruner.enforce` and
  :func:`train_with_pruning` use a global optimizer step post-hook, filtered to optimizers that
  hold a masked parameter, and removed on exit. The pruner keeps no state besides the mask
  buffers, so resuming from a checkpoint restores the pruning exactly.

Manual use::

    pruner = MagnitudePruner(model, 0.85, schedule=PruningSchedule.gradual(0.85, end=20))
    for epoch in range(epochs):
        pruner.step(epoch)              # masks for this epoch (they only ever shrink)
        for batch in loader:
            ...; optimizer.step()
            apply_masks(model)          # or run the loop inside ``with pruner.enforce():``
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from explain_capsules.layers import ConvolutionalCapsules, FullyConnectedCapsules
from explain_capsules.training import (
    CHECKPOINT_NAME,
    CapsuleTrainConfig,
    CapsuleTrainHistory,
    train_capsnet,
)

__all__ = [
    "MASK_SUFFIX",
    "MagnitudePruner",
    "PruningSchedule",
    "SparsityReport",
    "apply_masks",
    "default_prunable",
    "masks",
    "remove_masks",
    "train_with_pruning",
]

MASK_SUFFIX = "_mask"
_SCOPES = ("global", "layer")
_KINDS = ("one_shot", "iterative", "gradual")


def _split(name: str) -> tuple[str, str]:
    module, _, leaf = name.rpartition(".")
    return module, leaf


def _masked(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, torch.Tensor]]:
    """Yield ``(param name, owning module, param leaf name, mask)`` for every masked param."""
    for module_name, module in model.named_modules():
        for buffer_name, mask in list(module._buffers.items()):
            if mask is None or not buffer_name.endswith(MASK_SUFFIX):
                continue
            leaf = buffer_name[: -len(MASK_SUFFIX)]
            if isinstance(module._parameters.get(leaf), nn.Parameter):
                full = f"{module_name}.{leaf}" if module_name else leaf
                yield full, module, leaf, mask


def masks(model: nn.Module) -> dict[str, torch.Tensor]:
    """The pruning masks of ``model`` keyed by parameter name (``True`` = weight kept)."""
    return {name: mask for name, _, _, mask in _masked(model)}


@torch.no_grad()
def apply_masks(model: nn.Module) -> None:
    """Zero every pruned weight of ``model`` in place (call after each optimizer step)."""
    for _, module, leaf, mask in _masked(model):
        getattr(module, leaf).mul_(mask)


@torch.no_grad()
def remove_masks(model: nn.Module) -> dict[str, torch.Tensor]:
    """Bake the masks into the weights and delete the mask buffers (a plain model again).

    Returns:
        The removed masks keyed by parameter name.
    """
    removed = {}
    for name, module, leaf, mask in list(_masked(model)):
        getattr(module, leaf).mul_(mask)
        del module._buffers[leaf + MASK_SUFFIX]
        removed[name] = mask
    return removed


def default_prunable(model: nn.Module) -> list[str]:
    """Names of the weights pruned by default: conv/linear weights and capsule ``weight``s.

    Biases, normalisation parameters and routing state are never pruned by default.
    """
    kinds = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear, FullyConnectedCapsules)
    kinds += (ConvolutionalCapsules,)
    return [
        f"{name}.weight" if name else "weight"
        for name, module in model.named_modules()
        if isinstance(module, kinds) and isinstance(module._parameters.get("weight"), nn.Parameter)
    ]


def _check_fraction(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
        raise ValueError(f"{name} must be a number in [0, 1); got {value!r}")
    return float(value)


def _check_epoch(name: str, value: int, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int ≥ {minimum}; got {value!r}")
    return value


@dataclass(frozen=True)
class PruningSchedule:
    """Target sparsity per epoch, built with :meth:`one_shot`, :meth:`iterative`, :meth:`gradual`.

    ``sparsity_at(e)`` is the sparsity the masks should have while training epoch ``e``
    (0-based), i.e. it is applied by ``pruner.step(e)`` before that epoch's steps.

    Attributes:
        kind: ``"one_shot"``, ``"iterative"`` or ``"gradual"``.
        target: Final sparsity in ``[0, 1)``.
        start: First pruning epoch.
        end: Epoch at which the target is reached.
        every: Interval between pruning events (``iterative``).
        initial: Sparsity at ``start`` (``gradual``).
    """

    kind: str
    target: float
    start: int = 0
    end: int = 0
    every: int = 1
    initial: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"schedule kind must be one of {_KINDS}; got {self.kind!r}")
        _check_fraction("target", self.target)
        _check_fraction("initial", self.initial)
        _check_epoch("start", self.start)
        _check_epoch("end", self.end, self.start)
        _check_epoch("every", self.every, 1)
        if self.initial > self.target:
            raise ValueError(f"initial sparsity must be ≤ target {self.target}; got {self.initial}")

    @classmethod
    def one_shot(cls, target: float, epoch: int = 0) -> PruningSchedule:
        """Prune to ``target`` once, at ``epoch``."""
        return cls("one_shot", target, start=epoch, end=epoch)

    @classmethod
    def iterative(
        cls, target: float, steps: int, *, start: int = 0, every: int = 1
    ) -> PruningSchedule:
        """Iterative magnitude pruning: ``steps`` events at ``start, start+every, …``.

        Each event prunes the same fraction ``p`` of the *remaining* weights, with
        ``1 − (1 − p)^steps = target``, so after ``k`` events the sparsity is
        ``1 − (1 − target)^(k/steps)`` (e.g. target 0.75 in 2 steps: 0.5, then 0.75).
        """
        _check_epoch("steps", steps, 1)
        _check_epoch("every", every, 1)
        return cls("iterative", target, start=start, end=start + (steps - 1) * every, every=every)

    @classmethod
    def gradual(
        cls, target: float, *, start: int = 0, end: int, initial: float = 0.0
    ) -> PruningSchedule:
        """Zhu & Gupta (2017) polynomial schedule, cubic in the epoch.

        ``s(e) = target + (initial − target)·(1 − (e − start)/(end − start))³`` for
        ``start ≤ e ≤ end``; no pruning before ``start``; ``target`` after ``end``. Prunes fast
        early, when many weights are redundant, and slowly near the target.
        """
        return cls("gradual", target, start=start, end=end, initial=initial)

    def sparsity_at(self, epoch: int) -> float:
        """Sparsity for training epoch ``epoch`` (pure function of the schedule)."""
        _check_epoch("epoch", epoch)
        if epoch < self.start:
            return 0.0
        if epoch >= self.end:
            return self.target
        if self.kind == "iterative":
            steps = (self.end - self.start) // self.every + 1
            done = (epoch - self.start) // self.every + 1
            return 1.0 - (1.0 - self.target) ** (done / steps)
        # gradual (one_shot has start == end and returned above)
        remaining = 1.0 - (epoch - self.start) / (self.end - self.start)
        return self.target + (self.initial - self.target) * remaining**3


@dataclass(frozen=True)
class SparsityReport:
    """Fraction of exactly-zero weights among the prunable weights.

    Attributes:
        overall: Zeros / total over all prunable weights.
        per_layer: Zero fraction of each prunable parameter, by name.
        zeros: Number of zero weights.
        total: Number of prunable weights.
    """

    overall: float
    per_layer: dict[str, float]
    zeros: int
    total: int


class MagnitudePruner:
    """Masks the smallest-magnitude weights of ``model`` following a schedule.

    Creates a ``<param>_mask`` buffer (all ``True``) for each pruned parameter that has none,
    so build the pruner before loading a pruned checkpoint into the model.

    Args:
        model: The model to prune (masks are registered on its modules).
        target_sparsity: Final fraction of pruned weights, in ``[0, 1)``.
        scope: ``"global"``: one magnitude threshold over all pruned weights (layers end up
            with different sparsities); ``"layer"``: every layer pruned to the same sparsity.
        parameters: Names of the parameters to prune (as in ``model.named_parameters()``);
            default :func:`default_prunable`.
        schedule: Sparsity per epoch; default one-shot pruning to the target at epoch 0. Its
            target must equal ``target_sparsity``.
        layer_floor: With ``scope="global"``, the fraction of every layer's weights that is
            always kept (its largest magnitudes), so one threshold cannot empty a small layer
            whose weights happen to be small (which would kill the model). Pruned weights are
            then taken from the other layers, so the overall sparsity still meets the target
            unless the floors make that impossible. ``0`` (default) keeps the pure global rule.

    Raises:
        ValueError: On a sparsity outside ``[0, 1)``, an unknown scope, unknown or duplicate
            parameter names, no parameters, a schedule with another target, a ``layer_floor``
            outside ``[0, 1 − target_sparsity]``, or an existing mask of the wrong shape.
    """

    def __init__(
        self,
        model: nn.Module,
        target_sparsity: float,
        *,
        scope: Literal["global", "layer"] = "global",
        parameters: Sequence[str] | None = None,
        schedule: PruningSchedule | None = None,
        layer_floor: float = 0.0,
    ) -> None:
        self.target_sparsity = _check_fraction("target_sparsity", target_sparsity)
        if scope not in _SCOPES:
            raise ValueError(f"scope must be one of {_SCOPES}; got {scope!r}")
        self.scope = scope
        if not 0.0 <= layer_floor <= 1.0 - self.target_sparsity:
            raise ValueError(
                f"layer_floor must be in [0, 1 − target_sparsity] = [0, "
                f"{1.0 - self.target_sparsity:.4g}]; got {layer_floor!r}"
            )
        self.layer_floor = float(layer_floor)
        self.schedule = schedule or PruningSchedule.one_shot(self.target_sparsity)
        if not math.isclose(self.schedule.target, self.target_sparsity):
            raise ValueError(
                f"schedule target must equal target_sparsity {self.target_sparsity}; "
                f"got {self.schedule.target}"
            )
        named = dict(model.named_parameters())
        names = list(default_prunable(model) if parameters is None else parameters)
        unknown = [n for n in names if n not in named]
        if unknown:
            raise ValueError(
                f"unknown parameter names {unknown}; expected names from "
                f"model.named_parameters(), e.g. {list(named)[:8]}"
            )
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"expected a non-empty list of distinct parameter names; got {names}")
        self.model = model
        self.names = names
        modules = dict(model.named_modules())
        self._owners: dict[str, tuple[nn.Module, str]] = {}
        for name in names:
            module_name, leaf = _split(name)
            module = modules[module_name]
            param = getattr(module, leaf)
            mask = module._buffers.get(leaf + MASK_SUFFIX)
            if mask is None:
                module.register_buffer(leaf + MASK_SUFFIX, torch.ones_like(param, dtype=torch.bool))
            elif mask.shape != param.shape:
                raise ValueError(
                    f"{name}{MASK_SUFFIX}: expected a mask of shape {tuple(param.shape)}; "
                    f"got {tuple(mask.shape)}"
                )
            self._owners[name] = (module, leaf)

    def _pairs(self) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        out = []
        for name in self.names:
            module, leaf = self._owners[name]
            out.append((name, getattr(module, leaf), module._buffers[leaf + MASK_SUFFIX]))
        return out

    @staticmethod
    def _keep_mask(scores: torch.Tensor, mask: torch.Tensor, count: int) -> torch.Tensor:
        """Mask pruning exactly the ``count`` lowest scores, already pruned ones first."""
        # Already-pruned entries get −1 < any |w|, so they are counted first and never revive.
        flat = torch.where(mask.flatten(), scores.flatten(), torch.full_like(scores.flatten(), -1))
        count = max(count, int((~mask).sum()))
        keep = torch.ones_like(mask.flatten())
        if count > 0:
            keep[torch.argsort(flat, stable=True)[:count]] = False
        return keep.view_as(mask)

    def _floored_scores(self, weight: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Magnitudes on the CPU; the ``layer_floor`` largest unpruned ones raised to ``inf``."""
        scores = weight.detach().abs().float().flatten().cpu()
        floor = math.ceil(self.layer_floor * scores.numel())
        if floor:
            alive = torch.where(mask.flatten().cpu(), scores, torch.full_like(scores, -1.0))
            scores[torch.topk(alive, floor).indices] = math.inf
        return scores

    @torch.no_grad()
    def prune_to(self, sparsity: float) -> SparsityReport:
        """Shrink the masks to ``sparsity`` (by magnitude) and zero the pruned weights.

        Masks only ever shrink: if more weights are already pruned, nothing changes.
        """
        sparsity = _check_fraction("sparsity", sparsity)
        pairs = self._pairs()
        if self.scope == "layer":
            for _, weight, mask in pairs:
                count = round(sparsity * mask.numel())
                mask.copy_(self._keep_mask(weight.detach().abs().float(), mask, count))
        else:
            scores = torch.cat([self._floored_scores(w, m) for _, w, m in pairs])
            flat_mask = torch.cat([m.flatten().cpu() for _, _, m in pairs])
            keep = self._keep_mask(scores, flat_mask, round(sparsity * flat_mask.numel()))
            for (_, _, mask), part in zip(
                pairs, keep.split([m.numel() for _, _, m in pairs]), strict=True
            ):
                mask.copy_(part.view_as(mask))
        for _, weight, mask in pairs:
            weight.mul_(mask)
        return self.sparsity()

    def step(self, epoch: int) -> SparsityReport:
        """Set the masks for training epoch ``epoch`` (``schedule.sparsity_at(epoch)``)."""
        return self.prune_to(self.schedule.sparsity_at(epoch))

    @torch.no_grad()
    def sparsity(self) -> SparsityReport:
        """Fraction of zero weights, overall and per pruned parameter."""
        per_layer, zeros, total = {}, 0, 0
        for name, weight, _ in self._pairs():
            z = int((weight == 0).sum())
            per_layer[name] = z / weight.numel()
            zeros += z
            total += weight.numel()
        return SparsityReport(zeros / total, per_layer, zeros, total)

    def apply(self) -> None:
        """Zero the pruned weights of the pruned parameters in place."""
        with torch.no_grad():
            for _, weight, mask in self._pairs():
                weight.mul_(mask)

    def _holds_masked(self, optimizer: torch.optim.Optimizer) -> bool:
        ids = {id(w) for _, w, _ in self._pairs()}
        return any(id(p) in ids for group in optimizer.param_groups for p in group["params"])

    @contextlib.contextmanager
    def enforce(self, on_step: Any = None) -> Iterator[None]:
        """Re-apply the masks after every optimizer step taken inside the block.

        Uses a global optimizer step post-hook (``train_capsnet`` builds its optimizer inside),
        acting only on optimizers that hold one of the pruned parameters. Re-zeroing after the
        step matters for Adam: its moments keep moving pruned weights even with zero gradients.

        Args:
            on_step: Optional ``callable(optimizer)`` run after the masks are applied.
        """

        def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            if self._holds_masked(optimizer):
                self.apply()
                if on_step is not None:
                    on_step(optimizer)

        handle = register_optimizer_step_post_hook(hook)
        try:
            yield
        finally:
            handle.remove()


def _steps_taken(optimizer: torch.optim.Optimizer) -> int:
    steps = [
        int(state["step"]) for state in optimizer.state.values() if "step" in state
    ]  # Adam's per-parameter counter; restored from checkpoints, so resume-safe.
    return max(steps, default=0)


def train_with_pruning(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    config: CapsuleTrainConfig,
    pruner: MagnitudePruner,
    **kwargs: Any,
) -> CapsuleTrainHistory:
    """:func:`~explain_capsules.training.train_capsnet` with pruning during training.

    Before epoch ``e`` the masks are set by ``pruner.step(e)``; after every optimizer step the
    pruned weights are zeroed again. Epoch boundaries are found from the optimizer's step count
    (``ceil(N / batch_size)`` steps per epoch), so a run resumed from ``checkpoint_dir`` (whose
    checkpoints hold the masks) continues exactly as the uninterrupted one. No pruning happens
    after the last epoch, so the returned model was trained under its final masks.

    Args:
        model: The model, the one ``pruner`` was built on.
        images: Training inputs.
        labels: Integer labels.
        config: Training options.
        pruner: The pruner (with its schedule).
        **kwargs: Passed to ``train_capsnet`` (``checkpoint_dir``, ``evaluate``,
            ``stop_after_epoch``).

    Returns:
        The training history.

    Raises:
        ValueError: If ``pruner`` was built on another model.
    """
    if pruner.model is not model:
        raise ValueError(
            "train_with_pruning: expected a pruner built on this model; got one built on "
            f"another {type(pruner.model).__name__}"
        )
    per_epoch = math.ceil(len(labels) / config.batch_size)
    checkpoint_dir = kwargs.get("checkpoint_dir")
    resuming = checkpoint_dir is not None and (Path(checkpoint_dir) / CHECKPOINT_NAME).exists()
    if not resuming:  # A resumed run gets its masks from the checkpoint.
        pruner.step(0)

    def on_step(optimizer: torch.optim.Optimizer) -> None:
        done, rest = divmod(_steps_taken(optimizer), per_epoch)
        if rest == 0 and done < config.epochs:
            # End of epoch ``done - 1``: prune for the next one before its checkpoint is saved.
            pruner.step(done)

    with pruner.enforce(on_step):
        return train_capsnet(model, images, labels, config, **kwargs)
