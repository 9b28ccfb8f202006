"""Relevance rules: how a modified backward signal passes through individual modules.

A :class:`Rule` replaces a module's backward pass: given the signal arriving at the module's
output, it returns the signal for each tensor input. A :class:`Composite` maps modules (by type,
qualified name or predicate) to rules and, inside :meth:`Composite.context`, applies its
canonizers and attaches the rules with hooks. Leaving the context removes every hook and undoes
every canonizer, also when an exception is raised.

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
from typing import Any, Literal

import torch
from torch import nn

from explain_core.eager import eager_mode, uncompiled
from explain_core.errors import InvalidInputError
from explain_core.scoped import ModuleListener, listening

__all__ = [
    "Canonizer",
    "Composite",
    "CompositeSpec",
    "Matcher",
    "ModifiedGradient",
    "Op",
    "Predicate",
    "Rule",
    "RuleCall",
    "RuleMapping",
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
    """

    module: nn.Module | None
    name: str
    inputs: tuple[torch.Tensor, ...]
    output: torch.Tensor
    state: Any = None
    grad_output: torch.Tensor | None = field(default=None, repr=False)
    function: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, repr=False)


class Rule(ABC):
    """How relevance passes backwards through one module.

    Rules are small, stateless objects; a single instance may serve many modules. Per-call data
    belongs in the :class:`RuleCall` record (see :meth:`forward`).
    """

    def forward(self, call: RuleCall) -> Any:
        """Compute per-call state during the forward pass (optional; stored as ``call.state``)."""
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


class Canonizer(ABC):
    """A temporary rewrite of a model that makes rules applicable (e.g. merging BatchNorm)."""

    @abstractmethod
    def apply(self, model: nn.Module) -> Callable[[], None]:
        """Rewrite ``model`` in place and return a function that restores it exactly."""


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
        """Whether the module at ``name`` is matched by this entry."""
        matcher = self.matcher
        if isinstance(matcher, Op):
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
        canonizers: Applied in order before rules are attached, undone in reverse order.
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
        """Apply canonizers and attach rules for the duration of the block.

        Yields:
            The same model, rewritten by the canonizers and with rules attached.
        """
        yielded, model = model, uncompiled(model)
        with ExitStack() as stack:
            stack.enter_context(eager_mode())  # hooks must run as written, not be traced
            for canonizer in self.canonizers:
                stack.callback(canonizer.apply(model))
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
