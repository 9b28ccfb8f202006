"""Exceptions raised for user-facing problems.

Every error here carries a message that says what was expected, what was got and what to do. The
CLI prints such errors as one line; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from pathlib import Path

__all__ = [
    "DistributedError",
    "DuplicateMethodError",
    "ExplainError",
    "ExportError",
    "GraphvizNotFoundError",
    "GraphvizRenderError",
    "InvalidInputError",
    "MethodError",
    "MissingDependencyError",
    "ModelLoadError",
    "ModelRunError",
    "ModelStateError",
    "NumericalError",
    "OutOfMemoryError",
    "OutputPathError",
    "ParityError",
    "PluginLoadError",
    "RuntimeConflictError",
    "UnknownMethodError",
    "UnsupportedMethodError",
    "UnsupportedModelError",
    "UnsupportedOperatorError",
]


class ExplainError(Exception):
    """Base class of the errors a user can fix (bad input, missing plugin, bad file)."""


class UnknownMethodError(ExplainError, KeyError):
    """A method name that no loaded plugin registers."""

    def __init__(
        self, name: str, known: Iterable[str], failed: Mapping[str, str] | None = None
    ) -> None:
        known = sorted(known)
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
        if not close:
            # Fall back to names sharing the family prefix or containing the query.
            close = [k for k in known if name.split(".")[0] in k or name in k][:3]
        hint = f"did you mean {', '.join(repr(c) for c in close)}? " if close else ""
        broken = ""
        if failed:  # the method may be one of theirs: say so first
            plugins = "; ".join(f"{plugin!r} {error}" for plugin, error in sorted(failed.items()))
            broken = f"it may belong to a plugin that failed (plugin {plugins}); "
        message = (
            f"unknown method {name!r}; {broken}{hint}"
            f"run `explain plugins` to list the {len(known)} registered methods"
        )
        super().__init__(message)
        self.name = name
        self.suggestions = close

    def __str__(self) -> str:
        # KeyError would otherwise print the message with quotes around it.
        return str(self.args[0])


class DuplicateMethodError(ExplainError):
    """Two plugins register the same method name."""


class PluginLoadError(ExplainError):
    """A plugin could not be imported or registered."""


class InvalidInputError(ExplainError, ValueError):
    """Inputs, targets or options that do not fit the model or method."""


class ModelRunError(InvalidInputError, RuntimeError):
    """Inputs (or a model) on which the model's forward pass fails, explained in one sentence.

    Also a ``RuntimeError``, the type torch raised before it was explained, so that code catching
    that keeps working; torch's error is chained as the cause.
    """


class UnsupportedModelError(InvalidInputError):
    """A layer, operation or structure that relevance rules cannot propagate through.

    Raised instead of silently letting the ordinary gradient through a part of the model.
    """


class NumericalError(ExplainError, ArithmeticError):
    """A map that overflowed to NaN or infinite values although the model's outputs are finite.

    The message names the samples and how to avoid it (float64, another method).
    """


class OutOfMemoryError(ExplainError, RuntimeError):
    """An attribution that ran out of memory; names the batch size and what bounds memory.

    Also a ``RuntimeError``, the type of torch's own out-of-memory errors (chained as the cause).
    """


class ModelStateError(ExplainError):
    """The model is in a state in which attribution would be meaningless or would change it."""


class ModelLoadError(ExplainError):
    """A model reference or weights file that cannot be loaded safely."""


class MissingDependencyError(ExplainError, ImportError):
    """An optional dependency (an extra such as ``graphs``) that a feature needs is missing."""


class GraphvizNotFoundError(ExplainError, RuntimeError):
    """The graphviz ``dot`` program is not installed; the DOT source was written nonetheless.

    Attributes:
        source_path: Where the ``.gv`` DOT source was written (``None`` if it was not).
    """

    def __init__(self, message: str, source_path: object = None) -> None:
        super().__init__(message)
        self.source_path = source_path


class ExportError(ExplainError):
    """A model (or its explanation) that cannot be exported, or an export that failed a check."""


class UnsupportedOperatorError(ExportError):
    """An operator the ONNX exporter cannot translate; names the operator and the module.

    Attributes:
        operator: The operator, e.g. ``"aten.linalg_qr.default"``.
        module: Qualified name and type of the module that called it, when known.
    """

    def __init__(self, message: str, operator: str = "", module: str = "") -> None:
        super().__init__(message)
        self.operator = operator
        self.module = module


class ParityError(ExportError):
    """An exported graph whose outputs differ from PyTorch's by more than the tolerances."""


class RuntimeConflictError(ExplainError):
    """Two onnxruntime distributions (e.g. onnxruntime and onnxruntime-gpu) are installed."""


class DistributedError(ExplainError, RuntimeError):
    """A distributed evaluation that failed on some rank, or whose shards do not fit together."""


class MethodError(ExplainError, RuntimeError):
    """A plugin's method that broke the :class:`Method` contract or raised; names both.

    A factory that builds no :class:`Method`, a result that is no valid :class:`MethodResult`,
    or (for third-party plugins) an error escaping ``attribute()``, chained as the cause.
    """


class OutputPathError(InvalidInputError, OSError):
    """An output path that cannot be written.

    Also an ``OSError``, so that callers that tolerate unwritable locations (e.g. a read-only
    cache) keep catching it as they caught the file system's own error.
    """


class UnsupportedMethodError(ExplainError, TypeError):
    """A method that cannot propagate a given relevance from an intermediate layer."""


class GraphvizRenderError(ExplainError, RuntimeError):
    """The graphviz ``dot`` program ran but failed; the DOT source was written nonetheless.

    Attributes:
        source_path: Where the ``.gv`` DOT source was written.
        stderr: What ``dot`` wrote to its standard error.
    """

    def __init__(self, message: str, source_path: Path, stderr: str) -> None:
        super().__init__(message)
        self.source_path = source_path
        self.stderr = stderr
