"""Guarantee that attribution leaves the user's model exactly as it was.

Explainers attach hooks, switch layers into explanation mode and canonizers swap parameters. A
``ModelGuard`` records the model's structure before all that and puts it back afterwards, also when
an exception escapes, so that no explainer can leave a trace on the user's model by mistake.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch import nn

from explain_core.errors import ModelStateError

# Containers a module keeps its state in; restored as shallow copies (object identity preserved).
_STATE_DICTS = (
    "_parameters",
    "_buffers",
    "_modules",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


@dataclass
class _ModuleRecord:
    module: nn.Module
    attributes: dict[str, Any]
    containers: dict[str, OrderedDict[Any, Any]]


class ModelGuard:
    """Context manager that restores a model's attributes, hooks, parameters and buffers.

    On exit it restores every module's attributes and training flag, removes hooks and submodules
    that were added, puts back the original ``Parameter`` and buffer objects, the buffers' values
    and a parameter's storage if ``.data`` was replaced (and reports it). Parameter values are
    not copied: a
    second copy of the weights on every call costs memory (on a GPU, too much for large models)
    and, on the CPU, allocation time that measurably slowed ``bench_modbp_speed.py``. Instead a
    parameter changed in place (its version counter moved, or its checksum, the sum, which also
    sees edits through ``.data``, differs) makes the guard raise
    :class:`~explain_core.errors.ModelStateError` naming it: the explainers never write into
    parameters, so it was the model's own forward, and an explanation of weights that changed
    while it was computed is meaningless.

    Example:
        >>> with ModelGuard(model):
        ...     handle = model.register_forward_hook(lambda *a: None)
        >>> # the hook is gone again
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._records: list[_ModuleRecord] = []
        self._buffer_copies: list[tuple[torch.Tensor, int, torch.Tensor]] = []
        self._parameters: list[tuple[str, nn.Parameter, int, torch.Tensor]] = []
        self._checksums: torch.Tensor | None = None
        self.changed_parameters: list[str] = []  # names of the parameters found changed

    def __enter__(self) -> ModelGuard:
        for module in self.model.modules():
            containers = {
                name: OrderedDict(getattr(module, name))
                for name in _STATE_DICTS
                if isinstance(getattr(module, name, None), dict)
            }
            self._records.append(_ModuleRecord(module, dict(module.__dict__), containers))
        for buffer in _unique_tensors(self.model.buffers()):
            self._buffer_copies.append((buffer, _version(buffer), buffer.detach().clone()))
        for name, parameter in self.model.named_parameters():
            # detach() shares the storage: it puts back a replaced .data without copying.
            self._parameters.append((name, parameter, _version(parameter), parameter.detach()))
        self._checksums = _checksums(p for _, p, _, _ in self._parameters)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.restore()
        changed = self.changed_parameters
        if not changed:
            return
        names = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" * (len(changed) > 5))
        message = (
            f"the model's forward modified its parameter(s) {names} in place (e.g. "
            "weight.data.mul_(...) or weight.add_(...) under torch.no_grad() inside forward), so "
            "every pass of the attribution saw other weights and its result would be "
            "meaningless (a replaced .data was put back, values changed in place are not: "
            "reload the weights). Compute "
            "with a changed copy in forward instead (F.linear(x, self.fc.weight * 1.01)), or "
            "change the weights outside forward"
        )
        if exc_type is None:
            raise ModelStateError(message)
        # Another exception is on its way: keep it, and add what happened to the weights (unless
        # an inner guard already said so).
        if not isinstance(exc, ModelStateError) and hasattr(exc, "add_note"):  # Python >= 3.11
            exc.add_note(message)

    def restore(self) -> None:
        """Put the recorded structure, buffer values and parameter storages back.

        The names of the parameters whose values changed in place (which it cannot undo) are
        left in :attr:`changed_parameters`.
        """
        for record in self._records:
            module = record.module
            for key in set(module.__dict__) - set(record.attributes):
                del module.__dict__[key]
            for key, value in record.attributes.items():
                if module.__dict__.get(key, _MISSING) is not value:
                    module.__dict__[key] = value
            for name, saved in record.containers.items():
                current = getattr(module, name)
                if _identities(current) != _identities(saved):
                    current.clear()
                    current.update(saved)
        with torch.no_grad():
            for buffer, version, copy in self._buffer_copies:
                # An inference tensor has no version: compare its values instead.
                if _version(buffer) != version or (version < 0 and not _same_values(buffer, copy)):
                    buffer.copy_(copy)
            replaced = []
            for name, parameter, _, original in self._parameters:
                if parameter.data.data_ptr() != original.data_ptr() or (
                    parameter.shape != original.shape or parameter.dtype != original.dtype
                ):
                    parameter.data = original  # .data was replaced: put the storage back
                    replaced.append(name)
        checksums = _checksums(p for _, p, _, _ in self._parameters)
        moved = (
            checksums != self._checksums
            if checksums is not None and self._checksums is not None
            else None
        )
        self.changed_parameters = [
            name
            for index, (name, parameter, version, _) in enumerate(self._parameters)
            if name in replaced
            or _version(parameter) != version
            or (moved is not None and bool(moved[index]))
        ]


_MISSING = object()


def _identities(container: dict[Any, Any]) -> list[tuple[Any, int]]:
    # Compare by identity: tensors have no usable ==, and identity is what must be restored.
    return [(key, id(value)) for key, value in container.items()]


def _checksums(parameters: Any) -> torch.Tensor | None:
    """The sum of each parameter (in its own dtype; NaN → a fixed value) on the CPU.

    One read pass and no copy of the weights (a float64 sum converts first: four times slower).
    Complex and meta parameters count 0 (their version counter still applies). ``None`` for a
    model without parameters.
    """
    sums = [
        torch.nan_to_num(p.detach().sum().double(), nan=1.5e308).cpu()
        if not (p.is_complex() or p.device.type == "meta")
        else torch.zeros((), dtype=torch.float64)
        for p in parameters
    ]
    return torch.stack(sums) if sums else None


def _version(tensor: torch.Tensor) -> int:
    """Autograd's version counter; -1 for inference tensors, which have none."""
    return -1 if tensor.is_inference() else tensor._version


def _same_values(tensor: torch.Tensor, copy: torch.Tensor) -> bool:
    """Whether ``tensor`` still holds the values of ``copy`` (a NaN differs: copied back)."""
    return tensor.device.type == "meta" or torch.equal(tensor.detach(), copy)


def _unique_tensors(tensors: Any) -> list[torch.Tensor]:
    seen: set[int] = set()
    unique = []
    for tensor in tensors:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            unique.append(tensor)
    return unique


# Layers whose forward differs between training and eval mode.
_MODE_DEPENDENT = (
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.modules.dropout._DropoutNd,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
    nn.RReLU,
)


def require_eval_mode(model: nn.Module) -> None:
    """Refuse attribution when a mode-dependent layer is in training mode.

    In training mode BatchNorm uses batch statistics and updates its running statistics, and
    Dropout drops random units, so the explanation would describe a random network. Models
    without such layers are explained in whatever mode they are in.

    Raises:
        ModelStateError: If a BatchNorm, InstanceNorm (with running statistics), Dropout or
            RReLU layer is in training mode.
    """
    for name, module in model.named_modules():
        if module.training and isinstance(module, _MODE_DEPENDENT):
            if isinstance(module, nn.modules.instancenorm._InstanceNorm) and not (
                module.track_running_stats
            ):
                continue
            raise ModelStateError(
                f"{type(module).__name__} {name or '<root>'!r} is in training mode; call "
                "model.eval() before explaining, so that normalisation and dropout are "
                "deterministic and the model's buffers stay unchanged"
            )
