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

import torch
from torch import Tensor

__all__ = ["padding_mask", "causal_mask", "window_mask"]


def padding_mask(tokens: Tensor, pad_id: int, start: bool | Tensor = False) -> Tensor:
    """True where a key is a real token, False where it is padding. ``start``: ``tokens[:, 0]``
    is the decoder's start token, real even where it is ``pad_id`` (Marian starts from its
    padding token); one per row ``(B,)`` where rows are at different steps.

    Shape: tokens ``(B, S)`` -> ``(B, 1, 1, S)``.
    """
    real = tokens != pad_id  # (B, S)
    if isinstance(start, Tensor):
        real[:, 0] |= start
    elif start:
        real[:, 0] = True
    return real[:, None, None, :]


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
