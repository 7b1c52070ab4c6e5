"""The KV cache of incremental decoding (not in the paper, which decodes by recomputing: an
inference device exactly equal to it; tests compare the two).

Legend: B rows (sentences, or beams), H heads, L cached positions, S source length, D_k / D_v
per-head sizes.

At each decoding step the decoder sees only the new token; each attention sublayer keeps the
keys and values of the positions before it:
- masked self-attention appends the new position's K/V every step;
- encoder-decoder attention computes the source's K/V once (``init_cache``) and reuses them.
Beam search gathers every layer's rows by parent beam (``reorder``). The engine
(``aiayn.engine.cache``) has a faster layout with more features; this is the paper's minimum.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["LayerCache", "KVCache"]


class LayerCache:
    """Keys ``(B, H, L, D_k)`` and values ``(B, H, L, D_v)`` of one attention sublayer.
    ``static``: set once from the source (encoder-decoder attention), not appended to."""

    def __init__(self) -> None:
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.static = False

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.size(2)

    def set(self, k: Tensor, v: Tensor) -> None:
        """Store the encoder-decoder K/V ``(B, H, S, D)``, computed once per source."""
        self.k, self.v, self.static = k, v, True

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append ``(B, H, n, D)`` new keys and values; return all ``(B, H, L + n, D)``."""
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def reorder(self, indices: Tensor) -> None:
        """Row b becomes row ``indices[b]``."""
        if self.k is not None:
            self.k, self.v = self.k.index_select(0, indices), self.v.index_select(0, indices)


class KVCache:
    """The state of incremental decoding for a whole decoder stack.

    ``self_attn[l]`` / ``cross_attn[l]``: layer l's self-attention and encoder-decoder
    ``LayerCache`` (``cross_attn`` is None for a decoder-only model); ``memory_mask``: the
    source padding mask ``(B, 1, 1, S)`` (True = real token) or None; ``key_mask``: which cached
    target positions are real tokens ``(B, 1, 1, L)``, or None while all are; ``length``: the
    positions processed so far (the position of the next token). It is passed to ``decode`` and
    updated there; modules never keep it.
    """

    layer_cache = LayerCache  # each sublayer's K/V (the engine's cache keeps another layout)

    def __init__(self, num_layers: int, cross: bool = False, memory_mask: Tensor | None = None) -> None:
        self.self_attn = [self.layer_cache() for _ in range(num_layers)]
        self.cross_attn = [self.layer_cache() for _ in range(num_layers)] if cross else None
        self.memory_mask = memory_mask
        self.key_mask: Tensor | None = None

    @property
    def length(self) -> int:
        return self.self_attn[0].length if self.self_attn else 0

    def extend_key_mask(self, mask: Tensor) -> Tensor | None:
        """Record the padding mask ``(B, 1, 1, n)`` of n new positions; return the whole
        ``(B, 1, 1, L + n)`` mask of the self-attention keys, or None while every key is real."""
        if self.key_mask is None:
            if bool(mask.all()):
                return None
            self.key_mask = torch.cat([mask.new_ones(*mask.shape[:-1], self.length), mask], dim=-1)
        else:
            self.key_mask = torch.cat([self.key_mask, mask], dim=-1)
        return self.key_mask

    def reorder(self, indices: Tensor) -> KVCache:
        """Row b becomes row ``indices[b]``, in every layer (beam search: gather by parent)."""
        for layer_cache in [*self.self_attn, *(self.cross_attn or [])]:
            layer_cache.reorder(indices)
        if self.memory_mask is not None:
            self.memory_mask = self.memory_mask.index_select(0, indices)
        if self.key_mask is not None:
            self.key_mask = self.key_mask.index_select(0, indices)
        return self
