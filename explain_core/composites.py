"""Composites by name: what ``composite=`` of the gradient attributors resolves.

Plugins register composites through ``explain_register_composites``; a composite object (a
:class:`~explain_core.interfaces.relevance.ModifiedGradient`, e.g. any ``Composite``) is used as
it is.
"""

from __future__ import annotations

from explain_core import plugin_manager
from explain_core.errors import InvalidInputError
from explain_core.interfaces.relevance import ModifiedGradient

__all__ = ["resolve_composite"]


def resolve_composite(composite: str | ModifiedGradient) -> ModifiedGradient:
    """A registered composite by name, or the object itself.

    Raises:
        InvalidInputError: For a name no plugin registers (the registered names listed) or
            anything but a name or a :class:`ModifiedGradient`.
    """
    if isinstance(composite, ModifiedGradient):
        return composite
    if not isinstance(composite, str):
        raise InvalidInputError(
            "composite must be a registered composite's name (e.g. 'epsilon_plus') or a "
            f"Composite object; got {type(composite).__name__}"
        )
    registered = plugin_manager.get_plugin_manager().composites()
    if composite not in registered:
        raise InvalidInputError(
            f"no composite is registered as {composite!r}; registered: "
            f"{', '.join(sorted(registered)) or 'none'}"
        )
    return registered[composite].build()
