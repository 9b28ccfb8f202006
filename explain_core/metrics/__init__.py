"""Method-agnostic evaluation metrics for attribution maps.

Importing this package loads no optional dependency; scikit-image is imported by the SSIM
functions when they run.
"""

from explain_core.metrics.localisation import (
    grid_class_pairs,
    localisation_score,
    pointing_game_grids,
)
from explain_core.metrics.pixel_removal import pixel_removal_curve, removed_pixel_counts
from explain_core.metrics.randomisation import (
    RandomisationStep,
    cascading_randomisation,
    map_ssim,
)

__all__ = [
    "RandomisationStep",
    "cascading_randomisation",
    "grid_class_pairs",
    "localisation_score",
    "map_ssim",
    "pixel_removal_curve",
    "pointing_game_grids",
    "removed_pixel_counts",
]
