"""Attribution maps on disk: fixed-size shards keyed by global index range, plus an index.

Layout of an output folder::

    index.json                                   written last, by rank 0, atomically
    shards/shard-000000000-000000256.safetensors samples 0..255
    shards/shard-000000256-000000512.safetensors …

Each shard holds ``attribution`` ``(n, *sample_shape)``, ``index`` (the global sample indices),
``target`` and ``score`` (the explained class and its output), and metadata naming its range and
the *run key* (a hash of the model weights, method, options, batch size and data) and a SHA-256
of its own tensors. Shards are written to a temporary file and renamed, so a shard that exists is
complete; their bytes depend only on their content (the metadata is written in sorted order), so
identical runs write identical files. After an interruption, a rerun keeps every shard whose
metadata, run key, shapes and tensor digest check out and computes only the others.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from explain_core.errors import DistributedError
from explain_core.files import write_atomically

__all__ = [
    "FORMAT",
    "INDEX_NAME",
    "SHARD_FOLDER",
    "StoredAttributions",
    "check_listed_shards",
    "load_attributions",
    "read_index",
    "read_valid_shard",
    "remove_unlisted_shards",
    "shard_path",
    "tensor_digest",
    "write_index",
    "write_shard",
]

FORMAT = "explain-attributions"
VERSION = 1
INDEX_NAME = "index.json"
SHARD_FOLDER = "shards"
SHARED_FOLDER_ADVICE = (
    "--out (out_dir) must be one folder that every rank can see (a shared filesystem when the "
    "ranks run on several machines)"
)


def tensor_digest(hasher: Any, tensor: torch.Tensor) -> None:
    """Feed a tensor's dtype, shape and bytes into a ``hashlib`` hasher."""
    tensor = tensor.detach().cpu().contiguous()
    hasher.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    hasher.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())


def shard_path(out_dir: str | Path, piece: range) -> Path:
    """Where the shard of samples ``piece`` lives."""
    return Path(out_dir) / SHARD_FOLDER / f"shard-{piece.start:09d}-{piece.stop:09d}.safetensors"


def write_shard(
    out_dir: str | Path,
    piece: range,
    tensors: Mapping[str, torch.Tensor],
    run_key: str,
    extra: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Write one shard atomically and return its index entry.

    ``extra`` metadata (e.g. a hash of the chunk's inputs) must match again on resume. The
    metadata also holds ``tensors_sha256``, a digest of the tensors, so that a shard whose bytes
    changed on disk is never reused.
    """
    from safetensors.torch import save

    cpu = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    metadata = {
        "format": FORMAT,
        "version": str(VERSION),
        "start": str(piece.start),
        "stop": str(piece.stop),
        "run_key": run_key,
        **(extra or {}),
        "tensors_sha256": tensors_sha256(cpu),
    }
    data = _sorted_metadata(save(cpu, metadata))
    path = shard_path(out_dir, piece)
    write_atomically(path, data)
    return _entry(out_dir, path, piece, data)


def tensors_sha256(tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over the names, dtypes, shapes and bytes of ``tensors``, in name order.

    A digest of the file cannot live inside the file; one of the tensors can, and it covers every
    byte of tensor data (a flipped bit in a map, a NaN written over a value).
    """
    hasher = hashlib.sha256()
    for name in sorted(tensors):
        hasher.update(name.encode())
        tensor_digest(hasher, tensors[name])
    return hasher.hexdigest()


def _sorted_metadata(data: bytes) -> bytes:
    """``data`` (a safetensors file) with its ``__metadata__`` keys in sorted order.

    safetensors keeps the metadata in a hash map, so the same call writes its keys in a different
    order each time; sorting them makes identical shards identical byte for byte (and their
    SHA-256 in ``index.json`` too). The header keeps its length, padding and tensor offsets.
    """
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    if "__metadata__" in header:
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads the header to 8 bytes with spaces
    return struct.pack("<Q", len(text)) + text + data[8 + length :]


def _entry(out_dir: str | Path, path: Path, piece: range, data: bytes) -> dict[str, Any]:
    return {
        "file": path.relative_to(out_dir).as_posix(),
        "start": piece.start,
        "stop": piece.stop,
        "sha256": hashlib.sha256(data).hexdigest(),
    }


def read_valid_shard(
    out_dir: str | Path,
    piece: range,
    run_key: str,
    sample_shape: tuple[int, ...] | None = None,
    extra: Mapping[str, str] | None = None,
) -> dict[str, Any] | None:
    """The index entry of an existing, complete shard of this run, or ``None``.

    A shard is valid when it parses, its metadata names this range and run key, its tensors match
    the ``tensors_sha256`` of its metadata (bytes changed on disk are caught), ``index`` is
    ``piece`` and ``attribution`` has ``len(piece)`` rows (of ``sample_shape`` when given), and
    the ``extra`` metadata matches.
    """
    from safetensors import safe_open
    from safetensors.torch import load

    path = shard_path(out_dir, piece)
    try:
        data = path.read_bytes()
        tensors = load(data)
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
    except Exception:  # missing, truncated or foreign file: compute it again
        return None
    expected = {"format": FORMAT, "version": str(VERSION), "run_key": run_key}
    expected |= {"start": str(piece.start), "stop": str(piece.stop), **(extra or {})}
    if any(metadata.get(k) != v for k, v in expected.items()):
        return None
    if metadata.get("tensors_sha256") != tensors_sha256(tensors):
        return None  # corrupted on disk, or written before shards carried a digest
    attribution, index = tensors.get("attribution"), tensors.get("index")
    if attribution is None or index is None or attribution.shape[0] != len(piece):
        return None
    if sample_shape is not None and tuple(attribution.shape[1:]) != tuple(sample_shape):
        return None
    if not torch.equal(index, torch.arange(piece.start, piece.stop, dtype=index.dtype)):
        return None
    return _entry(out_dir, path, piece, data)


def check_listed_shards(
    out_dir: str | Path, entries: Iterable[Mapping[str, Any]], writers: Mapping[int, int]
) -> None:
    """Check, before ``index.json`` vouches for them, that the shards are here and unchanged.

    Rank 0 runs this on the entries every rank reported: a shard another rank wrote to a folder
    rank 0 cannot see (no shared filesystem) is missing or different here.

    Args:
        out_dir: The output folder as this process sees it.
        entries: Index entries (``file``, ``start``, ``sha256``).
        writers: Which rank wrote or checked the shard starting at each index.

    Raises:
        DistributedError: Naming the first shard that is missing or differs, and the fix.
    """
    for entry in entries:
        path = Path(out_dir) / entry["file"]
        rank = writers.get(entry["start"], "?")
        try:
            digest = _file_sha256(path)
        except FileNotFoundError:
            problem = "does not exist on rank 0"
        else:
            if digest == entry["sha256"]:
                continue
            problem = "differs on rank 0"
        raise DistributedError(
            f"shard {path} that rank {rank} wrote or checked {problem}, so no index.json was "
            f"written; {SHARED_FOLDER_ADVICE}, and only one run may write to it at a time"
        )


def _file_sha256(path: Path) -> str:
    hasher = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            hasher.update(block)
    return hasher.hexdigest()


def remove_unlisted_shards(out_dir: str | Path, entries: Iterable[Mapping[str, Any]]) -> list[Path]:
    """Delete the shard files in ``out_dir`` that the index does not list; return them.

    They are an earlier run's (another shard size, another model or method): left in place they
    would look like results. Only files named like shards are touched.
    """
    listed = {Path(out_dir) / entry["file"] for entry in entries}
    removed = []
    for path in sorted((Path(out_dir) / SHARD_FOLDER).glob("shard-*-*.safetensors")):
        if path not in listed:
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def write_index(out_dir: str | Path, index: Mapping[str, Any]) -> Path:
    """Write ``index.json`` atomically."""
    path = Path(out_dir) / INDEX_NAME
    write_atomically(path, (json.dumps(index, indent=1) + "\n").encode())
    return path


def read_index(out_dir: str | Path) -> dict[str, Any]:
    """Read and check ``index.json`` of an attribution folder.

    Raises:
        DistributedError: If it is missing, of another format, or incomplete.
    """
    path = Path(out_dir) / INDEX_NAME
    try:
        index = json.loads(path.read_text())
    except FileNotFoundError:
        raise DistributedError(
            f"{path} does not exist: the attribution run did not finish (run it again with the "
            f"same arguments to complete the missing shards; {SHARED_FOLDER_ADVICE})"
        ) from None
    except json.JSONDecodeError as error:
        raise DistributedError(f"{path} is not valid JSON: {error}") from None
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise DistributedError(f"{path} is not an {FORMAT} index of version {VERSION}")
    return index


@dataclass(frozen=True)
class StoredAttributions:
    """Attributions stitched from the shards, in global sample order.

    Attributes:
        attribution: ``(N, *sample_shape)`` maps.
        target: ``(N,)`` explained classes.
        score: ``(N,)`` model output for the explained class.
        index: The folder's ``index.json`` content.
    """

    attribution: torch.Tensor
    target: torch.Tensor
    score: torch.Tensor
    index: dict[str, Any]


def load_attributions(out_dir: str | Path, *, verify: bool = True) -> StoredAttributions:
    """Read every shard listed in ``index.json`` and stitch the maps in sample order.

    Args:
        out_dir: The folder ``evaluate("attributions", ...)`` wrote.
        verify: Check each shard's SHA-256 against the index.

    Raises:
        DistributedError: On a missing or altered shard, or shards that do not cover the data.
    """
    from safetensors.torch import load

    from explain_core.distributed.sharding import check_partition

    index = read_index(out_dir)
    entries = sorted(index["shards"], key=lambda e: e["start"])
    try:
        check_partition([range(e["start"], e["stop"]) for e in entries], index["n_samples"])
    except ValueError as problem:
        raise DistributedError(f"{out_dir}: {problem}") from None
    parts: dict[str, list[torch.Tensor]] = {"attribution": [], "target": [], "score": []}
    for entry in entries:
        path = Path(out_dir) / entry["file"]
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise DistributedError(f"shard {path} listed in the index is missing") from None
        if verify and hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise DistributedError(f"shard {path} changed since the index was written")
        tensors = load(data)
        for key, values in parts.items():
            values.append(tensors[key])
    stitched = {key: torch.cat(values) for key, values in parts.items()}
    return StoredAttributions(index=index, **stitched)
