"""AttnLRP and CP-LRP on attention written with plain PyTorch operations.

The reference is written from the papers' Gradient×Input form, independently of the engine: the
forward pass in float64 with the rules as detached factors (σ of a LayerNorm, CP-LRP's attention
weights, ``f(x)/x`` of an activation) and the uniform rule as the average of the product with
either factor detached; relevance is ``x ⊙ ∂y_k/∂x``.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from explain_core import Composite, Gradient, Op, Rule, explain
from explain_core.errors import UnsupportedModelError
from explain_modbp.norms import NormScale
from explain_modbp.products import Uniform

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Block(nn.Module):
    """A pre-norm transformer block: multi-head self-attention and a GELU MLP."""

    def __init__(self, width: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor, rules: Rules | None = None) -> torch.Tensor:
        r = rules or Rules("plain")
        b, t, d = x.shape
        q, k, v = self.qkv(r.norm(self.ln1, x)).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = r.product(q, k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        o = r.product(r.softmax(scores), v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(o)
        return x + self.fc2(r.activation(self.fc1(r.norm(self.ln2, x))))


class Tiny(nn.Module):
    def __init__(self, width: int = 8, blocks: int = 2, classes: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.ln, self.head = nn.LayerNorm(width), nn.Linear(width, classes)

    def forward(self, x: torch.Tensor, rules: Rules | None = None) -> torch.Tensor:
        r = rules or Rules("plain")
        for block in self.blocks:
            x = block(x, r)
        return self.head(r.norm(self.ln, x).mean(1))


class Rules:
    """The papers' rules as Gradient×Input factors (``plain``: the model itself)."""

    def __init__(self, method: str) -> None:
        self.method = method

    def norm(self, ln: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
        if self.method == "plain":
            return ln(x)
        mean = x.mean(-1, keepdim=True)
        sigma = torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + ln.eps)
        return (x - mean) / sigma.detach() * ln.weight + ln.bias

    def product(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if self.method == "attn":
            return 0.5 * (a @ b.detach()) + 0.5 * (a.detach() @ b)
        return a @ b

    def softmax(self, scores: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(scores, dim=-1)
        return weights.detach() if self.method == "cp" else weights

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        if self.method == "plain":
            return F.gelu(x)
        return x * (F.gelu(x) / x).detach()


def reference(model: Tiny, x: torch.Tensor, k: int, method: str) -> torch.Tensor:
    x = x.clone().requires_grad_(True)
    out = model(x, Rules(method))
    (grad,) = torch.autograd.grad(out[:, k].sum(), x)
    return x.detach() * grad


def tiny(bias_free: bool = False) -> Tiny:
    torch.manual_seed(0)
    model = Tiny().double().eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.2, 0.2)
            if bias_free and getattr(module, "bias", None) is not None:
                module.bias.zero_()
    return model


X = torch.randn(3, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(("name", "method"), [("lrp.attn", "attn"), ("lrp.cp", "cp")])
@pytest.mark.parametrize("k", [0, 2])
def test_the_methods_equal_the_papers_gradient_x_input_form(name, method, k):
    model = tiny()
    result = explain(model, X, name, k)
    torch.testing.assert_close(result.attribution, reference(model, X, k, method))
    torch.testing.assert_close(result.output, model(X))


def test_cp_lrp_conserves_on_a_bias_free_transformer_and_attn_lrp_reports_its_gap():
    model = tiny(bias_free=True)
    cp = explain(model, X, "lrp.cp", 1)
    torch.testing.assert_close(cp.delta, torch.zeros(3, dtype=torch.float64))
    attn = explain(model, X, "lrp.attn", 1)
    gap = attn.output[:, 1] - attn.attribution.sum((1, 2))
    torch.testing.assert_close(attn.delta, gap)
    assert bool((gap.abs() > 1e-6).any())  # the softmax rule does not conserve


def test_the_model_is_untouched():
    model = tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    explain(model, X, "lrp.attn", 0)
    explain(model, X, "lrp.cp", 0)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_norm_scale_equals_the_matrix_form_for_layer_norm_and_rms_norm():
    torch.manual_seed(3)
    x = torch.randn(4, 6, dtype=torch.float64)
    weight = torch.rand(6, dtype=torch.float64) + 0.5
    bias = torch.randn(6, dtype=torch.float64)
    signal = torch.randn(4, 6, dtype=torch.float64)
    centre = torch.eye(6, dtype=torch.float64) - 1 / 6
    for kind, norm, jacobian in (
        (
            "layer_norm",
            lambda t: F.layer_norm(t, (6,), weight, bias, 1e-5),
            lambda row: torch.diag(weight) @ centre / torch.sqrt(row.var(unbiased=False) + 1e-5),
        ),
        (
            "rms_norm",
            lambda t: F.rms_norm(t, (6,), weight, 1e-5),
            lambda row: torch.diag(weight) / torch.sqrt(row.square().mean() + 1e-5),
        ),
    ):
        model = _Functional(norm)
        composite = Composite([(Op(kind), NormScale())])
        _, got = composite.gradient(model, x, lambda out: signal)
        expected = torch.stack([jacobian(row).T @ s for row, s in zip(x, signal, strict=True)])
        torch.testing.assert_close(got, expected, msg=kind)


def test_the_uniform_rule_halves_both_factors_of_a_matrix_product():
    a = torch.randn(2, 3, 4, dtype=torch.float64)
    model = _Functional(lambda t: (t @ t.transpose(1, 2)).flatten(1))
    composite = Composite([(Op("matmul"), Uniform())])
    signal = torch.randn(2, 9, dtype=torch.float64)
    _, got = composite.gradient(model, a, lambda out: signal)
    t = a.clone().requires_grad_(True)
    (plain,) = torch.autograd.grad((t @ t.transpose(1, 2)).flatten(1), t, signal)
    torch.testing.assert_close(got, plain / 2)  # each factor's half, summed: half the gradient
    # relevance conserves: Σ a ⊙ s_a = Σ y ⊙ s_y
    torch.testing.assert_close((a * got).sum(), (model(a) * signal).sum())


class _Functional(nn.Module):
    def __init__(self, function) -> None:
        super().__init__()
        self.function = function

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.function(x)


# --- fused attention: computed in its math form inside the engine's pass ---------------------


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"is_causal": True},
        {"scale": 0.3},
        {"attn_mask": "bool"},
        {"attn_mask": "float"},
        {"enable_gqa": True},
    ],
    ids=str,
)
def test_scaled_dot_product_attention_in_math_form_equals_the_fused_kernel(options):
    from explain_core.engine.decompose import scaled_dot_product_attention

    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 5, 3, dtype=torch.float64, generator=g)
    heads = 2 if options.get("enable_gqa") else 4
    k = torch.randn(2, heads, 6, 3, dtype=torch.float64, generator=g)
    v = torch.randn(2, heads, 6, 3, dtype=torch.float64, generator=g)
    options = dict(options)
    if options.get("attn_mask") == "bool":
        options["attn_mask"] = torch.rand(5, 6, generator=g) > 0.3
        options["attn_mask"][:, 0] = True  # every query sees a key
    elif options.get("attn_mask") == "float":
        options["attn_mask"] = torch.randn(5, 6, dtype=torch.float64, generator=g)
    expected = F.scaled_dot_product_attention(q, k, v, **options)
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v, **options), expected)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("masks", [False, True])
def test_multi_head_attention_in_math_form_equals_the_module(batch_first, masks):
    from explain_core.engine.decompose import multi_head_attention

    torch.manual_seed(5)
    attention = nn.MultiheadAttention(8, 2, batch_first=batch_first).double().eval()
    samples = torch.randn(3, 4, 8, dtype=torch.float64)  # (batch, sequence, features)
    x = samples if batch_first else samples.transpose(0, 1)
    kwargs = {}
    if masks:
        kwargs["key_padding_mask"] = torch.tensor([[False] * 4, [False, False, True, True]] * 2)[:3]
        kwargs["attn_mask"] = ~torch.ones(4, 4, dtype=torch.bool).tril()  # True: masked
    out, weights = attention(x, x, x, **kwargs)
    seq = samples.transpose(0, 1)
    got, got_weights = multi_head_attention(
        seq,
        seq,
        seq,
        8,
        2,
        attention.in_proj_weight,
        attention.in_proj_bias,
        None,
        None,
        False,
        0.0,
        attention.out_proj.weight,
        attention.out_proj.bias,
        training=False,
        need_weights=True,
        **kwargs,
    )
    got = got if not batch_first else got.transpose(0, 1)
    torch.testing.assert_close(got, out)
    torch.testing.assert_close(got_weights, weights)


class Encoder(nn.Module):
    """``nn.TransformerEncoder`` (batch first, GELU) with a mean-pooled linear head."""

    def __init__(self, norm_first: bool) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(
            8, 2, 16, dropout=0.0, activation="gelu", batch_first=True, norm_first=norm_first
        )
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(1))


def encoder_reference(model: Encoder, x: torch.Tensor, k: int, method: str) -> torch.Tensor:
    """The same network written out by hand with the papers' rules (see :class:`Rules`)."""
    r = Rules(method)
    x = x.clone().requires_grad_(True)
    h = x
    for layer in model.encoder.layers:
        attention = layer.self_attn

        def block(t: torch.Tensor, attention=attention) -> torch.Tensor:
            b, n, d = t.shape
            q, key, v = F.linear(t, attention.in_proj_weight, attention.in_proj_bias).chunk(3, -1)
            q, key, v = (z.reshape(b, n, 2, d // 2).transpose(1, 2) for z in (q, key, v))
            scores = r.product(q, key.transpose(-2, -1)) / math.sqrt(d // 2)
            o = r.product(r.softmax(scores), v).transpose(1, 2).reshape(b, n, d)
            return attention.out_proj(o)

        def mlp(t: torch.Tensor, layer=layer) -> torch.Tensor:
            return layer.linear2(r.activation(layer.linear1(t)))

        if layer.norm_first:
            h = h + block(r.norm(layer.norm1, h))
            h = h + mlp(r.norm(layer.norm2, h))
        else:
            h = r.norm(layer.norm1, h + block(h))
            h = r.norm(layer.norm2, h + mlp(h))
    out = model.head(h.mean(1))
    (grad,) = torch.autograd.grad(out[:, k].sum(), x)
    return x.detach() * grad


def encoder(norm_first: bool, bias_free: bool = False) -> Encoder:
    torch.manual_seed(6)
    model = Encoder(norm_first).double().eval()
    if bias_free:
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith("bias"):
                    parameter.zero_()
    return model


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize(("name", "method"), [("lrp.attn", "attn"), ("lrp.cp", "cp")])
def test_nn_transformer_encoder_equals_the_same_network_written_by_hand(norm_first, name, method):
    model = encoder(norm_first)
    x = torch.randn(2, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    result = explain(model, x, name, 2)
    torch.testing.assert_close(result.attribution, encoder_reference(model, x, 2, method))
    torch.testing.assert_close(result.output, model(x))


def test_cp_lrp_conserves_on_a_bias_free_nn_transformer_encoder():
    model = encoder(norm_first=True, bias_free=True)
    x = torch.randn(2, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    result = explain(model, x, "lrp.cp", 0)
    torch.testing.assert_close(result.delta, torch.zeros(2, dtype=torch.float64))


def test_scaled_dot_product_attention_in_a_model_gets_the_attention_rules():
    class Attend(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(9)
            self.qkv, self.head = nn.Linear(8, 24), nn.Linear(8, 3)

        def forward(self, x: torch.Tensor, rules: Rules | None = None) -> torch.Tensor:
            q, k, v = self.qkv(x).chunk(3, -1)
            if rules is None:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                causal = torch.ones(5, 5, dtype=torch.bool).tril()
                scores = rules.product(q, k.transpose(-2, -1)) / math.sqrt(8)
                o = rules.product(rules.softmax(scores.masked_fill(~causal, -math.inf)), v)
            return self.head(o.mean(1))

    model = Attend().double().eval()
    x = torch.randn(2, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(10))
    for name, method in (("lrp.attn", "attn"), ("lrp.cp", "cp")):
        xr = x.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(model(xr, Rules(method))[:, 1].sum(), xr)
        torch.testing.assert_close(explain(model, x, name, 1).attribution, x * grad, msg=name)


@pytest.mark.parametrize("model", ["tiny", "encoder"])
def test_gamma_on_the_linear_layers_of_cp_lrp_still_conserves_on_bias_free_models(model):
    # LRP-γ conserves on a bias-free layer (its denominators are its numerators' sums), so
    # CP-LRP with γ on every linear layer — modules and the F.linear calls of
    # nn.MultiheadAttention — conserves too, but gives another map than the gradient's.
    net = tiny(bias_free=True) if model == "tiny" else encoder(norm_first=True, bias_free=True)
    x = X if model == "tiny" else torch.randn(2, 5, 8, dtype=torch.float64)
    gamma = explain(net, x, "lrp.cp", 1, gamma=0.5, epsilon=1e-12)
    torch.testing.assert_close(gamma.delta, torch.zeros(x.shape[0], dtype=torch.float64))
    plain = explain(net, x, "lrp.cp", 1).attribution
    assert not torch.allclose(gamma.attribution, plain, atol=1e-6)


def test_masking_with_where_by_a_constant_condition_is_a_selection():
    """``torch.where(causal, scores, min)`` (GPT-2's eager attention in transformers 4.5x)."""

    class Causal(nn.Module):
        def __init__(self, select: bool) -> None:
            super().__init__()
            torch.manual_seed(11)
            self.qkv, self.head, self.select = nn.Linear(8, 24), nn.Linear(8, 2), select
            self.register_buffer("causal", torch.ones(5, 5, dtype=torch.bool).tril())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            scores = q @ k.transpose(-2, -1) / math.sqrt(8)
            lowest = torch.tensor(torch.finfo(scores.dtype).min, dtype=scores.dtype)
            if self.select:
                scores = torch.where(self.causal, scores, lowest)
            else:
                scores = scores.masked_fill(~self.causal, torch.finfo(scores.dtype).min)
            return self.head((scores.softmax(-1) @ v).mean(1))

    x = torch.randn(2, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(12))
    for method in ("lrp.attn", "lrp.cp"):
        selected = explain(Causal(True).double().eval(), x, method, 1).attribution
        masked = explain(Causal(False).double().eval(), x, method, 1).attribution
        torch.testing.assert_close(selected, masked, rtol=1e-12, atol=1e-14)


def test_where_with_an_input_dependent_condition_is_refused():
    class Select(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            return self.b(torch.where(h > 0, h, 0.1 * h))

    # refused at the comparison that makes the condition
    with pytest.raises(UnsupportedModelError, match=r"'gt'.*comparison of activations"):
        explain(Select().eval(), torch.randn(2, 4), "lrp.attn", 1)


class SwiGLU(nn.Module):
    """A gated MLP, ``down(act(gate(x)) · up(x))``, the activation as an op or a module."""

    def __init__(self, activation: nn.Module | None = None) -> None:
        super().__init__()
        torch.manual_seed(13)
        self.gate, self.up, self.down = nn.Linear(6, 12), nn.Linear(6, 12), nn.Linear(12, 3)
        self.act = activation

    def forward(self, x: torch.Tensor, method: str = "plain") -> torch.Tensor:
        g = self.act(self.gate(x)) if self.act is not None else F.silu(self.gate(x))
        if method == "attn":  # pass rule at the activation, uniform rule at the product
            g = self.gate(x) * (g / self.gate(x)).detach()
            return self.down(0.5 * g * self.up(x).detach() + 0.5 * g.detach() * self.up(x))
        if method == "cp":  # the activated gate held constant
            g = g.detach()
        return self.down(g * self.up(x))


@pytest.mark.parametrize("activation", [None, nn.SiLU()], ids=["F.silu", "nn.SiLU"])
@pytest.mark.parametrize(("name", "method"), [("lrp.attn", "attn"), ("lrp.cp", "cp")])
def test_gated_mlps_hold_the_gate_in_cp_lrp_and_split_uniformly_in_attn_lrp(
    activation, name, method
):
    model = SwiGLU(activation).double().eval()
    x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(14))
    xr = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(model(xr, method)[:, 2].sum(), xr)
    torch.testing.assert_close(explain(model, x, name, 2).attribution, x * grad)


class AttentionPooling(nn.Module):
    """Attention pooling over positions, ``Σ_t a_t v_t``, written as ``form``."""

    def __init__(self, form: str, values: str) -> None:
        super().__init__()
        torch.manual_seed(15)
        self.form, self.values = form, values
        self.value, self.score = nn.Linear(4, 6, bias=False), nn.Linear(4, 1, bias=False)
        self.head = nn.Linear(6, 3, bias=False)

    def forward(self, x: torch.Tensor, hold: bool = False) -> torch.Tensor:
        a = torch.softmax(self.score(x).squeeze(-1), dim=1)
        v = torch.tanh(self.value(x)) if self.values == "tanh" else self.value(x)
        if hold:  # CP-LRP's reference: the weights held, the pass rule at tanh
            a = a.detach()
            v = self.value(x) * (v / self.value(x)).detach()
        if self.form == "mul":
            pooled = (a.unsqueeze(-1) * v).sum(1)
        else:
            pooled = torch.bmm(a.unsqueeze(1), v).squeeze(1)
        return self.head(pooled)


@pytest.mark.parametrize("values", ["linear", "tanh"])
@pytest.mark.parametrize("form", ["mul", "bmm"])
def test_cp_lrp_holds_attention_weights_also_in_a_product(form, values):
    # (a.unsqueeze(-1) * v).sum(1) split the relevance uniformly (half lost in the held
    # softmax), or held tanh(v) as the gate and lost all of it
    model = AttentionPooling(form, values).double().eval()
    x = torch.randn(3, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(16))
    xr = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(model(xr, hold=True)[:, 1].sum(), xr)
    result = explain(model, x, "lrp.cp", 1)
    torch.testing.assert_close(result.attribution, x * grad)
    if values == "linear":  # bias-free and linear with the weights held: it conserves
        torch.testing.assert_close(result.delta, torch.zeros(3, dtype=torch.float64))


# --- fused attention with scaled gradients: the same relevance, no attention weights kept ----


class _CrossAttend(nn.Module):
    """Queries from the input; keys and values from the input or from a learned memory."""

    def __init__(self, memory: bool, fused: bool, options: dict) -> None:
        super().__init__()
        torch.manual_seed(12)
        self.q, self.kv, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(4, 3)
        self.memory = nn.Parameter(torch.randn(1, 2, 6, 4)) if memory else None
        self.fused, self.options = fused, options

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x).unflatten(-1, (2, 4)).transpose(1, 2)  # (batch, heads, 5, 4)
        if self.memory is None:
            k, v = self.kv(x).unflatten(-1, (2, 4)).transpose(1, 2).chunk(2, dim=1)
            q = q[:, :1]  # one query head over one key/value head
        else:
            k = v = self.memory.expand(x.shape[0], -1, -1, -1)
        mask = self.options.get("attn_mask")
        if self.fused:
            o = F.scaled_dot_product_attention(q, k, v, **self.options)
        else:  # the same, written out: each operation gets its own rule
            scores = q @ k.transpose(-2, -1) / 2.0
            if mask is not None:
                scores = scores.masked_fill(~mask, -math.inf)
            o = torch.softmax(scores, dim=-1) @ v
        return self.head(o.mean((1, 2)))


@pytest.mark.parametrize("memory", [False, True], ids=["self-attention", "constant memory"])
@pytest.mark.parametrize("masked", [False, True], ids=["", "masked"])
@pytest.mark.parametrize("method", ["lrp.attn", "lrp.cp"])
def test_fused_attention_with_scaled_gradients_equals_its_operations_ruled_one_by_one(
    memory, masked, method
):
    x = torch.randn(3, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(13))
    length = 6 if memory else 5
    options = {}
    if masked:
        mask = torch.rand(5, length, generator=torch.Generator().manual_seed(14)) > 0.4
        mask[:, 0] = True
        options["attn_mask"] = mask
    fused = _CrossAttend(memory, True, options).double().eval()
    written = _CrossAttend(memory, False, options).double().eval()
    if memory and method == "lrp.cp":  # the input reaches the output only through the weights
        refusal = r"passes operation 'softmax'.*lrp\.attn"
        for model in (fused, written):
            with pytest.raises(UnsupportedModelError, match=refusal):
                explain(model, x, method, target=2)
        return
    result = explain(fused, x, method, target=2).attribution
    torch.testing.assert_close(result, explain(written, x, method, target=2).attribution)


class _AtenOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the names of the ATen operations run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def test_attention_weights_are_never_kept_by_the_attention_methods():
    model = _CrossAttend(memory=False, fused=True, options={}).eval()
    x = torch.randn(2, 5, 8)
    for method in ("lrp.attn", "lrp.cp"):
        explain(model, x, method, target=0)  # the first call traces one sample in math form
        with _AtenOps() as ops:
            explain(model, x, method, target=0)
        assert not {"_softmax", "_softmax_backward_data"} & ops.names, method
        assert any("scaled_dot_product" in name for name in ops.names), method
    # a softmax rule that does not say it is the gradient: the math form, ruled op by op
    composite = Composite(
        [(nn.Linear, Gradient()), (Op("softmax"), _UnscaledGradient()), (Op("matmul"), Uniform())]
    )
    with _AtenOps() as ops:
        written = explain(model, x, "lrp.custom", target=0, composite=composite)
    assert "_softmax" in ops.names
    expected = explain(model, x, "lrp.attn", target=0)
    torch.testing.assert_close(written.attribution, expected.attribution)


class _UnscaledGradient(Rule):
    """The gradient, without declaring its scale: the engine cannot fuse around it."""

    def backward(self, call, grad_output):
        return Gradient().backward(call, grad_output)


class ShiftedWindows(nn.Module):
    """Swin- and MaxViT-style attention: tokens rolled, ``einsum`` products, axes swapped.

    ``written="plainly"`` computes the same with a slicing roll, ``@`` and ``transpose``.
    """

    def __init__(self, written: str = "swin", bias: bool = True) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.written = written
        self.qkv = nn.Linear(8, 24, bias=bias)
        self.proj = nn.Linear(8, 8, bias=bias)
        self.head = nn.Linear(8, 3, bias=bias)

    def roll(self, x: torch.Tensor, shift: int) -> torch.Tensor:
        if self.written == "swin":
            return torch.roll(x, shift, dims=1)
        return torch.cat([x[:, -shift:], x[:, :-shift]], dim=1)  # either sign of shift

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, tokens, 8)
        shifted = self.roll(x, 2)
        q, k, v = self.qkv(shifted).chunk(3, dim=-1)
        if self.written == "swin":
            scores = torch.einsum("bid,bjd->bij", q, k) / math.sqrt(8)
            mixed = torch.einsum("bij,bjd->bid", scores.softmax(-1), v)
            mixed = mixed.swapaxes(1, 2).swapdims(1, 2).moveaxis(1, 2).moveaxis(2, 1)
            mixed = mixed.flip(1).flip(1)
        else:
            scores = q @ k.transpose(1, 2) / math.sqrt(8)
            mixed = (scores.softmax(-1) @ v).transpose(1, 2).transpose(1, 2)
        out = x + self.roll(self.proj(mixed), -2)
        return self.head(out.mean(1))


@pytest.mark.parametrize("method", ["lrp.attn", "lrp.cp"])
def test_einsum_roll_and_swapaxes_are_explained_as_matmul_slicing_and_transpose(method):
    # A known equivalence: the same network written with the operations the engine knew before
    # (whose rules the tests above compare with the papers' equations).
    x = torch.randn(2, 6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    swin = ShiftedWindows("swin").double().eval()
    plain = ShiftedWindows("plainly").double().eval()
    expected = explain(plain, x, method, 1).attribution
    assert expected.abs().sum() > 0
    torch.testing.assert_close(explain(swin, x, method, 1).attribution, expected)
    with pytest.raises(UnsupportedModelError, match=r"'einsum'.*explain with AttnLRP or CP-LRP"):
        explain(swin, x, "lrp.epsilon", 1)  # a CNN preset: refused, pointing to these methods
    bias_free = ShiftedWindows("swin", bias=False).double().eval()
    if method == "lrp.cp":  # and CP-LRP still conserves
        torch.testing.assert_close(
            explain(bias_free, x, method, 1).delta, torch.zeros(2, dtype=torch.float64)
        )


class GatedAttention(nn.Module):
    """Attention, then a squeeze-excitation gate (MaxViT's MBConv) and a SwiGLU-style product."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.qkv, self.head = nn.Linear(8, 24), nn.Linear(8, 3)
        self.squeeze, self.excite, self.up = nn.Linear(8, 4), nn.Linear(4, 8), nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        h = x + torch.softmax(q @ k.transpose(1, 2) / math.sqrt(8), -1) @ v
        gate = torch.sigmoid(self.excite(F.silu(self.squeeze(h.mean(1, keepdim=True)))))
        h = h * gate.expand_as(h)  # held by AttnLRP: all relevance to h
        a, b = self.up(h).chunk(2, dim=-1)
        return self.head((h + F.silu(a) * b).mean(1))  # SiLU's product: split uniformly


@pytest.mark.parametrize("model", ["encoder", "shifted windows", "gated"])
def test_the_zoo_reference_for_attn_lrp_agrees_and_tells_it_from_cp_lrp(model):
    # benchmarks/check_torchvision_zoo.py checks the real ViT, Swin and MaxViT with it; the
    # reference split MaxViT's sigmoid gates uniformly, which AttnLRP's gate rule holds
    import zoo_references

    if model == "encoder":
        network, x = encoder(norm_first=True), torch.randn(2, 5, 8, dtype=torch.float64)
    elif model == "gated":
        network, x = GatedAttention().double().eval(), torch.randn(2, 5, 8, dtype=torch.float64)
    else:
        network = ShiftedWindows("swin").double().eval()
        x = torch.randn(2, 6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    reference, attention = zoo_references.reference_attn_lrp(network, x, 1)
    assert attention
    torch.testing.assert_close(explain(network, x, "lrp.attn", 1).attribution, reference)
    cp = explain(network, x, "lrp.cp", 1).attribution
    assert (cp - reference).abs().max() > 1e-3 * reference.abs().max()


class CosineAttention(nn.Module):
    """Swin V2's scaled cosine attention: ``F.normalize`` of queries and keys."""

    def __init__(self, detached: str = "") -> None:
        super().__init__()
        torch.manual_seed(5)
        self.detached = detached  # "cp": the papers' CP-LRP form written by hand
        self.qkv, self.head = nn.Linear(8, 24), nn.Linear(8, 3)

    def normalize(self, t: torch.Tensor) -> torch.Tensor:
        if self.detached:
            return t / t.norm(dim=-1, keepdim=True).clamp_min(1e-12).detach()
        return F.normalize(t, dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        weights = torch.softmax(10 * self.normalize(q) @ self.normalize(k).transpose(1, 2), -1)
        if self.detached:
            weights = weights.detach()
        return self.head((weights @ v).mean(1))


def test_cosine_attention_holds_the_norms_constant():
    import zoo_references

    x = torch.randn(2, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    model = CosineAttention().double().eval()
    by_hand = CosineAttention("cp").double().eval()
    inputs = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(by_hand(inputs)[:, 1].sum(), inputs)
    torch.testing.assert_close(explain(model, x, "lrp.cp", 1).attribution, x * grad)
    reference, _ = zoo_references.reference_attn_lrp(model, x, 1)
    torch.testing.assert_close(explain(model, x, "lrp.attn", 1).attribution, reference)


class BiasedScores(nn.Module):
    """Attention whose scores carry an additive bias, as Bloom's ALiBi: ``torch.baddbmm``."""

    def __init__(self, form: str, beta: float = 0.5) -> None:
        super().__init__()
        self.form, self.beta = form, beta
        self.qkv, self.head = nn.Linear(8, 24), nn.Linear(8, 3)
        bias = torch.randn(1, 6, 6, generator=torch.Generator().manual_seed(5))
        self.register_buffer("alibi", bias if beta else bias.fill_(float("nan")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        alibi = self.alibi.to(x.dtype)
        if self.form == "baddbmm":  # as Bloom calls it: the method, keywords
            scores = alibi.baddbmm(batch1=q, batch2=k.transpose(1, 2), beta=self.beta, alpha=0.25)
        else:  # the same with the operations the engine knew before
            scores = 0.25 * (q @ k.transpose(1, 2))
            scores = scores + self.beta * alibi if self.beta else scores
        return self.head((scores.softmax(-1) @ v).mean(1))


@pytest.mark.parametrize("beta", [0.5, 0.0])  # β = 0: torch ignores the input, NaN and all
@pytest.mark.parametrize("method", ["lrp.attn", "lrp.cp", "gradient"])
def test_baddbmm_is_explained_as_its_product_plus_its_scaled_input(method, beta):
    from explain_core.engine.decompose import baddbmm

    x = torch.randn(2, 6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    torch.manual_seed(0)
    fused = BiasedScores("baddbmm", beta).double().eval()
    plain = copy.deepcopy(fused)
    plain.form = "plainly"
    expected = explain(plain, x, method, 1)
    assert expected.attribution.abs().sum() > 0
    result = explain(fused, x, method, 1)
    torch.testing.assert_close(result.attribution, expected.attribution)
    assert torch.isfinite(result.attribution).all()
    a, b, c = (torch.randn(2, 4, n, dtype=torch.float64) for n in (4, 5, 5))
    torch.testing.assert_close(  # the math form equals torch's kernel
        baddbmm(a, b, c.transpose(1, 2), beta=beta, alpha=0.3),
        torch.baddbmm(a, b, c.transpose(1, 2), beta=beta, alpha=0.3),
    )
