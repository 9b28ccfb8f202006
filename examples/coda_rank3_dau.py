"""A rank-3 Dynamic Alignment Unit learns three digits from noisy copies (CoDA-Nets, Fig. 3).

A Dynamic Alignment Unit (DAU) computes ``DAU(x) = g(ABx + b)ᵀx`` with a rank-``r`` matrix
``AB`` (``A`` is ``d × r``, ``B`` is ``r × d``). With the L2 non-linearity ``g(u) = u/‖u‖`` the
output is ``‖x‖·cos∠(x, ABx + b) ≤ ‖x‖``, and it reaches this bound only if ``x`` is an
eigenvector of ``x ↦ ABx + b`` (Böhle et al., "Convolutional Dynamic Alignment Networks for
Interpretable Classifications", CVPR 2021, eq. 3). Maximising the mean output over a data set
therefore pulls the frequent input patterns into the eigenvectors of ``AB``, much like an
``r``-dimensional PCA that reconstructs directions rather than vectors (supplement, sec. D).

This script repeats the paper's Fig. 3 on the bundled 8×8 digits:

1. take one clean '0', '1' and '2' from :func:`explain_core.data.digits.load_digits`;
2. build ``n = 3072`` noisy copies (digit + zero-mean Gaussian noise), as in the paper;
3. train a single L2 DAU (:class:`explain_coda.layers.DAULinear`, ``k = 1``, ``r = 3``, bias fixed
   at zero as in the paper) with Adam to MAXIMISE its mean output;
4. compute the eigenvectors of ``AB`` and compare them with the clean digits.

Success is measured on the subspace, which the objective determines well: the fraction of the
clean digits' energy captured by the span of the three eigenvectors and the cosine of the largest
principal angle between that span and the span of the digits. Both are 1 for a perfect recovery;
an untrained DAU, whose numbers are reported alongside, scores about 0.05 and below 0.3. The
individual eigenvectors usually match individual digits too (``digit_match``), but less stably:
see :func:`ab_eigenvectors`.

Run it from the repository root::

    .venv/bin/python examples/coda_rank3_dau.py                 # full run, a few seconds
    .venv/bin/python examples/coda_rank3_dau.py --quick         # smaller data, fewer steps
    .venv/bin/python examples/coda_rank3_dau.py --out fig.png --steps 500

It writes one PNG (clean digits, noisy samples, eigenvectors of ``AB``), prints where it went
and the success measures; :func:`main` also returns them as a dict.
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import torch

from explain_coda.layers import DAULinear
from explain_core.data.digits import load_digits

DIGITS = (0, 1, 2)
SIDE = 8
RANK = 3
NOISE_STD = 0.3  # pixels are in [0, 1]; a clean digit has norm ≈ 4, the noise ≈ 2.4
N_SAMPLES = 3072  # as in the paper
STEPS = 300
LEARNING_RATE = 0.05
QUICK_SAMPLES = 768
QUICK_STEPS = 200


def clean_digits() -> torch.Tensor:
    """The first '0', '1' and '2' of the training split, flattened: shape ``(3, 64)``."""
    split = load_digits()
    images, labels = split.train_images.flatten(1), split.train_labels
    return torch.stack([images[(labels == c).nonzero()[0, 0]] for c in DIGITS])


def noisy_copies(digits: torch.Tensor, n_samples: int, seed: int) -> torch.Tensor:
    """``n_samples`` copies of the digits (cycling through them) plus N(0, NOISE_STD²) noise."""
    generator = torch.Generator().manual_seed(seed)
    noise = NOISE_STD * torch.randn(n_samples, digits.shape[1], generator=generator)
    return digits[torch.arange(n_samples) % len(digits)] + noise


def make_dau(seed: int) -> DAULinear:
    """A single rank-3 L2 DAU with its bias ``b`` fixed at zero, initialised from ``seed``."""
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG untouched
        torch.manual_seed(seed)
        dau = DAULinear(SIDE * SIDE, 1, RANK, nonlinearity="l2")
    with torch.no_grad():
        dau.weightings.bias.zero_()
    dau.weightings.bias.requires_grad_(False)
    return dau


def train(dau: DAULinear, data: torch.Tensor, steps: int) -> float:
    """Maximise the mean DAU output over ``data`` (full batch, Adam); return the final mean."""
    params = [p for p in dau.parameters() if p.requires_grad]
    optimiser = torch.optim.Adam(params, lr=LEARNING_RATE)
    # The tensors are tiny (3072 × 64): intra-op threads only add overhead (tens of times
    # slower on a busy 2-core machine), so train on one thread and restore the setting after.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(steps):
            optimiser.zero_grad()
            loss = -dau(data).mean()
            loss.backward()
            optimiser.step()
        with torch.no_grad():
            return dau(data).mean().item()
    finally:
        torch.set_num_threads(threads)


def ab_eigenvectors(dau: DAULinear) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues and unit eigenvectors of ``AB`` for its ``r`` non-zero eigenvalues.

    Why the eigenvectors of ``AB`` itself and not its singular vectors (or the eigenvectors of
    its symmetric part): the paper's argument (footnote 3) is that the output is maximal for an
    input ``x`` only if ``ABx ∝ x``, i.e. the optimum makes the frequent inputs *eigenvectors*
    of the non-symmetric ``AB``. The clean digits are far from orthogonal (they share ink), so
    any orthonormal basis of their span, which is what an SVD or a symmetric eigendecomposition
    returns, would show mixtures of digits; only ``eig(AB)`` can return the digits themselves.
    All three give (nearly) the same 3-D subspace. Caveat: the objective barely constrains the
    eigenvalues' ratios (``AB ∝`` a projection onto the span is optimal too), so they end up
    close together and the individual eigenvectors are less stable than their span.

    ``AB`` (``d × d``) has rank ``r``; its non-zero eigenpairs come from the small ``BA``
    (``r × r``): ``BAv = λv`` implies ``AB(Av) = λ(Av)``.

    Returns:
        ``(eigenvalues, eigenvectors)``: ``(r,)`` and ``(r, d)``, float64, sorted by decreasing
        real part of the eigenvalue. Both are real parts: at the optimum the spectrum is real;
        a complex pair (possible for an untrained DAU) contributes its real and imaginary parts
        as the two vectors, so the span is kept. Each vector has unit norm and the sign that
        makes its pixel sum positive (ink is positive; eigenvectors have no sign of their own).
    """
    a = dau.weightings.weight.detach().double()  # (d * k, r) with k = 1: A
    b = dau.dim_reduction.weight.detach().double()  # (r, d): B
    eigenvalues, v = torch.linalg.eig(b @ a)
    order = torch.argsort(eigenvalues.real, descending=True)
    eigenvalues, vectors = eigenvalues[order], (a.to(v.dtype) @ v[:, order]).T
    # Rotate each complex vector's phase so its real part is as large as possible.
    vectors = vectors * torch.exp(-0.5j * torch.angle((vectors * vectors).sum(1, keepdim=True)))
    real = vectors.real.clone()
    for i in range(1, len(real)):  # second vector of a conjugate pair: use the imaginary part
        if eigenvalues[i].imag.abs() > 1e-9 and torch.isclose(
            eigenvalues[i], eigenvalues[i - 1].conj()
        ):
            real[i] = vectors[i - 1].imag
    real = real / real.norm(dim=1, keepdim=True)
    real = real * torch.where(real.sum(1, keepdim=True) < 0, -1.0, 1.0)
    return eigenvalues.real, real


def subspace_overlap(vectors: torch.Tensor, digits: torch.Tensor) -> dict[str, float]:
    """How well ``span(vectors)`` contains the clean digits.

    Args:
        vectors: ``(r, d)`` vectors spanning the recovered subspace.
        digits: ``(m, d)`` clean digits.

    Returns:
        ``energy_captured``: ``Σ‖P dᵢ‖² / Σ‖dᵢ‖²`` with ``P`` the orthogonal projector onto
        ``span(vectors)``; ``subspace_cos_min``: cosine of the largest principal angle between
        ``span(vectors)`` and ``span(digits)`` (the smallest singular value of ``QᵥᵀQ_d``).
    """
    q_vectors = torch.linalg.qr(vectors.double().T).Q
    q_digits = torch.linalg.qr(digits.double().T).Q
    captured = (q_vectors.T @ digits.double().T).square().sum() / digits.double().square().sum()
    cosines = torch.linalg.svdvals(q_vectors.T @ q_digits)
    return {"energy_captured": captured.item(), "subspace_cos_min": cosines.min().item()}


def digit_match(vectors: torch.Tensor, digits: torch.Tensor) -> tuple[list[float], list[int]]:
    """Pair eigenvectors with digits (the permutation maximising the smallest ``|cos|``).

    Returns:
        Per eigenvector, ``|cos|`` with its digit and that digit's index in ``DIGITS``.
    """
    unit = digits.double() / digits.double().norm(dim=1, keepdim=True)
    cos = (vectors.double() @ unit.T).abs()
    rows = range(len(vectors))
    best = max(
        itertools.permutations(range(len(digits)), len(vectors)),
        key=lambda p: min(cos[i, p[i]].item() for i in rows),
    )
    return [cos[i, best[i]].item() for i in rows], list(best)


def plot(
    path: Path,
    digits: torch.Tensor,
    noisy: torch.Tensor,
    eigenvalues: torch.Tensor,
    vectors: torch.Tensor,
    match: tuple[list[float], list[int]],
) -> None:
    """Clean digits (top), one noisy sample of each (middle), eigenvectors of ``AB`` (bottom)."""
    digits, noisy, vectors = (t.numpy().reshape(-1, SIDE, SIDE) for t in (digits, noisy, vectors))
    fig, axes = plt.subplots(3, RANK, figsize=(2.2 * RANK, 7.2))
    for j in range(RANK):
        axes[0, j].imshow(digits[j], cmap="gray_r", vmin=0, vmax=1)
        axes[0, j].set_title(f"clean '{DIGITS[j]}'", fontsize=9)
        axes[1, j].imshow(noisy[j], cmap="gray_r")
        axes[1, j].set_title(f"noisy '{DIGITS[j]}'", fontsize=9)
        scale = abs(vectors[j]).max()
        axes[2, j].imshow(vectors[j], cmap="RdBu_r", vmin=-scale, vmax=scale)
        cos, digit = match[0][j], DIGITS[match[1][j]]
        axes[2, j].set_title(
            f"EV {j + 1}, λ={float(eigenvalues[j]):.2f}\n≈'{digit}' (|cos| {cos:.2f})", fontsize=9
        )
    for ax in axes.flat:
        ax.set_xticks([])
        ax.set_yticks([])
    axes[0, 0].set_ylabel("originals")
    axes[1, 0].set_ylabel("training data")
    axes[2, 0].set_ylabel("EVs of AB")
    fig.suptitle("Rank-3 DAU maximised on noisy digits", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(
    out: Path = Path("coda_rank3_dau.png"),
    steps: int = STEPS,
    seed: int = 0,
    n_samples: int = N_SAMPLES,
) -> dict:
    """Train the DAU, save the figure to ``out`` and return the success measures.

    Args:
        out: Where to write the PNG.
        steps: Full-batch Adam steps.
        seed: Seed of the noise and of the DAU's initialisation.
        n_samples: Number of noisy training samples.

    Returns:
        ``energy_captured``, ``subspace_cos_min`` (see :func:`subspace_overlap`), the same two
        for the untrained DAU (``untrained_*``), ``digit_match`` (per eigenvector ``|cos|`` with
        its matched digit), ``eigenvalues``, ``mean_output``, ``seconds`` and ``out``.
    """
    start = time.perf_counter()
    out = Path(out)
    digits = clean_digits()
    data = noisy_copies(digits, n_samples, seed)
    dau = make_dau(seed)
    untrained = subspace_overlap(ab_eigenvectors(dau)[1], digits)
    mean_output = train(dau, data, steps)
    eigenvalues, vectors = ab_eigenvectors(dau)
    match = digit_match(vectors, digits)
    plot(out, digits, data[: len(DIGITS)], eigenvalues, vectors, match)
    result = {
        **subspace_overlap(vectors, digits),
        **{f"untrained_{key}": value for key, value in untrained.items()},
        "digit_match": match[0],
        "eigenvalues": eigenvalues.tolist(),
        "mean_output": mean_output,
        "seconds": time.perf_counter() - start,
        "out": str(out),
    }
    print(f"Saved figure to {out}")
    print(
        f"Energy of the clean digits in span(EVs of AB): {result['energy_captured']:.4f} "
        f"(untrained DAU: {result['untrained_energy_captured']:.4f})"
    )
    print(
        f"Cosine of the largest principal angle to span(digits): "
        f"{result['subspace_cos_min']:.4f} (untrained: {result['untrained_subspace_cos_min']:.4f})"
    )
    print(
        "Per-eigenvector |cos| with its matched digit: " + ", ".join(f"{c:.3f}" for c in match[0])
    )
    print(f"Mean DAU output {mean_output:.3f}; took {result['seconds']:.1f} s")
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("coda_rank3_dau.png"))
    parser.add_argument("--steps", type=int, default=None, help=f"Adam steps (default {STEPS})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK_SAMPLES} samples and {QUICK_STEPS} steps instead of {N_SAMPLES} and {STEPS}",
    )
    args = parser.parse_args()
    default_steps = QUICK_STEPS if args.quick else STEPS
    main(
        out=args.out,
        steps=default_steps if args.steps is None else args.steps,
        seed=args.seed,
        n_samples=QUICK_SAMPLES if args.quick else N_SAMPLES,
    )
