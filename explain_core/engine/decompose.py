"""Fused attention written out in its math form, so that rules see its operations.

(Fused recurrent layers and cells, ``torch.lstm``, ``torch.gru``, ``torch.rnn_tanh``/``rnn_relu``
and ``torch.lstm_cell`` …, are written out in :mod:`~explain_core.engine.recurrent` and registered
here too, and so is the gated linear unit ``F.glu``, ``a ⊙ σ(b)``: the gate rules apply to it
as to a gate written by hand.)

``F.scaled_dot_product_attention`` (every backend) and ``F.multi_head_attention_forward`` (what
``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` call) reach the engine as single
operations, and so do attention scores with an additive bias, ``torch.baddbmm`` (Bloom). Inside
the engine's pass they are computed instead as the operations they stand for — projections,
``Q·Kᵀ``, masking, ``softmax``, ``A·V`` — which the composite's rules then apply to, exactly as to
attention written by hand. The values equal the fused kernels' up to float rounding; the model
and ``torch`` are not changed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from explain_core.engine import recurrent
from explain_core.engine.ops import op_name
from explain_core.errors import UnsupportedModelError

__all__ = [
    "DECOMPOSED",
    "MathAttention",
    "baddbmm",
    "glu",
    "multi_head_attention",
    "scaled_dot_product_attention",
]


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``softmax(Q·Kᵀ·scale + mask)·V``, as ``F.scaled_dot_product_attention`` computes it.

    Raises:
        UnsupportedModelError: For dropout (training mode).
    """
    if dropout_p:
        raise UnsupportedModelError(
            f"scaled_dot_product_attention runs with dropout_p={dropout_p} (training): explain "
            "the model in eval mode, where attention dropout is off (pass dropout_p=0.0 then)"
        )
    if enable_gqa and key.size(-3) != query.size(-3):
        groups = query.size(-3) // key.size(-3)
        key = key.repeat_interleave(groups, dim=-3)
        value = value.repeat_interleave(groups, dim=-3)
    scale = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    scores = (query @ key.transpose(-2, -1)) * scale
    if is_causal:
        allowed = torch.ones(
            query.size(-2), key.size(-2), dtype=torch.bool, device=query.device
        ).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
    return torch.softmax(scores, dim=-1) @ value


def multi_head_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    embed_dim_to_check: int,
    num_heads: int,
    in_proj_weight: torch.Tensor | None,
    in_proj_bias: torch.Tensor | None,
    bias_k: torch.Tensor | None,
    bias_v: torch.Tensor | None,
    add_zero_attn: bool,
    dropout_p: float,
    out_proj_weight: torch.Tensor,
    out_proj_bias: torch.Tensor | None,
    training: bool = True,
    key_padding_mask: torch.Tensor | None = None,
    need_weights: bool = True,
    attn_mask: torch.Tensor | None = None,
    use_separate_proj_weight: bool = False,
    q_proj_weight: torch.Tensor | None = None,
    k_proj_weight: torch.Tensor | None = None,
    v_proj_weight: torch.Tensor | None = None,
    static_k: torch.Tensor | None = None,
    static_v: torch.Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``F.multi_head_attention_forward`` for sequence-first ``(L, N, E)`` or unbatched inputs.

    The projections are ``F.linear`` calls with the (detached) weights; the attention weights
    come from one ``softmax`` and the heads from two matrix products.

    Raises:
        UnsupportedModelError: For ``bias_k``/``bias_v``, ``add_zero_attn``, static keys or
            values, or dropout in training mode.
    """
    if bias_k is not None or bias_v is not None or add_zero_attn:
        raise UnsupportedModelError(
            "nn.MultiheadAttention with add_bias_kv=True or add_zero_attn=True has no rule yet: "
            "build it without them"
        )
    if static_k is not None or static_v is not None:
        raise UnsupportedModelError("multi_head_attention_forward with static_k/static_v")
    if training and dropout_p:
        raise UnsupportedModelError(
            "nn.MultiheadAttention runs with dropout in training mode: call model.eval()"
        )
    unbatched = query.dim() == 2
    if unbatched:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    length, batch, width = query.shape
    source = key.shape[0]
    head = width // num_heads
    if use_separate_proj_weight:
        weights = (q_proj_weight, k_proj_weight, v_proj_weight)
    else:
        assert in_proj_weight is not None
        weights = in_proj_weight.chunk(3)
    biases = in_proj_bias.chunk(3) if in_proj_bias is not None else (None, None, None)
    projected = []
    for tensor, weight, bias, size in zip(
        (query, key, value), weights, biases, (length, source, source), strict=True
    ):
        out = F.linear(tensor, _constant(weight), _constant(bias))
        projected.append(out.reshape(size, batch * num_heads, head).transpose(0, 1))
    q, k, v = projected
    mask = _additive_mask(attn_mask, key_padding_mask, batch, num_heads, length, source, q)
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(head))
    if mask is not None:
        scores = scores + mask
    attention = torch.softmax(scores, dim=-1)
    out = (attention @ v).transpose(0, 1).reshape(length * batch, width)
    out = F.linear(out, _constant(out_proj_weight), _constant(out_proj_bias))
    out = out.reshape(length, batch, width)
    attention_out = None
    if need_weights:
        attention_out = attention.reshape(batch, num_heads, length, source)
        if average_attn_weights:
            attention_out = attention_out.mean(dim=1)
    if unbatched:
        out = out.squeeze(1)
        attention_out = attention_out.squeeze(0) if attention_out is not None else None
    return out, attention_out


def baddbmm(
    input: torch.Tensor,  # torch's names: callers pass them as keywords
    batch1: torch.Tensor,
    batch2: torch.Tensor,
    *,
    beta: float = 1.0,
    alpha: float = 1.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``β·input + α·(batch1 @ batch2)``, as ``torch.baddbmm`` computes it.

    Attention scores with an additive bias (Bloom's ALiBi): the product of two activations and
    the addition become operations of their own, which the composite's rules apply to. As in
    torch, ``input`` is ignored where ``β = 0``.

    Raises:
        UnsupportedModelError: For ``out=`` (the pass cannot write into a given tensor).
    """
    if out is not None:
        raise UnsupportedModelError(
            "baddbmm writes into out=: the relevance engine cannot follow a result written into "
            "a given tensor; assign the result instead (scores = torch.baddbmm(...))"
        )
    product = batch1 @ batch2
    if alpha != 1:
        product = product * alpha
    if beta == 0:
        return product
    return product + (input if beta == 1 else input * beta)


def _constant(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """A weight as a constant of the pass (its views are not activations)."""
    return None if tensor is None else tensor.detach()


def _additive_mask(
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    batch: int,
    heads: int,
    length: int,
    source: int,
    like: torch.Tensor,
) -> torch.Tensor | None:
    """``attn_mask`` and ``key_padding_mask`` as one additive ``(N·H, L, S)`` mask."""
    mask = None
    for part, shape in (
        (attn_mask, (-1, length, source)),
        (key_padding_mask, (batch, 1, 1, source)),
    ):
        if part is None:
            continue
        part = part.detach()
        if part.dtype == torch.bool:  # True: not allowed to attend
            part = torch.zeros(part.shape, dtype=like.dtype, device=like.device).masked_fill(
                part, float("-inf")
            )
        part = part.to(like.dtype).reshape(shape)
        if part.dim() == 4:  # key padding: per sample, the same for every head and query
            part = part.expand(batch, heads, 1, source).reshape(batch * heads, 1, source)
        mask = part if mask is None else mask + part
    return mask


def glu(input: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``F.glu``: the first half of ``input`` along ``dim`` gated by the second's sigmoid."""
    signal, gate = input.chunk(2, dim)
    return signal * torch.sigmoid(gate)


DECOMPOSED: dict[str, Callable[..., Any]] = {
    "glu": glu,
    "scaled_dot_product_attention": scaled_dot_product_attention,
    "multi_head_attention_forward": multi_head_attention,
    "baddbmm": baddbmm,
    "lstm": recurrent.lstm,
    "gru": recurrent.gru,
    "rnn_tanh": recurrent.rnn_tanh,
    "rnn_relu": recurrent.rnn_relu,
    **recurrent.CELLS,
}
"""Operation kind → its math form."""


class MathAttention(TorchFunctionMode):
    """Inside this context fused attention runs in its math form (this thread only).

    For traced gradient graphs (ONNX exports): the fused kernels' backward operators have no
    ONNX translation, their math form's have.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        math_form = DECOMPOSED.get(op_name(func))
        if math_form is not None:
            with self:
                return math_form(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))
