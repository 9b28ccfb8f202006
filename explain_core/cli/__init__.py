"""The ``explain`` command line: ``explain --help`` lists the subcommands.

Every subcommand is registered by a plugin through ``explain_register_commands`` (the core's
own through its internal plugin), so a third-party plugin adds one exactly as the built-ins do.
Errors a user can fix end with one line on stderr and exit status 1 (2 for bad usage); a
traceback appears only with ``--debug``. A broken plugin is one warning line: ``--help`` and the
other subcommands keep working.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any, NoReturn

from explain_core.errors import ExplainError

PROGRAM = "explain"


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _SubcommandParser(_Parser):
    """Subcommand parser that also accepts ``--debug`` after the subcommand."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks"
        )


def build_parser() -> argparse.ArgumentParser:
    """The parser with every subcommand."""
    parser = _Parser(
        prog=PROGRAM,
        description="Explain PyTorch models with plugin-provided methods, and check the "
        "explanations.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    subparsers = parser.add_subparsers(
        dest="command", metavar="COMMAND", parser_class=_SubcommandParser
    )
    from explain_core.plugin_manager import get_plugin_manager

    manager = get_plugin_manager()
    for name, command in manager.commands().items():
        try:  # tried on a scratch parser first: a plugin's broken command fails alone
            command.add_arguments(_SubcommandParser(prog=f"{PROGRAM} {name}"))
        except (Exception, SystemExit) as error:
            plugin = manager.owner("explain_register_commands", name)
            warnings.warn(
                f"the command {name!r} of plugin {plugin!r} could not set up its arguments "
                f"({type(error).__name__}: {error}); the other commands still work",
                stacklevel=2,
            )
            continue
        subparser = subparsers.add_parser(name, help=command.help, description=command.description)
        command.add_arguments(subparser)
        subparser.set_defaults(run=command.run, command_parser=subparser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI and return the exit status."""
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # a reader that went away shows here, not at exit
    except BrokenPipeError:
        # `explain plugins | head -2`: stop quietly. Point stdout at devnull so that Python's
        # flush at exit does not fail again (Python docs, "Note on SIGPIPE").
        _stdout_to_devnull()
        return 1


def _main(argv: Sequence[str] | None) -> int:
    with warnings.catch_warnings():  # a broken plugin: one line, while the parser is built
        warnings.showwarning = _one_line_warning
        parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # argparse blames the top-level parser; the subcommand's --help lists its options.
        where = getattr(args, "command_parser", parser)
        where.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.version:
        from explain_core.plugin_manager import package_version

        print(f"{PROGRAM} {package_version()}")
        return 0
    if args.command is None:
        parser.print_help()
        return 0
    with warnings.catch_warnings():
        warnings.showwarning = _one_line_warning
        try:
            code = int(args.run(args) or 0)
        except BrokenPipeError:
            raise  # not an error of the user's: main() ends quietly
        except KeyboardInterrupt:
            print(f"{PROGRAM}: interrupted", file=sys.stderr)
            return 130
        except (ExplainError, OSError) as error:
            if args.debug:
                raise
            print(f"{PROGRAM}: error: {_describe(error)}", file=sys.stderr)
            return 1
    if (
        code == 0
        and getattr(args, "weights", False) is None
        and getattr(args, "model", None)
        and _is_main_rank()
    ):
        from explain_core.cli.common import note

        note(
            f"no --weights given, so {args.model} ran with the weights its factory gives it "
            "(untrained unless the factory loads its own)"
        )
    return code


def _is_main_rank() -> bool:
    # Under torchrun (explain evaluate) only rank 0 reports.
    return os.environ.get("RANK", "0") == "0"


def _stdout_to_devnull() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # stdout is no file (e.g. captured)
        pass


def _describe(error: BaseException) -> str:
    if isinstance(error, OSError) and not isinstance(error, ExplainError) and error.filename:
        # The file system's own error: name the file(s) and say where to look.
        files = " -> ".join(str(f) for f in (error.filename, error.filename2) if f)
        return f"{error.strerror or error} ({files}); check the path and its permissions"
    return " ".join(str(error).split()) or type(error).__name__


def _one_line_warning(message: Any, category: type[Warning], *args: Any, **kwargs: Any) -> None:
    print(f"{PROGRAM}: warning: {' '.join(str(message).split())}", file=sys.stderr)
