"""Token pictures: tokens coloured by relevance, red positive and blue negative, as HTML and PNG."""

import pytest
import torch

from explain_core.viz import save_tokens, tokens_to_html


def test_html_colours_escapes_and_labels_every_token():
    tokens = ["[CLS]", "<b>", "cat", "&"]
    page = tokens_to_html(tokens, torch.tensor([0.0, 2.0, -2.0, 1.0]))
    assert "&lt;b&gt;" in page and "<b>" not in page and "&amp;" in page
    assert "rgb(255, 255, 255)" in page  # 0: white
    assert "rgb(255, 0, 0)" in page  # the largest positive: red
    assert "rgb(0, 0, 255)" in page  # as large, negative: blue
    assert "rgb(255, 128, 128)" in page  # half of the largest: half-way to red
    assert 'title="-2"' in page


def test_png_shows_each_token_on_its_colour(tmp_path):
    pytest.importorskip("PIL", reason="the plots extra is missing")
    from PIL import Image

    tokens = ["good", "bad", "film"] * 30  # wraps onto several lines
    relevance = torch.tensor([1.0, -1.0, 0.0] * 30)
    path = save_tokens(tokens, relevance, tmp_path / "tokens.png")
    picture = Image.open(path).convert("RGB")
    assert picture.width == 600 and picture.height > 8 + 18  # more than one line
    assert picture.getpixel((5, 5)) == (255, 0, 0)  # the first token's box, left edge
    html = save_tokens(tokens[:3], relevance[:3], tmp_path / "tokens.html").read_text()
    assert html.startswith("<!doctype html>") and "film" in html


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="one relevance value per token"):
        tokens_to_html(["a", "b"], torch.tensor([1.0]))
    with pytest.raises(ValueError, match="NaN"):
        tokens_to_html(["a"], torch.tensor([float("nan")]))
    with pytest.raises(ValueError, match=r"\.html or \.png"):
        save_tokens(["a"], torch.tensor([1.0]), "tokens.txt")
