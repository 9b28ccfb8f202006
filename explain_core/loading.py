"""Loading user models for the CLI without ever unpickling arbitrary objects.

A model is named as ``package.module:factory``: the factory is called without arguments and must
return an ``nn.Module``. Weights come from a safetensors file, or from a PyTorch file read with
``torch.load(weights_only=True)`` that holds a state dict (``.pt``, ``.pth``, ``.bin``, ``.ckpt``
or ``.pkl``: the suffix does not matter to that reader, which refuses every pickled object but
tensors and plain containers). A factory may return a ``torch.compile``'d model, and weights saved
from either form load into either.

A model may read another code base's layout: if its module defines
``convert_state_dict(state) -> state``, :func:`load_weights` passes the file's state dict through
it before matching names and shapes (a plugin's model can so read the checkpoints of the code
its method was published with).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import pickle
import re
import sys
from pathlib import Path

import torch
from torch import nn

from explain_core.eager import uncompiled_tree
from explain_core.errors import ModelLoadError

__all__ = [
    "SAFETENSORS_SUFFIXES",
    "TORCH_SUFFIXES",
    "load_factory",
    "load_model",
    "load_state_dict",
    "load_weights",
]

_REFERENCE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
SAFETENSORS_SUFFIXES = (".safetensors",)
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".pkl")
_STATE_DICT_KEYS = ("state_dict", "model_state_dict", "model")
# torch.compile's wrapper adds this segment to the state dict keys of the module it wraps.
_COMPILED_SEGMENT = re.compile(r"(^|\.)_orig_mod\.")


def load_factory(reference: str) -> nn.Module:
    """Import ``package.module:factory`` and call the factory.

    A module not found on the installed path is looked up in the current working directory;
    ``sys.path`` is left as it was afterwards (and installed packages are never shadowed by
    folders of the same name in the working directory).

    Raises:
        ModelLoadError: If the reference is malformed, the import fails, or the factory does not
            return an ``nn.Module``.
    """
    if not _REFERENCE.match(reference):
        raise ModelLoadError(
            f"model reference {reference!r} is not of the form package.module:factory, e.g. "
            "mymodels.digits:build_model"
        )
    module_name, attribute = reference.split(":")
    folder = str(Path.cwd())
    added = "" not in sys.path and folder not in sys.path
    if added:
        sys.path.append(folder)  # last: a planted safetensors/ there never shadows the real one
    try:
        module = importlib.import_module(module_name)
    except Exception as error:
        raise ModelLoadError(
            f"cannot import {module_name!r} ({type(error).__name__}: {error}); run from the "
            "folder that contains it or install its package"
        ) from error
    finally:
        if added and folder in sys.path:
            sys.path.remove(folder)
    factory: object = module
    for part in attribute.split("."):
        if not hasattr(factory, part):
            raise ModelLoadError(
                f"{module_name!r} has no attribute {attribute!r}; {_factory_hint(factory, part)}"
            )
        factory = getattr(factory, part)
    if not callable(factory):
        raise ModelLoadError(f"{reference} is not callable; it must be a function or class")
    try:
        model = factory()
    except Exception as error:
        raise ModelLoadError(
            f"calling {reference}() failed ({type(error).__name__}: {error}); the factory must "
            "build the model without arguments"
        ) from error
    if not isinstance(model, nn.Module):
        raise ModelLoadError(
            f"{reference}() returned {type(model).__name__}, not a torch.nn.Module"
        )
    return model


def _factory_hint(owner: object, name: str) -> str:
    """Close matches for ``name`` among the public callables of ``owner`` (a module or class)."""
    callables = sorted(
        n
        for n, value in inspect.getmembers(owner, callable)
        if not n.startswith("_") and not inspect.ismodule(value)
    )
    close = difflib.get_close_matches(name, callables, n=3, cutoff=0.6)
    if close:
        return f"did you mean {', '.join(repr(c) for c in close)}?"
    if callables:
        shown = ", ".join(callables[:8]) + (", …" if len(callables) > 8 else "")
        return f"its functions and classes: {shown}"
    return "name a function or class defined in it"


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a state dict safely from a safetensors or PyTorch file.

    Raises:
        ModelLoadError: If the file is missing, has an unsupported suffix, or holds anything but
            tensors (pickled objects are refused, never executed).
    """
    path = Path(path)
    if path.is_dir():
        raise ModelLoadError(
            f"weights path {path} is a folder, not a file; give the weights file itself "
            f"({', '.join(SAFETENSORS_SUFFIXES + TORCH_SUFFIXES)})"
        )
    if not path.is_file():
        raise ModelLoadError(f"weights file {path} does not exist")
    suffix = path.suffix.lower()
    if suffix in SAFETENSORS_SUFFIXES:
        from safetensors.torch import load_file

        try:
            return load_file(str(path), device="cpu")
        except Exception as error:
            raise ModelLoadError(f"{path} is not a valid safetensors file: {error}") from error
    if suffix in TORCH_SUFFIXES:
        return _load_torch_state_dict(path)
    raise ModelLoadError(
        f"refusing to load {path.name}: weights must be a .safetensors file or a PyTorch state "
        f"dict ({', '.join(TORCH_SUFFIXES)}) saved with torch.save(model.state_dict(), path); "
        "other formats are not read (some, e.g. joblib or NumPy pickles, can run arbitrary code "
        "when loaded)"
    )


def _load_torch_state_dict(path: Path) -> dict[str, torch.Tensor]:
    try:
        content = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise ModelLoadError(
            f"refusing to load {path.name}: it holds pickled Python objects, not just tensors "
            "(e.g. a whole model saved with torch.save(model)). Save model.state_dict() instead, "
            "or convert it to safetensors"
        ) from error
    except Exception as error:
        raise ModelLoadError(f"{path} is not a readable PyTorch file: {error}") from error
    if isinstance(content, dict):
        for key in _STATE_DICT_KEYS:
            if isinstance(content.get(key), dict):
                content = content[key]
                break
    if not isinstance(content, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in content.items()
    ):
        raise ModelLoadError(
            f"{path.name} does not hold a state dict (a mapping of names to tensors); save it "
            "with torch.save(model.state_dict(), path)"
        )
    return content


def load_model(reference: str, weights: str | Path | None = None) -> nn.Module:
    """Build ``reference`` (``package.module:factory``), load ``weights``, return it in eval mode.

    Raises:
        ModelLoadError: If building or loading fails, or the weights do not match the model.
    """
    model = load_factory(reference)
    if weights is not None:
        load_weights(model, weights, name=reference)
    return model.eval()


def load_weights(model: nn.Module, weights: str | Path, *, name: str | None = None) -> nn.Module:
    """Load a weights file into ``model`` once its names and shapes are checked.

    The file is read by :func:`load_state_dict` (nothing but tensors is ever unpickled). Names
    are matched after removing ``torch.compile``'s ``_orig_mod.`` segments and, where the model's
    module defines ``convert_state_dict(state) -> state``, after that translation (another code
    base's layout).

    Args:
        model: The model, compiled or not; its parameters are filled in place.
        weights: A ``.safetensors`` file or a PyTorch state dict file.
        name: How error messages call the model (default: its class name).

    Returns:
        ``model`` itself (its training mode unchanged).

    Raises:
        ModelLoadError: If the file cannot be read safely, the translation refuses it, or its
            tensors do not match the model's names and shapes.
    """
    name = name or type(model).__name__
    file = Path(weights).name
    state = {_COMPILED_SEGMENT.sub(r"\1", k): v for k, v in load_state_dict(weights).items()}
    target = uncompiled_tree(model)  # shares its parameters and buffers with ``model``
    convert = getattr(target, "convert_state_dict", None)
    if callable(convert):
        try:
            state = convert(state)
        except ModelLoadError as error:
            raise ModelLoadError(f"{file}: {error}") from error
    missing, unexpected = _mismatch(target, state)
    if missing or unexpected:
        raise ModelLoadError(
            f"weights in {file} do not match {name}: "
            f"missing {_few(missing)}, unexpected {_few(unexpected)}"
        )
    try:
        target.load_state_dict(state)
    except RuntimeError as error:
        first = str(error).strip().splitlines()[-1].strip()
        raise ModelLoadError(f"weights in {file} do not fit {name}: {first}") from error
    return model


def _mismatch(model: nn.Module, state: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    expected = set(model.state_dict())
    return sorted(expected - set(state)), sorted(set(state) - expected)


def _few(names: list[str]) -> str:
    if not names:
        return "none"
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
