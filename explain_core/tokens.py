"""Models called with keyword inputs: token ids explained at their embeddings, or any input.

Integer token ids carry no gradient, so a language model is explained at its embedding output:
:func:`explain_tokens` embeds the ids once, runs the model from those vectors (the Hugging Face
convention ``model(inputs_embeds=..., attention_mask=..., ...)``) and returns the attribution of
every vector and its sum per token. The model's other inputs (attention mask, token types, …) go
with every call; a model returning an output object is read at ``.logits``; for a score per
position (a language model's next token), ``position`` picks the one explained.
:func:`explain_inputs` does the same for a floating-point input given by name
(``pixel_values``, say).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from explain_core.api import explain
from explain_core.attribution import Attribution
from explain_core.errors import InvalidInputError
from explain_core.targets import TargetLike

__all__ = ["TokenAttribution", "explain_inputs", "explain_tokens"]


@dataclass
class TokenAttribution:
    """An explanation of a model that takes token ids.

    Attributes:
        attribution: The explanation at the embeddings, ``(batch, tokens, hidden)``.
        relevance: Its sum over the hidden dimension: one value per token, ``(batch, tokens)``;
            0 at padding (``attention_mask == 0``).
        tokens: The tokens of each sample, when a tokenizer was given.
        absorbed: With ``explain_tokens(..., absorbed=True)``: the relevance per token that
            each of the model's other embedding tables (by module name, e.g.
            ``"bert.embeddings.position_embeddings"``) absorbs, ``(batch, tokens)``.
    """

    attribution: Attribution
    relevance: torch.Tensor
    tokens: list[list[str]] | None = None
    absorbed: dict[str, torch.Tensor] = field(default_factory=dict)


class _EmbeddingTables(TorchFunctionMode):
    """Replaces the lookups in the given embedding tables by given vectors (this thread only)."""

    def __init__(self, tables: Mapping[int, Callable[[torch.Tensor], torch.Tensor]]) -> None:
        super().__init__()
        self.tables = tables  # id(weight) → the vectors to return for a lookup

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        vectors = self.tables.get(id(_table(func, args, kwargs)))
        if vectors is not None:
            return vectors(func(*args, **kwargs))
        return func(*args, **kwargs)


def _table(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The table an ``F.embedding`` call looks up in, else ``None``."""
    if func is not F.embedding:
        return None
    return kwargs.get("weight", args[1] if len(args) > 1 else None)


class _KeywordModel(nn.Module):
    """The model run from one of its keyword inputs, returning ``(batch, n_outputs)`` scores.

    With ``tables``, the input is ``(batch, 1 + len(tables), tokens, hidden)``: the token
    vectors, then the vectors those embedding tables give each token (which the model's own
    lookups in them return instead).
    """

    def __init__(
        self,
        model: nn.Module,
        others: Mapping[str, Any],
        key: str,
        position: int | None,
        tables: Sequence[nn.Embedding] = (),
    ) -> None:
        super().__init__()
        if "labels" in others:  # a Hugging Face model returns the loss first then
            raise InvalidInputError(
                "the inputs hold 'labels': with them the model computes a loss and returns it "
                "first (with return_dict=False, before the logits), which would be explained "
                "instead of a class score; leave 'labels' out, target= picks the explained class"
            )
        self.model = model
        self.others = dict(others)
        self.key = key
        self.position = position
        self.tables = list(tables)

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        if not self.tables:
            return self._scores(embeddings)

        def given(index: int) -> Callable[[torch.Tensor], torch.Tensor]:
            # the model's lookup (e.g. (1, tokens, hidden) positions) as the input's vectors
            return lambda looked_up: embeddings[:, 1 + index].expand(
                embeddings.shape[0], *looked_up.shape[1:]
            )

        tables = {id(table.weight): given(i) for i, table in enumerate(self.tables)}
        with _EmbeddingTables(tables):
            return self._scores(embeddings[:, 0])

    def _call_model(self, embeddings: torch.Tensor) -> Any:
        others = {}
        samples = embeddings.shape[0]
        tiled = False  # some input repeated for copies of the batch
        for name, value in self.others.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                others[name] = value  # an option (a flag, a number): as given
                continue
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
                tiled = tiled or copies > 1
        try:
            return self.model(**{self.key: embeddings}, **others)
        except RuntimeError as error:
            if not tiled or "must be sorted in decreasing order" not in str(error):
                raise
            raise InvalidInputError(
                "the model packs its sequences with pack_padded_sequence(..., "
                "enforce_sorted=True), and the method runs it on copies of the batch one after "
                "another (path points, noisy copies or references), whose lengths are then no "
                "longer sorted; pack with enforce_sorted=False, which gives the same outputs"
            ) from error

    def _scores(self, embeddings: torch.Tensor) -> torch.Tensor:
        output = self._call_model(embeddings)
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


def explain_inputs(
    model: nn.Module,
    inputs: Mapping[str, Any],
    method: str,
    target: TargetLike = None,
    *,
    explained: str,
    position: int | None = None,
    **options: Any,
) -> Attribution:
    """Explain a model called with keyword inputs at one of them, the others held as given.

    For Hugging Face models and any model whose ``forward`` takes several inputs:
    ``explain_inputs(vit, {"pixel_values": x}, "lrp.attn", 3, explained="pixel_values")``.
    The model may return scores or an output object with ``.logits``; ``position`` picks the
    explained position of a score per position. Other tensors with a batch axis go with every
    call (stacked as methods stack the batch); other values (flags, numbers) are passed as given.

    Args:
        model: The model, in eval mode, called as ``model(**inputs)``.
        inputs: Its inputs by name.
        method: A registered method.
        target: The explained output (see :func:`~explain_core.explain`).
        explained: The name of the floating-point input to explain.
        position: For a score per position ``(batch, positions, n)``: the explained position.
        **options: Method options (``baselines=`` too, shaped like the explained input).

    Raises:
        InvalidInputError: If ``explained`` is not a floating-point tensor among ``inputs``.
    """
    value = inputs.get(explained)
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise InvalidInputError(
            f"explained={explained!r} must name a floating-point tensor among the inputs "
            f"{sorted(inputs)}; token ids are explained at their embeddings with explain_tokens"
        )
    others = {name: other for name, other in inputs.items() if name != explained}
    wrapped = _KeywordModel(model, others, explained, position)
    return explain(wrapped, value, method, target, **options)


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
    absorbed: bool = False,
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
        absorbed: Also explain the model's other embedding tables (position, token type):
            the vectors they add to each token become part of the explained input, and their
            relevance per token is ``result.absorbed[table name]``. For the rules of LRP the
            token relevance is the same either way; for Integrated Gradients and SmoothGrad
            the path and the noise then move those vectors too.
        **options: Method options (``baselines=`` too: a reference at the embeddings; with
            ``absorbed``, shaped ``(batch, 1 + tables, tokens, hidden)``).

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
    _require_keyword(model, embeddings_key)
    with torch.no_grad():
        vectors = embedding(token_ids).detach()
    others = {
        name: value
        for name, value in inputs.items()
        if name != ids and isinstance(value, torch.Tensor)
    }
    tables: dict[str, nn.Embedding] = {}
    if absorbed:
        looked_up = _other_lookups(model, vectors, others, embeddings_key, embedding)
        if not looked_up:
            raise InvalidInputError(
                "absorbed=True, but the model looks up no embedding table besides its token "
                "embeddings (no position or token-type embeddings to report)"
            )
        tables = {name: table for name, (table, _) in looked_up.items()}
        vectors = torch.stack([vectors, *(found for _, found in looked_up.values())], dim=1)
    wrapped = _KeywordModel(model, others, embeddings_key, position, list(tables.values()))
    result = explain(wrapped, vectors, method, target, **options)
    mask = inputs.get("attention_mask")
    keep = None
    if isinstance(mask, torch.Tensor) and mask.shape == token_ids.shape:
        keep = mask != 0
    per_token = result.attribution.sum(-1)
    if keep is not None:
        per_token = per_token * (keep[:, None] if tables else keep)
    absorbed_relevance = {}
    if tables:
        token_vectors = replace(result, attribution=result.attribution[:, 0])
        absorbed_relevance = {name: per_token[:, 1 + i] for i, name in enumerate(tables)}
        result, per_token = token_vectors, per_token[:, 0]
    tokens = None
    if tokenizer is not None:
        tokens = [tokenizer.convert_ids_to_tokens(row.tolist()) for row in token_ids]
    return TokenAttribution(result, per_token, tokens, absorbed_relevance)


def _require_keyword(model: nn.Module, key: str) -> None:
    """Refuse a model whose ``forward`` cannot take the vectors as ``key``.

    Raises:
        InvalidInputError: Naming the forward's parameters and the two ways out.
    """
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):  # a builtin forward: let the call itself decide
        return
    if any(p.kind is p.VAR_KEYWORD or p.name == key for p in parameters):
        return
    names = ", ".join(p.name for p in parameters)
    raise InvalidInputError(
        f"explain_tokens calls model({key}=vectors, ...), but {type(model).__name__}.forward "
        f"takes ({names}): pass embeddings_key= the name of its parameter for the vectors, or "
        "explain the part after the embedding with explain() on the embedding's output "
        "(docs/recurrent.md, a text-like classifier)"
    )


def _other_lookups(
    model: nn.Module,
    vectors: torch.Tensor,
    others: Mapping[str, torch.Tensor],
    key: str,
    token_embedding: nn.Module,
) -> dict[str, tuple[nn.Embedding, torch.Tensor]]:
    """The other embedding tables the model's forward looks up, with their vectors.

    By module name: the table and the vectors it gives each token, ``(batch, tokens, hidden)``.
    """
    candidates = {
        id(module.weight): (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Embedding) and module is not token_embedding
    }
    found: dict[str, tuple[nn.Embedding, torch.Tensor]] = {}

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            result = func(*args, **kwargs)
            table = candidates.get(id(_table(func, args, kwargs)))
            if table is not None:
                name, module = table
                found[name] = (module, result.expand(vectors.shape).detach().clone())
            return result

    with torch.no_grad(), Record():
        _KeywordModel(model, others, key, None)._call_model(vectors)
    return found
