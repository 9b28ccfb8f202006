"""Deletion and insertion curves, and the line plots that draw them (``plots.curves``).

The curves are checked against a reference written here from the definition: for each step, the
pixels to remove or keep are chosen by sorting the map, the input is masked by hand and the model
run on it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure
from torch import nn

from explain_core.errors import InvalidInputError, ModelStateError
from explain_core.metrics.deletion_insertion import deletion_insertion
from explain_core.plots import curves


def _linear_model(pixels: int, classes: int = 3, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(pixels, classes)).double().eval()


@torch.no_grad()
def _reference(model, inputs, maps, labels, kept_counts, keep_most):
    """Scores of ``labels`` with only the ``k`` most (keep_most) or all but the ``k`` most
    relevant pixels present, for each ``k`` in ``kept_counts``: masks built pixel by pixel."""
    batch, _, height, width = inputs.shape
    rows = []
    for b in range(batch):
        order = sorted(range(height * width), key=lambda i: -float(maps[b].flatten()[i]))
        scores = []
        for k in kept_counts:
            chosen = set(order[:k])
            x = inputs[b].clone()
            for i in range(height * width):
                present = (i in chosen) if keep_most else (i not in chosen)
                if not present:
                    x[:, i // width, i % width] = 0.0
            probabilities = model(x[None]).softmax(1)[0]
            scores.append(float(probabilities[labels[b]]))
        rows.append(scores)
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.parametrize(("side", "steps"), [(3, 9), (3, 2), (4, 5)])
def test_curves_match_masking_by_hand(side: int, steps: int) -> None:
    generator = torch.Generator().manual_seed(side + steps)
    inputs = torch.rand(2, 2, side, side, generator=generator, dtype=torch.float64) + 0.5
    # Distinct values: no ties, so the order is the map's alone.
    maps = torch.stack([torch.randperm(side * side, generator=generator) for _ in range(2)])
    maps = maps.double().view(2, side, side)
    labels = torch.tensor([0, 2])
    model = _linear_model(2 * side * side)
    result = deletion_insertion(model, inputs, maps, labels, steps=steps)
    pixels = side * side
    removed = [round(k * pixels / steps) for k in range(steps + 1)]
    np.testing.assert_allclose(result.removed, np.array(removed) / pixels)
    # Insertion's step k keeps the pixels that removing the least relevant ones leaves.
    kept = [pixels - count for count in reversed(removed)]
    np.testing.assert_allclose(result.inserted, np.array(kept) / pixels)
    torch.testing.assert_close(
        result.deletion.double(), _reference(model, inputs, maps, labels, removed, False)
    )
    torch.testing.assert_close(
        result.insertion.double(), _reference(model, inputs, maps, labels, kept, True)
    )
    # Both end at the ends they share: the whole input, and the empty one.
    torch.testing.assert_close(result.deletion[:, 0], result.insertion[:, -1])
    torch.testing.assert_close(result.deletion[:, -1], result.insertion[:, 0])


def test_areas_are_trapezoids_of_the_mean_curves() -> None:
    inputs = torch.rand(3, 1, 4, 4, dtype=torch.float64)
    maps = torch.rand(3, 4, 4, dtype=torch.float64)
    result = deletion_insertion(_linear_model(16), inputs, maps, torch.tensor([0, 1, 2]), steps=4)
    x, y = result.removed.numpy(), result.deletion.mean(0).numpy()
    by_hand = sum((x[i + 1] - x[i]) * (y[i + 1] + y[i]) / 2 for i in range(len(x) - 1))
    assert math.isclose(result.deletion_auc, by_hand, rel_tol=1e-12)
    x, y = result.inserted.numpy(), result.insertion.mean(0).numpy()
    by_hand = sum((x[i + 1] - x[i]) * (y[i + 1] + y[i]) / 2 for i in range(len(x) - 1))
    assert math.isclose(result.insertion_auc, by_hand, rel_tol=1e-12)


def test_a_faithful_map_beats_its_reverse() -> None:
    # A linear model: the true evidence map is weight × input, for the target class.
    model = _linear_model(16, classes=2, seed=3)
    inputs = torch.rand(4, 1, 4, 4, dtype=torch.float64)
    labels = torch.tensor([0, 1, 0, 1])
    weight = model[1].weight.detach()
    evidence = (weight[labels] - weight[1 - labels]).view(4, 4, 4) * inputs[:, 0]
    good = deletion_insertion(model, inputs, evidence, labels, steps=16)
    bad = deletion_insertion(model, inputs, -evidence, labels, steps=16)
    assert good.deletion_auc < bad.deletion_auc
    assert good.insertion_auc > bad.insertion_auc


def test_raw_scores_without_softmax() -> None:
    model = _linear_model(4)
    inputs = torch.rand(1, 1, 2, 2, dtype=torch.float64)
    maps = torch.tensor([[[4.0, 3.0], [2.0, 1.0]]], dtype=torch.float64)
    result = deletion_insertion(model, inputs, maps, 1, steps=4, probabilities=False)
    full = model(inputs)[0, 1]
    empty = model(torch.zeros_like(inputs))[0, 1]
    assert torch.isclose(result.deletion[0, 0], full) and torch.isclose(
        result.deletion[0, -1], empty
    )


def test_bad_input_is_refused_clearly() -> None:
    model = _linear_model(4)
    inputs = torch.rand(1, 1, 2, 2, dtype=torch.float64)
    maps = torch.rand(1, 2, 2, dtype=torch.float64)
    default = deletion_insertion(model, inputs, maps, 0)  # 4 pixels: one per step
    assert default.deletion.shape == (1, 5)
    with pytest.raises(InvalidInputError, match=r"steps must be an int >= 1"):
        deletion_insertion(model, inputs, maps, 0, steps=0)
    with pytest.raises(InvalidInputError, match=r"steps must be an int in \[1, 4\]"):
        deletion_insertion(model, inputs, maps, 0, steps=5)
    with pytest.raises(InvalidInputError, match=r"shape \(B, C, H, W\)"):
        deletion_insertion(model, inputs[0], maps, 0)
    with pytest.raises(InvalidInputError, match="attribution_maps"):
        deletion_insertion(model, inputs, maps[:, :1], 0)
    with pytest.raises(InvalidInputError, match="model must be a model or a function"):
        deletion_insertion("not a model", inputs, maps, 0)
    dropout = nn.Sequential(nn.Flatten(), nn.Dropout(), nn.Linear(4, 2)).double().train()
    with pytest.raises(ModelStateError):
        deletion_insertion(dropout, inputs, maps, 0)


# --- plots.curves -------------------------------------------------------------------------------


def test_curves_draws_each_panel_and_matches_colours_by_position() -> None:
    x = np.linspace(0, 1, 5)
    figure = curves(
        {
            "deletion": {"a (0.1)": (x, x**2), "b (0.2)": (x, 1 - x)},
            "insertion": {"a (0.9)": (x, x), "b (0.8)": (torch.tensor(x), torch.tensor(x / 2))},
        },
        xlabel="fraction",
        ylabel="probability",
        title="T",
        note="N",
        ylim=(0, 1),
    )
    assert isinstance(figure, Figure)
    left, right = figure.axes
    assert left.get_title() == "deletion" and right.get_title() == "insertion"
    assert [line.get_label() for line in left.lines] == ["a (0.1)", "b (0.2)"]
    np.testing.assert_allclose(left.lines[0].get_ydata(), x**2)
    np.testing.assert_allclose(right.lines[1].get_ydata(), x / 2)
    for i in range(2):  # a method's two curves share colour and dashes across panels
        assert left.lines[i].get_color() == right.lines[i].get_color()
        assert left.lines[i].get_linestyle() == right.lines[i].get_linestyle()
    assert left.lines[0].get_color() != left.lines[1].get_color()
    assert left.get_ylabel() == "probability" and right.get_xlabel() == "fraction"
    assert left.get_ylim() == (0, 1)
    assert figure._suptitle.get_text() == "T" and figure._supxlabel.get_text() == "N"


@pytest.mark.parametrize(
    ("panels", "message"),
    [
        ({}, "got none"),
        ({"p": {}}, "panel 'p' needs"),
        ({"p": {"a": [1, 2, 3]}}, r"must be an \(x, y\) pair"),
        ({"p": {"a": ([0, 1, 2], [0, 1])}}, "has 3 x values but 2 y values"),
        ({"p": {"a": ([0, 1], [0, float("nan")])}}, "NaN or infinite"),
        ({"p": {"a": ([0], [1])}}, "at least two values"),
    ],
)
def test_curves_refuses_bad_input(panels, message) -> None:
    with pytest.raises(InvalidInputError, match=message):
        curves(panels)
