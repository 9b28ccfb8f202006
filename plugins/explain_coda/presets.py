"""The CoDA-Net architectures of the paper's Table C1 (and one for the bundled digits)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["DEFAULT_LOGIT_BIAS", "PRESETS", "LayerSpec"]

DEFAULT_LOGIT_BIAS = math.log(0.1 / 0.9)
"""b₀ of the reference code: a sigmoid output of 0.1 for a zero contribution sum."""


@dataclass(frozen=True)
class LayerSpec:
    """One convolutional DAU layer: ``out_channels`` DAUs of rank ``rank``."""

    out_channels: int
    rank: int
    kernel_size: int
    stride: int = 1


def _specs(rows: Sequence[tuple[int, int, int, int]]) -> tuple[LayerSpec, ...]:
    return tuple(LayerSpec(*row) for row in rows)


# Table C1 of the supplement: (DAUs, rank, kernel, stride) per layer, and the input shape.
PRESETS: dict[str, tuple[tuple[int, int, int], tuple[LayerSpec, ...]]] = {
    "S": ((6, 32, 32), _specs([
        (16, 32, 3, 1), (16, 32, 3, 1), (32, 64, 3, 2), (32, 64, 3, 1), (32, 64, 3, 1),
        (64, 64, 3, 2), (64, 64, 3, 1), (64, 64, 3, 1), (10, 64, 1, 1),
    ])),
    "M": ((6, 32, 32), _specs([
        (16, 64, 3, 1), (16, 64, 3, 1), (32, 128, 3, 2), (32, 128, 3, 1), (32, 128, 3, 1),
        (64, 256, 3, 2), (64, 256, 3, 1), (64, 256, 3, 1), (10, 256, 1, 1),
    ])),
    "L": ((6, 240, 240), _specs([
        (16, 64, 7, 3), (32, 64, 3, 1), (32, 64, 3, 1), (64, 128, 3, 2), (64, 128, 3, 1),
        (64, 128, 3, 1), (64, 256, 3, 2), (64, 256, 3, 1), (100, 256, 3, 1),
    ])),
    "XL": ((6, 64, 64), _specs([
        (16, 64, 5, 1), (32, 64, 3, 1), (32, 128, 3, 2), (64, 128, 3, 1), (64, 128, 3, 1),
        (64, 256, 3, 2), (64, 256, 3, 1), (64, 256, 3, 1), (200, 256, 3, 2),
    ])),
    # Small preset for the bundled 8×8 digits, encoded as [x, 1 − x] (2 channels).
    "digits": ((2, 8, 8), _specs([
        (16, 16, 3, 1), (32, 32, 3, 2), (32, 32, 3, 1), (10, 32, 1, 1),
    ])),
}  # fmt: skip
