"""AttnLRP and CP-LRP on many Hugging Face model families (small random configs, float64).

The test suite checks BERT, GPT-2, ViT, Llama and Bloom in depth
(``tests/test_transformers_hf.py``); this run takes one small configuration of each of many
more families, as a user would build them, and records for ``lrp.attn``, ``lrp.cp`` and
``input_x_gradient``: a finite map or one clear refusal (never an exception from inside torch),
CP-LRP's conservation on the bias-free twin (every bias, position and token-type embedding,
class token and BatchNorm mean zero; ``|Σ R − f| / |f|``, largest over the batch), and that the
model's parameters and buffers are unchanged after every call. It writes
``benchmarks/results/hf_families.md``:

    PYTHONPATH=.:plugins:exporters:tests python benchmarks/check_hf_families.py
"""

from __future__ import annotations

import copy
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers as hf
from bench_transformers_speed import Logits
from test_transformers_hf import bias_free
from torch import nn

from explain_core import explain
from explain_core.errors import ExplainError

RESULTS = Path(__file__).parent / "results" / "hf_families.md"
METHODS = ("lrp.attn", "lrp.cp", "input_x_gradient")
SMALL = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "num_labels": 3,
}
DECODER = {**SMALL, "pad_token_id": 0}
IMAGE = {**SMALL, "image_size": 16, "patch_size": 4}


def _text(model: type, config: hf.PretrainedConfig, width: int = 32) -> Callable:
    return lambda: (model(config), "inputs_embeds", (2, 6, width))


def _image(model: type, config: hf.PretrainedConfig, side: int = 16) -> Callable:
    return lambda: (model(config), "pixel_values", (2, 3, side, side))


FAMILIES: dict[str, Callable[[], tuple[nn.Module, str, tuple[int, ...]]]] = {
    "roberta": _text(hf.RobertaForSequenceClassification, hf.RobertaConfig(**SMALL)),
    "xlm-roberta": _text(hf.XLMRobertaForSequenceClassification, hf.XLMRobertaConfig(**SMALL)),
    "distilbert": _text(
        hf.DistilBertForSequenceClassification,
        hf.DistilBertConfig(dim=32, n_layers=2, n_heads=4, hidden_dim=64, num_labels=3),
    ),
    "albert": _text(
        hf.AlbertForSequenceClassification, hf.AlbertConfig(embedding_size=16, **SMALL), 16
    ),
    "electra": _text(
        hf.ElectraForSequenceClassification, hf.ElectraConfig(embedding_size=32, **SMALL)
    ),
    "deberta-v2": _text(hf.DebertaV2ForSequenceClassification, hf.DebertaV2Config(**SMALL)),
    "mpnet": _text(hf.MPNetForSequenceClassification, hf.MPNetConfig(**SMALL)),
    "opt": _text(
        hf.OPTForSequenceClassification,
        hf.OPTConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            ffn_dim=64,
            word_embed_proj_dim=32,
            num_labels=3,
            pad_token_id=0,
        ),
    ),
    "gpt-neo": _text(
        hf.GPTNeoForSequenceClassification,
        hf.GPTNeoConfig(
            hidden_size=32,
            num_layers=2,
            num_heads=4,
            attention_types=[[["global", "local"], 1]],
            num_labels=3,
            pad_token_id=0,
        ),
    ),
    "gpt-neox": _text(hf.GPTNeoXForSequenceClassification, hf.GPTNeoXConfig(**DECODER)),
    "bloom": _text(
        hf.BloomForSequenceClassification,
        hf.BloomConfig(hidden_size=32, n_layer=2, n_head=4, num_labels=3, pad_token_id=0),
    ),
    "falcon": _text(
        hf.FalconForSequenceClassification,
        hf.FalconConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_labels=3,
            pad_token_id=0,
        ),
    ),
    "mistral": _text(
        hf.MistralForSequenceClassification, hf.MistralConfig(num_key_value_heads=2, **DECODER)
    ),
    "qwen2": _text(
        hf.Qwen2ForSequenceClassification, hf.Qwen2Config(num_key_value_heads=2, **DECODER)
    ),
    "gemma": _text(
        hf.GemmaForSequenceClassification,
        hf.GemmaConfig(num_key_value_heads=2, head_dim=8, **DECODER),
    ),
    "phi": _text(hf.PhiForSequenceClassification, hf.PhiConfig(**DECODER)),
    "phi3": _text(
        hf.Phi3ForSequenceClassification, hf.Phi3Config(num_key_value_heads=2, **DECODER)
    ),
    "deit": _image(hf.DeiTForImageClassification, hf.DeiTConfig(**IMAGE)),
    "beit": _image(hf.BeitForImageClassification, hf.BeitConfig(**IMAGE)),
    "dinov2": _image(hf.Dinov2ForImageClassification, hf.Dinov2Config(**IMAGE)),
    "swin": _image(
        hf.SwinForImageClassification,
        hf.SwinConfig(
            image_size=32,
            patch_size=4,
            embed_dim=16,
            depths=[1, 1],
            num_heads=[2, 2],
            window_size=4,
            num_labels=3,
        ),
        32,
    ),
    "convnext": _image(
        hf.ConvNextForImageClassification,
        hf.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_labels=3),
        32,
    ),
    "resnet": _image(
        hf.ResNetForImageClassification,
        hf.ResNetConfig(hidden_sizes=[8, 16], depths=[1, 1], embedding_size=8, num_labels=3),
        32,
    ),
    "mobilevit": _image(
        hf.MobileViTForImageClassification,
        hf.MobileViTConfig(
            image_size=32,
            hidden_sizes=[16, 24, 32],
            neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 32],
            num_labels=3,
        ),
        32,
    ),
}
"""Family → a builder of (model, input name, input shape)."""


def _refusal(error: ExplainError) -> str:
    message = str(error)
    assert "\n" not in message.strip(), message  # one clear line
    return "refuses: " + message.split(";")[0][:110].replace("|", "\\|")


def outcome(model: nn.Module, key: str, x: torch.Tensor, method: str) -> str:
    """What ``method`` gives on ``model``: a map (finite) or its refusal; the model unchanged."""
    state = copy.deepcopy(model.state_dict())
    try:
        result = explain(Logits(model, key), x, method, 1)
    except ExplainError as error:
        cell = _refusal(error)
    else:
        assert torch.isfinite(result.attribution).all(), method
        assert result.attribution.abs().sum() > 0, method
        cell = "✓ map"
    after = model.state_dict()
    assert all(torch.equal(state[name], after[name]) for name in state), method
    return cell


def conservation(model: nn.Module, key: str, x: torch.Tensor) -> str:
    """CP-LRP's relative gap ``|Σ R − f| / |f|`` on the bias-free twin (largest over the batch)."""
    twin = bias_free(copy.deepcopy(model))
    try:
        result = explain(Logits(twin, key), x, "lrp.cp", 1)
    except ExplainError:
        return "—"
    gap = (result.delta.abs() / result.output[:, 1].abs()).max()
    return f"{float(gap):.0e}"


def main() -> None:
    torch.set_num_threads(2)
    start = time.perf_counter()
    rows = []
    for family, build in FAMILIES.items():
        torch.manual_seed(0)
        model, key, shape = build()
        model = model.double().eval()
        x = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        cells = [outcome(model, key, x, method) for method in METHODS]
        rows.append(f"| {family} | " + " | ".join([*cells, conservation(model, key, x)]) + " |")
        print(rows[-1], flush=True)
    seconds = time.perf_counter() - start
    header = "| family | " + " | ".join(f"`{m}`" for m in METHODS) + " | CP-LRP gap, bias-free |"
    text = "\n".join(
        [
            "# AttnLRP and CP-LRP on Hugging Face model families (small random configs)",
            "",
            f"Run with torch {torch.__version__}, transformers {hf.__version__} on "
            f"{platform.machine()} with 2 threads in {seconds:.0f} s. Command: "
            "`PYTHONPATH=.:plugins:exporters:tests python benchmarks/check_hf_families.py`.",
            "Each family: one small configuration, random weights, float64, eval mode, class 1.",
            "Every map is finite and non-zero, every refusal one line, and the model's parameters",
            "and buffers are unchanged after every call (asserted). CP-LRP gap: `|Σ R − f| / |f|`",
            "on the bias-free twin (every bias, additive embedding and BatchNorm mean zero).",
            "",
            header,
            "|" + " --- |" * (len(METHODS) + 2),
            *rows,
            "",
        ]
    )
    RESULTS.write_text(text)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
