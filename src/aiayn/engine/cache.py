"""The engine's KV cache (not in the paper): the state of batched incremental decoding, laid
out for speed, with what translating many sentences at once needs beyond the paper's cache
(``aiayn.model.cache``).

Legend: B decoder rows (sentences, or beams), G beams sharing one row of the encoder-decoder K/V,
H heads, L cached positions, S source length, D_k / D_v per-head sizes.

Beyond ``aiayn.model.cache.KVCache``:
- keys and values in buffers reserved for the longest output (``reserve``), so that a step's
  append copies only the new position and gathering rows by beam parent only the filled ones;
- grouped encoder-decoder K/V (``expand``): the K beams of a sentence share its one row.
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
        ``length``: the number of target positions already processed (the position offset of
        the next step).
        ``group``: how many consecutive decoder rows share one row of the encoder-decoder K/V
        and memory mask (the beams of one sentence: ``expand(K)``); 1 otherwise.

    The engine's decoding step (``step.py``) reads and extends it; modules never keep it. ``reorder(indices)``
    gathers every layer's rows by parent, for beam search. ``expand(K)`` turns each row into K
    beams without copying the encoder-decoder K/V: the K queries of a sentence attend to its
    one copy together (reading it once instead of K times).
    """

    layer_cache = AttentionCache

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
        if cross:
            G = self.group
            sentences = indices[::G] // G if G > 1 else indices
            for layer_cache in self.cross_attn or []:
                layer_cache.reorder(sentences)
            if self.memory_mask is not None:
                self.memory_mask = self.memory_mask.index_select(0, sentences)
        return self
