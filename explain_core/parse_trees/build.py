"""Parse trees as networkx graphs: nodes are capsules, edges are couplings (REM, §3.2, C.4).

Reading of the paper used here (REM, Renzulli et al., §3.2 and appendix C.4):

- **Backtracking**: only connections reachable downwards from the capsule of the predicted class
  (or the classes given) are kept — first the layer ``L-1`` capsules coupled to it, then the
  layer ``L-2`` capsules coupled to those, and so on down to the primary capsules.
- **Threshold**: an edge ``i → j`` from capsule ``i`` of layer ``l`` to capsule ``j`` of layer
  ``l+1`` is kept only if ``c_ij^[l]`` is strictly above the threshold of that routing layer.
  The paper sets it to ``1/|Ω^[l]|``, "the number of capsules in layer l"; since the couplings of
  a capsule are a softmax over its *parents*, we read ``Ω`` as the parent layer ``l+1``:
  the default threshold is ``1/|Ω^[l+1]|``, the uniform coupling (the value routing starts from,
  appendix C.3), so an edge is drawn when a part prefers that whole to the average. For the
  paper's multi-layer net (16-16-16-16-10 capsules) this is 1/16 for the hidden layers and 1/10
  for the class layer. Convolutional capsules route each window over its capsule types only, so
  their uniform coupling is one over those (``ParseTreeData.parents``). With couplings quantised
  into ``K`` levels the default is the level the uniform coupling rounds to: an edge needs a
  rounded coupling strictly above it, "more than uniform" on the quantised scale (K = 11: 1/16
  and 1/10 both round to 0.1, so edges need 0.2, i.e. a coupling of at least 0.15). A layer
  with one parent has couplings of exactly 1, which say nothing, and its default is 0: every
  coupling is an edge. Any float, or one per routing layer, can be given instead and is used as
  given (on the quantised couplings where they are quantised).
- **In-degree rule**: ``deg⁻(u_j)`` counts the couplings from layer ``l-1`` into ``j`` above the
  threshold (over all capsules of layer ``l-1``, not only those in the tree). The outgoing
  edges of ``j`` are kept only if ``deg⁻(u_j) ≥ 1``. Primary capsules (layer 1) have no routing
  below them, so the rule does not apply to them.
- **Modes**: one sample; a class (couplings and activations averaged over the samples predicted
  as — or labelled — that class, then backtracked from it); the whole data set (averaged over
  all samples, backtracked from every class predicted for at least one sample).

Node ids are ``"L{l}:C{i}"`` (layer ``l`` from 1 = primary, capsule index ``i`` from 0), stable
across runs and processes. Node attributes: ``layer``, ``index``, ``activation`` (``‖u‖``),
``label`` (``C{i}``, or the class name in the last layer), ``in_tree`` (false only for the extra
capsules added by ``keep_all_nodes``), ``root`` and, on the last layer, ``class_name``. Edges run
from the part (layer ``l``) to the whole (layer ``l+1``) with attributes ``weight`` (the
coupling) and ``layer`` (``l``). Graph attributes: ``mode``, ``roots``, ``thresholds`` (text),
``n_samples``, ``sample`` or ``class_index`` where they apply, ``levels`` when the couplings were
quantised, and ``title``.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from explain_core.errors import InvalidInputError
from explain_core.extras import require
from explain_core.parse_trees.data import (
    LayerStack,
    ParseTreeData,
    as_index,
    not_integral,
)
from explain_core.quantisation import check_levels, quantise_couplings

__all__ = [
    "build_parse_tree",
    "check_parse_tree",
    "class_parse_tree",
    "dataset_parse_tree",
    "default_thresholds",
    "node_id",
    "parse_tree",
    "sample_parse_tree",
]

Threshold = float | Sequence[float] | None


def node_id(layer: int, index: int) -> str:
    """The stable id of capsule ``index`` (from 0) in layer ``layer`` (from 1): ``"L2:C5"``."""
    return f"L{int(layer)}:C{int(index)}"


def default_thresholds(
    sizes: Sequence[int],
    *,
    levels: int | None = None,
    parents: Sequence[int] | None = None,
) -> list[float]:
    """The default edge threshold of every routing layer: its uniform coupling.

    An edge needs a coupling strictly above the threshold (see the module docstring):

    - ``1/p``, ``p`` the number of parents of the routing softmax: ``|Ω^[l+1]|`` for fully
      connected routing, a window's capsule types for convolutional capsules (``parents``);
    - one parent (``p = 1``): 0, so that its couplings, always exactly 1, are edges;
    - ``levels=K`` (quantised couplings): the level ``1/p`` rounds to, so that an edge needs a
      rounded coupling *above* the rounded uniform one (``K = 11``, ``p = 16``: 0.1). It is
      capped at the level below 1, so that a coupling rounded to 1 is always an edge
      (``K = 2`` with two parents, where 1/2 rounds up to 1).

    Args:
        sizes: Number of capsules ``|Ω^l|`` of every layer ``l = 1 … L``.
        levels: Number of levels ``K`` the couplings were quantised into, or ``None``.
        parents: Per routing layer, the size of its routing softmax; default ``sizes[1:]``.

    Raises:
        InvalidInputError: If ``levels`` is not an int ≥ 2 or ``parents`` has the wrong length.
    """
    parents = list(sizes[1:]) if parents is None else list(parents)
    if len(parents) != len(sizes) - 1:
        raise InvalidInputError(
            f"parents needs one value per routing layer ({len(sizes) - 1}); got {len(parents)}"
        )
    return [_uniform_threshold(int(p), levels) for p in parents]


def _uniform_threshold(parents: int, levels: int | None) -> float:
    if parents == 1:  # a coupling of 1 to the only parent carries no preference
        return 0.0
    uniform = torch.tensor(1.0 / parents, dtype=torch.float64)
    if levels is None:
        return float(uniform)
    below_top = (levels - 2) / (levels - 1)
    return min(float(quantise_couplings(uniform, levels)), below_top)


def resolve_thresholds(
    threshold: Threshold,
    sizes: Sequence[int],
    *,
    levels: int | None = None,
    parents: Sequence[int] | None = None,
) -> list[float]:
    """One threshold per routing layer from ``None`` (default), a number, or a sequence.

    A number may be a Python, NumPy or 0-d tensor number; ``levels`` and ``parents`` are used
    by the default only (:func:`default_thresholds`).

    Raises:
        InvalidInputError: On a wrong count or a non-finite value.
    """
    routing_layers = len(sizes) - 1
    if threshold is None:
        return default_thresholds(sizes, levels=levels, parents=parents)
    scalar = _as_scalar(threshold)
    if scalar is not None:
        values = [scalar] * routing_layers
    else:
        values = _as_floats(threshold)
        if values is None:
            raise InvalidInputError(
                f"threshold must be a number, one number per routing layer ({routing_layers}) "
                f"or None for the default; got {threshold!r}"
            )
        if len(values) != routing_layers:
            raise InvalidInputError(
                f"threshold needs one value per routing layer ({routing_layers}); got {len(values)}"
            )
    if not all(torch.isfinite(torch.tensor(values))):
        raise InvalidInputError(f"thresholds must be finite numbers; got {values}")
    return values


def _as_scalar(value: Any) -> float | None:
    """``value`` as a float if it is one real number (Python, NumPy or a 0-d tensor), else None."""
    if isinstance(value, (bool, np.bool_)):  # True is no threshold
        return None
    if isinstance(value, numbers.Real):  # int, float and NumPy's numbers
        return float(value)
    if isinstance(value, Tensor) and value.dim() == 0 and value.dtype != torch.bool:
        return None if value.is_complex() else float(value.item())
    return None


def _as_floats(values: Any) -> list[float] | None:
    """``values`` as floats, or ``None`` if it is text or not a sequence of numbers."""
    if isinstance(values, (str, bytes)):  # iterable, but "0.5" is not one value per layer
        return None
    try:
        return [float(v) for v in values]
    except (TypeError, ValueError):
        return None


_NODE_ATTRIBUTES = ("layer", "index", "activation")


def check_parse_tree(graph: Any) -> Any:
    """Check that ``graph`` is a parse tree as built here, before drawing or writing it.

    Returns:
        ``graph``.

    Raises:
        InvalidInputError: If it is not a directed graph, or its capsules lack ``layer``,
            ``index`` or ``activation``, or its couplings lack ``weight``.
    """
    expected = "expected a parse-tree graph from parse_tree() or build_parse_tree()"
    if not all(hasattr(graph, name) for name in ("graph", "nodes", "edges", "predecessors")):
        raise InvalidInputError(f"{expected} (a networkx.DiGraph); got {type(graph).__name__}")
    for node, data in graph.nodes(data=True):
        missing = [name for name in _NODE_ATTRIBUTES if name not in data]
        if missing:
            raise InvalidInputError(
                f"{expected}, whose capsules carry {', '.join(_NODE_ATTRIBUTES)}; node {node!r} "
                f"lacks {', '.join(missing)}"
            )
    for child, parent, data in graph.edges(data=True):
        if "weight" not in data:
            raise InvalidInputError(
                f"{expected}, whose couplings carry a weight; edge {child!r} -> {parent!r} has none"
            )
    return graph


def build_parse_tree(
    couplings: Sequence[Tensor],
    activations: Sequence[Tensor],
    roots: Sequence[int],
    *,
    threshold: Threshold = None,
    class_names: Sequence[str] | None = None,
    keep_all_nodes: bool = False,
    backtrack: bool = True,
    levels: int | None = None,
    parents: Sequence[int] | None = None,
    **graph_attributes: Any,
) -> Any:
    """Build one parse tree from the couplings and activations of one sample (or a mean).

    Args:
        couplings: ``L-1`` matrices ``(|Ω^l|, |Ω^{l+1}|)``: ``couplings[l-1][i, j] = c_ij^[l]``.
        activations: ``L`` vectors ``(|Ω^l|,)`` of capsule lengths ``‖u‖``.
        roots: Class capsules (indices in layer ``L``) to backtrack from.
        threshold: Keep edges with a coupling strictly above this: ``None`` for the uniform
            coupling of each routing layer (:func:`default_thresholds`), a number for all, or
            one per routing layer, used as given.
        class_names: Names of the last layer's capsules (default: their indices).
        keep_all_nodes: Also add the capsules outside the tree (``in_tree=False``, no edges),
            so that pictures of different trees share one layout.
        backtrack: ``False`` keeps every thresholded edge that passes the in-degree rule, from
            all capsules, not only those below the roots.
        levels: The number of levels ``K`` the couplings were quantised into (the default
            thresholds are then quantised too); stored as the graph's ``levels``.
        parents: Per routing layer, the size of its routing softmax, for the default
            thresholds (default: the number of capsules of the next layer).
        **graph_attributes: Stored on the graph (e.g. ``mode``, ``title``).

    Returns:
        A ``networkx.DiGraph`` (see the module docstring for its attributes).

    Raises:
        InvalidInputError: If the shapes do not chain or a root is out of range.
        MissingDependencyError: If networkx is not installed.
    """
    nx = require("networkx", "parse-tree graphs")
    stack = _stack(couplings, activations)
    sizes = stack.sizes
    n_layers = len(sizes)
    classes = sizes[-1]
    roots = sorted({as_index(r, "a class to backtrack from") for r in roots})
    if not roots:
        raise InvalidInputError("a parse tree needs at least one class to backtrack from")
    if roots[0] < 0 or roots[-1] >= classes:
        raise InvalidInputError(f"classes to backtrack from must lie in [0, {classes - 1}]")
    if class_names is not None and len(class_names) != classes:
        raise InvalidInputError(f"{len(class_names)} class names given for {classes} classes")
    if levels is not None:
        check_levels(levels)
    thresholds = resolve_thresholds(threshold, sizes, levels=levels, parents=parents)
    above = [c > t for c, t in zip(stack.couplings, thresholds, strict=True)]
    # deg⁻ of the capsules of layer l ≥ 2: couplings from layer l-1 above the threshold.
    passes = [torch.ones(sizes[0], dtype=torch.bool)]
    passes += [a.sum(dim=0) >= 1 for a in above[:-1]]

    # Walk down from the roots: layer l's active capsules are the children of active parents.
    active: list[set[int]] = [set() for _ in range(n_layers)]
    active[-1] = set(roots)
    edges: list[tuple[int, int, int]] = []  # (layer l, child i, parent j), l from 1
    for layer in range(n_layers - 1, 0, -1):  # l = L-1 … 1; active[layer] is layer l+1
        keep = above[layer - 1] & passes[layer - 1][:, None]
        for i, j in keep.nonzero().tolist():
            if backtrack and j not in active[layer]:
                continue
            edges.append((layer, i, j))
            active[layer - 1].add(i)
            active[layer].add(j)

    graph = nx.DiGraph()
    graph.graph.update(
        {
            "roots": ",".join(node_id(n_layers, r) for r in roots),
            "thresholds": ",".join(f"{t:.6g}" for t in thresholds),
            "n_samples": stack.n_samples,
        }
    )
    graph_attributes["levels"] = levels
    graph.graph.update({k: v for k, v in graph_attributes.items() if v is not None})
    for layer0, size in enumerate(sizes):
        members = range(size) if keep_all_nodes else sorted(active[layer0])
        for index in members:
            _add_node(graph, stack, layer0, index, index in active[layer0], class_names, roots)
    for layer, i, j in sorted(edges):
        weight = float(stack.couplings[layer - 1][i, j])
        graph.add_edge(node_id(layer, i), node_id(layer + 1, j), weight=weight, layer=layer)
    return graph


def _add_node(
    graph: Any,
    stack: LayerStack,
    layer0: int,
    index: int,
    in_tree: bool,
    class_names: Sequence[str] | None,
    roots: list[int],
) -> None:
    last = layer0 == len(stack.sizes) - 1
    attributes: dict[str, Any] = {
        "layer": layer0 + 1,
        "index": index,
        "activation": float(stack.activations[layer0][index]),
        "in_tree": bool(in_tree),
        "root": bool(last and index in roots),
    }
    if last:
        name = str(class_names[index]) if class_names is not None else str(index)
        attributes.update(class_name=name, label=name)
    else:
        attributes["label"] = f"C{index}"
    graph.add_node(node_id(layer0 + 1, index), **attributes)


def _stack(couplings: Sequence[Tensor], activations: Sequence[Tensor]) -> LayerStack:
    couplings = tuple(torch.as_tensor(c).detach().cpu().float() for c in couplings)
    activations = tuple(torch.as_tensor(a).detach().cpu().float() for a in activations)
    if not couplings or len(activations) != len(couplings) + 1:
        raise InvalidInputError(
            f"a parse tree needs L-1 ≥ 1 coupling matrices and L activation vectors; got "
            f"{len(couplings)} and {len(activations)}"
        )
    for k, c in enumerate(couplings):
        a_in, a_out = activations[k], activations[k + 1]
        if c.dim() != 2 or a_in.shape != (c.shape[0],) or a_out.shape != (c.shape[1],):
            raise InvalidInputError(
                f"layer {k + 1}: couplings {tuple(c.shape)} need activation vectors of "
                f"{c.shape[0] if c.dim() == 2 else '?'} and {c.shape[1] if c.dim() == 2 else '?'}"
                f" capsules; got {tuple(a_in.shape)} and {tuple(a_out.shape)}"
            )
    return LayerStack(couplings, activations)


def sample_parse_tree(
    data: ParseTreeData,
    index: int,
    *,
    target: int | None = None,
    threshold: Threshold = None,
    keep_all_nodes: bool = False,
    title: str | None = None,
) -> Any:
    """The parse tree of one sample, backtracked from its predicted class (or ``target``).

    ``index`` and ``target`` are integers (ints, NumPy integers or 0-d integer tensors); a
    negative ``index`` counts from the end.
    """
    index = data.sample_index(index)
    stack = data.sample(index)
    predicted = int(data.predicted[index])
    root = predicted if target is None else as_index(target, "target")
    return build_parse_tree(
        stack.couplings,
        stack.activations,
        [root],
        threshold=threshold,
        class_names=data.class_names,
        keep_all_nodes=keep_all_nodes,
        levels=data.levels,
        parents=data.parents,
        mode="sample",
        sample=index,
        predicted=predicted,
        title=title,
    )


def class_parse_tree(
    data: ParseTreeData,
    cls: int,
    *,
    labels: Tensor | None = None,
    threshold: Threshold = None,
    keep_all_nodes: bool = False,
    title: str | None = None,
) -> Any:
    """The parse tree of a class: the mean over its samples, backtracked from the class.

    Args:
        data: The recorded samples.
        cls: The class: an int, a NumPy integer or a 0-d integer tensor.
        labels: ``(N,)`` integer labels selecting the samples to average; default: the
            predictions.
        threshold: See :func:`build_parse_tree`.
        keep_all_nodes: See :func:`build_parse_tree`.
        title: Stored as the graph's ``title``.

    Raises:
        InvalidInputError: If ``cls`` is not an integer, ``labels`` are not one integer class
            per sample, or no sample belongs to the class.
    """
    cls = as_index(cls, "cls")
    chosen = data.predicted if labels is None else _labels(labels, data.n_samples)
    mask = chosen == cls
    if not bool(mask.any()):
        present = sorted({int(c) for c in chosen.tolist()})
        how = "predicted as" if labels is None else "labelled"
        raise InvalidInputError(f"no sample is {how} class {cls}; classes present: {present}")
    stack = data.mean(mask)
    return build_parse_tree(
        stack.couplings,
        stack.activations,
        [cls],
        threshold=threshold,
        class_names=data.class_names,
        keep_all_nodes=keep_all_nodes,
        levels=data.levels,
        parents=data.parents,
        mode="class",
        class_index=cls,
        n_samples=stack.n_samples,
        title=title,
    )


def _labels(labels: Any, n_samples: int) -> Tensor:
    """``labels`` as an int64 ``(N,)`` tensor of class indices.

    Raises:
        InvalidInputError: For text, floats, bools or a count other than ``n_samples``.
    """
    expected = f"labels must be integer class indices, one per sample ({n_samples})"
    try:
        tensor = torch.as_tensor(labels)
    except (TypeError, ValueError, RuntimeError):
        raise InvalidInputError(
            f"{expected}; got {type(labels).__name__} holding {_first(labels)!r}. Map class "
            "names to their indices first"
        ) from None
    if not_integral(tensor.dtype):
        raise InvalidInputError(
            f"{expected}; got dtype {tensor.dtype}. Pass the class index of each sample, not "
            "scores or probabilities (labels.long() if they are whole numbers)"
        )
    tensor = tensor.detach().cpu().reshape(-1).long()
    if tensor.shape[0] != n_samples:
        raise InvalidInputError(f"{expected}; got {tensor.shape[0]} labels")
    return tensor


def _first(values: Any) -> Any:
    """The first element of ``values`` (for messages), or ``values`` itself."""
    if isinstance(values, (str, bytes)):
        return values
    try:
        return next(iter(values))
    except (TypeError, StopIteration):
        return values


def dataset_parse_tree(
    data: ParseTreeData,
    *,
    roots: Sequence[int] | None = None,
    threshold: Threshold = None,
    keep_all_nodes: bool = False,
    title: str | None = None,
) -> Any:
    """The parse tree of the whole data set: the mean over all samples.

    Backtracked from ``roots``, by default every class predicted for at least one sample.
    """
    stack = data.mean()
    if roots is None:
        roots = sorted({int(c) for c in data.predicted.tolist()})
    return build_parse_tree(
        stack.couplings,
        stack.activations,
        roots,
        threshold=threshold,
        class_names=data.class_names,
        keep_all_nodes=keep_all_nodes,
        levels=data.levels,
        parents=data.parents,
        mode="dataset",
        n_samples=stack.n_samples,
        title=title,
    )


def parse_tree(
    data: Any,
    *,
    sample: int | None = None,
    cls: int | None = None,
    threshold: Threshold = None,
    keep_all_nodes: bool = False,
    title: str | None = None,
) -> Any:
    """One entry point for the three modes: ``sample=``, ``cls=`` or neither (whole data set).

    ``data`` is a :class:`ParseTreeData` or a capsule recording (see
    :meth:`ParseTreeData.from_recording`). ``sample`` and ``cls`` are integers (ints, NumPy
    integers or 0-d integer tensors); ``threshold`` is a number (Python, NumPy or a 0-d tensor),
    one per routing layer, or ``None`` for the uniform couplings (:func:`default_thresholds`).

    Raises:
        InvalidInputError: If both ``sample`` and ``cls`` are given, or one is not an integer.
    """
    data = ParseTreeData.from_recording(data)
    options = {"threshold": threshold, "keep_all_nodes": keep_all_nodes, "title": title}
    if sample is not None and cls is not None:
        raise InvalidInputError("give sample= or cls=, not both")
    if sample is not None:
        return sample_parse_tree(data, sample, **options)
    if cls is not None:
        return class_parse_tree(data, cls, **options)
    return dataset_parse_tree(data, **options)
