"""Attention (§3.2): scaled dot-product attention, multi-head attention, and the KV cache.

Legend: B batch, T query length, S key/value length, H heads (the paper's h),
D_k / D_v per-head sizes (d_k, d_v), G beams sharing one row of a cache (beam search).

Masks are boolean with ``True`` = may attend (see ``aiayn.model.masks``); this is the opposite
of ``torch.nn.Transformer``'s convention.

What differs from the paper, and why:
- A query row whose mask allows no key returns zeros rather than NaN (softmax over an empty set
  is undefined; zeros keep training and batched decoding finite).
- Optional dropout on the attention weights (``attention_dropout``, default 0 as in the paper).
- The KV cache (for incremental decoding) is not in the paper; it is an explicit object that is
  passed in and returned, never stored on a module.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import cpu_kernels
from .linear import Linear, linear
from .masks import Packing

__all__ = ["scaled_dot_product_attention", "MultiHeadAttention", "AttentionCache", "KVCache"]


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    dropout_p: float = 0.0,
    need_weights: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Attention(Q, K, V) = softmax(Q Kᵀ / √d_k) V  (§3.2.1, eq. 1).

    One function, three paths: the explicit formula when the weights are needed;
    otherwise aiayn's CPU kernel for a few queries per row (decoding steps, ``cpu_kernels``)
    and ``torch.nn.functional.scaled_dot_product_attention`` (fused kernels) for the rest.
    Tests keep them equal.

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
    if not need_weights and dropout_p == 0.0 and cpu_kernels.eligible(q, k, v, mask):
        return cpu_kernels.decode_attention(q, k, v, mask), None  # decoding steps on the CPU
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
        # The fused CPU kernel needs each head's vectors contiguous; a decoding step's projections
        # come transposed (model/linear.py), and without this torch falls back to its slow math path.
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
    if mask is not None:
        out = out.masked_fill(~valid, 0.0)
    return out, weights


class AttentionCache:
    """Keys and values of one attention sublayer, kept between decoding steps.

    ``k`` is ``(B, H, L, D_k)`` and ``v`` is ``(B, H, L, D_v)`` with ``L = length``: views of
    buffers stored position-major, ``(B, capacity, H, D)``, so that each row's keys (or values)
    up to ``length`` are one contiguous block. Gathering rows by beam parent then copies one
    block per row instead of H (``index_select`` 1.6-2.1x faster in isolation at the base
    shape, 16-21% in a beam-search profile: docs/benchmarks.md), and a step's append writes one
    ``H D`` run per row. Self-attention appends the new positions every step into a buffer of
    ``reserved`` positions (known when the output length is bounded) that grows by doubling
    beyond it (amortized O(1) per step, no re-copy of the whole prefix); encoder-decoder
    attention sets them once per source (``static``), in the same layout.
    """

    def __init__(self) -> None:
        self._k: Tensor | None = None  # (B, capacity, H, D_k)
        self._v: Tensor | None = None  # (B, capacity, H, D_v)
        self._spare: tuple[Tensor, Tensor] | None = None  # reorder's destination, reused
        self.length = 0
        self.reserved = 0  # the capacity to allocate at the first append
        self.static = False
        self.group = 1  # decoder rows (beams) served by each row of a static cache

    @property
    def k(self) -> Tensor | None:
        return None if self._k is None else self._k[:, : self.length].transpose(1, 2)  # (B, H, L, D_k)

    @property
    def v(self) -> Tensor | None:
        return None if self._v is None else self._v[:, : self.length].transpose(1, 2)  # (B, H, L, D_v)

    def set(self, k: Tensor, v: Tensor) -> None:
        """Store keys and values ``(B, H, S, D)`` computed once (encoder-decoder attention)."""
        self._k, self._v = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()  # (B, S, H, D)
        self.length, self.static = k.size(2), True

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append ``(B, H, n, D)`` new keys and values; return all ``(B, H, length, D)``."""
        end = self.length + k.size(2)
        if self._k is None or end > self._k.size(1):
            capacity = max(end, 2 * (self._k.size(1) if self._k is not None else 0), 16, self.reserved)
            new_k = k.new_empty(k.size(0), capacity, k.size(1), k.size(3))
            new_v = v.new_empty(v.size(0), capacity, v.size(1), v.size(3))
            if self.length:
                new_k[:, : self.length] = self._k[:, : self.length]
                new_v[:, : self.length] = self._v[:, : self.length]
            self._k, self._v, self._spare = new_k, new_v, None
        self._k[:, self.length : end] = k.transpose(1, 2)
        self._v[:, self.length : end] = v.transpose(1, 2)
        self.length = end
        return self.k, self.v

    def add_rows(self, other: AttentionCache, rows: int) -> None:
        """Append ``rows`` rows, ``other``'s, after this cache's. Self-attention: the new rows
        get zeros at this cache's positions so far (the caller masks them) and must hold none of
        their own. Encoder-decoder (static): both are padded with zeros to the longer source."""
        if self.static != other.static:
            raise ValueError("cannot join a self-attention cache and an encoder-decoder one")
        if not self.static and other.length:
            raise ValueError("rows joining a self-attention cache must not hold positions yet")
        if self._k is None:
            return
        B, B2 = self._k.size(0), rows
        S = max(self.length, other.length) if self.static else self._k.size(1)
        k, v = self._k.new_zeros(B + B2, S, *self._k.shape[2:]), self._v.new_zeros(B + B2, S, *self._v.shape[2:])
        k[:B, : self.length], v[:B, : self.length] = self._k[:, : self.length], self._v[:, : self.length]
        if self.static:
            k[B:, : other.length], v[B:, : other.length] = other._k, other._v
            self.length = S
        self._k, self._v, self._spare = k, v, None

    @property
    def rows(self) -> int:
        return 0 if self._k is None else self._k.size(0)

    def drop_leading(self, n: int) -> None:
        """Forget the first ``n`` positions (masked in every row): views, no copy."""
        if n and self._k is not None:
            self._k, self._v, self._spare = self._k[:, n:], self._v[:, n:], None
            self.length -= n

    def reorder(self, indices: Tensor) -> None:
        """Select batch rows: row b of the result is row ``indices[b]`` (beam search parents)."""
        if self._k is None:
            return
        # Into a second buffer of the same capacity kept between calls (a fresh allocation this
        # size costs more than the copy), and only the first ``length`` positions of it.
        spare_k, spare_v = self._spare if self._spare is not None else (self._k.new_empty(0), self._v.new_empty(0))
        if spare_k.shape[1:] != self._k.shape[1:] or spare_k.size(0) != indices.numel():
            spare_k = self._k.new_empty(indices.numel(), *self._k.shape[1:])
            spare_v = self._v.new_empty(indices.numel(), *self._v.shape[1:])
        torch.index_select(self._k[:, : self.length], 0, indices, out=spare_k[:, : self.length])
        torch.index_select(self._v[:, : self.length], 0, indices, out=spare_v[:, : self.length])
        self._spare = (self._k, self._v) if not self.static else None
        self._k, self._v = spare_k, spare_v


class KVCache:
    """The state of incremental decoding for a whole decoder stack.

    Layout:
        ``self_attn[l]``: the masked self-attention K/V of layer l, growing one step at a time.
        ``cross_attn[l]``: the encoder-decoder K/V of layer l, computed once per source, one row
        per sentence: ``(B / group, H, S, D)`` (empty for a decoder-only model).
        ``memory_mask``: the source padding mask ``(B / group, 1, 1, S)`` (True = real token), or
        None.
        ``key_mask``: which cached target positions are real tokens ``(B, 1, 1, length)``
        (True = real, False = padding, e.g. of left-padded prompts), or None while all are real.
        ``length``: the number of target positions already processed (the position offset of
        the next step).
        ``group``: how many consecutive decoder rows share one row of the encoder-decoder K/V
        and memory mask (the beams of one sentence: ``expand(K)``); 1 otherwise.
        ``positions``: None while every row's next token is at position ``length``; with rows
        that joined later (``add_rows``: translation taking in new sentences as others end)
        the position of each row's next token ``(B,)``, its earlier cached positions masked.

    It is passed to ``decode`` and returned by it; modules never keep it. ``reorder(indices)``
    gathers every layer's rows by parent, for beam search. ``expand(K)`` turns each row into K
    beams without copying the encoder-decoder K/V: the K queries of a sentence attend to its
    one copy together (reading it once instead of K times).
    """

    def __init__(self, num_layers: int, cross: bool = False, memory_mask: Tensor | None = None) -> None:
        self.self_attn = [AttentionCache() for _ in range(num_layers)]
        self.cross_attn = [AttentionCache() for _ in range(num_layers)] if cross else None
        self.memory_mask = memory_mask
        self.key_mask: Tensor | None = None
        self.positions: Tensor | None = None

    @property
    def group(self) -> int:
        """Decoder rows per row of the encoder-decoder K/V (1 without them)."""
        return self.cross_attn[0].group if self.cross_attn else 1

    def reserve(self, length: int) -> KVCache:
        """Allocate room for ``length`` target positions at the first step (no regrowing)."""
        for layer_cache in self.self_attn:
            layer_cache.reserved = length
        return self

    def expand(self, group: int) -> KVCache:
        """Each decoder row becomes ``group`` consecutive rows (beams) sharing its encoder-decoder
        K/V and memory mask, which stay one row per sentence."""
        if group < 1:
            raise ValueError(f"expand needs a group of at least 1 row, got {group}")
        for layer_cache in self.self_attn:
            if layer_cache.k is not None:
                rows = torch.arange(layer_cache.k.size(0), device=layer_cache.k.device)
                layer_cache.reorder(rows.repeat_interleave(group))
        if self.key_mask is not None:
            self.key_mask = self.key_mask.repeat_interleave(group, dim=0)
        for layer_cache in self.cross_attn or []:
            layer_cache.group *= group
        return self

    def reorder_self(self, indices: Tensor) -> None:
        """Gather the self-attention K/V (and key mask) rows: row b becomes row ``indices[b]``."""
        for layer_cache in self.self_attn:
            layer_cache.reorder(indices)
        if self.key_mask is not None:
            self.key_mask = self.key_mask.index_select(0, indices)
        if self.positions is not None:
            self.positions = self.positions.index_select(0, indices)

    def add_rows(self, other: KVCache) -> KVCache:
        """Append the rows of ``other``, a fresh cache of new sources (``init_cache``, then
        ``expand`` like this one: no step taken yet), after this one's: decoding goes on for the
        rows this cache has while the new ones start at position 0, with the positions cached
        so far masked for them. The encoder-decoder K/V and memory masks are padded to the
        longer source."""
        if other.length or self.group != other.group or not self.cross_attn or not other.cross_attn:
            raise ValueError("add_rows joins encoder-decoder caches of the same group, the other one fresh")
        first, new, G = self.cross_attn[0], other.cross_attn[0], self.group
        n, n2, L, S, S2 = first.rows, new.rows, self.length, first.length, new.length
        B, B2 = n * G, n2 * G  # decoder rows: G beams per sentence
        device = first.k.device
        for layer_cache, joining in zip(self.self_attn, other.self_attn, strict=True):
            layer_cache.add_rows(joining, B2)
        for layer_cache, joining in zip(self.cross_attn, other.cross_attn, strict=True):
            layer_cache.add_rows(joining, n2)
        mask = torch.zeros(n + n2, 1, 1, max(S, S2), dtype=torch.bool, device=device)  # one row per sentence
        mask[:n, ..., :S] = True if self.memory_mask is None else self.memory_mask
        mask[n:, ..., :S2] = True if other.memory_mask is None else other.memory_mask
        self.memory_mask = mask
        if L:
            earlier = (
                self.key_mask if self.key_mask is not None else torch.ones(B, 1, 1, L, dtype=torch.bool, device=device)
            )
            self.key_mask = torch.cat([earlier, earlier.new_zeros(B2, 1, 1, L)])
        positions = self.positions if self.positions is not None else torch.full((B,), L, device=device)
        self.positions = torch.cat([positions, positions.new_zeros(B2)])
        return self

    def drop_leading(self) -> None:
        """Forget the leading cached positions that no row attends to any more (those before
        the oldest remaining row's first), so that rows joining later do not make the cache
        grow without end."""
        if self.key_mask is None:
            return
        real = self.key_mask.reshape(-1, self.key_mask.size(-1)).any(0)  # (length,)
        n = int(real.nonzero()[0]) if bool(real.any()) else real.numel()
        if n:
            for layer_cache in self.self_attn:
                layer_cache.drop_leading(n)
            self.key_mask = self.key_mask[..., n:]

    def extend_key_mask(self, mask: Tensor) -> Tensor | None:
        """Record the padding mask ``(B, 1, 1, n)`` of n new positions; return the whole
        ``(B, 1, 1, length + n)`` mask of the self-attention keys, or None while every key is a
        real token (no mask to apply: the usual case when translating)."""
        if self.key_mask is None:
            if bool(mask.all()):
                return None
            earlier = mask.new_ones(*mask.shape[:-1], self.length)  # the positions so far were all real
            self.key_mask = torch.cat([earlier, mask], dim=-1)
        else:
            self.key_mask = torch.cat([self.key_mask, mask], dim=-1)
        return self.key_mask

    @property
    def length(self) -> int:
        return self.self_attn[0].length if self.self_attn else 0

    def reorder(self, indices: Tensor, cross: bool = True) -> KVCache:
        """Row b becomes row ``indices[b]``. ``cross=False`` leaves the encoder-decoder K/V and
        the memory mask as they are: right (and cheaper) when every index stays among the rows
        of the same source, as when beam search gathers a sentence's beams by parent. With
        ``group`` K > 1, ``indices`` must keep each group of K rows within one sentence's group
        (as beam search does): the sentence of new group j is that of row ``indices[j K]``."""
        self.reorder_self(indices)
        if cross:
            G = self.group
            sentences = indices[::G] // G if G > 1 else indices
            for layer_cache in self.cross_attn or []:
                layer_cache.reorder(sentences)
            if self.memory_mask is not None:
                self.memory_mask = self.memory_mask.index_select(0, sentences)
        return self


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
        self.in_proj = Linear(d_model, h * (2 * d_k + d_v))  # [W^Q; W^K; W^V], all heads
        self.out_proj = Linear(h * d_v, d_model)  # W^O

    def _heads(self, x: Tensor, d: int) -> Tensor:
        B, L, _ = x.shape
        return x.view(B, L, self.h, d).transpose(1, 2)  # (B, L, H*D) -> (B, H, L, D)

    def project_q(self, x: Tensor) -> Tensor:
        """Q = x W^Q of encoder-decoder attention, split into heads: ``(B, T, d_model) -> (B, H, T, D_k)``."""
        q_size = self.h * self.d_k
        return self._heads(linear(x, self.in_proj.weight[:q_size], self.in_proj.bias[:q_size]), self.d_k)

    def project_kv(self, memory: Tensor, packing: Packing | None = None) -> tuple[Tensor, Tensor]:
        """K = memory W^K, V = memory W^V, split into heads: ``(B, H, S, D_k)``, ``(B, H, S, D_v)``.
        With ``packing``, ``memory`` is ``(N, d_model)``, the real positions only (zeros elsewhere)."""
        q_size = self.h * self.d_k
        kv = linear(memory, self.in_proj.weight[q_size:], self.in_proj.bias[q_size:])  # (B, S, H*(D_k+D_v))
        if packing is not None:
            kv = packing.unpack(kv)
        k, v = kv.split([self.h * self.d_k, self.h * self.d_v], dim=-1)
        return self._heads(k, self.d_k), self._heads(v, self.d_v)

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        mask: Tensor | None = None,
        cache: AttentionCache | None = None,
        need_weights: bool = False,
        packing: Packing | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend from ``x`` to itself (self-attention) or to ``memory`` (encoder-decoder).

        Args:
            x: ``(B, T, d_model)``, the queries (and keys/values in self-attention).
            memory: ``(B, S, d_model)`` encoder output, for ``cross=True`` (may be None when
                ``cache`` already holds its K/V).
            mask: boolean, ``True`` = may attend, broadcastable to ``(B, H, T, S)``.
            cache: this sublayer's K/V from earlier steps; updated in place. An encoder-decoder
                cache expanded to G beams (``KVCache.expand``) holds one row per sentence for G
                consecutive rows of ``x``; ``mask`` then has one row per sentence as well.
            need_weights: also return the attention weights ``(B, H, T, S)``.
            packing: self-attention only: ``x`` is ``(N, d_model)``, the real positions of a
                padded ``(B, T)`` batch (``masks.Packing``); the projections run on the N rows
                and the result is ``(N, d_model)`` too.

        Shape: returns ``(B, T, d_model)`` (or ``(N, d_model)``) and the weights or None.
        """
        q_size, k_size = self.h * self.d_k, self.h * self.d_k
        if self.cross:
            if packing is not None:
                raise ValueError("packed rows serve self-attention only")
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
            qkv = self.in_proj(x)  # (B, T, H*(2 D_k + D_v)), or (N, ...) packed
            if packing is not None:
                qkv = packing.unpack(qkv)  # (B, T, H*(2 D_k + D_v)), zeros at padding
            q, k, v = qkv.split([q_size, k_size, self.h * self.d_v], dim=-1)
            q, k, v = self._heads(q, self.d_k), self._heads(k, self.d_k), self._heads(v, self.d_v)
            if cache is not None:
                k, v = cache.append(k, v)  # (B, H, length, D)
        dropout_p = self.attention_dropout if self.training else 0.0
        B, _, T, _ = q.shape
        G = cache.group if self.cross and cache is not None and cache.static else 1  # beams per cached row
        if G > 1:  # the G beams of a sentence attend together, as G·T queries of its one K/V row
            if G * k.size(0) != B:
                raise ValueError(f"{B} query rows do not fill {k.size(0)} cached rows of {G} beams each")
            q = q.view(-1, G, self.h, T, self.d_k).transpose(1, 2).reshape(-1, self.h, G * T, self.d_k)
        out, weights = scaled_dot_product_attention(q, k, v, mask, dropout_p, need_weights)
        if G > 1:  # out (B/G, H, G T, D_v), weights (B/G, H, G T, S) -> per row: (B, T, H*D_v), (B, H, T, S)
            out = out.view(-1, self.h, G, T, self.d_v).permute(0, 2, 3, 1, 4).reshape(B, T, self.h * self.d_v)
            if weights is not None:
                weights = weights.view(-1, self.h, G, T, k.size(2)).transpose(1, 2).reshape(B, self.h, T, -1)
        else:
            out = out.transpose(1, 2).reshape(B, T, self.h * self.d_v)  # (B, T, H*D_v)
        if packing is not None:
            out = packing.pack(out)  # (N, H*D_v)
        return self.out_proj(out), weights
