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
    that were added, puts back the original ``Parameter`` and buffer objects and the buffers'
    values. Parameters are never copied (they can be large); if one was modified in place, the
    guard raises, since that is a bug in whichever explainer did it.

    Example:
        >>> with ModelGuard(model):
        ...     handle = model.register_forward_hook(lambda *a: None)
        >>> # the hook is gone again
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._records: list[_ModuleRecord] = []
        self._buffer_copies: list[tuple[torch.Tensor, int, torch.Tensor]] = []
        self._parameter_versions: list[tuple[str, torch.Tensor, int]] = []

    def __enter__(self) -> ModelGuard:
        for module in self.model.modules():
            containers = {
                name: OrderedDict(getattr(module, name))
                for name in _STATE_DICTS
                if isinstance(getattr(module, name, None), dict)
            }
            self._records.append(_ModuleRecord(module, dict(module.__dict__), containers))
        for buffer in _unique_tensors(self.model.buffers()):
            self._buffer_copies.append((buffer, buffer._version, buffer.detach().clone()))
        for name, parameter in self.model.named_parameters():
            self._parameter_versions.append((name, parameter, parameter._version))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.restore()
        changed = [name for name, p, version in self._parameter_versions if p._version != version]
        if changed and exc_type is None:
            raise ModelStateError(
                f"attribution modified parameters in place ({', '.join(changed[:5])}); this is a "
                "bug in the explainer, please report it with the method name"
            )

    def restore(self) -> None:
        """Put the recorded structure and buffer values back."""
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
                if buffer._version != version:
                    buffer.copy_(copy)


_MISSING = object()


def _identities(container: dict[Any, Any]) -> list[tuple[Any, int]]:
    # Compare by identity: tensors have no usable ==, and identity is what must be restored.
    return [(key, id(value)) for key, value in container.items()]


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
