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
  for the class layer. Any float, or one per routing layer, can be given instead.
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

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from explain_core.errors import InvalidInputError
from explain_core.parse_trees._deps import require_networkx
from explain_core.parse_trees.data import LayerStack, ParseTreeData

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


def default_thresholds(sizes: Sequence[int]) -> list[float]:
    """``1/|Ω^[l+1]|`` for every routing layer ``l``: one over its number of parent capsules."""
    return [1.0 / int(n) for n in sizes[1:]]


def resolve_thresholds(threshold: Threshold, sizes: Sequence[int]) -> list[float]:
    """One threshold per routing layer from ``None`` (default), a float, or a sequence.

    Raises:
        InvalidInputError: On a wrong count or a non-finite value.
    """
    routing_layers = len(sizes) - 1
    if threshold is None:
        return default_thresholds(sizes)
    if isinstance(threshold, (int, float)) and not isinstance(threshold, bool):
        values = [float(threshold)] * routing_layers
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
    **graph_attributes: Any,
) -> Any:
    """Build one parse tree from the couplings and activations of one sample (or a mean).

    Args:
        couplings: ``L-1`` matrices ``(|Ω^l|, |Ω^{l+1}|)``: ``couplings[l-1][i, j] = c_ij^[l]``.
        activations: ``L`` vectors ``(|Ω^l|,)`` of capsule lengths ``‖u‖``.
        roots: Class capsules (indices in layer ``L``) to backtrack from.
        threshold: Keep edges with a coupling strictly above this: ``None`` for
            ``1/|Ω^[l+1]|`` per routing layer, a float for all, or one per routing layer.
        class_names: Names of the last layer's capsules (default: their indices).
        keep_all_nodes: Also add the capsules outside the tree (``in_tree=False``, no edges),
            so that pictures of different trees share one layout.
        backtrack: ``False`` keeps every thresholded edge that passes the in-degree rule, from
            all capsules, not only those below the roots.
        **graph_attributes: Stored on the graph (e.g. ``mode``, ``title``).

    Returns:
        A ``networkx.DiGraph`` (see the module docstring for its attributes).

    Raises:
        InvalidInputError: If the shapes do not chain or a root is out of range.
        MissingDependencyError: If networkx is not installed.
    """
    nx = require_networkx()
    stack = _stack(couplings, activations)
    sizes = stack.sizes
    n_layers = len(sizes)
    classes = sizes[-1]
    roots = sorted({int(r) for r in roots})
    if not roots:
        raise InvalidInputError("a parse tree needs at least one class to backtrack from")
    if roots[0] < 0 or roots[-1] >= classes:
        raise InvalidInputError(f"classes to backtrack from must lie in [0, {classes - 1}]")
    if class_names is not None and len(class_names) != classes:
        raise InvalidInputError(f"{len(class_names)} class names given for {classes} classes")
    thresholds = resolve_thresholds(threshold, sizes)
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
    """The parse tree of one sample, backtracked from its predicted class (or ``target``)."""
    stack = data.sample(index)
    root = int(data.predicted[index]) if target is None else int(target)
    return build_parse_tree(
        stack.couplings,
        stack.activations,
        [root],
        threshold=threshold,
        class_names=data.class_names,
        keep_all_nodes=keep_all_nodes,
        mode="sample",
        sample=int(index) % data.n_samples,
        predicted=int(data.predicted[index]),
        levels=data.levels,
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
        cls: The class.
        labels: ``(N,)`` labels selecting the samples to average; default: the predictions.
        threshold: See :func:`build_parse_tree`.
        keep_all_nodes: See :func:`build_parse_tree`.
        title: Stored as the graph's ``title``.

    Raises:
        InvalidInputError: If no sample belongs to the class.
    """
    chosen = data.predicted if labels is None else torch.as_tensor(labels).reshape(-1).cpu()
    mask = chosen == int(cls)
    if not bool(mask.any()):
        present = sorted({int(c) for c in chosen.tolist()})
        how = "predicted as" if labels is None else "labelled"
        raise InvalidInputError(f"no sample is {how} class {cls}; classes present: {present}")
    stack = data.mean(mask)
    return build_parse_tree(
        stack.couplings,
        stack.activations,
        [int(cls)],
        threshold=threshold,
        class_names=data.class_names,
        keep_all_nodes=keep_all_nodes,
        mode="class",
        class_index=int(cls),
        n_samples=stack.n_samples,
        levels=data.levels,
        title=title,
    )


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
        mode="dataset",
        n_samples=stack.n_samples,
        levels=data.levels,
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

    ``data`` is a :class:`ParseTreeData` or a recording shaped like
    ``explain_capsules.CapsuleRecording``.

    Raises:
        InvalidInputError: If both ``sample`` and ``cls`` are given.
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
