"""Guarantee that attribution leaves the user's model exactly as it was.

Explainers attach hooks, switch layers into explanation mode and canonizers swap parameters. A
``ModelGuard`` records the model's structure before all that and puts it back afterwards, also when
an exception escapes, so that no explainer can leave a trace on the user's model by mistake.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.ao.quantization.fake_quantize import FakeQuantizeBase
from torch.ao.quantization.observer import (
    NoopObserver,
    ObserverBase,
    PlaceholderObserver,
    ReuseInputObserver,
)
from torch.nn.utils import parametrizations
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.overrides import TorchFunctionMode

from explain_core.errors import ModelStateError

__all__ = [
    "ModelGuard",
    "RefuseTrainingCalls",
    "require_eval_mode",
]

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
    """Context manager that checks a model's parameters and, if asked, restores the model.

    Every guard reports parameters changed in place (below). With ``restore=True`` (what third-party
    methods run under, since they may attach hooks or call ``.backward()``) it also records the
    model's structure on entry and on exit restores every module's attributes and training flag,
    removes hooks and submodules that were added, puts back the original ``Parameter`` and buffer
    objects, the values of every buffer that changed (BatchNorm's kernel updates its running
    statistics in place without moving their version counter, so values are compared, not versions),
    each parameter's ``requires_grad`` flag and ``.grad`` (the same tensor object, or ``None``: the
    gradients are set aside on entry, so a ``.backward()`` inside accumulates into fresh tensors,
    never into the caller's), and a parameter's storage if ``.data`` was replaced (and reports it).
    Parameter values are not copied: a second copy of the weights on every call costs memory (on a
    GPU, too much for large models) and, on the CPU, allocation time that measurably slowed
    ``bench_modbp_speed.py``. Instead a parameter changed in place (its version counter moved, or
    its checksum, the sum, which also sees edits through ``.data``, differs) makes the guard raise
    :class:`~explain_core.errors.ModelStateError` naming it: the built-in explainers never write
    into parameters, so it was the model's own forward (or, with ``during``, the forward or the
    third-party code named there), and an explanation of weights that changed while it was computed
    is meaningless.

    Without ``restore`` (the built-in explainers, which never write to the model: their state
    lives in :mod:`explain_core.scoped`) the guard only reads the model, so other threads may use
    the same model meanwhile: run plain forwards, train it, or explain it. Tensors a forward
    stores on the model (``self.hidden = h``) stay, as after a plain forward, and are named in
    :attr:`stored_tensors`. A restoring guard
    writes the model's state back on exit and sets gradients aside while it is open, which
    other threads would see.

    Args:
        model: The model to guard.
        during: What runs inside the guard besides the model's forward, for the error message
            (e.g. ``"explain(..., 'x.method') (plugin 'x')"``); ``None`` blames the forward.
        restore: Restore the model's structure, buffers and gradients on exit (see above).

    Example:
        >>> with ModelGuard(model, restore=True):
        ...     handle = model.register_forward_hook(lambda *a: None)
        >>> # the hook is gone again
    """

    def __init__(
        self, model: nn.Module, *, during: str | None = None, restore: bool = False
    ) -> None:
        self.model = model
        self.during = during
        self.restoring = restore
        self._records: list[_ModuleRecord] = []
        self._buffer_copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._parameters: list[tuple[str, nn.Parameter, int, torch.Tensor]] = []
        self._autograd: list[tuple[nn.Parameter, bool, torch.Tensor | None]] = []
        self._checksums: torch.Tensor | None = None
        self._replaced: set[str] = set()  # kept over calls: a second restore() finds them back
        self._attributes: list[tuple[str, nn.Module, dict[str, Any]]] = []
        self.changed_parameters: list[str] = []  # names of the parameters found changed
        self.stored_tensors: list[str] = []  # ``module.attribute`` the forward stored tensors in

    def __enter__(self) -> ModelGuard:
        for name, parameter in self.model.named_parameters():
            # detach() shares the storage: it puts back a replaced .data without copying.
            self._parameters.append((name, parameter, _version(parameter), parameter.detach()))
        self._checksums = _checksums(p for _, p, _, _ in self._parameters)
        if not self.restoring:
            self._attributes = [
                (name, module, _public_attributes(module))
                for name, module in self.model.named_modules()
            ]
            return self
        for module in self.model.modules():
            containers = {
                name: OrderedDict(getattr(module, name))
                for name in _STATE_DICTS
                if isinstance(getattr(module, name, None), dict)
            }
            self._records.append(_ModuleRecord(module, dict(module.__dict__), containers))
        for buffer in _unique_tensors(self.model.buffers()):
            self._buffer_copies.append((buffer, buffer.detach().clone()))
        for _, parameter, _, _ in self._parameters:
            self._autograd.append((parameter, parameter.requires_grad, parameter.grad))
            # Set aside: a backward pass inside would add into the caller's gradient in place.
            parameter.grad = None
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
        message = self._changed_message(changed)
        if exc_type is None:
            raise ModelStateError(message)
        # Another exception is on its way: keep it, and add what happened to the weights (unless
        # an inner guard already said so).
        if not isinstance(exc, ModelStateError) and hasattr(exc, "add_note"):  # Python >= 3.11
            exc.add_note(message)

    def _changed_message(self, changed: list[str]) -> str:
        names = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" * (len(changed) > 5))
        undo = (
            "(a replaced .data was put back, values changed in place are not: reload the weights)"
        )
        if self.during is not None:
            # Third-party code ran beside the forward: either may have written the weights.
            return (
                f"parameter(s) {names} changed in place during {self.during}: by the model's "
                "forward or by the method, so the attribution saw other weights and its result "
                f"would be meaningless {undo}. If the model's forward changes its weights, "
                "compute with a changed copy instead (F.linear(x, self.fc.weight * 1.01)); "
                "otherwise report it to the plugin's authors"
            )
        return (
            f"the model's forward modified its parameter(s) {names} in place (e.g. "
            "weight.data.mul_(...) or weight.add_(...) under torch.no_grad() inside forward), so "
            "every pass of the attribution saw other weights and its result would be "
            f"meaningless {undo}. Compute with a changed copy in forward instead "
            "(F.linear(x, self.fc.weight * 1.01)), or change the weights outside forward"
        )

    def restore(self) -> None:
        """Put the recorded structure, buffer values, gradients and parameter storages back.

        Without ``restore=True`` only a replaced ``.data`` is put back. Safe to call more than
        once. The names of the parameters whose values changed in place (which it cannot undo)
        are left in :attr:`changed_parameters`.
        """
        self._note_stored_tensors()
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
            for buffer, copy in self._buffer_copies:
                _restore_values(buffer, copy)
            for name, parameter, _, original in self._parameters:
                if parameter.data.data_ptr() != original.data_ptr() or (
                    parameter.shape != original.shape or parameter.dtype != original.dtype
                ):
                    parameter.data = original  # .data was replaced: put the storage back
                    self._replaced.add(name)
            for parameter, requires_grad, grad in self._autograd:
                if parameter.requires_grad != requires_grad:
                    parameter.requires_grad_(requires_grad)
                if parameter.grad is not grad:
                    parameter.grad = grad
        checksums = _checksums(p for _, p, _, _ in self._parameters)
        moved = (
            (checksums != self._checksums).tolist()  # one read, not one per parameter
            if checksums is not None and self._checksums is not None
            else [False] * len(self._parameters)
        )
        self.changed_parameters = [
            name
            for (name, parameter, version, _), changed in zip(self._parameters, moved, strict=True)
            if name in self._replaced or _version(parameter) != version or changed
        ]

    def _note_stored_tensors(self) -> None:
        """Name the public attributes the forward stored tensors in (:attr:`stored_tensors`).

        A model that keeps state on itself (``self.hidden = h``) is left as its forward leaves
        it, as after a plain forward (a guard that only reads writes nothing); the caller can
        tell whether its outputs depend on that state (``explain()`` does).
        """
        for name, module, saved in self._attributes:
            now = _public_attributes(module)
            for key in now.keys() | saved.keys():
                before, after = saved.get(key, _MISSING), now.get(key, _MISSING)
                if before is not after and (_holds_tensors(before) or _holds_tensors(after)):
                    self.stored_tensors.append(f"{name or '<root>'}.{key}")


def _public_attributes(module: nn.Module) -> dict[str, Any]:
    return {key: value for key, value in module.__dict__.items() if not key.startswith("_")}


def _holds_tensors(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return any(isinstance(item, torch.Tensor) for item in value)
    return isinstance(value, torch.Tensor)


_MISSING = object()


def _identities(container: dict[Any, Any]) -> list[tuple[Any, int]]:
    # Compare by identity: tensors have no usable ==, and identity is what must be restored.
    return [(key, id(value)) for key, value in container.items()]


def _checksums(parameters: Any) -> torch.Tensor | None:
    """The sum of each parameter (in its own dtype; NaN → a fixed value) on the CPU.

    One read pass and no copy of the weights (a float64 sum converts first: four times slower),
    and one transfer per device and dtype: a transfer per parameter would wait for the GPU
    hundreds of times per call. Complex and meta parameters count 0 (their version counter
    still applies). ``None`` for a model without parameters.
    """
    parameters = list(parameters)
    if not parameters:
        return None
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for index, p in enumerate(parameters):
        if not (p.is_complex() or p.device.type == "meta"):
            groups.setdefault((p.device, p.dtype), []).append(index)
    sums = torch.zeros(len(parameters), dtype=torch.float64)
    for indices in groups.values():
        group = torch.stack([parameters[i].detach().sum() for i in indices])
        sums[indices] = torch.nan_to_num(group.double(), nan=1.5e308).cpu()
    return sums


def _version(tensor: torch.Tensor) -> int:
    """Autograd's version counter; -1 for inference tensors, which have none."""
    return -1 if tensor.is_inference() else tensor._version


def _restore_values(buffer: torch.Tensor, copy: torch.Tensor) -> None:
    """Copy ``copy`` back into ``buffer`` if its values (or its storage's shape) changed."""
    if buffer.shape != copy.shape or buffer.dtype != copy.dtype or buffer.device != copy.device:
        buffer.data = copy  # .data was replaced by another shape: put a tensor of the old one
    elif not _same_values(buffer, copy):
        buffer.copy_(copy)  # only then: a write moves the version that caches key on


def _same_values(tensor: torch.Tensor, copy: torch.Tensor) -> bool:
    """Whether ``tensor`` still holds the values of ``copy``; NaN equals NaN in the same place."""
    if tensor.device.type == "meta":
        return True
    tensor = tensor.detach()
    if torch.equal(tensor, copy):
        return True
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return False
    nan = tensor.isnan()
    return torch.equal(nan, copy.isnan()) and torch.equal(
        tensor.masked_fill(nan, 0), copy.masked_fill(nan, 0)
    )


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
    parametrizations._SpectralNorm,  # a power iteration on every forward in training mode
)


def require_eval_mode(model: nn.Module) -> None:
    """Refuse attribution when a mode-dependent layer is in training mode.

    In training mode BatchNorm uses batch statistics and updates its running statistics, and
    Dropout drops random units, so the explanation would describe a random network. Models
    without such layers are explained in whatever mode they are in.

    Quantization observers, which record statistics in every mode, are refused too.

    Raises:
        ModelStateError: If a BatchNorm, InstanceNorm (with running statistics), Dropout or
            RReLU layer, or an LSTM, GRU or RNN with dropout between its layers, is in training
            mode, or the model holds an enabled quantization observer.
    """
    fake_quantizers: list[str] = []  # their observers run only where they let them
    for name, module in model.named_modules():
        if isinstance(module, FakeQuantizeBase):
            fake_quantizers.append(f"{name}.")
        if module.training and _mode_dependent(module):
            raise ModelStateError(
                f"{type(module).__name__} {name or '<root>'!r} is in training mode; call "
                "model.eval() before explaining, so that normalisation and dropout are "
                "deterministic and the model's buffers stay unchanged"
            )
        if _observes(module) and not name.startswith(tuple(fake_quantizers)):
            raise ModelStateError(
                f"{type(module).__name__} {name or '<root>'!r} records statistics of every "
                "forward (a quantization observer, from torch.ao.quantization.prepare or "
                "prepare_qat), in eval mode too: explaining would add the inputs the method runs "
                "(path points, references, noisy copies) to its calibration. Explain the float "
                "model (a copy kept before prepare(): copy.deepcopy(model)); for fake "
                "quantization, call model.apply(torch.ao.quantization.disable_observer) first"
            )


def _mode_dependent(module: nn.Module) -> bool:
    """Whether ``module``'s forward differs between training and eval mode."""
    if isinstance(module, nn.modules.instancenorm._InstanceNorm):
        return module.track_running_stats
    if isinstance(module, nn.RNNBase):  # dropout between its layers, in training mode only
        return module.dropout > 0 and module.num_layers > 1
    if any(isinstance(hook, SpectralNorm) for hook in module._forward_pre_hooks.values()):
        return True  # torch.nn.utils.spectral_norm's hook: a power iteration per forward
    return isinstance(module, _MODE_DEPENDENT)


def _observes(module: nn.Module) -> bool:
    """Whether ``module`` updates quantization statistics in every forward."""
    if isinstance(module, FakeQuantizeBase):
        return bool(module.observer_enabled[0])
    return isinstance(module, ObserverBase) and not isinstance(module, _RECORDING_NOTHING)


# Observers that keep no statistics (a fixed dtype, an input's own parameters).
_RECORDING_NOTHING = (PlaceholderObserver, ReuseInputObserver, NoopObserver)


def _training_use(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """What a call does in training mode (``"dropout with p=0.5"``), or ``None``.

    Dropout draws new units on every call, batch norm uses the batch's statistics: the calls a
    forward makes with ``training=self.training``, which no check of the layer types can see.
    """
    functional = torch.nn.functional
    if func in _TRAINING_ARGUMENTS:
        if not _argument(func, args, kwargs, "training"):
            return None
        if func is functional.batch_norm:
            return "batch norm with the batch's statistics"
        if func in (functional.rrelu, torch.rrelu, torch.rrelu_):
            return "a randomised leaky ReLU"
        p = _argument(func, args, kwargs, "p", _argument(func, args, kwargs, "dropout_p", 0.0))
        return f"dropout with p={p}" if p else None
    if func is functional.scaled_dot_product_attention:
        p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
        return f"attention dropout with p={p}" if p else None
    return None


def _argument(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], name: str, absent: Any = None
) -> Any:
    """The value ``func(*args, **kwargs)`` gets for parameter ``name`` (``absent``: no such one).

    By position, without binding the signature: the check runs on every operation of a forward
    (binding it took 13 µs, for each batch norm of a ResNet).
    """
    where = _TRAINING_ARGUMENTS[func].get(name)
    if where is None:
        return absent
    if name in kwargs:
        return kwargs[name]
    position, default = where
    return args[position] if position < len(args) else default


def _training_arguments() -> dict[Any, dict[str, tuple[int, Any]]]:
    """Each call that may run in training mode → its parameters' positions and defaults."""
    functional = torch.nn.functional
    calls = (
        functional.dropout,
        functional.dropout1d,
        functional.dropout2d,
        functional.dropout3d,
        functional.alpha_dropout,
        functional.feature_alpha_dropout,
        functional.batch_norm,
        functional.rrelu,
        functional.multi_head_attention_forward,
    )
    arguments = {
        call: {
            name: (position, parameter.default)
            for position, (name, parameter) in enumerate(inspect.signature(call).parameters.items())
        }
        for call in calls
    }
    for builtin in (torch.rrelu, torch.rrelu_):  # F.rrelu_ too; no signature to read
        arguments[builtin] = {"training": (3, False)}
    return arguments


_TRAINING_ARGUMENTS = _training_arguments()


def _without_statistics(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether an ``F.batch_norm`` call has no running statistics (``running_mean``, second)."""
    mean = kwargs.get("running_mean", args[1] if len(args) > 1 else None)
    var = kwargs.get("running_var", args[2] if len(args) > 2 else None)
    return mean is None and var is None


def _normalises_a_weight(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether an ``F.batch_norm`` call normalises a parameter (or a view of one), not data.

    Weight standardisation (timm's ``StdConv2d`` and ``ScaledStdConv2d``, in ResNetV2-BiT and
    NFNets) standardises a convolution's weight with ``F.batch_norm(w.reshape(1, out, -1),
    None, None, training=True)``: statistics of the weight, the same for every sample.
    """
    tensor = kwargs.get("input", args[0] if args else None)
    return isinstance(tensor, torch.nn.Parameter) or isinstance(
        getattr(tensor, "_base", None), torch.nn.Parameter
    )


def _random_windows(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a fractional max pooling draws its windows (no ``_random_samples``, sixth)."""
    return kwargs.get("_random_samples", args[5] if len(args) > 5 else None) is None


# Random in every mode unless given the windows.
_FRACTIONAL_POOLS = tuple(
    getattr(torch.nn.functional, f"fractional_max_pool{d}d{suffix}")
    for d in (2, 3)
    for suffix in ("", "_with_indices")
)


class RefuseTrainingCalls(TorchFunctionMode):
    """Refuses the calls a forward makes in training mode (this thread only).

    ``F.dropout(h, p, self.training)`` in a model left in training mode gives another map on
    every call; :func:`require_eval_mode` only sees modules, this sees the calls.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FRACTIONAL_POOLS and _random_windows(args, kwargs):
            raise ModelStateError(
                f"the model's forward calls {func.__name__}, which draws its pooling windows at "
                "random on every call, also in eval mode, so the explanation would change from "
                "call to call; pool with nn.MaxPool2d or nn.AdaptiveMaxPool2d instead, or pass "
                "allow_training=True to explain() to explain the random model anyway"
            )
        use = _training_use(func, args, kwargs)
        if (
            use is not None
            and func is torch.nn.functional.batch_norm
            and _without_statistics(args, kwargs)
        ):
            if _normalises_a_weight(args, kwargs):  # no batch in it, no statistics to update
                return func(*args, **kwargs)
            # eval mode does not help here: nn.BatchNorm* passes training=True whenever it has
            # no running statistics, so "call model.eval()" would send the user in a circle
            raise ModelStateError(
                "the model's forward calls batch_norm without running statistics (a BatchNorm "
                "with track_running_stats=False normalises with the batch's statistics in eval "
                "mode too), so each sample's explanation would depend on the others in its "
                "batch; give it running statistics (track_running_stats=True, estimated on "
                "training data), use nn.GroupNorm or nn.InstanceNorm2d instead, or pass "
                "allow_training=True to explain() to explain the batch-dependent model anyway"
            )
        if use is not None:
            raise ModelStateError(
                f"the model's forward calls {getattr(func, '__name__', func)} in training mode "
                f"({use}), so the explanation would change from call to call; call "
                "model.eval() before explaining (a forward that passes training=self.training "
                "then runs deterministically), or pass allow_training=True to explain() to "
                "explain the random model anyway"
            )
        return func(*args, **kwargs)
