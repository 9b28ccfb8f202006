"""The plan cache: a model's trace is reused while the model keeps its traced structure.

The trace (a one-sample run with checks) is cached per model, keyed by the composite's shape and
the input's per-sample shape, and validated on every call; the rules are resolved again from the
caller's composite each time.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import weakref
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from explain_core.engine.ops import without_function_modes
from explain_core.engine.tracing import Plan, move_custom_rules, resolve_rules, trace
from explain_core.interfaces.relevance import InputLayer, Op, OutputLayer
from explain_core.scoped import is_own_hook

if TYPE_CHECKING:
    from explain_core.engine.composite import Composite

# Key: the composite's *shape* (matchers that are types, type tuples, name globs or operation
# kinds, and the type of every rule), the handler's extra operations and the input's per-sample
# shape, dtype and device, and the canonizers (type and options). Predicates count by identity
# when they are functions defined at module level (which decide by the module's name and
# structure, both validated below); a composite with other matchers (lambdas, closures,
# callable objects) is never cached.
# Validity, checked on every call: every submodule, parameter and buffer is the same object as
# when traced (compared through weak references) and unchanged since (version counters), modules
# are in the same train/eval mode with the same plain attributes (flags that may steer
# ``forward``), and no hook or instance-level ``forward`` was added or removed. And after the
# real forward pass the affine modules actually called must be exactly the planned ones, each
# once; otherwise the plan is dropped and the pass re-runs with a fresh trace, so a stale plan can
# never skip a rule.
# The rules themselves are resolved again from the caller's composite on every call.

_PLAN_CACHE: weakref.WeakKeyDictionary[nn.Module, dict[Any, tuple[Any, Plan]]] = (
    weakref.WeakKeyDictionary()
)


def clear_plan_cache() -> None:
    """Forget every cached trace (the next call of each model traces again)."""
    _PLAN_CACHE.clear()


def _composite_key(composite: Composite, extra_ops: frozenset[str]) -> Any:
    canonizers = tuple((type(c), repr(sorted(vars(c).items()))) for c in composite.canonizers)
    entries = []
    for entry in composite.mapping:
        matcher = entry.matcher
        if not (
            isinstance(matcher, (str, type, Op, InputLayer, OutputLayer))
            or (isinstance(matcher, tuple) and all(isinstance(t, type) for t in matcher))
            or _named_function(matcher)
        ):
            return None
        entries.append((matcher, type(entry.rule)))
    return (type(composite), tuple(entries), canonizers, extra_ops)


def _named_function(matcher: Any) -> bool:
    """A predicate defined at module level (by identity: it decides by name and module only)."""
    return (
        inspect.isfunction(matcher)
        and matcher.__closure__ is None
        and "<" not in matcher.__qualname__  # not a lambda, not a function made in a function
    )


def _fingerprint(model: nn.Module) -> list[tuple[Any, ...]]:
    from torch.nn.modules import module as module_globals

    parts: list[tuple[Any, ...]] = [
        (
            _user_hooks(module_globals._global_forward_hooks),
            _user_hooks(module_globals._global_forward_pre_hooks),
        )
    ]
    with without_function_modes():  # reading ≈ 300 version counters on a ResNet-50
        parts.extend(_module_part(name, module) for name, module in model.named_modules())
    return parts


def _module_part(name: str, module: nn.Module) -> tuple[Any, ...]:
    """What of ``module`` steers the traced structure (compared by :func:`_same_fingerprint`)."""
    return (
        name,
        weakref.ref(module),
        module.training,
        tuple(module._forward_hooks),
        tuple(module._forward_pre_hooks),
        tuple(module._backward_hooks),
        module.__dict__.get("forward"),
        _settings(module),
        _tensor_refs(module._parameters),
        _tensor_refs(module._buffers),
    )


def _user_hooks(hooks: dict[int, Any]) -> tuple[int, ...]:
    """Keys of the process-wide hooks, without those attribution in other threads installs."""
    return tuple(key for key, hook in hooks.items() if not is_own_hook(hook))


def _settings(module: nn.Module) -> tuple[tuple[str, Any], ...]:
    """The module's attributes that may steer ``forward``, in comparable form.

    Flags and options (numbers, strings, enums, small containers and dataclasses of them),
    functions (by identity, e.g. ``self.act = torch.tanh``), other objects by identity and the
    flags among their own attributes (a config object: ``self.config.pad_input``), and tensor
    attributes that are neither parameters nor buffers (by identity and version). Submodules,
    parameters and buffers are compared elsewhere. Recursion stops there: an object's objects
    are compared by identity only.
    """
    return tuple(
        (key, _setting(value)) for key, value in module.__dict__.items() if key not in _INTERNAL
    )


# nn.Module's own bookkeeping (compared elsewhere, or irrelevant to forward).
_INTERNAL = frozenset(nn.Module().__dict__)
_PLAIN = (bool, int, float, complex, str, bytes, type(None), enum.Enum)


def _setting(value: Any) -> Any:
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value), value._version)
    if isinstance(value, (list, tuple, set, frozenset)) and len(value) <= 64:
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return (type(value).__name__, tuple(_setting(item) for item in items))
    if isinstance(value, dict) and len(value) <= 64:
        return ("dict", tuple((k, _setting(v)) for k, v in value.items()))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # a config object
        fields = dataclasses.fields(value)
        return ("dataclass", id(value), tuple(_setting(getattr(value, f.name)) for f in fields))
    state = getattr(value, "__dict__", None)
    if isinstance(state, dict) and not callable(value) and len(state) <= 512:
        flags = tuple((k, v) for k, v in state.items() if isinstance(v, _PLAIN))
        return ("object", id(value), flags)  # a config object: its flags steer forward
    return ("object", id(value))  # functions, modules' helpers, anything else: by identity


def _tensor_refs(tensors: dict[str, torch.Tensor | None]) -> tuple[tuple[Any, ...], ...]:
    # The version counter moves with every in-place change (an optimizer step): a layer with
    # its own forward passed the trace's affine check only for the values it had then.
    return tuple((k, weakref.ref(v), v._version) for k, v in tensors.items() if v is not None)


def _same_fingerprint(old: list[tuple[Any, ...]], new: list[tuple[Any, ...]]) -> bool:
    if len(old) != len(new) or old[0] != new[0]:
        return False
    for a, b in zip(old[1:], new[1:], strict=True):
        if a[0] != b[0] or a[1]() is not b[1]() or a[2:8] != b[2:8]:
            return False
        for refs_a, refs_b in ((a[8], b[8]), (a[9], b[9])):
            if len(refs_a) != len(refs_b) or any(
                ka != kb or ra() is not rb() or va != vb
                for (ka, ra, va), (kb, rb, vb) in zip(refs_a, refs_b, strict=True)
            ):
                return False
    return True


def _resolve_rules(model: nn.Module, composite: Composite, structure: Plan) -> Plan:
    """A copy of a cached plan with the rules of ``composite`` (raises like the trace)."""
    plan = replace(structure, order=list(structure.trace_order), rules={}, custom={})
    for name in structure.opaque_custom:
        rule = composite.rule_for(name, model.get_submodule(name))
        if rule is not None:
            plan.custom[name] = rule
    resolve_rules(model, composite, plan)
    move_custom_rules(plan)
    return plan


def planned(
    model: nn.Module,
    inputs: torch.Tensor,
    composite: Composite,
    extra_ops: frozenset[str],
    *,
    cache: bool,
) -> tuple[Plan, bool]:
    """The plan for this call, from the cache when valid; also whether it came from the cache."""
    key = _composite_key(composite, extra_ops) if cache else None
    fingerprint: list[tuple[Any, ...]] = []
    if key is not None:
        key = (key, tuple(inputs.shape[1:]), inputs.dtype, inputs.device)
        entry = _PLAN_CACHE.get(model, {}).get(key)
        fingerprint = _fingerprint(model)
        if entry is not None and _same_fingerprint(entry[0], fingerprint):
            return _resolve_rules(model, composite, entry[1]), True
    plan = trace(model, inputs, composite, extra_ops)
    if key is not None and not plan.value_dependent:  # a branch on values may go another way
        structure = replace(plan, order=[], rules={}, custom={})
        _PLAN_CACHE.setdefault(model, {})[key] = (fingerprint, structure)
    return plan, False


def forget_plan(model: nn.Module) -> None:
    """Drop the cached plans of ``model``."""
    _PLAN_CACHE.pop(model, None)


def expected_calls(plan: Plan) -> dict[str, int]:
    """Affine (and custom-ruled) module name → calls a pass following ``plan`` makes."""
    calls = dict.fromkeys(plan.order, 1)
    calls.update(dict.fromkeys(plan.merged.values(), 1))
    calls.update(dict.fromkeys(plan.custom, 1))
    calls.update(plan.calls)
    return calls
