"""Pictures of inputs and attributions as RGB arrays (NumPy) and PNG files (Pillow, ``plots``).

The colours of :mod:`explain_core.plots` without matplotlib. Figures with colour bars, titles and
labels — what people read — are drawn by :mod:`explain_core.plots` (``heatmap``, ``overlay``,
``grid``).
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from explain_core.extras import require

__all__ = [
    "ArrayLike",
    "attribution_to_rgb",
    "image_to_rgb",
    "save_grid",
    "save_tokens",
    "tokens_to_html",
]

ArrayLike = np.ndarray | torch.Tensor


def _to_numpy(values: ArrayLike) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        return values.detach().cpu().double().numpy()
    return np.asarray(values, dtype=np.float64)


def attribution_to_rgb(attribution: ArrayLike, percentile: float = 99.75) -> np.ndarray:
    """Colour a 2-D map: positive red, negative blue, zero white, on a symmetric scale.

    The scale is ``(−v, v)`` with ``v`` the given percentile of ``|attribution|``, as in the
    CoDA-Nets paper; values beyond it saturate.

    Args:
        attribution: ``(H, W)`` map (sum channels first for image attributions).
        percentile: Percentile of the absolute values that maps to full colour.

    Returns:
        ``(H, W, 3)`` uint8 image.

    Raises:
        ValueError: If the map is not 2-D or not finite.
    """
    values = _to_numpy(attribution)
    if values.ndim != 2:
        raise ValueError(f"expected a 2-D (H, W) map; got shape {values.shape}")
    if not np.isfinite(values).all():
        raise ValueError("the attribution map contains NaN or infinite values")
    scale = np.percentile(np.abs(values), percentile)
    normalised = np.clip(values / scale, -1.0, 1.0) if scale > 0 else np.zeros_like(values)
    positive, negative = np.clip(normalised, 0, 1), np.clip(-normalised, 0, 1)
    rgb = np.stack(
        [1.0 - negative, 1.0 - positive - negative, 1.0 - positive], axis=-1
    )  # white → red for positive, white → blue for negative
    return (np.clip(rgb, 0, 1) * 255).round().astype(np.uint8)


def patch_relevance(attribution: ArrayLike, patch_size: int) -> np.ndarray:
    """The relevance of each patch (a ViT's tokens), ``(H / p, W / p)``.

    A ``(C, H, W)`` or ``(H, W)`` map summed over channels and each ``p × p`` patch.

    Raises:
        ValueError: If the map's height or width is not a multiple of ``patch_size``.
    """
    values = _to_numpy(attribution)
    if values.ndim == 3:
        values = values.sum(axis=0)
    if values.ndim != 2 or patch_size < 1:
        raise ValueError(f"expected a (C, H, W) or (H, W) map; got shape {values.shape}")
    height, width = values.shape
    if height % patch_size or width % patch_size:
        raise ValueError(
            f"a {height}×{width} map does not divide into {patch_size}×{patch_size} patches"
        )
    rows, cols = height // patch_size, width // patch_size
    return values.reshape(rows, patch_size, cols, patch_size).sum(axis=(1, 3))


def image_to_rgb(image: ArrayLike) -> np.ndarray:
    """An input image ``(C, H, W)`` or ``(H, W)`` with values in [0, 1] as ``(H, W, 3)`` uint8."""
    values = _to_numpy(image)
    if values.ndim == 3:
        # One channel (or two, e.g. [x, 1 − x] encodings) shows as grey; three or more as RGB.
        values = values[0] if values.shape[0] < 3 else np.moveaxis(values[:3], 0, -1)
    if values.ndim == 2:
        values = np.repeat(values[..., None], 3, axis=-1)
    return (np.clip(values, 0, 1) * 255).round().astype(np.uint8)


def save_grid(
    rows: Sequence[Sequence[np.ndarray]],
    path: str | Path,
    *,
    scale: int = 8,
    row_titles: Sequence[str] | None = None,
    column_titles: Sequence[str] | None = None,
) -> Path:
    """Save RGB tiles as one PNG, enlarged with nearest-neighbour so pixels stay visible.

    Bare tiles with Pillow only; :func:`explain_core.plots.grid` draws the same with colour bars,
    row titles and each sample's labels.

    Args:
        rows: Rows of ``(H, W, 3)`` uint8 tiles, all of one size.
        path: Output PNG path.
        scale: Enlargement factor per tile.
        row_titles: Optional text left of each row.
        column_titles: Optional text above each column.

    Returns:
        The path written.
    """
    Image = require("PIL.Image", "saving pictures")  # noqa: N806
    ImageDraw = require("PIL.ImageDraw", "saving pictures")  # noqa: N806
    tile_h, tile_w = rows[0][0].shape[:2]
    size = (tile_w * scale, tile_h * scale)
    gap, font = 4, require("PIL.ImageFont", "saving pictures").load_default()
    left = 8 + 7 * max((len(t) for t in row_titles or ()), default=0)
    top = 16 if column_titles else 0
    n_cols = max(len(r) for r in rows)
    canvas = Image.new(
        "RGB",
        (left + n_cols * (size[0] + gap), top + len(rows) * (size[1] + gap)),
        "white",
    )
    draw = ImageDraw.Draw(canvas)
    for c, title in enumerate(column_titles or ()):
        draw.text((left + c * (size[0] + gap), 2), title, fill="black", font=font)
    for r, row in enumerate(rows):
        y = top + r * (size[1] + gap)
        if row_titles:
            draw.text((4, y + size[1] // 2 - 5), row_titles[r], fill="black", font=font)
        for c, tile in enumerate(row):
            picture = Image.fromarray(tile).resize(size, Image.Resampling.NEAREST)
            canvas.paste(picture, (left + c * (size[0] + gap), y))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(path)
    return path


def _token_colours(tokens: Sequence[str], relevance: ArrayLike) -> list[tuple[int, int, int]]:
    values = _to_numpy(relevance)
    if values.ndim != 1 or len(values) != len(tokens):
        raise ValueError(
            f"expected one relevance value per token ({len(tokens)}); got shape {values.shape}"
        )
    rgb = attribution_to_rgb(values[None], percentile=100.0)[0]  # scale: the largest |value|
    return [tuple(int(c) for c in colour) for colour in rgb]


def tokens_to_html(tokens: Sequence[str], relevance: ArrayLike) -> str:
    r"""The tokens as HTML, each on its relevance's colour (red positive, blue negative).

    The scale is symmetric, ``(−v, v)`` with ``v`` the largest ``|relevance|``; every token shows
    its value when hovered.

    Args:
        tokens: The tokens of one sample (e.g. ``TokenAttribution.tokens[0]``).
        relevance: One value per token (e.g. ``TokenAttribution.relevance[0]``).

    Returns:
        An HTML fragment (a ``<div>`` of ``<span>``\ s), text escaped.

    Raises:
        ValueError: If the lengths differ or a value is not finite.
    """
    values = _to_numpy(relevance)
    spans = [
        f'<span style="background: rgb{colour}; padding: 1px 2px" '
        f'title="{value:.4g}">{html.escape(token)}</span>'
        for token, value, colour in zip(tokens, values, _token_colours(tokens, values), strict=True)
    ]
    return '<div style="font-family: monospace; line-height: 1.8">' + " ".join(spans) + "</div>"


def save_tokens(tokens: Sequence[str], relevance: ArrayLike, path: str | Path) -> Path:
    """Save the coloured tokens as ``.html`` (a page) or ``.png`` (Pillow, the ``plots`` extra).

    Returns:
        The path written.

    Raises:
        ValueError: For another suffix, or as :func:`tokens_to_html`.
    """
    path = Path(path)
    if path.suffix not in (".html", ".png"):
        raise ValueError(f"save tokens as .html or .png; got {path.name!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".html":
        body = tokens_to_html(tokens, relevance)
        path.write_text(f'<!doctype html><meta charset="utf-8">\n{body}\n', encoding="utf-8")
        return path
    Image = require("PIL.Image", "saving pictures")  # noqa: N806
    ImageDraw = require("PIL.ImageDraw", "saving pictures")  # noqa: N806
    font = require("PIL.ImageFont", "saving pictures").load_default()
    colours = _token_colours(tokens, relevance)
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    widths = [int(measure.textlength(token, font=font)) + 6 for token in tokens]
    width, line_height = 600, 18
    lines: list[list[tuple[int, int]]] = [[]]  # per line: (token index, left edge)
    left = 4
    for index, token_width in enumerate(widths):  # wrap at the picture's width
        if left + token_width > width and lines[-1]:
            lines.append([])
            left = 4
        lines[-1].append((index, left))
        left += token_width + 2
    canvas = Image.new("RGB", (width, 8 + line_height * len(lines)), "white")
    draw = ImageDraw.Draw(canvas)
    for row, line in enumerate(lines):
        top = 4 + line_height * row
        for index, left in line:
            box = (left, top, left + widths[index], top + line_height - 3)
            draw.rectangle(box, fill=colours[index])
            draw.text((left + 3, top + 2), tokens[index], fill="black", font=font)
    canvas.save(path)
    return path
