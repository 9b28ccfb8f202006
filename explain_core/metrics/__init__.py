"""Method-agnostic evaluation metrics for attribution maps.

Importing this package loads no optional dependency; scikit-image is imported by the SSIM
functions when they run.
"""

from explain_core.metrics.card import faithfulness_card, format_card, format_value
from explain_core.metrics.csc import (
    AutogradPropagator,
    CSCResult,
    LayerPropagator,
    SupportsLayerPropagation,
    UnsupportedMethodError,
    cosine_similarity_convergence,
    layer_propagator,
    relevance_cosines,
)
from explain_core.metrics.deletion_insertion import DeletionInsertion, deletion_insertion
from explain_core.metrics.localisation import (
    grid_class_pairs,
    localisation_score,
    pointing_game_grids,
)
from explain_core.metrics.maps import method_maps, to_maps
from explain_core.metrics.matrix_chain import MatrixChainCurve, matrix_chain_convergence
from explain_core.metrics.pixel_removal import pixel_removal_curve, removed_pixel_counts
from explain_core.metrics.random_logit import RandomLogitResult, random_logit_ssim
from explain_core.metrics.randomisation import (
    RandomisationStep,
    cascading_randomisation,
    map_ssim,
    randomisation_layers,
    signal_ssim,
)

__all__ = [
    "AutogradPropagator",
    "CSCResult",
    "DeletionInsertion",
    "LayerPropagator",
    "MatrixChainCurve",
    "RandomLogitResult",
    "RandomisationStep",
    "SupportsLayerPropagation",
    "UnsupportedMethodError",
    "cascading_randomisation",
    "cosine_similarity_convergence",
    "deletion_insertion",
    "faithfulness_card",
    "format_card",
    "format_value",
    "grid_class_pairs",
    "layer_propagator",
    "localisation_score",
    "map_ssim",
    "matrix_chain_convergence",
    "method_maps",
    "pixel_removal_curve",
    "pointing_game_grids",
    "random_logit_ssim",
    "randomisation_layers",
    "relevance_cosines",
    "removed_pixel_counts",
    "signal_ssim",
    "to_maps",
]
