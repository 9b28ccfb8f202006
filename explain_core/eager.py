"""Attribution runs a model eagerly, also when the model (or a part of it) was ``torch.compile``'d.

Explainers work through forward hooks, autograd functions and torch-function modes that must run
as written on every call. Under ``torch.compile`` dynamo would trace them into its graph instead
(breaking on the engines' checks, or baking one call's hooks into the compiled code), so
attribution unwraps a compiled model and switches compilation off for its duration. The weights
are the same objects, so the explanation is the compiled model's.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = [
    "eager_mode",
    "uncompiled",
    "uncompiled_tree",
]


def uncompiled(model: nn.Module) -> nn.Module:
    """The module a ``torch.compile`` wrapper runs (``model`` itself if it is not one)."""
    original = getattr(model, "_orig_mod", None)
    return original if isinstance(original, nn.Module) else model


def uncompiled_tree(model: nn.Module) -> nn.Module:
    """``model`` with every compiled part replaced by the module it runs, for tracers (FX).

    Modules above a compiled submodule are shallow copies sharing their parameters, buffers and
    hooks with the originals; ``model`` itself is not changed.
    """
    model = uncompiled(model)
    children = {name: child for name, child in model._modules.items() if child is not None}
    replaced = {name: uncompiled_tree(child) for name, child in children.items()}
    if all(replaced[name] is child for name, child in children.items()):
        return model
    clone = copy.copy(model)
    clone._modules = {**model._modules, **replaced}
    return clone


_STANCE_LOCK = threading.Lock()
_eager_users = 0
_stance: contextlib.AbstractContextManager[Any] | None = None


@contextlib.contextmanager
def eager_mode() -> Iterator[None]:
    """Run compiled modules and functions eagerly inside the block (torch >= 2.6).

    Dynamo's stance is process-wide: it is switched on by the first block to enter (in any
    thread) and back by the last one to leave, so overlapping blocks in several threads never
    leave it switched on. Compiled code in other threads runs eagerly meanwhile (same values).
    A stance set meanwhile by someone else (another thread's ``set_stance`` call, or the end of
    its ``with set_stance(...)`` block) is theirs: the last block to leave puts the earlier
    stance back only where its own is still in effect, and never overwrites theirs.
    """
    global _eager_users, _stance
    set_stance = getattr(torch.compiler, "set_stance", None)
    # Nothing can be compiled before dynamo is imported, and importing it costs seconds (and
    # threads that made torch.distributed workers abort at exit): then there is nothing to do.
    if set_stance is None or "torch._dynamo" not in sys.modules:
        yield
        return
    with _STANCE_LOCK:
        if _eager_users == 0:
            _stance = set_stance("force_eager")
            _stance.__enter__()
        _eager_users += 1
    try:
        yield
    finally:
        with _STANCE_LOCK:
            _eager_users -= 1
            if _eager_users == 0 and _stance is not None:
                if _still_in_effect(_stance):
                    _stance.__exit__(None, None, None)
                _stance = None


def _still_in_effect(stance: Any) -> bool:
    """Whether the stance ``stance`` set is the one in effect (unknown on other torch: yes)."""
    frames = sys.modules.get("torch._dynamo.eval_frame")
    current = getattr(frames, "_stance", None)
    ours = getattr(stance, "stance", None)
    return current is None or ours is None or current is ours
