"""Pictures of inputs and attributions as RGB arrays (NumPy) and PNG files (Pillow, ``plots``)."""

from __future__ import annotations

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
