"""Griffe extension: the docstrings' Sphinx roles read as code, linked where the site has them.

The docstrings name other objects the Sphinx way (``:class:`~explain_core.cli.command.Command```,
``:func:`explain```); mkdocstrings renders Markdown, where those would show as typed. Each role
becomes the object's name in code font, wrapped in an optional cross-reference: a link where the
API reference renders that object, plain code where it does not (no warning either way).
"""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):`(~?)([\w.]+)(\(\))?`")


def _code(match: re.Match[str]) -> str:
    short, target = match.group(1), match.group(2)
    shown = target.rsplit(".", 1)[-1] if short else target
    return (
        f'<autoref identifier="{html.escape(target)}" optional>'
        f"<code>{html.escape(shown)}</code></autoref>"
    )


class SphinxRoles(griffe.Extension):
    """Rewrites the Sphinx roles of every docstring that griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrite the roles in ``obj``'s docstring."""
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(_code, obj.docstring.value)
