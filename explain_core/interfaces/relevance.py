"""Relevance rules: how a modified backward signal passes through a module or an operation.

A :class:`Rule` replaces the backward pass of one module call or one traced operation: given the
signal arriving at the output, it returns the signal for each tensor input. Rules for affine
layers (:class:`AffineRule`: Linear, ConvNd, BatchNorm, or a Linear/Conv merged with its
BatchNorm) read the layer's weights from ``call.layer``. A :class:`Composite` maps modules (by
type, qualified name or predicate) and operation kinds (:class:`Op`) to rules; an engine applies
them (inside :meth:`Composite.context` with module hooks, or through the modified-backpropagation
engine, which also checks every operation and applies the composite's canonizers).

Each forward call of a ruled module gets its own :class:`RuleCall` record, held only by the
autograd graph, so nothing outlives the graph and a module called twice never overwrites the
tensors of its first call. Reuse is still refused by default, because most relevance methods
(e.g. those storing statistics per layer) assume one call per module.
"""

from __future__ import annotations

import contextvars
import fnmatch
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from explain_core.affine import AffineLayer, is_affine
from explain_core.canonizers import Canonizer
from explain_core.eager import eager_mode, uncompiled
from explain_core.errors import InvalidInputError
from explain_core.scoped import ModuleListener, listening

__all__ = [
    "AffineRule",
    "Canonizer",
    "Composite",
    "CompositeSpec",
    "Gradient",
    "Matcher",
    "ModifiedGradient",
    "Op",
    "Predicate",
    "Rule",
    "RuleCall",
    "RuleMapping",
    "safe_divide",
]

Predicate = Callable[[str, nn.Module], bool]

# True while a rule's backward runs: rules typically re-run their module (with modified
# parameters) to differentiate it, and those calls must not be wrapped again.
_RULES_SUSPENDED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "explain_rules_suspended", default=False
)


@dataclass
class RuleCall:
    """One forward call of a module, or one traced operation, with a rule attached.

    Attributes:
        module: The module that was called (``None`` for an operation).
        name: Its qualified name inside the model (``""`` for the root), or the operation's kind.
        inputs: The tensor inputs of the call, detached.
        output: The output of the call, detached.
        state: Whatever :meth:`Rule.forward` returned for this call.
        grad_output: The signal that arrived at the output during backward (set by the engine).
        function: For an operation: the call as written, applied out of place to other values
            of its (first) tensor input, e.g. to take a derivative.
        layer: For an affine module: its weights and geometry (merged with the BatchNorm that
            follows it where a canonizer merged them), else ``None``.
    """

    module: nn.Module | None
    name: str
    inputs: tuple[torch.Tensor, ...]
    output: torch.Tensor
    state: Any = None
    grad_output: torch.Tensor | None = field(default=None, repr=False)
    function: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, repr=False)
    layer: AffineLayer | None = field(default=None, repr=False)


class Rule(ABC):
    """How relevance passes backwards through one module call or one traced operation.

    The signal convention: the signal ``s`` is shaped like the tensor it belongs to and the
    relevance of an activation ``h`` is ``h ⊙ s``; the ordinary gradient is such a signal.
    Rules are small, stateless objects; a single instance may serve many modules. Per-call data
    belongs in the :class:`RuleCall` record (see :meth:`forward`).

    Attributes:
        returns_relevance: :meth:`backward` returns relevance, not a signal, at the input. Such
            rules (Deep Taylor's w², flat, z^B) only apply to the layer that reads the model
            input: relevance cannot be propagated further down.
    """

    returns_relevance: ClassVar[bool] = False

    def applies_to(self, module: nn.Module) -> bool:
        """Whether the rule can serve ``module`` (composites skip entries that cannot)."""
        return True

    def forward(self, call: RuleCall) -> Any:
        """Compute per-call state during the forward pass (optional; stored as ``call.state``).

        Runs without autograd; the tensors of ``call`` are detached.
        """
        return None

    @abstractmethod
    def backward(
        self, call: RuleCall, grad_output: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        """Return the backward signal for each tensor input of the call.

        Args:
            call: The forward call being propagated through.
            grad_output: Signal arriving at the module's output, shaped like ``call.output``.

        Returns:
            One tensor (shaped like the input) or ``None`` per entry of ``call.inputs``.
        """

    def relevance(self, call: RuleCall, relevance: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """The signal at the inputs for a *relevance* ``R`` set at the output.

        Used where relevance is injected at a layer (the CSC metric). The default is
        :meth:`backward` of the signal ``R / output`` (0 where the output is 0); rules whose
        relevance form is defined there too override it.
        """
        return self.backward(call, safe_divide(relevance, call.output))

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({options})"


class AffineRule(Rule):
    """A rule for affine layers: it reads the weights from ``call.layer``.

    ``call.layer`` is an :class:`~explain_core.affine.AffineLayer`; the module is never run
    again. Composites skip its entries for other modules, so a broad matcher
    (``"features.*"``) gives it only the Linear/Conv/BatchNorm layers.
    """

    def applies_to(self, module: nn.Module) -> bool:  # noqa: D102
        return is_affine(module)

    @staticmethod
    def affine(call: RuleCall) -> tuple[AffineLayer, torch.Tensor, torch.Tensor]:
        """``(layer, x, z)``: the layer view, its input and its output.

        Raises:
            InvalidInputError: If the call has no layer view (the rule was applied to an
                operation, or by an engine that provides none).
        """
        if call.layer is None:
            raise InvalidInputError(
                f"this rule is for Linear/Conv/BatchNorm layers; {call.name!r} is not one"
            )
        return call.layer, call.inputs[0], call.output


class Gradient(Rule):
    """The ordinary gradient (engines attach nothing for it where they can)."""

    def backward(  # noqa: D102
        self, call: RuleCall, grad_output: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        if call.layer is not None:
            return (call.layer.transpose(grad_output, call.inputs[0]),)
        inputs = tuple(t.detach().requires_grad_(True) for t in call.inputs)
        run = call.function if call.function is not None else call.module
        if run is None:
            raise InvalidInputError(f"the call {call.name!r} cannot be run again")
        with torch.enable_grad():
            output = run(*inputs)
        return torch.autograd.grad(output, inputs, grad_output, allow_unused=True)


def safe_divide(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """``numerator / denominator`` with 0 where the denominator is 0."""
    zero = denominator == 0
    return numerator / denominator.masked_fill(zero, 1.0) * ~zero


class ModifiedGradient(ABC):
    """A backward signal in place of the gradient: a composite's rules, an explanation mode.

    Any attributor that takes gradients (gradient, Input×Gradient, SmoothGrad, Integrated
    Gradients) runs over any of them (the ``composite=`` option of those methods). A subclass
    says inside which context the model's backward pass is modified (:meth:`context`);
    :meth:`gradient` runs the model there.
    """

    @abstractmethod
    def context(self, model: nn.Module) -> AbstractContextManager[Any]:
        """Inside this context, gradients through ``model`` are the modified ones."""

    def gradient(
        self,
        model: nn.Module,
        inputs: torch.Tensor,
        select: Callable[[torch.Tensor], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``model`` at ``inputs`` and propagate a signal back to them.

        Args:
            model: The model.
            inputs: ``(batch, ...)`` inputs (not changed).
            select: Maps the detached output to the signal started at the output (e.g. a
                one-hot of the explained class).

        Returns:
            ``(output, signal at the inputs)``: the detached output, and the modified gradient
            shaped like ``inputs``.
        """
        x = inputs.detach().requires_grad_(True)
        with self.context(model), torch.enable_grad():
            output = model(x)
            (signal,) = torch.autograd.grad(output, x, select(output.detach()))
        return output.detach(), signal


@dataclass(frozen=True)
class CompositeSpec:
    """A composite registered by name (``explain_register_composites``).

    Attributes:
        name: The name methods take (``composite="epsilon_plus"``).
        build: Builds the :class:`ModifiedGradient` with its defaults.
        summary: One line for listings.
    """

    name: str
    build: Callable[[], ModifiedGradient]
    summary: str = ""


class Op:
    """Matches traced operations by kind (``Op("gelu", "silu")``), for a composite's entries.

    A kind is the operation's normalised name: ``F.gelu`` and ``Tensor.gelu`` are ``"gelu"``,
    ``Tensor.relu_`` is ``"relu_"``. Engines that trace operations (the modified-backpropagation
    engine) apply the rule to every call of those operations on values that depend on the input.
    Rules for operations see one tensor input and one output.
    """

    def __init__(self, *kinds: str) -> None:
        if not kinds or not all(isinstance(kind, str) and kind for kind in kinds):
            raise InvalidInputError(f"Op needs operation names such as 'gelu'; got {kinds!r}")
        self.kinds = frozenset(kinds)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Op) and other.kinds == self.kinds

    def __hash__(self) -> int:
        return hash(("Op", self.kinds))

    def __repr__(self) -> str:
        return f"Op({', '.join(map(repr, sorted(self.kinds)))})"


Matcher = type[nn.Module] | tuple[type[nn.Module], ...] | str | Predicate | Op


@dataclass(frozen=True)
class RuleMapping:
    """One entry of a composite: modules (or operations) matching ``matcher`` get ``rule``."""

    matcher: Matcher
    rule: Rule

    def matches(self, name: str, module: nn.Module) -> bool:
        """Whether the module at ``name`` is matched by this entry (and its rule applies)."""
        matcher = self.matcher
        if isinstance(matcher, Op) or not self.rule.applies_to(module):
            return False
        if isinstance(matcher, str):
            return fnmatch.fnmatchcase(name, matcher)
        if isinstance(matcher, type) or (
            isinstance(matcher, tuple) and all(isinstance(t, type) for t in matcher)
        ):
            return isinstance(module, matcher)
        return bool(matcher(name, module))


class Composite(ModifiedGradient):
    """Maps the modules of a model to rules; the first matching entry wins.

    As a :class:`ModifiedGradient` its gradient is taken inside :meth:`context`.

    Args:
        mapping: ``(matcher, rule)`` pairs. A matcher is a module type (or tuple of types), a
            glob over qualified module names (``"features.*"``), or a predicate
            ``(name, module) -> bool``.
        canonizers: Rewrites of the traced layers (e.g.
            :class:`~explain_core.canonizers.MergeBatchNorm`), applied in order by engines that
            trace the model; the module-hook :meth:`context` traces nothing and refuses them.
        allow_reuse: Allow a ruled module to be called more than once per forward pass.
        unmapped: What to do with a leaf module that no entry matches and that is not in
            ``passthrough``: ``"pass"`` lets the ordinary gradient through it, ``"error"`` raises.
        passthrough: Leaf module types that need no rule (e.g. activations handled by the
            gradient), consulted only when ``unmapped="error"``.
    """

    def __init__(
        self,
        mapping: Sequence[tuple[Matcher, Rule]],
        *,
        canonizers: Sequence[Canonizer] = (),
        allow_reuse: bool = False,
        unmapped: Literal["pass", "error"] = "pass",
        passthrough: tuple[type[nn.Module], ...] = (),
    ) -> None:
        if unmapped not in ("pass", "error"):
            raise ValueError(f"unmapped must be 'pass' or 'error'; got {unmapped!r}")
        self.mapping = [RuleMapping(matcher, rule) for matcher, rule in mapping]
        self.canonizers = list(canonizers)
        self.allow_reuse = allow_reuse
        self.unmapped = unmapped
        self.passthrough = passthrough

    def rule_for(self, name: str, module: nn.Module) -> Rule | None:
        """The rule for one module, or ``None`` if no entry matches."""
        for entry in self.mapping:
            if entry.matches(name, module):
                return entry.rule
        return None

    def rule_for_op(self, kind: str) -> Rule | None:
        """The rule for traced operations of ``kind`` (e.g. ``"gelu"``), or ``None``."""
        for entry in self.mapping:
            if isinstance(entry.matcher, Op) and kind in entry.matcher.kinds:
                return entry.rule
        return None

    @property
    def op_kinds(self) -> frozenset[str]:
        """Every operation kind an entry maps."""
        kinds = (entry.matcher.kinds for entry in self.mapping if isinstance(entry.matcher, Op))
        return frozenset().union(*kinds)

    def assignments(self, model: nn.Module) -> dict[str, Rule]:
        """Qualified module name → rule, for every module the composite maps.

        Raises:
            InvalidInputError: If ``unmapped="error"`` and a leaf module has no rule.
        """
        assigned: dict[str, Rule] = {}
        for name, module in model.named_modules():
            rule = self.rule_for(name, module)
            if rule is not None:
                assigned[name] = rule
            elif (
                self.unmapped == "error"
                and _is_leaf(module)
                and not isinstance(module, self.passthrough)
            ):
                raise InvalidInputError(
                    f"no rule for module {name or '<root>'!r} of type {type(module).__name__}; "
                    f"add an entry for it to the composite, e.g. ({type(module).__name__}, "
                    "SomeRule()), or list the type in passthrough"
                )
        return assigned

    @contextmanager
    def context(self, model: nn.Module) -> Iterator[nn.Module]:
        """Apply the rules to every module call of this context (this thread) in the block.

        Rules apply per module call, without tracing the model (operation rules and canonizers
        need an engine that traces it, such as the modified-backpropagation engine).

        Yields:
            The same model (unchanged; other threads see no rules).

        Raises:
            InvalidInputError: If the composite has canonizers.
        """
        if self.canonizers:
            raise InvalidInputError(
                "canonizers rewrite the layers an engine traced, and this context traces "
                "nothing: run the composite through a tracing engine (the modified-"
                "backpropagation plugin's composites and methods), or leave canonizers out"
            )
        yielded, model = model, uncompiled(model)
        with ExitStack() as stack:
            stack.enter_context(eager_mode())  # hooks must run as written, not be traced
            stack.enter_context(listening(_RuleListener(model, self)))
            yield yielded


class _RuleListener(ModuleListener):
    """Applies a composite's rules to the module calls of one context (see ``listening``)."""

    def __init__(self, model: nn.Module, composite: Composite) -> None:
        self.root = id(model)
        calls_this_pass: dict[str, int] = {}
        self.calls = calls_this_pass
        self.ruled: dict[int, _RuleHooks] = {}
        for name, rule in composite.assignments(model).items():
            if isinstance(rule, Gradient):
                continue  # nothing to change
            module = model.get_submodule(name) if name else model
            hooks = _RuleHooks(name, rule, calls_this_pass, composite.allow_reuse)
            self.ruled[id(module)] = hooks

    def before(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if id(module) == self.root:
            self.calls.clear()  # a new forward pass of the model
        hooks = self.ruled.get(id(module))
        return None if hooks is None else hooks.before(module, args)

    def after(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        hooks = self.ruled.get(id(module))
        return None if hooks is None else hooks.after(module, args, output)


def _is_leaf(module: nn.Module) -> bool:
    return next(module.children(), None) is None


class _RuleHooks:
    """The forward pre-hook and hook that wrap one module's inputs and output for its rule."""

    def __init__(self, name: str, rule: Rule, calls: dict[str, int], allow_reuse: bool) -> None:
        self.name = name
        self.rule = rule
        self.calls = calls
        self.allow_reuse = allow_reuse
        self.pending: list[RuleCall] = []

    def before(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if _RULES_SUSPENDED.get():
            return None
        count = self.calls[self.name] = self.calls.get(self.name, 0) + 1
        if count > 1 and not self.allow_reuse:
            raise InvalidInputError(
                f"module {self.name or '<root>'!r} ({type(module).__name__}) is called more than "
                "once in one forward pass; give each use its own module instance, or build the "
                "composite with allow_reuse=True if its rules support that"
            )
        tensors = tuple(a for a in args if isinstance(a, torch.Tensor))
        call = RuleCall(module, self.name, tuple(t.detach() for t in tensors), torch.empty(0))
        self.pending.append(call)
        wrapped = iter(_RuleEntry.apply(self.rule, call, *tensors) if tensors else ())
        return tuple(next(wrapped) if isinstance(a, torch.Tensor) else a for a in args)

    def after(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> torch.Tensor | None:
        if _RULES_SUSPENDED.get():
            return None
        call = self.pending.pop()
        if not isinstance(output, torch.Tensor):
            raise InvalidInputError(
                f"module {self.name or '<root>'!r} ({type(module).__name__}) returns "
                f"{type(output).__name__}; relevance rules need modules that return one tensor"
            )
        call.output = output.detach()
        if is_affine(module):
            call.layer = AffineLayer.from_module(self.name, module)
        with torch.no_grad():
            call.state = self.rule.forward(call)
        return _RuleExit.apply(call, output)


class _RuleEntry(torch.autograd.Function):
    """Identity on a module's inputs whose backward calls the rule instead of the gradient."""

    @staticmethod
    def forward(ctx: Any, rule: Rule, call: RuleCall, *inputs: torch.Tensor) -> Any:
        ctx.rule = rule
        ctx.call = call
        # Clones keep in-place modules (ReLU(inplace=True)) from altering the recorded inputs.
        return tuple(t.clone() for t in inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rule: Rule = ctx.rule
        call: RuleCall = ctx.call
        if call.grad_output is None:  # the module's output never reached what is differentiated
            return (None, None, *grads)
        token = _RULES_SUSPENDED.set(True)
        try:
            with torch.enable_grad():
                results = tuple(rule.backward(call, call.grad_output))
        finally:
            _RULES_SUSPENDED.reset(token)
        if len(results) != len(call.inputs):
            raise RuntimeError(
                f"{type(rule).__name__}.backward returned {len(results)} tensors for the "
                f"{len(call.inputs)} tensor inputs of module {call.name or '<root>'!r}"
            )
        return (None, None, *results)


class _RuleExit(torch.autograd.Function):
    """Identity on a module's output that hands the arriving signal to the call's record."""

    @staticmethod
    def forward(ctx: Any, call: RuleCall, output: torch.Tensor) -> torch.Tensor:
        ctx.call = call
        return output.clone()

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[None, torch.Tensor]:
        ctx.call.grad_output = grad_output
        return None, grad_output
