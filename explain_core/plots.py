"""Figures of attributions, in one style: red positive, blue negative, on a stated symmetric scale.

Four functions draw, one writes:

- :func:`heatmap`: one map with a colour bar.
- :func:`overlay`: one map over its input, with a colour bar.
- :func:`grid`: methods × samples (rows × columns), the inputs on top, every sample titled with
  its true and predicted label (wrong predictions in red, marked ✗).
- :func:`curves`: line plots side by side, one panel per curve family (e.g. deletion and
  insertion curves per method).
- :func:`save_figure`: writes a figure (PNG, or any format matplotlib knows).

Every drawing function returns a :class:`matplotlib.figure.Figure`. Maps are ``(C, H, W)`` or
``(H, W)`` NumPy arrays or torch tensors; a ``(C, H, W)`` map is summed over its channels (a
pixel's relevance is the sum over its channels, as conservation counts it). Colours are symmetric
around 0, ``(−v, v)`` with ``v`` the ``percentile`` of ``|map|`` (99.75 by default, as in the
CoDA-Nets paper; 100 takes the largest ``|value|``): white is 0, full red ``+v``, full blue
``−v``, and values beyond saturate. The colour bar's label states ``v`` and how it was chosen.

Figures are built with matplotlib's object-oriented API (``matplotlib.figure.Figure``), never
through ``pyplot``: drawing changes no global state (backend, open figures) and no figure needs
closing. matplotlib (the ``plots`` extra) is imported when a figure is drawn, never on
``import explain_core``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Literal

import numpy as np
import torch

from explain_core.errors import InvalidInputError
from explain_core.extras import require
from explain_core.viz import patch_relevance

__all__ = [
    "curves",
    "grid",
    "heatmap",
    "overlay",
    "save_attribution_figure",
    "save_figure",
    "save_overlay",
]

ArrayLike = np.ndarray | torch.Tensor
Rows = Mapping[str, Any] | Sequence[tuple[str, Any]]
Scale = Literal["map", "row", "column", "all"]

COLOUR_MAP = "bwr"  # blue (−v) → white (0) → red (+v), linear: viz.attribution_to_rgb's colours
WRONG = "#c00000"  # the colour of a wrong prediction's title and frame
OUTLINE = "#00c000"  # masks (ground-truth regions) on the inputs
SCALES = ("map", "row", "column", "all")


def _figure(width: float, height: float) -> Any:
    figure_module = require("matplotlib.figure", "drawing figures")
    return figure_module.Figure(figsize=(width, height), layout="constrained")


def _as_array(values: Any, what: str) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().double().numpy()
    try:
        array = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as error:
        raise InvalidInputError(
            f"{what} must be a NumPy array or a torch tensor of numbers; got "
            f"{type(values).__name__}"
        ) from error
    if not np.isfinite(array).all():
        raise InvalidInputError(f"{what} contains NaN or infinite values; nothing to draw")
    return array


def _map_2d(attribution: Any, what: str = "the map", patch_size: int | None = None) -> np.ndarray:
    """``attribution`` as one ``(H, W)`` map: channels summed, per patch with ``patch_size``.

    A ``(F,)`` vector becomes one row ``(1, F)``.
    """
    values = _as_array(attribution, what)
    if values.ndim == 1:
        values = values[None]
    if values.ndim not in (2, 3) or values.size == 0:
        raise InvalidInputError(
            f"{what} must be one map (C, H, W) or (H, W); got shape {values.shape} (for a "
            "batch, draw one sample at a time, e.g. attribution[0], or use grid())"
        )
    if patch_size is not None:
        try:
            return patch_relevance(values, patch_size)
        except ValueError as error:
            raise InvalidInputError(f"{what}: {error}") from error
    return values.sum(axis=0) if values.ndim == 3 else values


def _picture(image: Any, what: str = "the input") -> np.ndarray:
    """An input as shown: ``(H, W)`` grey or ``(H, W, 3)`` RGB, values in [0, 1].

    One or two channels (e.g. the ``[x, 1 − x]`` encoding) show the first channel; three or more
    the first three as RGB. Values already in [0, 1] are kept, uint8 values divided by 255, and
    anything else (a normalised input) is stretched from its minimum to its maximum.
    """
    raw = image.detach().cpu() if isinstance(image, torch.Tensor) else image
    is_bytes = getattr(raw, "dtype", None) in (np.uint8, torch.uint8)
    values = _as_array(raw, what)
    if values.ndim == 3:
        values = values[0] if values.shape[0] < 3 else np.moveaxis(values[:3], 0, -1)
    elif values.ndim != 2:
        values = values[None]  # refused below
    if values.ndim not in (2, 3) or values.size == 0:
        raise InvalidInputError(
            f"{what} must be an image (C, H, W) or (H, W); got shape {np.shape(raw)}"
        )
    if is_bytes:
        return values / 255.0
    low, high = float(values.min()), float(values.max())
    if low >= 0.0 and high <= 1.0:
        return values
    return (values - low) / (high - low) if high > low else np.zeros_like(values)


def _grey(picture: np.ndarray) -> np.ndarray:
    """A shown picture in grey (the mean of R, G and B), so the map's colours stand out."""
    return picture.mean(axis=-1) if picture.ndim == 3 else picture


def _scale(values: np.ndarray, percentile: float) -> float:
    """The symmetric scale's ``v``: the percentile of ``|values|`` (1 for an all-zero map)."""
    magnitude = np.abs(values)
    v = float(np.percentile(magnitude, percentile))
    return v or float(magnitude.max()) or 1.0


def _check_percentile(percentile: float) -> None:
    if not 0 < percentile <= 100:
        raise InvalidInputError(
            f"percentile must be in (0, 100] (100: the largest |value| is full colour); got "
            f"{percentile!r}"
        )


def _which(percentile: float, whose: str = "|R|") -> str:
    return f"max {whose}" if percentile == 100 else f"{percentile:g}th percentile of {whose}"


def _scale_label(v: float, percentile: float, patch_size: int | None = None) -> str:
    what = f"relevance per {patch_size}×{patch_size} patch" if patch_size else "relevance"
    return f"{what}, symmetric scale\n±{v:.3g} = {_which(percentile)}"


def _single(figure: Any, axis: Any, shown: Any, title: str | None, scale: str | None) -> Any:
    """Finish a one-picture figure: no ticks, the title, the colour bar labelled ``scale``."""
    _bare(axis)
    if title:
        axis.set_title(title, fontsize=10)
    if scale is not None:
        _colour_bar(figure, shown, axis, scale)
    return figure


def _bare(axis: Any) -> None:
    axis.set_xticks([])
    axis.set_yticks([])


def heatmap(
    attribution: ArrayLike,
    *,
    ax: Any = None,
    patch_size: int | None = None,
    percentile: float = 99.75,
    title: str | None = None,
    colorbar: bool = True,
) -> Any:
    """One map, red positive and blue negative, with a colour bar stating its symmetric scale.

    Args:
        attribution: ``(C, H, W)`` (summed over channels), ``(H, W)``, or ``(F,)`` (one row).
        ax: A matplotlib ``Axes`` to draw into (default: a new figure).
        patch_size: Sum each ``p × p`` patch first (a ViT's tokens).
        percentile: Percentile of ``|map|`` that is full colour (100: the largest).
        title: Optional title.
        colorbar: Whether to add the colour bar.

    Returns:
        The ``Figure`` drawn on (``ax.figure`` when ``ax`` is given).

    Raises:
        InvalidInputError: For a map of another shape, non-finite values or a bad percentile.
    """
    _check_percentile(percentile)
    heat = _map_2d(attribution, patch_size=patch_size)
    v = _scale(heat, percentile)
    figure, axis = _target(ax, heat.shape)
    shown = axis.imshow(heat, cmap=COLOUR_MAP, vmin=-v, vmax=v, interpolation="nearest")
    scale = _scale_label(v, percentile, patch_size) if colorbar else None
    return _single(figure, axis, shown, title, scale)


def overlay(
    image: ArrayLike,
    attribution: ArrayLike,
    *,
    ax: Any = None,
    patch_size: int | None = None,
    percentile: float = 99.75,
    alpha: float = 0.75,
    title: str | None = None,
    colorbar: bool = True,
) -> Any:
    """The map laid over its input, with a colour bar stating the symmetric scale.

    The input shows in grey (see the module's notes on channels and value ranges); the map's
    colour is laid over it with an opacity growing with ``|value|``: ``alpha`` at ``±v``,
    transparent at 0, so the input shows where the map is near 0. A coarser map (per patch, or
    with ``patch_size``) is stretched over the image; its size must divide the image's.

    Args:
        image: The input ``(C, H, W)`` or ``(H, W)``, as the model saw it or before
            normalisation (both show alike: see the module's notes).
        attribution: Its map ``(C, H, W)`` (summed over channels) or ``(H, W)``.
        ax: A matplotlib ``Axes`` to draw into (default: a new figure).
        patch_size: Colour each ``p × p`` patch by its summed relevance (a ViT's tokens).
        percentile: Percentile of ``|map|`` that is full colour (100: the largest).
        alpha: Opacity of the map's colour at ``±v``, in (0, 1].
        title: Optional title.
        colorbar: Whether to add the colour bar.

    Returns:
        The ``Figure`` drawn on (``ax.figure`` when ``ax`` is given).

    Raises:
        InvalidInputError: For shapes that do not fit, non-finite values or bad settings.
    """
    _check_percentile(percentile)
    if not 0 < alpha <= 1:
        raise InvalidInputError(f"alpha must be in (0, 1]; got {alpha!r}")
    grey = _grey(_picture(image))
    heat = _map_2d(attribution, patch_size=patch_size)
    height, width = grey.shape
    if height % heat.shape[0] or width % heat.shape[1]:
        raise InvalidInputError(
            f"a {heat.shape[0]}×{heat.shape[1]} map does not fit a {height}×{width} image: its "
            "height and width must divide the image's (give the map of this input)"
        )
    v = _scale(heat, percentile)
    figure, axis = _target(ax, grey.shape)
    axis.imshow(grey, cmap="gray", vmin=0.0, vmax=1.0, interpolation="nearest")
    shown = axis.imshow(
        heat,
        cmap=COLOUR_MAP,
        vmin=-v,
        vmax=v,
        alpha=alpha * np.clip(np.abs(heat) / v, 0.0, 1.0),
        interpolation="nearest",
        extent=(-0.5, width - 0.5, height - 0.5, -0.5),
    )
    scale = _scale_label(v, percentile, patch_size) if colorbar else None
    return _single(figure, axis, shown, title, scale)


def _target(ax: Any, shape: tuple[int, ...]) -> tuple[Any, Any]:
    """The figure and axes to draw one picture of ``shape`` on."""
    if ax is not None:
        return ax.figure, ax
    height, width = shape
    side, aspect = 3.6, min(max(width / height, 0.25), 4.0)
    figure = _figure(side * min(aspect, 1.0) + 1.5, side / max(aspect, 1.0) + 0.6)
    return figure, figure.add_subplot()


def _colour_bar(
    figure: Any, shown: Any, place: Any, label: str, orientation: str = "vertical"
) -> Any:
    """A colour bar for ``shown``: beside the axes ``place``, or in the grid cell ``place``."""
    if hasattr(place, "imshow"):  # an Axes: the bar takes its room from it
        bar = figure.colorbar(shown, ax=place, orientation=orientation)
    else:
        bar = figure.colorbar(shown, cax=figure.add_subplot(place), orientation=orientation)
    bar.set_label(label, fontsize=8)
    bar.ax.tick_params(labelsize=8)
    return bar


def _samples(values: Any, what: str) -> list[Any]:
    """A row's maps (or the inputs) as a list: an array's first axis, or a sequence's items."""
    if isinstance(values, torch.Tensor | np.ndarray):
        if values.ndim < 2:
            raise InvalidInputError(
                f"{what} must be a batch (N, ...) or a list of maps; got shape "
                f"{tuple(values.shape)}"
            )
        return list(values)
    if isinstance(values, str) or not isinstance(values, Sequence):
        raise InvalidInputError(
            f"{what} must be a batch (N, ...) or a list of maps; got {type(values).__name__}"
        )
    return list(values)


def _class_name(label: Any, class_names: Any) -> str:
    index = int(label)
    if class_names is None:
        return str(index)
    try:
        return str(class_names[index])
    except (IndexError, KeyError):
        return str(index)


def _column_titles(
    count: int,
    column_titles: Sequence[str] | None,
    labels: Any,
    predictions: Any,
    class_names: Any,
) -> tuple[list[str], list[bool]]:
    """Each column's title and whether its prediction is wrong."""
    given = {}
    for name, values in (
        ("column_titles", column_titles),
        ("labels", labels),
        ("predictions", predictions),
    ):
        if values is None:
            continue
        items = list(values)
        if len(items) != count:
            raise InvalidInputError(f"grid has {count} samples but {len(items)} {name}")
        given[name] = items
    titles, wrong = [], []
    for c in range(count):
        lines = [str(given["column_titles"][c])] if "column_titles" in given else []
        true = given.get("labels", [None] * count)[c]
        guess = given.get("predictions", [None] * count)[c]
        is_wrong = true is not None and guess is not None and int(true) != int(guess)
        if true is not None and guess is not None:
            lines.append(
                f"true {_class_name(true, class_names)}, pred {_class_name(guess, class_names)}"
                + (" ✗" if is_wrong else "")
            )
        elif true is not None:
            lines.append(f"label {_class_name(true, class_names)}")
        elif guess is not None:
            lines.append(f"pred {_class_name(guess, class_names)}")
        titles.append("\n".join(lines))
        wrong.append(is_wrong)
    return titles, wrong


def grid(
    maps: Rows = (),
    *,
    inputs: ArrayLike | Sequence[ArrayLike] | None = None,
    labels: Sequence[int] | ArrayLike | None = None,
    predictions: Sequence[int] | ArrayLike | None = None,
    class_names: Sequence[str] | Mapping[int, str] | None = None,
    masks: Sequence[ArrayLike | None] | ArrayLike | None = None,
    column_titles: Sequence[str] | None = None,
    scale: Scale = "map",
    percentile: float = 99.75,
    title: str | None = None,
    tile: float = 1.5,
) -> Any:
    """Methods × samples: one row per method (or class), one column per sample.

    The inputs form the first row. Every column is titled with its sample's true and predicted
    label (``true 3, pred 5 ✗``); a wrong prediction's title is red and its top tile framed in
    red. Row titles are the keys of ``maps``.

    ``scale`` chooses what shares a symmetric scale ``(−v, v)`` (``v`` the ``percentile`` of
    ``|map|`` over what shares it) and where its colour bar goes: ``"map"`` (each map its own;
    one colour bar in units of each map's ``v``), ``"row"`` (one scale and colour bar per row:
    methods compared across samples), ``"column"`` (one per column, below it: the maps of one
    sample compared, e.g. per class) or ``"all"`` (one for the figure).

    Args:
        maps: ``{row title: maps}`` (or ``(row title, maps)`` pairs); a row's maps are a batch
            ``(N, C, H, W)`` / ``(N, H, W)`` or a list of ``(C, H, W)`` / ``(H, W)`` maps
            (channels summed), one per sample.
        inputs: The samples ``(N, C, H, W)`` or a list of ``(C, H, W)`` / ``(H, W)`` images.
        labels: The true label of each sample.
        predictions: The model's prediction for each sample.
        class_names: Names of the labels (a list, or a mapping from label to name).
        masks: Per input, a region (``(H, W)``, true inside) outlined in green, or ``None``.
        column_titles: Optional first title line per column.
        scale: ``"map"``, ``"row"``, ``"column"`` or ``"all"`` (above).
        percentile: Percentile of ``|map|`` that is full colour (100: the largest).
        title: Optional figure title.
        tile: Size of each picture, in inches.

    Returns:
        The ``Figure``.

    Raises:
        InvalidInputError: If the rows, inputs, labels or masks disagree on the number of samples,
            a map or image has a bad shape or non-finite values, or a setting is unknown.
    """
    _check_percentile(percentile)
    if scale not in SCALES:
        raise InvalidInputError(f"scale must be one of {', '.join(SCALES)}; got {scale!r}")
    pairs = list(maps.items()) if isinstance(maps, Mapping) else list(maps)
    rows = []
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise InvalidInputError(
                "grid's maps must be {row title: maps} or (row title, maps) pairs"
            )
        name, values = pair
        rows.append(
            (
                str(name),
                [
                    _map_2d(m, f"map {i} of row {name!r}")
                    for i, m in enumerate(_samples(values, f"row {name!r}"))
                ],
            )
        )
    pictures = (
        [_picture(x, f"input {i}") for i, x in enumerate(_samples(inputs, "inputs"))]
        if inputs is not None
        else None
    )
    counts = {len(row) for _, row in rows} | ({len(pictures)} if pictures is not None else set())
    if not counts:
        raise InvalidInputError("grid needs maps or inputs to draw")
    if len(counts) > 1 or 0 in counts:
        found = [f"{name!r}: {len(row)}" for name, row in rows]
        if pictures is not None:
            found.insert(0, f"inputs: {len(pictures)}")
        raise InvalidInputError(
            "every row of the grid needs one picture per sample; got " + ", ".join(found)
        )
    (count,) = counts
    titles, wrong = _column_titles(count, column_titles, labels, predictions, class_names)
    outlines = _masks(masks, pictures, count)

    n_rows = len(rows) + (pictures is not None)
    # Colour bars get their own narrow column (or, per column, a row below): placed by the grid
    # rather than taken from the tiles, so the tiles stay equal and the row titles in view.
    bar_column, bar_row = bool(rows) and scale != "column", bool(rows) and scale == "column"
    extra = 0.2 * max((t.count("\n") + 1 for t in titles), default=0) + (0.4 if title else 0)
    left = 0.08 * max((len(name) for name, _ in rows), default=5)
    figure = _figure(
        left + tile * count + (1.0 if bar_column else 0.2),
        tile * n_rows + extra + (0.8 if bar_row else 0.0) + (0.3 if rows else 0.0),
    )
    spec = figure.add_gridspec(
        n_rows + bar_row,
        count + bar_column,
        width_ratios=[1.0] * count + [0.06] * bar_column,
        height_ratios=[1.0] * n_rows + [0.06] * bar_row,
    )
    axes = np.array([[figure.add_subplot(spec[r, c]) for c in range(count)] for r in range(n_rows)])
    for axis in axes.flat:
        _bare(axis)
    first = 0
    if pictures is not None:
        for c, picture in enumerate(pictures):
            axes[0][c].imshow(
                picture,
                cmap="gray" if picture.ndim == 2 else None,
                vmin=0.0,
                vmax=1.0,
                interpolation="nearest",
            )
            if outlines[c] is not None:
                axes[0][c].add_collection(_outline(outlines[c]))
        if rows:
            axes[0][0].set_ylabel("input", rotation=0, ha="right", va="center", fontsize=9)
        first = 1
    if rows:
        _draw_maps(figure, spec, first, axes[first:], rows, scale, percentile)
    for c, (text, is_wrong) in enumerate(zip(titles, wrong, strict=True)):
        top = axes[0][c]
        if text:
            top.set_title(text, fontsize=9, color=WRONG if is_wrong else "black")
        if is_wrong:
            for spine in top.spines.values():
                spine.set_edgecolor(WRONG)
                spine.set_linewidth(2.5)
    if title:
        figure.suptitle(title, fontsize=11)
    return figure


def _outline(mask: np.ndarray) -> Any:
    """The edges between a mask's pixels and the others (or the border), as green lines."""
    collections = require("matplotlib.collections", "drawing figures")
    padded = np.pad(mask > 0, 1)
    # Padded index i is pixel i − 1, whose edges lie at i − 1.5 and i − 0.5.
    rows, columns = np.nonzero(padded[:, 1:] != padded[:, :-1])  # an edge at x = column − 0.5
    segments = [
        [(c - 0.5, r - 1.5), (c - 0.5, r - 0.5)] for r, c in zip(rows, columns, strict=True)
    ]
    rows, columns = np.nonzero(padded[1:] != padded[:-1])  # an edge at y = row − 0.5
    segments += [
        [(c - 1.5, r - 0.5), (c - 0.5, r - 0.5)] for r, c in zip(rows, columns, strict=True)
    ]
    return collections.LineCollection(segments, colors=OUTLINE, linewidths=2.0)


def _masks(masks: Any, pictures: list[np.ndarray] | None, count: int) -> list[Any]:
    if masks is None:
        return [None] * count
    if pictures is None:
        raise InvalidInputError("masks are outlined on the inputs: give inputs too")
    items = list(masks)
    if len(items) != count:
        raise InvalidInputError(f"grid has {count} samples but {len(items)} masks")
    outlines = []
    for i, (mask, picture) in enumerate(zip(items, pictures, strict=True)):
        if mask is None:
            outlines.append(None)
            continue
        region = _as_array(mask, f"mask {i}")
        if region.shape != picture.shape[:2]:
            raise InvalidInputError(
                f"mask {i} has shape {region.shape} but its input is {picture.shape[:2]}"
            )
        outlines.append(region > 0)
    return outlines


def _draw_maps(
    figure: Any,
    spec: Any,
    first: int,
    axes: Any,
    rows: list[tuple[str, list[np.ndarray]]],
    scale: str,
    percentile: float,
) -> None:
    """Draw the map rows (from grid row ``first`` of ``spec``) with their scales and bars."""
    n_cols = len(rows[0][1])

    def pooled(maps: list[np.ndarray]) -> float:
        return _scale(np.concatenate([m.ravel() for m in maps]), percentile)

    if scale == "map":
        scales = [[_scale(m, percentile) for m in row] for _, row in rows]
    elif scale == "row":
        scales = [[pooled(row)] * n_cols for _, row in rows]
    elif scale == "column":
        per_column = [pooled([row[c] for _, row in rows]) for c in range(n_cols)]
        scales = [per_column for _ in rows]
    else:
        everything = pooled([m for _, row in rows for m in row])
        scales = [[everything] * n_cols for _ in rows]
    shown = [[None] * n_cols for _ in rows]
    for r, (name, row) in enumerate(rows):
        for c, heat in enumerate(row):
            v = scales[r][c]
            values, limit = (heat / v, 1.0) if scale == "map" else (heat, v)
            shown[r][c] = axes[r][c].imshow(
                values, cmap=COLOUR_MAP, vmin=-limit, vmax=limit, interpolation="nearest"
            )
        axes[r][0].set_ylabel(name, rotation=0, ha="right", va="center", fontsize=9)
    last = first + len(rows)
    if scale == "map":
        bar = _colour_bar(figure, shown[0][0], spec[first:last, n_cols], "relevance ÷ v")
        bar.set_ticks([-1.0, 0.0, 1.0], labels=["−v", "0", "+v"])
        note = f"each map on its own symmetric scale ±v, v = {_which(percentile, 'its |R|')}"
    elif scale == "row":
        for r in range(len(rows)):
            _colour_bar(figure, shown[r][0], spec[first + r, n_cols], f"±{scales[r][0]:.3g}")
        note = f"one symmetric scale per row: ±v, v = {_which(percentile, 'the row’s |R|')}"
    elif scale == "column":
        for c in range(n_cols):
            bar = _colour_bar(
                figure, shown[-1][c], spec[last, c], f"±{scales[0][c]:.3g}", "horizontal"
            )
            bar.ax.tick_params(labelsize=7)
        note = f"one symmetric scale per column: ±v, v = {_which(percentile, 'the column’s |R|')}"
    else:
        _colour_bar(figure, shown[0][0], spec[first:last, n_cols], f"±{scales[0][0]:.3g}")
        note = f"one symmetric scale: ±v, v = {_which(percentile)}"
    figure.supxlabel(f"red +, blue −; {note}", fontsize=9)


def _line(values: Any, what: str) -> np.ndarray:
    """``values`` as a 1-D array of at least two finite numbers."""
    array = _as_array(values, what)
    if array.ndim != 1 or array.size < 2:
        raise InvalidInputError(
            f"{what} must be one line of at least two values; got shape {array.shape}"
        )
    return array


def curves(
    panels: Mapping[str, Mapping[str, tuple[Any, Any]]],
    *,
    xlabel: str = "",
    ylabel: str = "",
    title: str | None = None,
    note: str | None = None,
    ylim: tuple[float, float] | None = None,
    size: tuple[float, float] = (4.2, 3.2),
) -> Any:
    """Line plots side by side: one panel per family of curves, one line per name.

    The ``i``-th line of every panel has the same colour, so panels that list their lines in the
    same order match (e.g. a method's deletion and insertion curves), whatever their names.

    Args:
        panels: ``{panel title: {line name: (x, y)}}``, each ``x`` and ``y`` one line of
            numbers of equal length (arrays, tensors or sequences).
        xlabel: The x axis's label (shared by the panels).
        ylabel: The y axis's label (shared by the panels).
        title: Optional figure title.
        note: Optional line below the panels (what was averaged, over which samples…).
        ylim: Optional y limits shared by the panels.
        size: Width and height of each panel, in inches.

    Returns:
        The ``Figure``.

    Raises:
        InvalidInputError: If there is no panel or line, a line's ``x`` and ``y`` differ in
            length, or a value is not finite.
    """
    if not isinstance(panels, Mapping) or not panels:
        raise InvalidInputError("curves needs {panel title: {line name: (x, y)}}; got none")
    lines: dict[str, list[tuple[str, np.ndarray, np.ndarray]]] = {}
    for panel, named in panels.items():
        if not isinstance(named, Mapping) or not named:
            raise InvalidInputError(f"panel {panel!r} needs {{line name: (x, y)}}; got none")
        lines[str(panel)] = []
        for name, pair in named.items():
            if not (isinstance(pair, tuple | list) and len(pair) == 2):
                raise InvalidInputError(f"line {name!r} of panel {panel!r} must be an (x, y) pair")
            x = _line(pair[0], f"x of line {name!r} in panel {panel!r}")
            y = _line(pair[1], f"y of line {name!r} in panel {panel!r}")
            if x.shape != y.shape:
                raise InvalidInputError(
                    f"line {name!r} of panel {panel!r} has {x.size} x values but {y.size} y values"
                )
            lines[str(panel)].append((str(name), x, y))
    palette = require("matplotlib", "drawing figures").colormaps["tab10"]
    width, height = size
    figure = _figure(width * len(lines), height + (0.4 if title else 0) + (0.3 if note else 0))
    axes = figure.subplots(1, len(lines), squeeze=False)[0]
    for axis, (panel, named) in zip(axes, lines.items(), strict=True):
        for i, (name, x, y) in enumerate(named):
            # Dashes as well as colours: lines that coincide (equal methods) stay visible.
            style = ("-", "--", "-.", ":")[i % 4]
            axis.plot(x, y, color=palette(i % 10), linestyle=style, linewidth=1.6, label=name)
        axis.set_title(panel, fontsize=10)
        axis.set_xlabel(xlabel, fontsize=9)
        axis.tick_params(labelsize=8)
        axis.grid(alpha=0.3)
        if ylim is not None:
            axis.set_ylim(*ylim)
        axis.legend(fontsize=7, frameon=False)
    axes[0].set_ylabel(ylabel, fontsize=9)
    if title:
        figure.suptitle(title, fontsize=11)
    if note:
        figure.supxlabel(note, fontsize=9)
    return figure


def save_figure(
    figure: Any, path: str | Path | IO[bytes], *, dpi: int = 150, format: str | None = None
) -> Path | IO[bytes]:
    """Write ``figure`` to ``path`` (its folder created) or to an open binary file.

    Args:
        figure: A figure from :func:`heatmap`, :func:`overlay` or :func:`grid` (or any
            matplotlib figure).
        path: A file name (the format follows its suffix: ``.png``, ``.svg``, ``.pdf``…) or a
            binary file object (PNG unless ``format`` says otherwise).
        dpi: Resolution of raster formats.
        format: The format, overriding the suffix.

    Returns:
        The path (as a ``Path``) or the file object written.
    """
    if isinstance(path, str | Path):
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=dpi, format=format or (None if isinstance(path, Path) else "png"))
    return path


def save_overlay(
    image: ArrayLike, attribution: ArrayLike, path: str | Path, **options: Any
) -> Path:
    """Draw :func:`overlay` and write it: ``save_figure(overlay(image, attribution, ...), path)``.

    Args:
        image: The input, as for :func:`overlay`.
        attribution: Its map, as for :func:`overlay`.
        path: The file to write.
        **options: :func:`overlay`'s keyword arguments (``patch_size``, ``title``…).

    Returns:
        The path written.
    """
    return Path(save_figure(overlay(image, attribution, **options), path))


def save_attribution_figure(rows: Rows, path: str | Path, **options: Any) -> Path:
    """Draw :func:`grid` and write it: ``save_figure(grid(rows, ...), path)``.

    Args:
        rows: The map rows, as :func:`grid`'s ``maps``.
        path: The file to write.
        **options: :func:`grid`'s keyword arguments (``inputs``, ``labels``, ``predictions``…).

    Returns:
        The path written.
    """
    return Path(save_figure(grid(rows, **options), path))
