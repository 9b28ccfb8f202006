"""Relevance rules: how a modified backward signal passes through a module or an operation.

A :class:`Rule` replaces the backward pass of one module call or one traced operation: given the
signal arriving at the output, it returns the signal for each tensor input. Rules for affine
layers (:class:`AffineRule`: Linear, ConvNd, BatchNorm, or a Linear/Conv merged with its
BatchNorm) read the layer's weights from ``call.layer``. A composite
(:class:`explain_core.engine.Composite`) maps modules (by type, qualified name or predicate),
layer positions (:class:`InputLayer`, :class:`OutputLayer`) and operation kinds (:class:`Op`) to
rules; the relevance engine (:mod:`explain_core.engine`) traces the model and applies them.

Each call of a ruled module or operation gets its own :class:`RuleCall` record, held only by the
autograd graph, so nothing outlives the graph.
"""

from __future__ import annotations

import fnmatch
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from explain_core.affine import AffineLayer, is_affine
from explain_core.errors import InvalidInputError
from explain_core.vjp import vjp

__all__ = [
    "AffineRule",
    "CompositeSpec",
    "Gradient",
    "InputLayer",
    "InputPath",
    "Matcher",
    "ModifiedGradient",
    "Op",
    "OutputLayer",
    "Predicate",
    "Rule",
    "RuleCall",
    "RuleMapping",
    "safe_divide",
]

Predicate = Callable[[str, nn.Module], bool]


@dataclass(frozen=True)
class InputPath:
    """How the model input reaches the layer that reads it, for that layer's rule.

    The model may reshape, permute or pad its input before its first layer (``x.flatten(1)``,
    ``nn.ReflectionPad2d``); an input-layer rule that reads a tensor given for the model input
    (z^B's bounds) or asks which of the layer's inputs are the model's (the flat and w² rules:
    zero padding is no input) maps it the same way.

    Attributes:
        shape: The model input's shape.
        apply: The model's own operations from its input to the layer's, applied to another
            tensor of that shape.
    """

    shape: torch.Size
    apply: Callable[[torch.Tensor], torch.Tensor]

    def ones(self, like: torch.Tensor) -> torch.Tensor:
        """1 where the layer's input is a value of the model input, 0 where it is padding."""
        return self.apply(torch.ones(self.shape, dtype=like.dtype, device=like.device))


@dataclass
class RuleCall:
    """One forward call of a module, or one traced operation, with a rule attached.

    Attributes:
        module: The module that was called (``None`` for an operation).
        name: Its qualified name inside the model (``""`` for the root), or the operation's kind.
        inputs: The tensor inputs of the call, detached (not copied, as autograd saves
            tensors: an operation's input changed in place before backward is refused).
        output: The output of the call, detached (not copied: see ``output_in_backward``).
        state: Whatever :meth:`Rule.forward` returned for this call.
        grad_output: The signal that arrived at the output during backward (set by the engine).
        function: The call as written, applied to other values of its input tensors (one
            argument per entry of ``inputs``; an operation out of place, a module without the
            pass's rules), e.g. to take a derivative.
        layer: For an affine module: its weights and geometry (merged with the BatchNorm that
            follows it where a canonizer merged them), else ``None``.
        args: For an operation: its positional arguments as written (the inputs among them).
        kwargs: For an operation: its keyword arguments as written.
        sources: For each entry of ``inputs``: the call of this pass, with a rule of the
            composite's, that returned it (an activation's output, say), also through
            reshapes, selections, splits and broadcasts of that output and arithmetic of it
            with a number (``σ(s).view(b, c, 1, 1).expand_as(x)``, ``σ(s).chunk(3, 1)``,
            ``1 - σ(s)``, ``relu6(s + 3) / 6``), else ``None``; e.g. to tell a gate from the
            signal it gates.
        branch_free: The pass is being traced into a graph (an ONNX export): the rule must not
            branch on tensor values (``if bool(...)``), e.g. compute a fallback everywhere and
            select it with ``torch.where``.
        last_backward: Set by the engine during backward: no other backward pass will read
            ``state`` (the graph is not kept), so the rule may write into its tensors, e.g.
            multiply the signal into a kept ratio instead of allocating a new tensor.
        rectified_output: Set by the engine, for a rule whose
            :meth:`AffineRule.reads_rectified_output` says so: the output ``max(z, 0)`` of the
            ReLU that reads the layer's output, detached (not copied; changed in place before
            backward, it is refused, as autograd refuses for a ReLU's own saved output).
        rectified_version: The version counter of ``rectified_output`` when the ReLU returned
            it (the engine's, for that check).
        input_path: Set by the engine for a call of the layer that reads the model input: how
            the input reaches it (:class:`InputPath`); else ``None``.
    """

    module: nn.Module | None
    name: str
    inputs: tuple[torch.Tensor, ...]
    output: torch.Tensor
    state: Any = None
    grad_output: torch.Tensor | None = field(default=None, repr=False)
    function: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, repr=False)
    layer: AffineLayer | None = field(default=None, repr=False)
    args: tuple[Any, ...] = field(default=(), repr=False)
    kwargs: dict[str, Any] = field(default_factory=dict, repr=False)
    sources: tuple[RuleCall | None, ...] = field(default=(), repr=False)
    branch_free: bool = False
    last_backward: bool = False
    rectified_output: torch.Tensor | None = field(default=None, repr=False)
    rectified_version: int = field(default=0, repr=False)
    input_path: InputPath | None = field(default=None, repr=False)


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
        output_in_backward: :meth:`backward` reads ``call.output``. The engine keeps the
            call's tensors by reference (no copies, as autograd saves tensors); an output the
            model changes in place later in its forward is computed again from the inputs
            for such rules (inputs changed in place are refused, as autograd does).
        min_inputs: An operation rule applies to calls with at least this many
            input-dependent tensors; others pass the gradient (a product rule needs two
            factors: a product with a weight is linear).
    """

    returns_relevance: ClassVar[bool] = False
    output_in_backward: ClassVar[bool] = True
    min_inputs: ClassVar[int] = 1

    def applies_to(self, module: nn.Module) -> bool:
        """Whether the rule can serve ``module`` (composites skip entries that cannot)."""
        return True

    def gradient_scale(self, factors: int) -> float | None:
        """``c`` if this rule's backward is ``c`` times the gradient for every input, else ``None``.

        ``factors``: the call's number of input-dependent tensors. Rules of this form (the
        gradient: 1; the uniform product rule: ``1/factors``; an output held constant: 0)
        let the engine run fused kernels, such as attention's, and scale their gradients
        instead of writing the operation out.
        """
        return None

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

    uses_rectified_outputs: ClassVar[bool] = False
    """Whether, on a layer whose ``output_rectified`` is set, :meth:`backward` gives the outputs
    ``<= 0`` no signal, whatever arrives there: the ReLU's gradient, applied by the rule (the
    engine then passes the signal through that ReLU unchanged, and refuses a signal injected
    at the layer that is not 0 there)."""

    def applies_to(self, module: nn.Module) -> bool:  # noqa: D102
        return is_affine(module)

    @property
    def counts_bias(self) -> bool:
        """Whether the layer's bias takes its share of the relevance (LRP-0, ε, γ).

        A rule that ignores it (z⁺, w², flat, z^B, Excitation BP) passes the whole relevance of
        the layer's output to its inputs, and the engine does the same for a constant added to
        the output, the layer's bias written as an addition (``x @ W + b``). Default: ``True``.
        """
        return True

    def reads_input_in_backward(self, call: RuleCall) -> bool:
        """Whether :meth:`backward` reads the values of the layer's input for this call.

        Asked once :meth:`forward` has run. ``False`` (the input's shape and layout suffice, as
        for ``call.layer.transpose(s, x)``) lets the model free the input before the backward
        pass, as the gradient would (a ReLU's output that only this layer reads): ``backward``
        then finds in ``call.inputs`` a stand-in on the ``meta`` device with the input's shape,
        dtype and strides, which :meth:`~explain_core.affine.AffineLayer.transpose` takes as
        ``like`` and any computation refuses. A pass that records its layers (to inject or read
        signals there) keeps the input whatever this says. Default: ``True``.
        """
        return True

    def reads_rectified_output(self, call: RuleCall) -> bool:
        """Whether :meth:`backward` reads ``call.rectified_output`` for this call.

        Asked once :meth:`forward` has run, for a rule that :attr:`uses_rectified_outputs` on a
        layer whose ``output_rectified`` is set. The ReLU's output ``max(z, 0)`` is what the
        model keeps for its own backward anyway (the next layer's input, a pooling's), so a
        rule that computes its per-output factors from it in backward, instead of keeping them
        from forward, holds no tensor the size of the layer's output until then. Default:
        ``False``.
        """
        return False

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

    def gradient_scale(self, factors: int) -> float:  # noqa: D102
        return 1.0

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
        return vjp(output, inputs, grad_output, allow_unused=True)


def safe_divide(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """``numerator / denominator`` with 0 where the denominator is 0."""
    zero = denominator == 0
    return torch.div(numerator, denominator.masked_fill(zero, 1.0)).masked_fill_(zero, 0.0)


class ModifiedGradient(ABC):
    """A backward signal in place of the gradient: a composite's rules, an explanation mode.

    Any attributor that takes gradients (gradient, Input×Gradient, SmoothGrad, Integrated
    Gradients) runs over any of them (the ``composite=`` option of those methods).
    """

    @abstractmethod
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
    ``Tensor.relu_`` is ``"relu_"``, ``a * b`` is ``"mul"``. The engine applies the rule to every
    call of those operations on values that depend on the input. A rule for an operation sees
    the call's input-dependent tensor arguments as ``call.inputs`` (e.g. both factors of a
    product of two activations; not the weights of ``F.layer_norm``), its one output, and
    ``call.function``, the call as written applied to other values of those tensors.
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


class _Position:
    """A matcher for a layer by its place in the traced model."""

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(type(self))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class InputLayer(_Position):
    """Matches the affine layer that reads the model input (up to reshaping and padding).

    For Deep Taylor's input-layer rules (w², flat, z^B). Position entries are consulted before
    the others; a composite that has one refuses a model whose first layer reads something else
    (e.g. a normalisation inside ``forward``).
    """


class OutputLayer(_Position):
    """Matches the affine layer that produces the model output (the last one run)."""


Matcher = (
    type[nn.Module] | tuple[type[nn.Module], ...] | str | Predicate | Op | InputLayer | OutputLayer
)


@dataclass(frozen=True)
class RuleMapping:
    """One entry of a composite: modules (or operations) matching ``matcher`` get ``rule``."""

    matcher: Matcher
    rule: Rule

    def matches(self, name: str, module: nn.Module) -> bool:
        """Whether the module at ``name`` is matched by a module matcher (and the rule applies).

        Operation and position matchers never match here (see :class:`Op`, :class:`InputLayer`).
        """
        matcher = self.matcher
        if isinstance(matcher, Op | _Position) or not self.rule.applies_to(module):
            return False
        if isinstance(matcher, str):
            return fnmatch.fnmatchcase(name, matcher)
        if isinstance(matcher, type) or (
            isinstance(matcher, tuple) and all(isinstance(t, type) for t in matcher)
        ):
            return isinstance(module, matcher)
        return bool(matcher(name, module))
