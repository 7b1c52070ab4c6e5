"""Attention masks: the only place they are built.

One convention everywhere in aiayn: a boolean mask where ``True`` means *may attend*
(the convention of ``torch.nn.functional.scaled_dot_product_attention``). Note that
``torch.nn.Transformer`` uses the opposite convention (``True`` = masked out).

Shapes broadcast against attention scores ``(B, H, T, S)``:
- padding masks are ``(B, 1, 1, S)``,
- causal and window masks are ``(1, 1, T, S)``,
and they are combined with ``&``.

Legend: B batch, T query length, S key length.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["padding_mask", "causal_mask", "window_mask", "Packing"]


def padding_mask(tokens: Tensor, pad_id: int) -> Tensor:
    """True where a key is a real token, False where it is padding.

    Shape: tokens ``(B, S)`` -> ``(B, 1, 1, S)``.
    """
    return (tokens != pad_id)[:, None, None, :]


def causal_mask(T: int, S: int | None = None, offset: int = 0, device: torch.device | None = None) -> Tensor:
    """True where query i may attend to key j, i.e. j <= offset + i (§3.2.3: no leftward flow).

    The queries are the positions ``offset .. offset + T - 1`` of a sequence whose keys are
    positions ``0 .. S - 1`` (``S`` defaults to ``offset + T``): with a KV cache holding
    ``offset`` earlier positions, the new queries start at ``offset``.

    Shape: ``(1, 1, T, S)``.
    """
    S = offset + T if S is None else S
    i = torch.arange(offset, offset + T, device=device)[:, None]
    j = torch.arange(S, device=device)[None, :]
    return (j <= i)[None, None]


def window_mask(
    T: int, S: int | None = None, r: int = 1, offset: int = 0, device: torch.device | None = None
) -> Tensor:
    """Restricted self-attention (§4, Table 1): True where |(offset + i) - j| <= r.

    Each query attends only to the r neighbours on either side of its own position; combine with
    ``causal_mask`` for a decoder (r previous positions). Shape: ``(1, 1, T, S)``.
    """
    S = offset + T if S is None else S
    i = torch.arange(offset, offset + T, device=device)[:, None]
    j = torch.arange(S, device=device)[None, :]
    return ((i - j).abs() <= r)[None, None]


class Packing(NamedTuple):
    """The real tokens of a padded batch as N packed rows (not in the paper; an inference
    economy, as in FasterTransformer's "remove padding"; the encoder uses it in eval mode).

    The projections, the feed-forward network, residuals and layer norm act on each position
    alone, so they can run on the N real positions instead of all B·S; only attention needs the
    ``(B, S)`` layout, and it unpacks its projections (zeros at padding, which the mask hides)
    and packs its output again. ``index`` ``(N,)`` holds the real positions' indices into the
    flattened ``B·S`` positions, in order.
    """

    index: Tensor  # (N,)
    padding: Tensor  # (B·S - N,): the other positions
    B: int
    S: int

    @classmethod
    def of(cls, keep: Tensor) -> Packing | None:
        """From a ``(B, S)`` boolean tensor (True = real token); None when nothing is padding."""
        if bool(keep.all()):
            return None
        flat = keep.reshape(-1)
        return cls(flat.nonzero().squeeze(1), (~flat).nonzero().squeeze(1), keep.size(0), keep.size(1))

    def pack(self, x: Tensor) -> Tensor:
        """``(B, S, ...) -> (N, ...)``: the rows of the real positions."""
        return x.reshape(self.B * self.S, *x.shape[2:]).index_select(0, self.index)

    def unpack(self, rows: Tensor) -> Tensor:
        """``(N, ...) -> (B, S, ...)``, zeros at padding."""
        out = rows.new_empty(self.B * self.S, *rows.shape[1:])
        out.index_copy_(0, self.index, rows).index_fill_(0, self.padding, 0.0)  # autograd follows rows
        return out.view(self.B, self.S, *rows.shape[1:])
