"""Explained ONNX export of attention models: AttnLRP, CP-LRP and Input×Gradient in one graph.

Fused attention (``nn.MultiheadAttention``'s fast path, ``F.scaled_dot_product_attention``) is
traced in its math form; the graphs are checked against ``explain()`` on batches never traced.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

for _module in ("onnx", "onnxscript", "onnxruntime"):
    pytest.importorskip(_module, reason="the onnx extra is not installed")

import onnx  # noqa: E402

from explain_core import explain  # noqa: E402
from explain_onnx import OnnxSession, export_onnx  # noqa: E402
from explain_onnx.parity import relative_difference  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Encoder(nn.Module):
    """Token vectors → a small ``nn.TransformerEncoder`` (fused attention) → mean → classes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(
            16, 4, 32, dropout=0.0, batch_first=True, activation="gelu"
        )
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(tokens).mean(1))


def assert_standard(path) -> None:
    graph = onnx.load(str(path))
    onnx.checker.check_model(graph, full_check=True)
    assert {node.domain for node in graph.graph.node} <= {"", "ai.onnx"}


@pytest.mark.parametrize("method", ["lrp.attn", "lrp.cp", "input_x_gradient"])
def test_transformer_encoder_exports_with_parity(tmp_path, method):
    model = Encoder().eval()
    path = tmp_path / "encoder.onnx"
    result = export_onnx(model, torch.randn(4, 5, 16), path, explain=method, target_input=True)
    assert result.parity is not None and result.parity.passed
    assert_standard(path)

    torch.manual_seed(1)
    held_back = torch.randn(3, 5, 16)  # a batch size never traced
    target = torch.tensor([2, 0, 1])
    logits, relevance = OnnxSession(path).run(held_back, target)
    reference = explain(model, held_back, method, target)
    assert np.abs(logits - reference.output.numpy()).max() <= 1e-4
    assert relative_difference(relevance, reference.attribution.numpy()) <= 1e-3


class FromEmbeddings(nn.Module):
    """A Hugging Face model run from its input embeddings: the logits (at one position)."""

    def __init__(self, model: nn.Module, position: int | None = None) -> None:
        super().__init__()
        self.model = model
        self.position = position

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        logits = self.model(inputs_embeds=embeddings).logits
        return logits if self.position is None else logits[:, self.position]


def hugging_face_models() -> dict[str, tuple[nn.Module, torch.Tensor]]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    small = {"num_attention_heads": 4, "attn_implementation": "sdpa"}
    bert = transformers.BertForSequenceClassification(
        transformers.BertConfig(
            vocab_size=40, hidden_size=32, num_hidden_layers=2, intermediate_size=64, **small
        )
    )
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=40,
            hidden_size=32,
            num_hidden_layers=2,
            num_key_value_heads=2,
            intermediate_size=64,
            **small,
        )
    )
    return {
        "bert": (FromEmbeddings(bert).eval(), torch.randn(3, 6, 32)),
        "llama": (FromEmbeddings(llama, position=-1).eval(), torch.randn(3, 6, 32)),
    }


@pytest.mark.parametrize(
    "family, method", [("bert", "lrp.attn"), ("llama", "lrp.attn"), ("llama", "lrp.cp")]
)
def test_hugging_face_models_export_with_parity(tmp_path, family, method):
    """BERT (GELU module, LayerNorm) and Llama (SwiGLU, RMSNorm module, rotary, causal SDPA)."""
    model, example = hugging_face_models()[family]
    path = tmp_path / f"{family}.onnx"
    result = export_onnx(model, example, path, explain=method)
    assert result.parity is not None and result.parity.passed
    held_back = torch.randn(2, 6, 32)
    logits, relevance = OnnxSession(path).run(held_back)
    reference = explain(model, held_back, method)
    assert np.abs(logits - reference.output.numpy()).max() <= 1e-4
    assert relative_difference(relevance, reference.attribution.numpy()) <= 1e-3
