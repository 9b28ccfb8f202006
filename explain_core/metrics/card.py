"""The faithfulness card: one method checked on one model and data.

The card (Sixt et al. 2020, *When explanations lie*; Adebayo et al. 2018) holds

- **completeness**: mean ``|output − Σ attribution| / |output|`` of the explained class, for
  methods that report a completeness delta;
- **CSC at the first layer**: random relevance vectors set at the output layer and propagated
  down by the method; the median ``|cos|`` between them at the input of the first layer (near 1:
  the explanation has stopped depending on what was explained). Only for methods that can
  propagate relevance from a layer (methods with a
  ``layer_propagator``: the modified-backpropagation family, the gradient);
- **random-logit SSIM**: maps for the explained class vs. a random other class (1: not class
  sensitive);
- **randomisation SSIM**: maps of the model vs. copies with the output layer, then every layer
  re-initialised (``max(SSIM(s), SSIM(−s))``; 1: the maps ignore the weights).

``explain check`` prints it as a table and writes it as JSON.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from explain_core.api import explain
from explain_core.errors import UnsupportedMethodError
from explain_core.metrics.csc import cosine_similarity_convergence
from explain_core.metrics.maps import method_maps
from explain_core.metrics.random_logit import random_logit_ssim
from explain_core.metrics.randomisation import cascading_randomisation, randomisation_layers

__all__ = ["faithfulness_card", "format_card", "format_value"]


def faithfulness_card(
    model: nn.Module,
    images: torch.Tensor,
    targets: torch.Tensor,
    method: str,
    *,
    seed: int = 0,
    n_vectors: int = 5,
    **options: Any,
) -> dict[str, Any]:
    """Completeness, CSC at the first layer, random-logit and randomisation SSIM of ``method``.

    Every entry is a number, or a short text saying why it is not defined for this method.

    Returns:
        ``method``, ``samples``, ``completeness``, ``first_layer``, ``csc_first_layer``,
        ``random_logit_ssim``, ``randomisation_ssim_top`` (output layer re-initialised),
        ``randomisation_ssim_all`` (every layer) and ``randomised_layers``.
    """
    card: dict[str, Any] = {"method": method, "samples": len(targets)}
    result = explain(model, images, method, targets, **options)
    if result.delta is None:
        card["completeness"] = "not defined"
    else:
        chosen = result.output.gather(1, result.target.view(-1, 1)).squeeze(1).abs()
        relative = result.delta.detach().abs() / chosen.detach().clamp(min=1e-12)
        card["completeness"] = float(relative.mean())
    layers = randomisation_layers(model)
    card["first_layer"] = layers[-1] if layers else None
    try:
        csc = cosine_similarity_convergence(
            model, images, method, n_vectors=n_vectors, seed=seed, **options
        )
        first = csc.layers[-1]
        card["first_layer"] = first
        value = csc.median[first]
        card["csc_first_layer"] = "undefined (zero relevance)" if math.isnan(value) else value
    except UnsupportedMethodError:
        card["csc_first_layer"] = "not supported by the method"
    maps = method_maps(method, **options)
    try:
        card["random_logit_ssim"] = random_logit_ssim(
            model, maps, images, targets, seed=seed
        ).mean_ssim
    except ValueError as error:
        card["random_logit_ssim"] = f"not defined: {error}"
    if layers:
        steps = cascading_randomisation(
            model, maps, images, targets, layers, seed=seed, absolute_sign=True
        )
        card["randomisation_ssim_top"] = steps[0].mean_ssim
        card["randomisation_ssim_all"] = steps[-1].mean_ssim
        card["randomised_layers"] = list(steps[-1].layers)
    else:
        card["randomisation_ssim_top"] = "no layers with parameters"
        card["randomisation_ssim_all"] = "no layers with parameters"
        card["randomised_layers"] = []
    return card


ROWS = (
    ("completeness", "completeness error |out − Σ map| / |out|", "0 = complete"),
    ("csc_first_layer", "CSC at the first layer (median |cos|)", "lower is better"),
    ("random_logit_ssim", "random-logit SSIM", "lower is better"),
    ("randomisation_ssim_top", "SSIM, output layer randomised", "lower is better"),
    ("randomisation_ssim_all", "SSIM, all layers randomised", "lower is better"),
)


def format_value(value: Any) -> str:
    """Numbers as short text, reasons as they are."""
    if isinstance(value, float):
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e4):
            return f"{value:.2e}"
        return f"{value:.3f}"
    return str(value)


def format_card(card: dict[str, Any]) -> str:
    """The card as an aligned plain-text table."""
    rows = [(label, format_value(card[key]), hint) for key, label, hint in ROWS]
    width = max(len(r[0]) for r in rows)
    value_width = max(len(r[1]) for r in rows)
    head = f"faithfulness card: {card['method']} on {card['samples']} samples"
    if card.get("first_layer"):
        head += f" (first layer: {card['first_layer']})"
    body = [f"  {label:<{width}}  {value:>{value_width}}  ({hint})" for label, value, hint in rows]
    return "\n".join([head, *body])
