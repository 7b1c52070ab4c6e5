"""Attention (§3.2): scaled dot-product attention (§3.2.1) and multi-head attention (§3.2.2).

Legend: B batch, T query length, S key/value length, H heads (the paper's h),
D_k / D_v per-head sizes (d_k, d_v).

Masks are boolean with ``True`` = may attend (see ``aiayn.model.masks``); this is the opposite
of ``torch.nn.Transformer``'s convention.

What differs from the paper, and why:
- A query row whose mask allows no key returns zeros rather than NaN (softmax over an empty set
  is undefined; zeros keep training and batched decoding finite).
- Optional dropout on the attention weights (``attention_dropout``, default 0 as in the paper).
- Incremental decoding passes a ``LayerCache`` (``model/cache.py``, not in the paper) holding
  the keys and values of earlier positions; modules never keep it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .cache import LayerCache

__all__ = ["scaled_dot_product_attention", "MultiHeadAttention"]


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    dropout_p: float = 0.0,
    need_weights: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Attention(Q, K, V) = softmax(Q Kᵀ / √d_k) V  (§3.2.1, eq. 1).

    One function, two paths: the explicit formula when the weights are needed, otherwise
    ``torch.nn.functional.scaled_dot_product_attention`` (fused kernels). Tests keep them equal.

    Args:
        q, k, v: queries ``(B, H, T, D_k)``, keys ``(B, H, S, D_k)``, values ``(B, H, S, D_v)``.
        mask: boolean, ``True`` = may attend, broadcastable to ``(B, H, T, S)``.
        dropout_p: dropout on the attention weights (pass 0 in eval mode).
        need_weights: also return the attention weights.

    Returns:
        ``(out, weights)``: ``out`` is ``(B, H, T, D_v)``; ``weights`` is ``(B, H, T, S)``
        or None. A query row with no key to attend to gives zeros (and zero weights).
    """
    if not need_weights and q.dtype == torch.bfloat16 and q.device.type == "cpu":
        # torch's fused bfloat16 CPU kernel's backward ran ~10x slower than float32's (a third of a
        # bf16 training step at d_model 256): in float32 there, autocast (training) or not
        with torch.autocast("cpu", enabled=False):
            out, _ = scaled_dot_product_attention(q.float(), k.float(), v.float(), mask, dropout_p)
        return out.to(q.dtype), None
    if mask is not None:
        # Rows that may attend to nothing: let them attend everywhere (finite softmax), then zero
        # their output, so neither the forward nor the backward pass meets a NaN.
        valid = mask.any(dim=-1, keepdim=True)  # (B|1, H|1, T|1, 1)
        mask = mask | ~valid
    if need_weights:
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (B, H, T, S)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        weights = scores.softmax(dim=-1)
        if mask is not None:
            weights = weights.masked_fill(~valid, 0.0)
        out = F.dropout(weights, p=dropout_p) @ v  # (B, H, T, D_v)
    else:
        weights = None
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
    if mask is not None:
        out = out.masked_fill(~valid, 0.0)
    return out, weights


class MultiHeadAttention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O,
    head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V)  (§3.2.2).

    The h heads are folded into a tensor dimension, never looped over. One module serves both
    uses in the paper (§3.2.3):
    - self-attention (``cross=False``): Q, K and V all come from ``x``, through one fused
      projection ``in_proj`` = [W^Q; W^K; W^V];
    - encoder-decoder attention (``cross=True``): Q from the decoder state ``x``, K and V from
      the encoder output ``memory``, through the same ``in_proj`` split in two.
    The weight layout equals ``torch.nn.MultiheadAttention``'s ``in_proj_weight``.
    """

    def __init__(
        self,
        d_model: int,
        h: int,
        d_k: int,
        d_v: int,
        attention_dropout: float = 0.0,
        cross: bool = False,
    ) -> None:
        super().__init__()
        self.h, self.d_k, self.d_v, self.cross = h, d_k, d_v, cross
        self.attention_dropout = attention_dropout
        self.in_proj = nn.Linear(d_model, h * (2 * d_k + d_v))  # [W^Q; W^K; W^V], all heads
        self.out_proj = nn.Linear(h * d_v, d_model)  # W^O

    def _heads(self, x: Tensor, d: int) -> Tensor:
        B, L, _ = x.shape
        return x.view(B, L, self.h, d).transpose(1, 2)  # (B, L, H*D) -> (B, H, L, D)

    def project_q(self, x: Tensor) -> Tensor:
        """Q = x W^Q of encoder-decoder attention, split into heads: ``(B, T, d_model) -> (B, H, T, D_k)``."""
        q_size = self.h * self.d_k
        return self._heads(F.linear(x, self.in_proj.weight[:q_size], self.in_proj.bias[:q_size]), self.d_k)

    def project_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """K = memory W^K, V = memory W^V, split into heads: ``(B, H, S, D_k)``, ``(B, H, S, D_v)``."""
        q_size = self.h * self.d_k
        kv = F.linear(memory, self.in_proj.weight[q_size:], self.in_proj.bias[q_size:])  # (B, S, H*(D_k+D_v))
        k, v = kv.split([self.h * self.d_k, self.h * self.d_v], dim=-1)
        return self._heads(k, self.d_k), self._heads(v, self.d_v)

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        mask: Tensor | None = None,
        cache: LayerCache | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend from ``x`` to itself (self-attention) or to ``memory`` (encoder-decoder).

        Args:
            x: ``(B, T, d_model)``, the queries (and keys/values in self-attention).
            memory: ``(B, S, d_model)`` encoder output, for ``cross=True`` (may be None when
                ``cache`` already holds its K/V).
            mask: boolean, ``True`` = may attend, broadcastable to ``(B, H, T, S)``.
            cache: this sublayer's K/V from earlier steps (``model/cache.py``); updated in place.
            need_weights: also return the attention weights ``(B, H, T, S)``.

        Shape: returns ``(B, T, d_model)`` and the weights or None.
        """
        q_size, k_size = self.h * self.d_k, self.h * self.d_k
        if self.cross:
            q = self.project_q(x)  # (B, H, T, D_k)
            if cache is not None and cache.static:
                k, v = cache.k, cache.v
            else:
                if memory is None:
                    raise ValueError("encoder-decoder attention needs memory or a filled cache")
                k, v = self.project_kv(memory)  # (B, H, S, D_k), (B, H, S, D_v)
                if cache is not None:
                    cache.set(k, v)
        else:
            qkv = self.in_proj(x)  # (B, T, H*(2 D_k + D_v))
            q, k, v = qkv.split([q_size, k_size, self.h * self.d_v], dim=-1)
            q, k, v = self._heads(q, self.d_k), self._heads(k, self.d_k), self._heads(v, self.d_v)
            if cache is not None:
                k, v = cache.append(k, v)  # (B, H, length, D)
        dropout_p = self.attention_dropout if self.training else 0.0
        out, weights = scaled_dot_product_attention(q, k, v, mask, dropout_p, need_weights)  # (B, H, T, D_v)
        B, _, T, _ = out.shape
        out = out.transpose(1, 2).reshape(B, T, self.h * self.d_v)  # (B, T, H*D_v)
        return self.out_proj(out), weights
