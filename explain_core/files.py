"""Writing files so that a file that exists is always whole.

Every output of the library (parse trees, attribution maps, cards, shards, cached models, ONNX
graphs) is written to a temporary file beside its destination and renamed into place, so an
interrupted run never leaves a half-written file under the final name.

A destination that cannot be written (its folder is a file, or does not accept new files; the
destination is a folder) is reported as :class:`OutputPathError` naming the caller's path, never
the hidden temporary file. :func:`check_output_path` and :func:`check_output_folder` check the
same up front, creating nothing, so that commands can refuse a bad path before their work.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from explain_core.errors import OutputPathError

__all__ = [
    "check_output_folder",
    "check_output_path",
    "give_default_permissions",
    "temporary_beside",
    "write_atomically",
]

_ADVICE = "choose a path in a folder that exists (or can be created) and is writable"
_NOT_A_FOLDER = "not a folder"  # the problem of a would-be folder that is a file


def check_output_path(path: str | Path) -> Path:
    """Check, creating nothing, that a file can be written at ``path``.

    Missing folders on the way are fine (writers create them); the nearest existing one must be
    a folder that accepts new files, which is tried with a real file: ``os.access`` says yes to
    root even where the file system says no (``/proc``, read-only mounts).

    Args:
        path: The destination file.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        OutputPathError: If ``path`` is a folder, a folder on its way is a file, or the nearest
            existing folder does not accept new files.
    """
    path = Path(path)
    if _is_dir(path):
        raise OutputPathError(
            f"cannot write {path}: it is a folder; give a file name inside it instead"
        )
    folder = path.parent
    ancestor, problem = _folder_problem(folder)
    if problem is None:
        return path
    if problem == _NOT_A_FOLDER and ancestor == folder:
        raise OutputPathError(f"cannot write {path}: {folder} is a file, not a folder; {_ADVICE}")
    if problem == _NOT_A_FOLDER:
        raise OutputPathError(
            f"cannot write {path}: cannot create the output folder {folder} because {ancestor} "
            f"is a file, not a folder; {_ADVICE}"
        )
    raise OutputPathError(
        f"cannot write {path}: the folder {ancestor} does not accept new files ({problem}); "
        f"{_ADVICE}"
    )


def check_output_folder(folder: str | Path) -> Path:
    """Check, creating nothing, that ``folder`` can be created if needed and written into.

    Args:
        folder: The destination folder.

    Returns:
        ``folder`` as a ``Path``.

    Raises:
        OutputPathError: If ``folder`` or a folder on its way is a file, or the nearest existing
            folder does not accept new files.
    """
    folder = Path(folder)
    ancestor, problem = _folder_problem(folder)
    if problem is None:
        return folder
    if problem == _NOT_A_FOLDER and ancestor == folder:
        raise OutputPathError(
            f"cannot create output folder {folder}: a file of that name exists; choose another "
            "folder for the outputs"
        )
    if problem == _NOT_A_FOLDER:
        raise OutputPathError(
            f"cannot create output folder {folder}: {ancestor} is a file, not a folder; {_ADVICE}"
        )
    raise OutputPathError(
        f"cannot write into output folder {folder}: {ancestor} does not accept new files "
        f"({problem}); {_ADVICE}"
    )


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:  # e.g. a permission error on the way; the write will say more
        return False


def _folder_problem(folder: Path) -> tuple[Path, str | None]:
    """The nearest existing folder of ``folder`` (itself included) and why it cannot be used.

    Returns:
        ``(ancestor, None)`` when files can be created in it, ``(ancestor, _NOT_A_FOLDER)`` when
        it is a file, else ``(ancestor, reason)`` with the file system's reason in lower case.
    """
    ancestor = folder
    while not os.path.lexists(ancestor) and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not _is_dir(ancestor):
        return ancestor, _NOT_A_FOLDER
    try:
        descriptor, probe = tempfile.mkstemp(prefix=".explain-probe-", dir=ancestor)
    except OSError as error:
        return ancestor, (error.strerror or str(error)).lower()
    os.close(descriptor)
    os.unlink(probe)
    return ancestor, None


@functools.cache
def _umask() -> int:
    # Read once (os.umask can only be read by setting it); tempfile's files are 0600 and its
    # folders 0700 whatever the umask, which would hide outputs from the user's group.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def give_default_permissions(path: Path, *, folder: bool = False) -> None:
    """Give ``path`` the permissions a plain ``open``/``mkdir`` would have (umask applied)."""
    os.chmod(path, (0o777 if folder else 0o666) & ~_umask())


@contextlib.contextmanager
def temporary_beside(path: Path, suffix: str = "") -> Iterator[Path]:
    """A fresh temporary file in ``path``'s folder, removed on exit unless renamed away.

    The folder is created if needed. Writers that need a file name (safetensors, ONNX) write
    to it and ``os.replace`` it onto ``path``.

    Raises:
        OutputPathError: If ``path`` is a folder or its folder cannot be created or written.
    """
    path = Path(path)
    if _is_dir(path):
        check_output_path(path)  # raises, naming the folder
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor, name = tempfile.mkstemp(prefix=f".{path.name}-", suffix=suffix, dir=path.parent)
    except OSError as error:
        check_output_path(path)  # raises with the reason, naming the user's path
        raise OutputPathError(  # a cause the check cannot see (e.g. a race): still name path
            f"cannot write {path}: {error.strerror or error}; {_ADVICE}"
        ) from error
    os.close(descriptor)
    temporary = Path(name)
    give_default_permissions(temporary)
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

    Raises:
        OutputPathError: If ``path`` is a folder or its folder cannot be created or written.
    """
    with temporary_beside(path) as temporary:
        with open(temporary, "wb") as handle:
            if callable(content):
                content(handle)
            else:
                handle.write(content)
        os.replace(temporary, path)
    return path
