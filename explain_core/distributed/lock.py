"""One run at a time per output folder: an exclusive lock that rank 0 holds while a run writes.

The lock is an OS file lock (``flock``, which Linux forwards to NFS's lock manager on shared
folders; ``msvcrt`` on Windows) on ``explain.lock`` in the output folder; it excludes a second run
in the same process too. The operating system releases it when
the holder exits, also when it is killed, so an interrupted run never leaves a stale lock and can
be resumed at once. The file keeps the holder's host, process and start time for the message a
second run gets, and is removed when the run ends.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path
from typing import IO

from explain_core.errors import DistributedError

LOCK_NAME = "explain.lock"


class OutputLock:
    """The exclusive lock of one output folder, held from :meth:`acquire` to :meth:`release`.

    Args:
        out_dir: The output folder (created if needed).
    """

    def __init__(self, out_dir: Path) -> None:
        self.path = Path(out_dir) / LOCK_NAME
        self._handle: IO[str] | None = None

    def acquire(self) -> None:
        """Take the lock, or raise at once if another run holds it.

        Raises:
            DistributedError: Naming the folder and the run that holds it.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            handle = open(self.path, "a+")  # noqa: SIM115 - held open for the lock's lifetime
            try:
                _lock(handle)
            except OSError:
                handle.seek(0)
                holder = handle.read().strip() or "another process"
                handle.close()
                raise DistributedError(
                    f"another run is writing into {self.path.parent} ({holder}); wait for it "
                    "to finish, or give this run another output folder"
                ) from None
            if _same_file(handle, self.path):
                break
            handle.close()  # the holder removed the file as we opened it: lock the new one
        handle.seek(0)
        handle.truncate()
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        handle.write(f"process {os.getpid()} on {socket.gethostname()}, started {started}\n")
        handle.flush()
        self._handle = handle

    def release(self) -> None:
        """Remove the lock file and release the lock, leaving the folder as the run wrote it."""
        if self._handle is not None:
            self.path.unlink(missing_ok=True)  # before closing: nobody locks a file being removed
            self._handle.close()
            self._handle = None


def _same_file(handle: IO[str], path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(handle.fileno()), os.stat(path))
    except FileNotFoundError:
        return False


def _lock(handle: IO[str]) -> None:
    """Lock ``handle``'s file without waiting; ``OSError`` if it is locked already."""
    if sys.platform == "win32":  # pragma: no cover - exercised on Windows only
        import msvcrt

        handle.seek(0)
        msvcrt.locking(handle.fileno(), msvcrt.LK_NBLCK, 1)
        return
    import fcntl

    fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
