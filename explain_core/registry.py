"""Method specifications and the registry that resolves method names to explainers."""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
import types
import typing
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Union

import torch
from torch import nn

from explain_core.errors import InvalidInputError, UnknownMethodError


@dataclass(frozen=True)
class MethodResult:
    """What a method computes; :func:`explain_core.explain` wraps it into an ``Attribution``.

    Attributes:
        attribution: Same shape as the inputs.
        output: Model output, detached, ``(batch, n_outputs)``.
        target: Explained output per sample, int64 ``(batch,)``.
        delta: Completeness or convergence delta per sample, or ``None``.
        extras: Method-specific values.
    """

    attribution: torch.Tensor
    output: torch.Tensor
    target: torch.Tensor
    delta: torch.Tensor | None = None
    extras: dict[str, Any] = field(default_factory=dict)


class Method(ABC):
    """An attribution method configured with its options (usually a dataclass).

    Attributes:
        uses_baselines: Whether :meth:`attribute` accepts reference inputs.
    """

    uses_baselines: ClassVar[bool] = False

    @abstractmethod
    def attribute(
        self,
        model: nn.Module,
        inputs: torch.Tensor,
        target: torch.Tensor | None,
        baselines: torch.Tensor | None,
    ) -> MethodResult:
        """Explain ``model`` at ``inputs``.

        Args:
            model: The user's model, in eval mode; the caller guards its state.
            inputs: ``(batch, ...)`` floating-point inputs.
            target: Output index per sample, or ``None`` for the predicted class.
            baselines: Reference inputs broadcastable to ``inputs``, only if
                :attr:`uses_baselines`.

        Returns:
            The attribution with the output and explained targets.
        """


@dataclass(frozen=True)
class MethodSpec:
    """A method as a plugin registers it.

    Attributes:
        name: Registered name, conventionally ``family.variant`` (``lrp.epsilon``).
        factory: Builds a configured :class:`Method` from keyword options (e.g. the class).
        family: Method family, for listings (``"gradient"``, ``"lrp"``, ``"coda"``).
        summary: One line describing the method.
        plugin: Name of the plugin that registered it; filled in by the registry.
    """

    name: str
    factory: Callable[..., Method]
    family: str
    summary: str
    plugin: str = ""

    def options(self) -> dict[str, Any]:
        """Option name → default value (``inspect.Parameter.empty`` when required)."""
        if dataclasses.is_dataclass(self.factory):
            return {
                f.name: (
                    f.default if f.default is not dataclasses.MISSING else inspect.Parameter.empty
                )
                for f in dataclasses.fields(self.factory)
                if f.init
            }
        parameters = inspect.signature(self.factory).parameters.values()
        keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        return {p.name: p.default for p in parameters if p.kind in keyword}

    def create(self, **options: Any) -> Method:
        """Build the method with ``options``.

        Options are checked against the annotations of a dataclass factory's fields first:
        ``bool`` takes only booleans, ``int`` integers (not ``bool`` or ``float``), ``float`` finite
        numbers, and float tensors must be finite.

        Raises:
            InvalidInputError: If an option is unknown, of the wrong type, not finite or invalid.
        """
        known = self.options()
        unknown = sorted(set(options) - set(known))
        if unknown:
            accepted = ", ".join(known) or "none"
            raise InvalidInputError(
                f"method {self.name!r} has no option {', '.join(map(repr, unknown))}; "
                f"accepted options: {accepted}"
            )
        self._check_option_types(options, known)
        try:
            return self.factory(**options)
        except (TypeError, ValueError) as error:
            raise InvalidInputError(f"invalid options for method {self.name!r}: {error}") from error

    def _check_option_types(self, options: Mapping[str, Any], defaults: Mapping[str, Any]) -> None:
        """Check options against the factory's annotations before the factory compares them.

        Without this, ``steps="10"`` fails inside ``__post_init__`` with "'<' not supported
        between 'str' and 'int'" and ``epsilon=nan`` is accepted and yields NaN maps.
        """
        hints = _option_hints(self.factory)
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
                f"option {name!r} of method {self.name!r} must be {_expected(hint)}; "
                f"got {_describe(value)}{example}"
            )


def _option_hints(factory: Callable[..., Method]) -> dict[str, Any]:
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


class MethodRegistry(Mapping[str, MethodSpec]):
    """Read-only mapping of method names to specifications."""

    def __init__(self, specs: Mapping[str, MethodSpec]) -> None:
        self._specs = dict(sorted(specs.items()))

    def __getitem__(self, name: str) -> MethodSpec:
        try:
            return self._specs[name]
        except KeyError:
            raise UnknownMethodError(name, self._specs) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def by_plugin(self, plugin: str) -> list[MethodSpec]:
        """The methods registered by one plugin, sorted by name."""
        return [spec for spec in self._specs.values() if spec.plugin == plugin]
