"""Smoke test of examples/coda_rank3_dau.py: a rank-3 DAU recovers the digits' subspace."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "coda_rank3_dau.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("coda_rank3_dau_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_quick_run_recovers_digit_subspace(example, tmp_path, capsys):
    out = tmp_path / "x.png"
    result = example.main(out=out, steps=example.QUICK_STEPS, n_samples=example.QUICK_SAMPLES)

    assert out.is_file()
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(out) in capsys.readouterr().out
    assert result["out"] == str(out)

    # The quick run reaches ≈0.998 and ≈0.995; an untrained DAU stays below 0.2 and 0.25.
    assert result["energy_captured"] > 0.99
    assert result["subspace_cos_min"] > 0.98
    assert result["untrained_energy_captured"] < 0.3
    assert result["untrained_subspace_cos_min"] < 0.5
    # Individual eigenvectors also match individual digits (≈0.998 for this seed).
    assert len(result["digit_match"]) == 3
    assert min(result["digit_match"]) > 0.8
    assert len(result["eigenvalues"]) == 3


def test_untrained_dau_does_not_capture_digits(example):
    digits = example.clean_digits()
    for seed in range(5):
        _, vectors = example.ab_eigenvectors(example.make_dau(seed))
        assert vectors.shape == (3, 64)
        overlap = example.subspace_overlap(vectors, digits)
        assert overlap["energy_captured"] < 0.3
        assert overlap["subspace_cos_min"] < 0.5


def test_overlap_measure_is_one_for_the_digits_themselves(example):
    digits = example.clean_digits()
    mixed = digits[[2, 0, 1]] * 3.0 - digits.mean(0)  # another basis of the same span
    assert example.subspace_overlap(digits, digits)["energy_captured"] == pytest.approx(1.0)
    assert example.subspace_overlap(digits, digits)["subspace_cos_min"] == pytest.approx(1.0)
    assert example.subspace_overlap(mixed, digits)["energy_captured"] == pytest.approx(1.0)
