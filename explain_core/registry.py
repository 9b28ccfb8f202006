"""Method specifications and the registry that resolves method names to explainers."""

from __future__ import annotations

import dataclasses
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar, NoReturn

import torch
from torch import nn

from explain_core.errors import ExplainError, InvalidInputError, MethodError, UnknownMethodError
from explain_core.option_types import check_option_types

__all__ = [
    "Method",
    "MethodRegistry",
    "MethodResult",
    "MethodSpec",
    "check_method_result",
    "third_party_errors",
]


@dataclass(frozen=True)
class MethodResult:
    """What a method computes; :func:`explain_core.explain` wraps it into an ``Attribution``.

    ``explain()`` checks every result (:func:`check_method_result`) and detaches its tensors.

    Attributes:
        attribution: Same shape as the inputs (every built-in method returns that shape).
        output: Model output, detached, ``(batch, n_outputs)``.
        target: Explained output per sample, int64 ``(batch,)``.
        delta: Completeness or convergence delta per sample ``(batch,)``, or ``None``.
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
        memory_option: The option that bounds the rows per forward pass, if the method has
            one (named by the out-of-memory error, e.g. ``"internal_batch_size"``).
        convergence_delta: Whether :meth:`attribute` returns a delta per sample (what the
            attribution leaves of the explained output or output gain); Captum's
            ``has_convergence_delta()``, which must be known before any call.
        multiplies_by_inputs: Whether the attribution is a product with the input (or with
            input − baseline), so zero wherever they are equal; Captum's property of that name.
            A method whose option decides it overrides it with a property.
        quadrature: For a path integral, its rule in Captum's naming (``"riemann_middle"``:
            the midpoint rule), so that Captum's ``method=`` keyword can be checked; else
            ``None``.
        contrasts_outputs: Whether the map contrasts the explained output with the model's
            other outputs (contrastive LRP): a tuple target, which explains one entry of an
            output map, would contrast it with every other entry of the map.
    """

    uses_baselines: ClassVar[bool] = False
    memory_option: ClassVar[str | None] = None
    convergence_delta: ClassVar[bool] = False
    multiplies_by_inputs: ClassVar[bool] = False
    quadrature: ClassVar[str | None] = None
    contrasts_outputs: ClassVar[bool] = False

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
        builtin: Whether that plugin ships with the package; filled in by the registry.
    """

    name: str
    factory: Callable[..., Method]
    family: str
    summary: str
    plugin: str = ""
    builtin: bool = False

    @property
    def label(self) -> str:
        """``method 'name' (plugin 'p')``, for messages."""
        return f"method {self.name!r}" + (f" (plugin {self.plugin!r})" if self.plugin else "")

    def options(self) -> dict[str, Any]:
        """Option name → default value (``inspect.Parameter.empty`` when required).

        Raises:
            MethodError: If the factory's parameters cannot be read (e.g. a builtin type).
        """
        if dataclasses.is_dataclass(self.factory):
            return {
                f.name: (
                    f.default if f.default is not dataclasses.MISSING else inspect.Parameter.empty
                )
                for f in dataclasses.fields(self.factory)
                if f.init
            }
        try:
            parameters = inspect.signature(self.factory).parameters.values()
        except (TypeError, ValueError):
            raise MethodError(
                f"{self.label} has the factory {self.factory!r}, whose options cannot be read; "
                "a MethodSpec's factory must build an explain_core.Method (usually the Method "
                "subclass itself): report it to the plugin's authors"
            ) from None
        keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        return {p.name: p.default for p in parameters if p.kind in keyword}

    def create(self, **options: Any) -> Method:
        """Build the method with ``options``.

        Options are checked against the annotations of a dataclass factory's fields first:
        ``bool`` takes only booleans, ``int`` integers (not ``bool`` or ``float``), ``float`` finite
        numbers, and float tensors must be finite.

        Raises:
            InvalidInputError: If an option is unknown, of the wrong type, not finite or invalid.
            MethodError: If the factory does not build a :class:`Method`, or a third-party
                factory raises (``SystemExit`` too).
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
        with third_party_errors(self, "report it to the plugin's authors", " while being built"):
            try:
                method = self.factory(**options)
            except (TypeError, ValueError) as error:
                raise InvalidInputError(
                    f"invalid options for method {self.name!r}: {error}"
                ) from error
        if not isinstance(method, Method):
            raise MethodError(
                f"{self.label}: its factory built {type(method).__name__}; expected an "
                "explain_core.Method (a MethodSpec's factory is usually the Method subclass): "
                "report it to the plugin's authors"
            )
        return method


@contextmanager
def third_party_errors(spec: MethodSpec, advice: str, doing: str = "") -> Iterator[None]:
    """Turn an error escaping a third-party method into one naming the method and plugin.

    The user cannot fix a plugin's bug, so it gets a one-line error on the command line (with
    the original chained) instead of a traceback; a built-in method's error is a bug of this
    package and keeps its type and traceback. ``SystemExit`` (``sys.exit(0)`` in a plugin) and
    other ``BaseException`` subclasses count as errors too; only ``KeyboardInterrupt`` passes.

    Args:
        spec: The method.
        advice: What the message tells the user after naming the error.
        doing: What the method was doing, e.g. ``" while being built"``.
    """
    try:
        yield
    except (ExplainError, KeyboardInterrupt):
        raise
    except BaseException as error:  # sys.exit(0) in a plugin must not look like success
        if spec.builtin:
            raise
        first = (str(error).strip().splitlines() or [""])[0]
        raise MethodError(
            f"{spec.label} raised {type(error).__name__}{doing}: {first}; {advice}"
        ) from error


def check_method_result(result: Any, inputs: torch.Tensor, label: str) -> MethodResult:
    """``result`` with its tensors detached, if it keeps the :class:`MethodResult` contract.

    The attribution must have the inputs' shape, the output ``(batch, n_outputs)`` rows, the
    target one integer per sample within ``[0, n_outputs)``, and the delta (if any) one value
    per sample. The target comes back as int64.

    Args:
        result: What a method's ``attribute()`` returned.
        inputs: The inputs it explained, ``(batch, ...)``.
        label: The method in messages, e.g. ``"method 'x' (plugin 'p')"``.

    Raises:
        MethodError: Naming the method, what it returned and what was expected.
    """
    if not isinstance(result, MethodResult):
        _broken(label, f"returned {type(result).__name__}; expected explain_core.MethodResult")
    batch = inputs.shape[0]
    shape = tuple(inputs.shape)
    _check_tensor(label, "attribution", result.attribution, shape, f"the inputs' shape {shape}")
    _check_tensor(label, "output", result.output, (batch, -1), f"shape ({batch}, n_outputs)")
    _check_tensor(label, "target", result.target, (batch,), f"shape ({batch},)")
    _check_target(label, result.target, result.output.shape[1])
    if result.delta is not None:
        _check_tensor(label, "delta", result.delta, (batch,), f"shape ({batch},) or None")
    if not isinstance(result.extras, dict):
        _broken(label, f"returned extras of type {type(result.extras).__name__}; expected a dict")
    return MethodResult(
        attribution=result.attribution.detach(),
        output=result.output.detach(),
        target=result.target.detach().long(),
        delta=None if result.delta is None else result.delta.detach(),
        extras={
            key: value.detach() if isinstance(value, torch.Tensor) else value
            for key, value in result.extras.items()
        },
    )


def _broken(label: str, what: str) -> NoReturn:
    raise MethodError(f"{label} {what}; report it to the plugin's authors")


def _check_tensor(label: str, name: str, value: Any, shape: tuple[int, ...], wanted: str) -> None:
    """A tensor of ``shape`` (-1: any size on that axis), else :class:`MethodError`."""
    name = f"{'an' if name[0] in 'aeiou' else 'a'} {name}"
    if not isinstance(value, torch.Tensor):
        _broken(
            label,
            f"returned {name} of type {type(value).__name__}; expected a torch.Tensor of {wanted}",
        )
    sizes = zip(shape, value.shape, strict=False)  # compared only when the ranks agree
    if value.dim() != len(shape) or any(n not in (-1, m) for n, m in sizes):
        _broken(label, f"returned {name} of shape {tuple(value.shape)}; expected {wanted}")


def _check_target(label: str, target: torch.Tensor, n_outputs: int) -> None:
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        _broken(label, f"returned a target of dtype {target.dtype}; expected integer class indices")
    if target.numel() and (int(target.min()) < 0 or int(target.max()) >= n_outputs):
        _broken(
            label,
            f"returned targets {target.tolist()[:8]} outside [0, {n_outputs - 1}], the model's "
            "outputs",
        )


class MethodRegistry(Mapping[str, MethodSpec]):
    """Read-only mapping of method names to specifications."""

    def __init__(
        self, specs: Mapping[str, MethodSpec], failed: Mapping[str, str] | None = None
    ) -> None:
        self._specs = dict(sorted(specs.items()))
        self._failed = dict(failed or {})  # plugin name → why it failed (its methods are gone)

    def __getitem__(self, name: str) -> MethodSpec:
        try:
            return self._specs[name]
        except KeyError:
            raise UnknownMethodError(name, self._specs, self._failed) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def by_plugin(self, plugin: str) -> list[MethodSpec]:
        """The methods registered by one plugin, sorted by name."""
        return [spec for spec in self._specs.values() if spec.plugin == plugin]
