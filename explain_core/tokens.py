"""Explaining models that take token ids: attributions at the embeddings, and per token.

Integer token ids carry no gradient, so a language model is explained at its embedding output:
:func:`explain_tokens` embeds the ids once, runs the model from those vectors (the Hugging Face
convention ``model(inputs_embeds=..., attention_mask=..., ...)``) and returns the attribution of
every vector and its sum per token. The model's other inputs (attention mask, token types, …) go
with every call; a model returning an output object is read at ``.logits``; for a score per
position (a language model's next token), ``position`` picks the one explained.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from explain_core.api import explain
from explain_core.attribution import Attribution
from explain_core.errors import InvalidInputError
from explain_core.targets import TargetLike

__all__ = ["TokenAttribution", "explain_tokens"]


@dataclass
class TokenAttribution:
    """An explanation of a model that takes token ids.

    Attributes:
        attribution: The explanation at the embeddings, ``(batch, tokens, hidden)``.
        relevance: Its sum over the hidden dimension: one value per token, ``(batch, tokens)``;
            0 at padding (``attention_mask == 0``).
        tokens: The tokens of each sample, when a tokenizer was given.
    """

    attribution: Attribution
    relevance: torch.Tensor
    tokens: list[list[str]] | None = None


class _FromEmbeddings(nn.Module):
    """The model run from its embeddings, returning ``(batch, n_outputs)`` scores."""

    def __init__(
        self,
        model: nn.Module,
        others: Mapping[str, torch.Tensor],
        key: str,
        position: int | None,
    ) -> None:
        super().__init__()
        self.model = model
        self.others = dict(others)
        self.key = key
        self.position = position

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        others = {}
        samples = embeddings.shape[0]
        for name, value in self.others.items():
            copies, rest = divmod(samples, value.shape[0])
            if samples < value.shape[0]:  # the first samples (the engine traces on one)
                others[name] = value[:samples]
            elif rest:
                raise InvalidInputError(
                    f"the method ran the model on {samples} samples, not a multiple of the "
                    f"{value.shape[0]} given with {name!r}"
                )
            else:  # methods stack copies of the batch (path points, noisy copies, reference)
                others[name] = value.repeat(copies, *([1] * (value.dim() - 1)))
        output = self.model(**{self.key: embeddings}, **others)
        scores = getattr(output, "logits", output)
        if isinstance(scores, tuple):
            scores = scores[0]
        if not isinstance(scores, torch.Tensor):
            raise InvalidInputError(
                f"the model returned {type(output).__name__}; expected a tensor of scores or an "
                "output object with .logits"
            )
        if scores.dim() == 3:
            if self.position is None:
                raise InvalidInputError(
                    f"the model returns a score per position {tuple(scores.shape)}: pass "
                    "position= (e.g. -1 for the next token after the last one)"
                )
            scores = scores[:, self.position]
        return scores


def explain_tokens(
    model: nn.Module,
    inputs: Mapping[str, torch.Tensor],
    method: str,
    target: TargetLike = None,
    *,
    position: int | None = None,
    embedding: nn.Module | None = None,
    tokenizer: Any = None,
    ids: str = "input_ids",
    embeddings_key: str = "inputs_embeds",
    **options: Any,
) -> TokenAttribution:
    """Explain a model that takes token ids (and other inputs) at its embeddings.

    Args:
        model: The model, in eval mode; it is called as ``model(inputs_embeds=vectors,
            **other_inputs)`` and may return scores or an output object with ``.logits``.
        inputs: Its inputs by name, e.g. a tokenizer's output: ``input_ids`` plus
            ``attention_mask``, ``token_type_ids``, …
        method: A registered method, e.g. ``"lrp.attn"``.
        target: The explained output (see :func:`~explain_core.explain`): a class, or for a
            language model a token id (with ``position``).
        position: For a score per position ``(batch, tokens, n)``: the explained position,
            e.g. ``-1`` (the next token after the last one).
        embedding: The module mapping ids to vectors; by default
            ``model.get_input_embeddings()`` (Hugging Face models).
        tokenizer: Gives the tokens (``convert_ids_to_tokens``), optional.
        ids: The name of the token ids in ``inputs``.
        embeddings_key: The name under which the model takes the vectors.
        **options: Method options (``baselines=`` too: a reference at the embeddings).

    Raises:
        InvalidInputError: For missing ids, no embedding module, or outputs that do not fit.
    """
    if ids not in inputs or not isinstance(inputs[ids], torch.Tensor):
        raise InvalidInputError(
            f"inputs needs the token ids under {ids!r} (a tokenizer's output, e.g. "
            f"tokenizer(texts, return_tensors='pt', padding=True)); got {sorted(inputs)}"
        )
    token_ids = inputs[ids]
    if embedding is None:
        getter = getattr(model, "get_input_embeddings", None)
        embedding = getter() if callable(getter) else None
        if not isinstance(embedding, nn.Module):
            raise InvalidInputError(
                "cannot find the model's embedding module: pass embedding=the module that maps "
                "token ids to vectors (e.g. model.embed_tokens)"
            )
    with torch.no_grad():
        vectors = embedding(token_ids).detach()
    others = {
        name: value
        for name, value in inputs.items()
        if name != ids and isinstance(value, torch.Tensor)
    }
    wrapped = _FromEmbeddings(model, others, embeddings_key, position)
    attribution = explain(wrapped, vectors, method, target, **options)
    relevance = attribution.attribution.sum(-1)
    mask = inputs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.shape == relevance.shape:
        relevance = relevance * (mask != 0)
    tokens = None
    if tokenizer is not None:
        tokens = [tokenizer.convert_ids_to_tokens(row.tolist()) for row in token_ids]
    return TokenAttribution(attribution, relevance, tokens)
