"""The engine's KV cache (not in the paper): the state of batched incremental decoding, laid
out for speed, with what translating many sentences at once needs beyond the paper's cache
(``aiayn.model.cache``).

Legend: B decoder rows (sentences, or beams), G beams sharing one row of the encoder-decoder K/V,
H heads, L cached positions, S source length, D_k / D_v per-head sizes.

Beyond ``aiayn.model.cache.KVCache``:
- keys and values in buffers reserved for the longest output (``reserve``), so that a step's
  append copies only the new position and gathering rows by beam parent only the filled ones;
- grouped encoder-decoder K/V (``expand``): the K beams of a sentence share its one row;
- rows added while others decode (``add_rows``), each at its own position (``positions``), and
  leading positions no row attends to any more dropped (``drop_leading``): continuous batching
  (``aiayn.decode.translate_continuous``, which ``aiayn serve`` runs).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..model.cache import KVCache

__all__ = ["AttentionCache", "EngineCache"]


class AttentionCache:
    """Keys and values of one attention sublayer, kept between decoding steps.

    ``k`` is ``(B, H, L, D_k)`` and ``v`` is ``(B, H, L, D_v)`` with ``L = length``: views of
    buffers ``(B, H, capacity, D)``, the paper cache's layout. Self-attention appends the new
    positions every step into a buffer of ``reserved`` positions (known when the output length
    is bounded) that grows by doubling beyond it (amortized O(1) per step, no re-copy of the
    whole prefix, which ``torch.cat`` makes at every step); encoder-decoder attention sets them
    once per source (``static``). (A position-major layout, ``(B, capacity, H, D)``, gathered one
    block per row: 0.98-1.03x end to end on the Xeon with AMX, gone by issue 25's 5% rule.)
    """

    def __init__(self) -> None:
        self._k: Tensor | None = None  # (B, H, capacity, D_k)
        self._v: Tensor | None = None  # (B, H, capacity, D_v)
        self._spare: tuple[Tensor, Tensor] | None = None  # reorder's destination, reused
        self.length = 0
        self.reserved = 0  # the capacity to allocate at the first append
        self.static = False
        self.group = 1  # decoder rows (beams) served by each row of a static cache

    @property
    def k(self) -> Tensor | None:
        return None if self._k is None else self._k[:, :, : self.length]  # (B, H, L, D_k)

    @property
    def v(self) -> Tensor | None:
        return None if self._v is None else self._v[:, :, : self.length]  # (B, H, L, D_v)

    def set(self, k: Tensor, v: Tensor) -> None:
        """Store keys and values ``(B, H, S, D)`` computed once (encoder-decoder attention)."""
        self._k, self._v = k.contiguous(), v.contiguous()  # (B, H, S, D)
        self.length, self.static = k.size(2), True

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append ``(B, H, n, D)`` new keys and values; return all ``(B, H, length, D)``."""
        end = self.length + k.size(2)
        if self._k is None or end > self._k.size(2):
            capacity = max(end, 2 * (self._k.size(2) if self._k is not None else 0), 16, self.reserved)
            new_k = k.new_empty(k.size(0), k.size(1), capacity, k.size(3))
            new_v = v.new_empty(v.size(0), v.size(1), capacity, v.size(3))
            if self.length:
                new_k[:, :, : self.length] = self._k[:, :, : self.length]
                new_v[:, :, : self.length] = self._v[:, :, : self.length]
            self._k, self._v, self._spare = new_k, new_v, None
        self._k[:, :, self.length : end] = k
        self._v[:, :, self.length : end] = v
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
        B, H, L = self._k.size(0), self._k.size(1), self.length
        S = max(L, other.length) if self.static else self._k.size(2)  # static: source positions
        k = self._k.new_empty(B + rows, H, S, self._k.size(3))  # (B + rows, H, S, D_k)
        v = self._v.new_empty(B + rows, H, S, self._v.size(3))
        k[:B, :, :L], v[:B, :, :L] = self._k[:, :, :L], self._v[:, :, :L]
        # what a mask hides must still be finite (a weight of 0 times NaN is NaN): zeros, not
        # the buffer's old bytes; positions past the length are written before they are read
        if self.static:
            k[B:, :, : other.length], v[B:, :, : other.length] = other._k, other._v
            k[:B, :, L:], v[:B, :, L:], k[B:, :, other.length :], v[B:, :, other.length :] = 0, 0, 0, 0
            self.length = S
        else:
            k[B:, :, :L], v[B:, :, :L] = 0, 0
        self._k, self._v, self._spare = k, v, None

    @property
    def rows(self) -> int:
        return 0 if self._k is None else self._k.size(0)

    def drop_leading(self, n: int) -> None:
        """Forget the first ``n`` positions (masked in every row): views, no copy."""
        if n and self._k is not None:
            self._k, self._v, self._spare = self._k[:, :, n:], self._v[:, :, n:], None
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
        torch.index_select(self._k[:, :, : self.length], 0, indices, out=spare_k[:, :, : self.length])
        torch.index_select(self._v[:, :, : self.length], 0, indices, out=spare_v[:, :, : self.length])
        self._spare = (self._k, self._v) if not self.static else None
        self._k, self._v = spare_k, spare_v


class EngineCache(KVCache):
    """The state of incremental decoding for a whole decoder stack (``KVCache``'s fields, its
    ``length`` and ``extend_key_mask``, on ``AttentionCache`` layers, and more).

    Layout:
        ``self_attn[l]``: the masked self-attention K/V of layer l, growing one step at a time.
        ``cross_attn[l]``: the encoder-decoder K/V of layer l, computed once per source, one row
        per sentence: ``(B / group, H, S, D)`` (empty for a decoder-only model).
        ``memory_mask``: the source padding mask ``(B / group, 1, 1, S)`` (True = real token), or
        None.
        ``key_mask``: which cached target positions are real tokens ``(B, 1, 1, length)``
        (True = real, False = padding, e.g. of left-padded prompts), or None while all are real.
        ``length``: the number of target positions cached (the position offset of the next
        step, while ``positions`` is None).
        ``group``: how many consecutive decoder rows share one row of the encoder-decoder K/V
        and memory mask (the beams of one sentence: ``expand(K)``); 1 otherwise.
        ``positions``: None while every row's next token is at position ``length``; with rows
        that joined later (``add_rows``: sentences joining as others end) the position of each
        row's next token ``(B,)``, the cached positions before its first masked.

    The engine's decoding step (``step.py``) reads and extends it; modules never keep it. ``reorder(indices)``
    gathers every layer's rows by parent, for beam search. ``expand(K)`` turns each row into K
    beams without copying the encoder-decoder K/V: the K queries of a sentence attend to its
    one copy together (reading it once instead of K times).
    """

    layer_cache = AttentionCache

    def __init__(self, num_layers: int, cross: bool = False, memory_mask: Tensor | None = None) -> None:
        super().__init__(num_layers, cross, memory_mask)
        self.positions: Tensor | None = None

    @property
    def group(self) -> int:
        """Decoder rows per row of the encoder-decoder K/V (1 without them)."""
        return self.cross_attn[0].group if self.cross_attn else 1

    def reserve(self, length: int) -> EngineCache:
        """Allocate room for ``length`` target positions at the first step (no regrowing)."""
        for layer_cache in self.self_attn:
            layer_cache.reserved = length
        return self

    def expand(self, group: int) -> EngineCache:
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

    def reorder(self, indices: Tensor, cross: bool = True) -> EngineCache:
        """Row b becomes row ``indices[b]``. ``cross=False`` leaves the encoder-decoder K/V and
        the memory mask as they are: right (and cheaper) when every index stays among the rows
        of the same source, as when beam search gathers a sentence's beams by parent. With
        ``group`` K > 1, ``indices`` must keep each group of K rows within one sentence's group
        (as beam search does): the sentence of new group j is that of row ``indices[j K]``."""
        for layer_cache in self.self_attn:
            layer_cache.reorder(indices)
        if self.key_mask is not None:
            self.key_mask = self.key_mask.index_select(0, indices)
        if self.positions is not None:
            self.positions = self.positions.index_select(0, indices)
        if cross:
            G = self.group
            sentences = indices[::G] // G if G > 1 else indices
            for layer_cache in self.cross_attn or []:
                layer_cache.reorder(sentences)
            if self.memory_mask is not None:
                self.memory_mask = self.memory_mask.index_select(0, sentences)
                if self.positions is not None:  # rows joined: the sources left may all be shorter
                    self._trim_sources()
        return self

    def _trim_sources(self) -> None:
        """Forget the trailing source positions that are padding in every row (a long source
        that joined has ended): views, no copy."""
        real = self.memory_mask.reshape(self.memory_mask.size(0), -1).any(0)  # (S,)
        S = int(real.nonzero()[-1]) + 1 if bool(real.any()) else real.numel()
        if real.numel() > S:
            self.memory_mask = self.memory_mask[..., :S]
            for layer_cache in self.cross_attn:
                layer_cache.length = S

    def add_rows(self, other: EngineCache) -> None:
        """Append the rows of ``other``, a fresh cache of new sources (``Decoding._start``:
        expanded like this one, no step taken yet), after this one's: decoding goes on for the
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
        grow without end. Only with per-row ``positions``: otherwise ``length`` is every row's
        position."""
        if self.key_mask is None or self.positions is None:
            return
        real = self.key_mask.reshape(-1, self.key_mask.size(-1)).any(0)  # (length,)
        n = int(real.nonzero()[0]) if bool(real.any()) else real.numel()
        if n:
            for layer_cache in self.self_attn:
                layer_cache.drop_leading(n)
            self.key_mask = self.key_mask[..., n:]
