"""quantus_explain as Quantus' explain_func: faithfulness, robustness, randomisation, localisation.

A tiny CNN trained on the bundled digits is explained by Quantus' metrics twice: through
``quantus_explain`` and through Quantus' own explain function (Captum's ``InputXGradient``
on the same weights); with the same random draws the scores agree. Where a score is known in
closed form (a linear model, a class-insensitive model, the pointing game's arg-max) it is
checked by hand.

Quantus is installed by ``scripts/setup-env.sh`` (without its dependencies: its torch extra
pulls torchvision); these tests fail, not skip, without it.
"""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import quantus
import torch
from torch import nn

from explain_core import explain, quantus_explain
from explain_core.data import load_digits
from explain_core.training import train_classifier

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

OURS = {"explain_func": quantus_explain, "explain_func_kwargs": {"method": "input_x_gradient"}}
THEIRS = {"explain_func": quantus.explain, "explain_func_kwargs": {"method": "InputXGradient"}}
QUIET = {"disable_warnings": True, "display_progressbar": False}


@pytest.fixture(scope="module")
def digits():
    """A small CNN trained for two epochs on the digits, and 8 test digits with labels."""
    split = load_digits()
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 10),
    )
    model = train_classifier(model, split.train_images, split.train_labels, epochs=2)
    x = split.test_images[:8]
    assert (model(x).argmax(1) == split.test_labels[:8]).float().mean() >= 0.5
    return model, x.numpy(), split.test_labels[:8].numpy()


def score(metric, model, x, y, explainer, seed=0, **kwargs):
    np.random.seed(seed)
    return metric(
        model=model, x_batch=x, y_batch=y, a_batch=None, device="cpu", **explainer, **kwargs
    )


def test_faithfulness_correlation(digits):
    model, x, y = digits
    metric = quantus.FaithfulnessCorrelation(nr_runs=10, subset_size=8, **QUIET)
    ours = score(metric, model, x, y, OURS)
    assert np.isfinite(ours).all()
    np.testing.assert_allclose(ours, score(metric, model, x, y, THEIRS), rtol=1e-6)
    # On a linear model Input×Gradient is exact: removing any subset (to 0) lowers the logit by
    # the subset's summed attribution, a correlation of 1.
    linear = nn.Sequential(nn.Flatten(), nn.Linear(64, 10)).eval()
    metric = quantus.FaithfulnessCorrelation(
        nr_runs=10, subset_size=8, perturb_baseline=0.0, return_aggregate=False, **QUIET
    )
    np.testing.assert_allclose(score(metric, linear, x, y, OURS), 1.0, rtol=1e-5)


def test_max_sensitivity(digits):
    model, x, y = digits
    metric = quantus.MaxSensitivity(nr_samples=4, **QUIET)
    ours = np.asarray(score(metric, model, x, y, OURS))
    assert (ours > 0).all()
    np.testing.assert_allclose(ours, score(metric, model, x, y, THEIRS), rtol=1e-5)
    # The gradient of a linear model does not depend on the input: no sensitivity at all.
    linear = nn.Sequential(nn.Flatten(), nn.Linear(64, 10)).eval()
    gradient = {"explain_func": quantus_explain, "explain_func_kwargs": {"method": "gradient"}}
    np.testing.assert_allclose(score(metric, linear, x, y, gradient), 0.0, atol=1e-6)


def test_random_logit(digits):
    model, x, y = digits
    metric = quantus.RandomLogit(num_classes=10, **QUIET)
    ours = np.asarray(score(metric, model, x, y, OURS))
    assert (ours < 0.9).all()  # a trained CNN's maps depend on the class
    np.testing.assert_allclose(ours, score(metric, model, x, y, THEIRS), rtol=1e-5)

    class SameForEveryClass(nn.Module):
        """Logit k is g(x) + k: every class has the same map."""

        def forward(self, inputs):
            g = model(inputs)[:, :1]
            return g + torch.arange(10, dtype=g.dtype)

    same = SameForEveryClass().eval()
    np.testing.assert_allclose(score(metric, same, x, y, OURS), 1.0, rtol=1e-6)


def test_model_parameter_randomisation(digits):
    model, x, y = digits
    metric = quantus.ModelParameterRandomisation(**QUIET)
    ours = score(metric, model, x, y, OURS)
    theirs = score(metric, model, x, y, THEIRS)
    assert list(ours) == list(theirs) == ["original", "4", "0"]  # top down: Linear, then Conv2d
    np.testing.assert_allclose(ours["original"], 1.0)
    for layer in ours:
        np.testing.assert_allclose(ours[layer], theirs[layer], rtol=1e-5, atol=1e-6)
    assert max(np.mean(ours["4"]), np.mean(ours["0"])) < 0.99  # randomised maps differ
    assert all(not module.training for module in model.modules())  # Quantus worked on a copy


def test_pointing_game(digits):
    model, x, y = digits
    ink = x > 0.3  # where each digit is written
    metric = quantus.PointingGame(**QUIET)
    ours = score(metric, model, x, y, OURS, s_batch=ink)
    # By hand: the hit is whether the map's maximum lies on the digit's ink.
    maps = explain(model, torch.from_numpy(x), "input_x_gradient", y).attribution.numpy()
    by_hand = [bool(s.flatten()[np.argmax(a.flatten())]) for a, s in zip(maps, ink, strict=True)]
    assert list(ours) == by_hand
    assert list(ours) == list(score(metric, model, x, y, THEIRS, s_batch=ink))


def test_the_captum_and_quantus_example_runs(tmp_path):
    example = Path(__file__).resolve().parents[1] / "examples" / "captum_quantus.py"
    command = [sys.executable, str(example), "--samples", "4", "--epochs", "1"]
    result = subprocess.run(
        [*command, "--methods", "input_x_gradient"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "input_x_gradient:" in result.stdout
    for score in ("NoiseTunnel", "sensitivity_max", "infidelity", "faithfulness", "pointing"):
        assert score in result.stdout
