"""Errors of the modified-backpropagation plugin (subclasses of the core's user errors)."""

from __future__ import annotations

from explain_core.errors import InvalidInputError

__all__ = ["PatternMismatchError"]


class PatternMismatchError(InvalidInputError):
    """Patterns that were fitted on a different architecture than the model being explained."""
