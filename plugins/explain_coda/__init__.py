"""Built-in plugin: CoDA-Nets (Convolutional Dynamic Alignment Networks, Böhle et al. 2021).

Provides DAU layers (:class:`DAULinear`, :class:`DAUConv2d`), :class:`CoDANet` with the
paper's presets, training, exact model-inherent contributions, registered as
``coda.contributions``, and :func:`load_original_coda` for checkpoints of the original code
(:mod:`explain_coda.original`).
"""

from __future__ import annotations

from explain_coda.contributions import (
    CoDAContributions,
    coda_contributions,
    explicit_matrix,
    require_dau_model,
)
from explain_coda.layers import DAUConv2d, DAULinear
from explain_coda.model import PRESETS, CoDANet, LayerSpec, bce_one_vs_all, encode_input
from explain_coda.original import load_original_coda
from explain_coda.training import TrainConfig, train_coda
from explain_core.hookspecs import hookimpl
from explain_core.registry import MethodSpec

__all__ = [
    "PRESETS",
    "CoDANet",
    "DAUConv2d",
    "DAULinear",
    "LayerSpec",
    "TrainConfig",
    "bce_one_vs_all",
    "coda_contributions",
    "encode_input",
    "explicit_matrix",
    "load_original_coda",
    "require_dau_model",
    "train_coda",
]


@hookimpl
def explain_register_methods() -> list[MethodSpec]:
    """The CoDA family."""
    return [
        MethodSpec(
            "coda.contributions",
            CoDAContributions,
            "coda",
            "Exact model-inherent contributions W_{0→l}(x)⊙x of CoDA-Nets (output or any unit)",
        )
    ]


@hookimpl
def explain_demo_steps() -> list[object]:
    """The CoDA-Nets section of ``explain demo``."""
    from explain_coda.demo import CoDADemoStep

    return [CoDADemoStep()]
