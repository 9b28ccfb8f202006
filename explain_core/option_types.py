"""Method options checked against the annotations of the method's dataclass fields.

Without this, ``steps="10"`` fails inside a method's ``__post_init__`` with "'<' not supported
between 'str' and 'int'", and ``epsilon=nan`` is accepted and yields NaN maps.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import numbers
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal, Union

import torch

from explain_core.errors import InvalidInputError


def check_option_types(
    method: str,
    factory: Callable[..., object],
    options: Mapping[str, Any],
    defaults: Mapping[str, Any],
) -> None:
    """Refuse options whose values do not fit the factory's field annotations.

    Args:
        method: The method's registered name (for messages).
        factory: The method class; only dataclasses are checked.
        options: The options given.
        defaults: Option name → default value (for the example in messages).

    Raises:
        InvalidInputError: Naming the option, the expected type and the value got.
    """
    hints = _option_hints(factory)
    for name, value in options.items():
        hint = hints.get(name)
        if hint is None or _conforms(value, hint):
            continue
        default = defaults.get(name)
        example = (
            ""
            if default is None or default is inspect.Parameter.empty
            else f"; pass e.g. {name}={default!r} (the default)"
        )
        raise InvalidInputError(
            f"option {name!r} of method {method!r} must be {_expected(hint)}; "
            f"got {_describe(value)}{example}"
        )


@functools.lru_cache(maxsize=256)  # resolving the annotations costs ~0.5 ms: once per method
def _option_hints(factory: Callable[..., object]) -> dict[str, Any]:
    """Resolved annotations of a dataclass factory's fields; empty (no check) otherwise."""
    if not (isinstance(factory, type) and dataclasses.is_dataclass(factory)):
        return {}
    try:
        return typing.get_type_hints(factory)
    except Exception:  # unresolvable annotations: leave the check to the factory
        return {}


def _union_args(hint: Any) -> tuple[Any, ...] | None:
    origin = typing.get_origin(hint)
    if origin is Union or origin is types.UnionType:
        return typing.get_args(hint)
    return None


def _conforms(value: Any, hint: Any) -> bool:
    """Whether ``value`` fits ``hint``; hints this cannot judge (generics, protocols) pass."""
    members = _union_args(hint)
    if members is not None:
        return any(_conforms(value, member) for member in members)
    if hint is Any:
        return True
    if hint is None or hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        # bool is an int subclass, but True for a step count is a mistake.
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if hint is float:
        return (
            isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
        )
    origin = typing.get_origin(hint)
    if origin is Literal:
        return value in typing.get_args(hint)
    if origin is tuple:
        return _conforms_tuple(value, typing.get_args(hint))
    if isinstance(hint, type):
        if not isinstance(value, hint):
            return False
        return not isinstance(value, torch.Tensor) or _finite_tensor(value)
    return True


def _conforms_tuple(value: Any, items: tuple[Any, ...]) -> bool:
    if not isinstance(value, tuple):
        return False
    if len(items) == 2 and items[1] is Ellipsis:
        return all(_conforms(item, items[0]) for item in value)
    return len(value) == len(items) and all(map(_conforms, value, items))


def _finite_tensor(value: torch.Tensor) -> bool:
    # NaN in a tensor option (e.g. an LRP bound) would silently turn the whole map into NaN.
    if not value.is_floating_point() or value.device.type == "meta":
        return True
    return bool(torch.isfinite(value).all())


def _expected(hint: Any) -> str:
    """The hint in words: ``int | None`` → "an integer or None"."""
    members = _union_args(hint)
    if members is not None:
        words = [_expected(member) for member in members]
        return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"
    if hint is None or hint is type(None):
        return "None"
    named = {bool: "True or False", int: "an integer", float: "a finite number", str: "a string"}
    if hint in named:
        return named[hint]
    origin = typing.get_origin(hint)
    if origin is Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(hint)))
    if origin is tuple:
        items = typing.get_args(hint)
        if len(items) == 2 and items[1] is Ellipsis:
            return f"a tuple of {_plural(items[0])}"
        if len(set(items)) == 1:
            return f"a tuple of {len(items)} {_plural(items[0])}"
        return f"a tuple ({', '.join(_expected(item) for item in items)})"
    if hint is torch.Tensor:
        return "a finite tensor"
    return f"a {getattr(hint, '__name__', str(hint))}"


def _plural(hint: Any) -> str:
    return {int: "integers", float: "finite numbers", bool: "booleans", str: "strings"}.get(
        hint, f"values of type {_expected(hint)}"
    )


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"
