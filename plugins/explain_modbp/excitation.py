"""Excitation backprop (Zhang et al. 2018) and its contrastive variant.

Relevance starts as 1 at the explained output (a probability) and flows through positive weights
only, normalised per output: the marginal winning probability. The contrastive variant changes the
output layer's rule to ``Z⁺ − N⁺`` (``N⁺`` computed like ``Z⁺`` from ``−W``), the paper's Eq. 16.
"""

from __future__ import annotations

from dataclasses import dataclass

from explain_modbp import composites
from explain_modbp.methods import CompositeMethod


@dataclass
class ExcitationBP(CompositeMethod):
    """Excitation backprop: marginal winning probabilities (sum to 1 on bias-free models)."""

    preset = staticmethod(composites.excitation)
    start = "one"


@dataclass
class ContrastiveExcitationBP(CompositeMethod):
    """Contrastive excitation backprop: ``(Z⁺ − N⁺) m_k`` at the output layer, W⁺ below."""

    preset = staticmethod(composites.contrastive_excitation)
    start = "one"
