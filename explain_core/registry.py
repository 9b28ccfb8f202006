"""Method specifications and the registry that resolves method names to explainers."""

from __future__ import annotations

import dataclasses
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from explain_core.errors import InvalidInputError, UnknownMethodError
from explain_core.option_types import check_option_types


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
        check_option_types(self.name, self.factory, options, known)
        try:
            return self.factory(**options)
        except (TypeError, ValueError) as error:
            raise InvalidInputError(f"invalid options for method {self.name!r}: {error}") from error


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
