"""Open a local page in headless Chromium and report its images and console errors.

Chromium is driven over the DevTools protocol through ``--remote-debugging-pipe``: it reads
NUL-terminated JSON messages from file descriptor 3 and writes its own to descriptor 4, so no
websocket client (and no Python package) is needed. The page is loaded in a fresh target; after
its ``load`` event (which waits for every image) each ``<img>`` is asked for ``complete`` and
``naturalWidth``, and every error the page logged is collected: ``console.error`` calls,
uncaught exceptions and the browser's own log entries (a resource that failed to load, a
blocked request…).

Debian's package is ``chromium``; ``scripts/setup-env.sh`` installs it with apt-get where it runs
as root, as it does graphviz. :func:`require_chromium` fails a test when Chromium is missing
where that script could have installed it, and skips it elsewhere.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
HOW = "apt-get install chromium (scripts/setup-env.sh does it where it runs as root)"


def find_chromium() -> str | None:
    """The Chromium (or Chrome) program on ``PATH``, if any."""
    return next((path for name in NAMES if (path := shutil.which(name))), None)


def installable_here() -> bool:
    """Whether ``scripts/setup-env.sh`` would have installed Chromium here (root with apt-get)."""
    return hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get") is not None


def require_chromium() -> str:
    """The Chromium program; fail the test where it could be installed, else skip it."""
    program = find_chromium()
    if program is None:
        message = f"headless Chromium is missing ({HOW})"
        if installable_here():
            pytest.fail(f"{message}; setup-env.sh should have installed it here")
        pytest.skip(message)
    return program


@dataclass
class PageReport:
    """What the browser saw of one page.

    Attributes:
        images: Per ``<img>``: its ``src``, whether it finished loading (``complete``) and its
            ``naturalWidth`` (0 when it did not load or is not a picture).
        errors: Every error the page logged, one line each.
        title: The document's title.
    """

    images: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    title: str = ""


class _Pipe:
    """The DevTools protocol over Chromium's two pipes: commands out, replies and events in."""

    def __init__(self, to_browser: int, from_browser: int, timeout: float) -> None:
        self.to_browser, self.from_browser = to_browser, from_browser
        self.deadline = time.monotonic() + timeout
        self.buffer = b""
        self.next_id = 0
        self.events: list[dict[str, Any]] = []

    def receive(self) -> dict[str, Any]:
        while b"\0" not in self.buffer:
            left = self.deadline - time.monotonic()
            ready, _, _ = select.select([self.from_browser], [], [], max(left, 0.0))
            if not ready:
                raise TimeoutError("Chromium did not answer in time")
            chunk = os.read(self.from_browser, 1 << 16)
            if not chunk:
                raise EOFError("Chromium closed its DevTools pipe")
            self.buffer += chunk
        message, self.buffer = self.buffer.split(b"\0", 1)
        return json.loads(message)

    def call(self, method: str, session: str | None = None, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        message: dict[str, Any] = {"id": self.next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self.to_browser, json.dumps(message).encode() + b"\0")
        while True:
            reply = self.receive()
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, method: str) -> None:
        while not any(event.get("method") == method for event in self.events):
            self.events.append(self.receive())


def _error_lines(events: list[dict[str, Any]]) -> list[str]:
    lines = []
    for event in events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in params["args"])
            lines.append(f"console.{params['type']}: {text}")
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            text = details.get("exception", {}).get("description") or details.get("text", "")
            lines.append(f"uncaught exception: {text}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            lines.append(f"{entry.get('source')}: {entry.get('text')} {entry.get('url', '')}")
    return lines


_IMAGES = (
    "JSON.stringify(Array.from(document.images, image => ({src: image.getAttribute('src'), "
    "complete: image.complete, naturalWidth: image.naturalWidth})))"
)


def open_page(path: Path, program: str, timeout: float = 60.0) -> PageReport:
    """Load ``path`` in headless Chromium and report its images and errors.

    Args:
        path: The HTML file.
        program: The Chromium program (see :func:`require_chromium`).
        timeout: Seconds for the whole visit.

    Returns:
        The page's images, errors and title.
    """
    to_browser_read, to_browser = os.pipe()
    from_browser, from_browser_write = os.pipe()
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        log = Path(profile) / "stderr.txt"
        log_fd = os.open(log, os.O_WRONLY | os.O_CREAT, 0o600)
        arguments = [
            program,
            "--headless",
            "--remote-debugging-pipe",
            "--no-sandbox",  # as root (CI containers) the sandbox refuses to start
            "--disable-gpu",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            "--disable-background-networking",
            f"--user-data-dir={Path(profile) / 'profile'}",
            "about:blank",
        ]
        # The descriptors Chromium expects: 3 to read commands, 4 to write replies.
        pid = os.posix_spawn(
            program,
            arguments,
            os.environ,
            file_actions=[
                (os.POSIX_SPAWN_DUP2, to_browser_read, 3),
                (os.POSIX_SPAWN_DUP2, from_browser_write, 4),
                (os.POSIX_SPAWN_DUP2, log_fd, 1),
                (os.POSIX_SPAWN_DUP2, log_fd, 2),
            ],
        )
        for fd in (to_browser_read, from_browser_write, log_fd):
            os.close(fd)
        pipe = _Pipe(to_browser, from_browser, timeout)
        try:
            target = pipe.call("Target.createTarget", url="about:blank")["targetId"]
            session = pipe.call("Target.attachToTarget", targetId=target, flatten=True)
            session_id = session["sessionId"]
            for domain in ("Page", "Runtime", "Log"):
                pipe.call(f"{domain}.enable", session_id)
            pipe.events.clear()  # only what the page itself does counts
            navigated = pipe.call("Page.navigate", session_id, url=path.resolve().as_uri())
            if navigated.get("errorText"):
                raise RuntimeError(f"cannot open {path}: {navigated['errorText']}")
            pipe.wait_for("Page.loadEventFired")
            images = pipe.call("Runtime.evaluate", session_id, expression=_IMAGES)
            title = pipe.call("Runtime.evaluate", session_id, expression="document.title")
            report = PageReport(
                images=json.loads(images["result"]["value"]),
                errors=_error_lines(pipe.events),
                title=title["result"]["value"],
            )
            pipe.call("Browser.close")
        except (TimeoutError, EOFError, RuntimeError) as error:
            output = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise AssertionError(f"Chromium failed: {error}\n{output}") from error
        finally:
            os.close(to_browser)
            os.close(from_browser)
            _stop(pid)
    return report


def _stop(pid: int, grace: float = 10.0) -> None:
    """Wait for Chromium to exit after ``Browser.close``; kill it if it does not."""
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
