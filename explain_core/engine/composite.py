"""Composites: which rule each module, layer position and operation of a model gets."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from explain_core.canonizers import Canonizer, MergeBatchNorm
from explain_core.engine.backprop import ModifiedBackprop
from explain_core.errors import InvalidInputError
from explain_core.interfaces.relevance import (
    InputLayer,
    Matcher,
    ModifiedGradient,
    Op,
    OutputLayer,
    Rule,
    RuleMapping,
)

__all__ = ["Composite"]


class Composite(ModifiedGradient):
    """Maps a model's modules, layer positions and operations to rules.

    For a module, position entries (:class:`~explain_core.interfaces.relevance.InputLayer`,
    :class:`~explain_core.interfaces.relevance.OutputLayer`) are consulted first, then the
    others in order: the first entry that matches and whose rule applies to the module wins.
    The relevance engine (:class:`~explain_core.engine.ModifiedBackprop`) applies it; as a
    :class:`~explain_core.interfaces.relevance.ModifiedGradient` it gives any gradient
    attributor its signal (``explain(model, x, "smoothgrad", composite=...)``).

    Args:
        mapping: ``(matcher, rule)`` pairs. A matcher is a module type (or tuple of types), a
            glob over qualified module names (``"features.*"``), a predicate
            ``(name, module) -> bool``, a position (``InputLayer()``, ``OutputLayer()``) or
            operation kinds (``Op("gelu")``).
        canonizers: Rewrites of the traced layers, applied in order; by default each BatchNorm
            that directly follows a Linear/Conv is folded into it (the model is not changed).
        name: Short description for error messages and listings.
    """

    def __init__(
        self,
        mapping: Sequence[tuple[Matcher, Rule]],
        *,
        canonizers: Sequence[Canonizer] = (MergeBatchNorm(),),
        name: str = "composite",
    ) -> None:
        self.mapping = [RuleMapping(matcher, rule) for matcher, rule in mapping]
        for entry in self.mapping:
            if not isinstance(entry.rule, Rule):
                raise InvalidInputError(
                    f"a composite maps matchers to explain_core.Rule objects; got "
                    f"{type(entry.rule).__name__} for {entry.matcher!r}"
                )
        self.canonizers = list(canonizers)
        self.name = name

    def rule_for(
        self, name: str, module: nn.Module, *, reads_input: bool = False, is_output: bool = False
    ) -> Rule | None:
        """The rule for one module, or ``None`` if no entry matches.

        Args:
            name: The module's qualified name.
            module: The module.
            reads_input: It is the affine layer that reads the model input.
            is_output: It is the affine layer that produces the model output.
        """
        for entry in self.mapping:
            if (reads_input and isinstance(entry.matcher, InputLayer)) or (
                is_output and isinstance(entry.matcher, OutputLayer)
            ):
                return entry.rule
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

    def position_rule(self, position: type[InputLayer] | type[OutputLayer]) -> Rule | None:
        """The rule mapped to a layer position, or ``None``."""
        for entry in self.mapping:
            if isinstance(entry.matcher, position):
                return entry.rule
        return None

    def with_rules(self, *entries: tuple[Matcher, Rule]) -> Composite:
        """A copy with ``entries`` taking precedence over the existing mapping."""
        mapping = [*entries, *((m.matcher, m.rule) for m in self.mapping)]
        return Composite(mapping, canonizers=self.canonizers, name=self.name)

    def gradient(
        self,
        model: nn.Module,
        inputs: torch.Tensor,
        select: Callable[[torch.Tensor], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The engine's signal at the inputs (``inputs ⊙ signal`` is the composite's relevance).

        Raises:
            InvalidInputError: For a composite whose input-layer rule returns relevance (w²,
                flat, z^B): it defines no signal at the input.
            UnsupportedModelError: For what the rules cannot propagate through.
        """
        forward = ModifiedBackprop(self).forward(model, inputs)
        output = forward.output.detach()
        result = forward.backward(select(output))
        if result.input_is_relevance:
            raise InvalidInputError(
                f"the composite {self.name!r} puts a rule on the input layer that returns "
                "relevance, not a gradient (w², flat, z^B), so it cannot run under a gradient "
                "attributor; explain with the composite's own relevance method, or use a "
                "composite without an input-layer rule"
            )
        return output, result.input_signal

    def __repr__(self) -> str:
        return f"Composite({self.name!r}, {len(self.mapping)} entries)"
