"""The composite of the engine: a core composite plus rules for the first and the last layer.

As a :class:`~explain_core.interfaces.relevance.ModifiedGradient` it runs the model through the
modified-backpropagation engine (BatchNorms merged, its rules for layers and operations), so that
any attributor taking gradients (Input×Gradient, SmoothGrad, Integrated Gradients) runs over it:
``explain(model, x, "smoothgrad", composite="epsilon_plus")``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from explain_core.canonizers import Canonizer, MergeBatchNorm
from explain_core.errors import InvalidInputError
from explain_core.interfaces.relevance import Composite, Matcher, Rule
from explain_modbp.engine import ModifiedBackprop

__all__ = ["LayerComposite"]


class LayerComposite(Composite):
    """A core :class:`~explain_core.Composite` plus rules for the first and the last layer.

    Args:
        mapping: ``(matcher, rule)`` pairs as for the core composite; the first match wins.
        first: Rule for the affine layer that reads the model input (e.g. z^B, flat, w²).
        last: Rule for the affine layer that produces the output (e.g. contrastive excitation).
        name: Short description for error messages and listings.
        canonizers: Rewrites of the traced layers; by default each BatchNorm that directly
            follows a Linear/Conv is merged into it (the model is not changed).
    """

    def __init__(
        self,
        mapping: Sequence[tuple[Matcher, Rule]],
        *,
        first: Rule | None = None,
        last: Rule | None = None,
        name: str = "composite",
        canonizers: Sequence[Canonizer] = (MergeBatchNorm(),),
    ) -> None:
        super().__init__(mapping, canonizers=canonizers)
        self.first = first
        self.last = last
        self.name = name

    def with_rules(self, *entries: tuple[Matcher, Rule]) -> LayerComposite:
        """A copy with ``entries`` taking precedence over the existing mapping."""
        mapping = [*entries, *((m.matcher, m.rule) for m in self.mapping)]
        return LayerComposite(
            mapping, first=self.first, last=self.last, name=self.name, canonizers=self.canonizers
        )

    def gradient(
        self,
        model: nn.Module,
        inputs: torch.Tensor,
        select: Callable[[torch.Tensor], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The engine's signal at the inputs (``inputs ⊙ signal`` is the composite's relevance).

        Raises:
            InvalidInputError: For a composite whose input-layer rule returns relevance (w²,
                flat, z^B): it defines no signal at the input; use its ``lrp.*`` method.
        """
        forward = ModifiedBackprop(self).forward(model, inputs)
        output = forward.output.detach()
        result = forward.backward(select(output))
        if result.input_is_relevance:
            raise InvalidInputError(
                f"the composite {self.name!r} puts a rule on the input layer that returns "
                "relevance, not a gradient (w², flat, z^B), so it cannot run under a gradient "
                "attributor; use its lrp.* method, or a composite without an input-layer rule"
            )
        return output, result.input_signal
