"""REM parse-tree statistics: quantised couplings, per-class key dictionaries and their entropy.

REM (Renzulli, Tartaglione, Grangetto, "Capsule networks do not need to model everything")
quantises the last routing iteration's coupling coefficients ``c_ij`` into ``K`` uniform levels at
inference, and for each sample takes the quantised column ``c̃_{:,j}`` over all lower capsules for
its *predicted* class ``j`` as a key ("parse tree"). Keys are counted per predicted class; the
entropy of class ``j`` is ``H_j = -Σ p log₂ p`` over its key frequencies and the dictionary's
entropy is the mean of ``H_j`` over classes (paper, eqs. 14-15). ``K`` is the lowest number of
levels that loses no accuracy (paper, §3.1.2).

Keys are stored as the raw bytes of integer level indices (``uint8`` when ``K ≤ 256``): exact,
compact and hashable, so counts from several batches, processes or saved states merge by adding.

Quantising recorded couplings (``record_parse_tree_data(..., levels=K)``) does not change how the
model routes. REM's "+Q" model routes with the quantised couplings, so its outputs, predictions
and deeper couplings differ from the plain model's: :func:`quantised_routing` makes a model route
so for the duration of a block.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from explain_capsules.layers import COUPLING_TRANSFORM
from explain_core.eager import uncompiled
from explain_core.errors import InvalidInputError
from explain_core.interfaces.routing import RoutingLayer
from explain_core.quantisation import (
    check_levels,
    level_index_dtype,
    quantise_couplings,
    quantise_to_levels,
)
from explain_core.scoped import scoped_settings

__all__ = [
    "ParseTreeDictionary",
    "lowest_lossless_levels",
    "quantise_couplings",
    "quantise_to_levels",
    "quantised_routing",
]

_STATE_VERSION = 1


@contextmanager
def quantised_routing(model: nn.Module, levels: int) -> Iterator[nn.Module]:
    """Make ``model`` route with couplings quantised into ``K`` levels inside the block (REM's +Q).

    Every capsule layer of :mod:`explain_capsules.layers` in ``model`` routes with
    :func:`quantise_couplings` at ``levels`` instead of its ``coupling_transform``, in the calling
    thread (or asyncio task) only: the layers are not changed, so other threads keep using the
    continuous model. The layers apply the
    transform in eval mode only (training routes with continuous couplings), as
    :func:`~explain_capsules.recording.record_parse_tree_data`, ``capsule_saliency`` and
    ``explain_core.parse_trees.collect_parse_tree_data`` run the model. Inside the block the
    quantised couplings form the output capsules, so predictions, activations and the couplings
    of later layers are those of the quantised model::

        with quantised_routing(model, levels=11):
            recording = record_parse_tree_data(model, inputs, levels=11)

    Args:
        model: A capsule network.
        levels: Number of levels ``K ≥ 2``.

    Yields:
        ``model``.

    Raises:
        ValueError: If ``levels`` is not an int ≥ 2.
        InvalidInputError: If ``model`` has no routing layer with a ``coupling_transform``.
    """
    check_levels(levels)
    layers = [
        module
        for module in uncompiled(model).modules()
        if isinstance(module, RoutingLayer) and hasattr(module, "active_coupling_transform")
    ]
    if not layers:
        raise InvalidInputError(
            f"{type(model).__name__} has no routing layer with a coupling_transform (such as "
            "explain_capsules' FullyConnectedCapsules or ConvolutionalCapsules); quantised "
            "routing needs capsule layers that can transform their couplings"
        )
    quantiser = partial(quantise_couplings, levels=levels)
    with scoped_settings(COUPLING_TRANSFORM, dict.fromkeys(layers, quantiser)):
        yield model


class ParseTreeDictionary:
    """Per-predicted-class dictionary of quantised coupling columns (REM parse trees).

    Storage: one ``dict[bytes, int]`` per class, mapping the bytes of a key's level-index row
    (``n_lower`` values, ``uint8`` when ``K ≤ 256``) to its count. Each :meth:`update` finds the
    unique (class, key) rows of the batch with one vectorised ``np.unique`` over a byte view of
    the rows (class prepended as the first column), then adds the batch counts into the dicts, so
    the Python loop runs over unique rows only, never over per-sample strings. Dict merging is
    exact, so batch splits and :meth:`merge` give identical counts.

    Args:
        n_classes: Number of output classes; inferred from the first update when ``None``.
        levels: Number of quantisation levels ``K``; taken from the first update when ``None``.
    """

    def __init__(self, n_classes: int | None = None, levels: int | None = None) -> None:
        if levels is not None:
            check_levels(levels)
        self.n_classes = n_classes
        self.levels = levels
        self.n_lower: int | None = None
        self._counts: list[dict[bytes, int]] = [{} for _ in range(n_classes or 0)]

    # ----------------------------------------------------------------------------- building
    def _check_compatible(self, n_lower: int, n_classes: int, levels: int) -> None:
        """Refuse a shape or K other than the dictionary's; changes nothing."""
        check_levels(levels)
        mine = (self.n_lower, self.n_classes, self.levels)
        given = (n_lower, n_classes, levels)
        if any(m is not None and m != g for m, g in zip(mine, given, strict=True)):
            raise ValueError(
                f"update with n_lower={n_lower}, n_classes={n_classes}, K={levels} does not match "
                f"the dictionary's n_lower={self.n_lower}, n_classes={self.n_classes}, "
                f"K={self.levels}"
            )

    def _configure(self, n_lower: int, n_classes: int, levels: int) -> None:
        """Fix (or check) the shape and K; keys of different shapes or K are not comparable."""
        self._check_compatible(n_lower, n_classes, levels)
        if self.n_classes is None:
            self.n_classes = n_classes
            self._counts = [{} for _ in range(n_classes)]
        if self.levels is None:
            self.levels = levels
        if self.n_lower is None:
            self.n_lower = n_lower

    def update(self, couplings: Tensor, predicted: Tensor, levels: int) -> None:
        """Add one batch of samples.

        Args:
            couplings: Last-iteration couplings, shape ``(B, n_lower, n_classes)``.
            predicted: Predicted class per sample, shape ``(B,)`` (integers).
            levels: Number of quantisation levels ``K``; must match earlier updates.

        Every argument is checked before the dictionary changes: a refused first update does not
        fix its shape or ``K``.

        Raises:
            ValueError: On shape mismatches, out-of-range classes, ``K < 2`` or NaN couplings.
        """
        if couplings.dim() != 3:
            raise ValueError(
                f"couplings must be (B, n_lower, n_classes), got {tuple(couplings.shape)}"
            )
        batch, n_lower, n_classes = couplings.shape
        predicted = torch.as_tensor(predicted).reshape(-1)
        if predicted.is_floating_point() or predicted.is_complex() or predicted.dtype == torch.bool:
            raise ValueError(
                f"predicted must hold class indices (integers); got dtype {predicted.dtype}. "
                "Pass output.argmax(1), not scores or probabilities"
            )
        predicted = predicted.to(torch.int64).to(couplings.device)
        if predicted.numel() != batch:
            raise ValueError(f"predicted has {predicted.numel()} entries for a batch of {batch}")
        self._check_compatible(n_lower, n_classes, levels)
        if batch and (predicted.min() < 0 or predicted.max() >= n_classes):
            raise ValueError(f"predicted classes must lie in [0, {n_classes})")
        # Select the predicted column before quantising: 1/n_classes of the work.
        index = predicted.view(batch, 1, 1).expand(batch, n_lower, 1)
        columns = couplings.gather(2, index).squeeze(2)
        rows = quantise_to_levels(columns, levels).cpu()  # refuses NaN: still unconfigured
        self._configure(n_lower, n_classes, levels)
        if batch == 0:
            return
        key_dtype = rows.dtype
        if key_dtype == torch.uint8 and n_classes > 256:
            key_dtype = torch.int32  # class column would not fit in a byte
        rows = rows.to(key_dtype)
        full = torch.cat([predicted.cpu().to(key_dtype).unsqueeze(1), rows], dim=1).numpy()
        full = np.ascontiguousarray(full)
        width = full.shape[1] * full.itemsize
        # One sort over fixed-width byte records = all (class, key) pairs of the batch at once.
        records = full.view(np.dtype((np.void, width))).ravel()
        unique, counts = np.unique(records, return_counts=True)
        cls_bytes = full.itemsize
        for record, count in zip(unique.tolist(), counts.tolist(), strict=True):
            cls = int.from_bytes(record[:cls_bytes], sys.byteorder)
            key = self._key_bytes(record[cls_bytes:], key_dtype)
            table = self._counts[cls]
            table[key] = table.get(key, 0) + count

    def _key_bytes(self, raw: bytes, dtype: torch.dtype) -> bytes:
        """Normalise key bytes to the canonical key dtype of this K (independent of n_classes)."""
        canonical = level_index_dtype(self.levels or 2)
        if dtype == canonical:
            return raw
        values = np.frombuffer(raw, dtype=_NUMPY_DTYPES[dtype])
        return values.astype(_NUMPY_DTYPES[canonical]).tobytes()

    def merge(self, other: ParseTreeDictionary) -> ParseTreeDictionary:
        """Add another dictionary's counts into this one (in place) and return ``self``.

        The result is identical to one dictionary updated with both sets of samples, so shards
        from several processes can be combined.

        Raises:
            ValueError: If ``n_lower``, ``n_classes`` or ``K`` differ.
        """
        if other.n_classes is None:
            return self  # empty, never configured
        if other.n_lower is None:
            # configured (n_classes) but no sample yet
            if self.n_classes is None:
                self.n_classes = other.n_classes
                self._counts = [{} for _ in range(other.n_classes)]
            return self
        self._configure(other.n_lower, other.n_classes, other.levels or 2)
        for mine, theirs in zip(self._counts, other._counts, strict=True):
            for key, count in theirs.items():
                mine[key] = mine.get(key, 0) + count
        return self

    # ----------------------------------------------------------------------------- queries
    def _require_classes(self) -> int:
        if self.n_classes is None:
            raise ValueError("the dictionary has no classes yet: pass n_classes or call update")
        return self.n_classes

    def counts(self, cls: int) -> tuple[Tensor, Tensor]:
        """Keys and counts of one class, keys sorted lexicographically (deterministic).

        Args:
            cls: Class index.

        Returns:
            ``(keys, counts)``: level indices ``(n_keys, n_lower)`` (``uint8`` for ``K ≤ 256``)
            and ``int64`` counts ``(n_keys,)``.
        """
        n_classes = self._require_classes()
        if not 0 <= cls < n_classes:
            raise IndexError(f"class {cls} out of range [0, {n_classes})")
        table = self._counts[cls]
        dtype = level_index_dtype(self.levels or 2)
        n_lower = self.n_lower or 0
        if not table:
            return torch.empty(0, n_lower, dtype=dtype), torch.empty(0, dtype=torch.int64)
        keys = sorted(table)  # bytes order == lexicographic order of uint8 rows
        flat = np.frombuffer(b"".join(keys), dtype=_NUMPY_DTYPES[dtype]).reshape(len(keys), -1)
        return torch.from_numpy(flat.copy()), torch.tensor([table[k] for k in keys])

    def counts_dict(self, cls: int) -> dict[tuple[int, ...], int]:
        """Counts of one class as ``{tuple of level indices: count}`` (convenient, slower)."""
        keys, counts = self.counts(cls)
        return {tuple(k): c for k, c in zip(keys.tolist(), counts.tolist(), strict=True)}

    def samples_per_class(self) -> Tensor:
        """Number of samples predicted as each class, ``int64`` ``(n_classes,)``."""
        self._require_classes()
        return torch.tensor([sum(t.values()) for t in self._counts], dtype=torch.int64)

    def keys_per_class(self) -> Tensor:
        """Number of distinct keys (parse trees) per class, ``int64`` ``(n_classes,)``."""
        self._require_classes()
        return torch.tensor([len(t) for t in self._counts], dtype=torch.int64)

    def entropy(self) -> Tensor:
        """Per-class entropy ``H_j = -Σ p log₂ p`` over key frequencies, float64 ``(n_classes,)``.

        A class with no samples has an empty distribution; its entropy is defined as ``0`` (never
        NaN). Check :meth:`samples_per_class` to tell it from a class whose samples share one key;
        :meth:`mean_entropy` leaves such classes out.
        """
        self._require_classes()
        values = []
        for table in self._counts:
            total = sum(table.values())
            if total == 0:
                values.append(0.0)
                continue
            # Sorted counts: the float sum must not depend on insertion (batch/merge) order.
            counts = torch.tensor(sorted(table.values()), dtype=torch.float64)
            p = counts / total
            values.append(float(-(p * torch.log2(p)).sum()))
        # -0.0 from a single key is normalised to 0.0 by the + 0.0.
        return torch.tensor(values, dtype=torch.float64) + 0.0

    def mean_entropy(self) -> float:
        """Dictionary entropy ``H``: mean of ``H_j`` over the classes that have samples.

        The paper averages over all ``J`` classes; on a full test set every class is predicted at
        least once, so the two agree. Leaving out never-predicted classes avoids pulling the mean
        towards 0 on small subsets.

        Raises:
            ValueError: If no sample has been added.
        """
        present = self.samples_per_class() > 0
        if not bool(present.any()):
            raise ValueError("the dictionary is empty: no samples to average over")
        return float(self.entropy()[present].mean())

    # ----------------------------------------------------------------------------- state
    def to_state(self) -> dict[str, Any]:
        """Plain-data state (ints and lists, JSON-serialisable, no pickle).

        Keys are lists of level indices; per class, ``keys[i]`` has count ``counts[i]``, in
        lexicographic key order, so equal dictionaries give equal states.
        """
        classes = []
        for cls in range(self.n_classes or 0):
            keys, counts = self.counts(cls)
            classes.append({"keys": keys.tolist(), "counts": counts.tolist()})
        return {
            "version": _STATE_VERSION,
            "n_classes": self.n_classes,
            "n_lower": self.n_lower,
            "levels": self.levels,
            "classes": classes,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> ParseTreeDictionary:
        """Rebuild a dictionary from :meth:`to_state` output.

        Raises:
            ValueError: On an unknown version or inconsistent content.
        """
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"unsupported ParseTreeDictionary state version {state.get('version')!r}"
            )
        out = cls(n_classes=state["n_classes"], levels=state["levels"])
        out.n_lower = state["n_lower"]
        n_classes = state["n_classes"] or 0
        if len(state["classes"]) != n_classes:
            raise ValueError("state has a class list of the wrong length")
        np_dtype = _NUMPY_DTYPES[level_index_dtype(out.levels or 2)]
        for table, entry in zip(out._counts, state["classes"], strict=True):
            if len(entry["keys"]) != len(entry["counts"]):
                raise ValueError("state keys and counts differ in length")
            for key, count in zip(entry["keys"], entry["counts"], strict=True):
                if len(key) != out.n_lower:
                    raise ValueError(f"state key of length {len(key)}, expected {out.n_lower}")
                if not all(0 <= v < (out.levels or 0) for v in key):
                    raise ValueError("state key has a level index outside [0, K)")
                table[np.asarray(key, dtype=np_dtype).tobytes()] = int(count)
        return out

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ParseTreeDictionary):
            return NotImplemented
        return self.to_state() == other.to_state()

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        n = int(self.samples_per_class().sum()) if self.n_classes else 0
        return (
            f"ParseTreeDictionary(n_classes={self.n_classes}, n_lower={self.n_lower}, "
            f"levels={self.levels}, samples={n})"
        )


_NUMPY_DTYPES = {torch.uint8: np.uint8, torch.int32: np.int32}


def lowest_lossless_levels(
    evaluate: Callable[[int], float],
    candidates: Iterable[int] = range(2, 21),
    *,
    reference: float,
    tolerance: float = 0.0,
) -> int:
    """The smallest ``K`` whose quantised accuracy is at least ``reference - tolerance``.

    REM picks "the lowest K such that the accuracy does not deteriorate" (paper, §3.1.2).
    Candidates are tried in ascending order and the search stops at the first that passes, so
    larger ``K`` are never evaluated; accuracy need not be monotone in ``K``, and this returns
    the smallest passing ``K``, not the best one.

    Args:
        evaluate: ``evaluate(K)`` returns the validation accuracy with ``K``-level couplings.
        candidates: ``K`` values to try (each ``≥ 2``); sorted and de-duplicated first.
        reference: Accuracy of the unquantised model on the same data.
        tolerance: Accuracy drop accepted as "no loss" (same units as ``reference``).

    Returns:
        The smallest passing ``K``.

    Raises:
        ValueError: If a candidate is ``< 2``, ``tolerance < 0``, there are no candidates, or
            none passes (the message lists the best one seen).
    """
    if tolerance < 0 or math.isnan(tolerance):
        raise ValueError(f"tolerance must be ≥ 0, got {tolerance}")
    ordered = sorted(set(candidates))
    if not ordered:
        raise ValueError("no candidate K given")
    for levels in ordered:
        check_levels(levels)
    threshold = reference - tolerance
    seen: dict[int, float] = {}
    for levels in ordered:
        accuracy = float(evaluate(levels))
        seen[levels] = accuracy
        if accuracy >= threshold:
            return levels
    best = max(seen, key=lambda k: seen[k])
    raise ValueError(
        f"no K in {ordered} reaches accuracy {threshold:.6g}; best K={best} with {seen[best]:.6g}"
    )
