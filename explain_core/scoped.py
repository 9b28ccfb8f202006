"""State that belongs to one attribution, never to the user's modules.

Explainers need to change how some layers behave (detach a dynamic weight, quantise couplings,
record routing) and to see module calls (which layer ran, on what) while a model runs. Writing a
flag on the user's module, or registering a hook on it, would be seen by every thread using that
model: a web server explaining one model in two threads, or serving plain forwards beside an
attribution, would get wrong results. So such state is kept in :mod:`contextvars` instead: it is
visible in the context that set it (its thread, its asyncio task) and nowhere else.

- :func:`scoped_settings` / :func:`scoped_setting`: per-module values, e.g. "this layer is in
  explanation mode", read by the layer's own ``forward``.
- :func:`listening` / :class:`ModuleListener`: module calls of the current context. While at least
  one listener is active anywhere in the process, one process-wide pair of module hooks
  (``torch.nn.modules.module.register_module_forward_pre_hook`` and ``…_forward_hook``) is
  installed; it hands each call to the listeners of the calling context only, and returns at once
  in every other context. No module's own hook dictionaries ever change, and the pair is removed
  when the last listener leaves.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any

from torch import nn
from torch.nn.modules import module as module_globals

__all__ = ["ModuleListener", "is_own_hook", "listening", "scoped_setting", "scoped_settings"]

_SETTINGS: contextvars.ContextVar[Mapping[tuple[int, str], Any]] = contextvars.ContextVar(
    "explain_scoped_settings", default=MappingProxyType({})
)


@contextmanager
def scoped_settings(key: str, values: Mapping[nn.Module, Any]) -> Iterator[None]:
    """Give each module of ``values`` its value of setting ``key`` inside the block, here only.

    The modules are not touched: their ``forward`` reads the value with :func:`scoped_setting`.
    Blocks nest; leaving one restores the values the enclosing block had.

    Args:
        key: Setting name, e.g. ``"explanation_mode"``.
        values: Module → value (the modules are kept alive for the block).
    """
    updated = dict(_SETTINGS.get())
    updated.update({(id(module), key): value for module, value in values.items()})
    token = _SETTINGS.set(MappingProxyType(updated))
    try:
        yield
    finally:
        _SETTINGS.reset(token)


def scoped_setting(module: nn.Module, key: str, default: Any = None) -> Any:
    """The value of setting ``key`` for ``module`` in this context, else ``default``."""
    return _SETTINGS.get().get((id(module), key), default)


class ModuleListener:
    """Receives the module calls made in the context it listens in (see :func:`listening`).

    Both methods see every module call of the context, of any model: filter by module identity.
    Returning ``None`` leaves the call as it is.
    """

    def before(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """Called before ``module`` runs; may return replacement positional arguments."""
        return None

    def after(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        """Called after ``module`` ran, before its own forward hooks; may replace the output."""
        return None


_LISTENERS: contextvars.ContextVar[tuple[ModuleListener, ...]] = contextvars.ContextVar(
    "explain_module_listeners", default=()
)
_LOCK = threading.Lock()
_users = 0
_handles: list[Any] = []


def _before_module(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    listeners = _LISTENERS.get()
    if not listeners:
        return None  # another thread's (or a plain) call: untouched
    replaced = None
    for listener in listeners:
        result = listener.before(module, args if replaced is None else replaced)
        if result is not None:
            replaced = result if isinstance(result, tuple) else (result,)
    return replaced


def _after_module(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    listeners = _LISTENERS.get()
    if not listeners:
        return None
    replaced = None
    for listener in listeners:
        result = listener.after(module, args, output if replaced is None else replaced)
        if result is not None:
            replaced = result
    return replaced


def is_own_hook(hook: Any) -> bool:
    """Whether ``hook`` is one of the process-wide hooks :func:`listening` installs."""
    return hook is _before_module or hook is _after_module


@contextmanager
def unheard() -> Iterator[None]:
    """Module calls inside the block reach no listener (a rule re-running its module)."""
    token = _LISTENERS.set(())
    try:
        yield
    finally:
        _LISTENERS.reset(token)


@contextmanager
def listening(listener: ModuleListener) -> Iterator[None]:
    """Hand the module calls of this context to ``listener`` inside the block.

    Calls made in other threads (or other asyncio tasks) are not seen, and are not changed.
    """
    global _users
    with _LOCK:
        if _users == 0:
            _handles.append(module_globals.register_module_forward_pre_hook(_before_module))
            _handles.append(module_globals.register_module_forward_hook(_after_module))
        _users += 1
    token = _LISTENERS.set((*_LISTENERS.get(), listener))
    try:
        yield
    finally:
        _LISTENERS.reset(token)
        with _LOCK:
            _users -= 1
            if _users == 0:
                for handle in _handles:
                    handle.remove()
                _handles.clear()
