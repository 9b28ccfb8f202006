"""Writing files so that a file that exists is always whole.

Every output of the library (parse trees, attribution maps, cards, shards, cached models, ONNX
graphs) is written to a temporary file beside its destination and renamed into place, so an
interrupted run never leaves a half-written file under the final name.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO


@contextlib.contextmanager
def temporary_beside(path: Path, suffix: str = "") -> Iterator[Path]:
    """A fresh temporary file in ``path``'s folder, removed on exit unless renamed away.

    The folder is created if needed. Writers that need a file name (safetensors, ONNX) write
    to it and ``os.replace`` it onto ``path``.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, name = tempfile.mkstemp(prefix=f".{path.name}-", suffix=suffix, dir=path.parent)
    os.close(descriptor)
    temporary = Path(name)
    try:
        yield temporary
    finally:
        temporary.unlink(missing_ok=True)


def write_atomically(path: Path, content: bytes | Callable[[BinaryIO], object]) -> Path:
    """Write ``content`` (bytes, or a function writing to a binary handle) to ``path`` whole.

    Args:
        path: Destination; its folder is created if needed.
        content: The bytes, or a callable given the open binary handle of the temporary file.

    Returns:
        ``path``.
    """
    with temporary_beside(path) as temporary:
        with open(temporary, "wb") as handle:
            if callable(content):
                content(handle)
            else:
                handle.write(content)
        os.replace(temporary, path)
    return path
