"""Built-in plugin: gradient-based methods for any differentiable PyTorch model.

Registers ``gradient``, ``input_x_gradient``, ``integrated_gradients``, ``smoothgrad`` and
``dynamic.contributions`` through the same hooks third-party plugins use.
"""

from __future__ import annotations

from explain_core.hookspecs import hookimpl
from explain_core.interfaces.relevance import CompositeSpec
from explain_core.registry import MethodSpec
from explain_gradients.methods import (
    DynamicLinearContributions,
    ExplanationMode,
    Gradient,
    InputXGradient,
    IntegratedGradients,
    SmoothGrad,
)


@hookimpl
def explain_register_methods() -> list[MethodSpec]:
    """The gradient family."""
    return [
        MethodSpec("gradient", Gradient, "gradient", "Gradient of the target output (saliency)"),
        MethodSpec(
            "input_x_gradient", InputXGradient, "gradient", "Input times gradient of the target"
        ),
        MethodSpec(
            "integrated_gradients",
            IntegratedGradients,
            "gradient",
            "Integrated Gradients along the straight path from a baseline (midpoint rule)",
        ),
        MethodSpec(
            "smoothgrad",
            SmoothGrad,
            "gradient",
            "SmoothGrad: the gradient averaged over noisy copies of the input (seeded)",
        ),
        MethodSpec(
            "dynamic.contributions",
            DynamicLinearContributions,
            "dynamic-linear",
            "Exact contributions W(x)⊙x of dynamic-linear models (DAU nets, ReLU nets)",
        ),
    ]


@hookimpl
def explain_demo_steps() -> list[object]:
    """The gradient-baselines section of ``explain demo``."""
    from explain_gradients.demo import GradientBaselinesStep

    return [GradientBaselinesStep()]


@hookimpl
def explain_register_composites() -> list[CompositeSpec]:
    """``explanation_mode``: dynamic-linear layers' weights detached."""
    return [
        CompositeSpec(
            "explanation_mode", ExplanationMode, "dynamic weights detached (exact contributions)"
        )
    ]
