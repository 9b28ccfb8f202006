"""A subcommand of the ``explain`` command line, as plugins register it."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

__all__ = ["Command"]


@dataclass(frozen=True)
class Command:
    """One ``explain`` subcommand (registered through ``explain_register_commands``).

    Attributes:
        name: The subcommand, e.g. ``"export"``.
        help: One line for ``explain --help``.
        description: The subcommand's own ``--help`` text.
        add_arguments: Adds the subcommand's arguments to its parser.
        run: Runs it; returns the exit status. Raise an ``explain_core.ExplainError`` for a
            problem the user can fix: the command line prints it as one line.
    """

    name: str
    help: str
    description: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]

    @classmethod
    def from_module(cls, module: ModuleType) -> Command:
        """The command a module defines as ``NAME``, ``HELP``, ``DESCRIPTION`` and functions.

        The functions are looked up on the module when called, so the module stays their one
        definition (e.g. for a test that replaces one).
        """

        def add_arguments(parser: argparse.ArgumentParser) -> None:
            module.add_arguments(parser)

        def run(args: argparse.Namespace) -> int:
            return module.run(args)

        return cls(module.NAME, module.HELP, module.DESCRIPTION, add_arguments, run)
