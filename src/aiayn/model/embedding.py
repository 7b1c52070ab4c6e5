"""Embeddings and positional encodings (§3.4, §3.5).

Legend: B batch, L sequence length.

What differs from the paper: learned positional embeddings are an option (the paper reports
they give nearly identical results, Table 3 row E); token embeddings are initialised
N(0, d_model^-0.5), so that after the √d_model scaling they have unit variance; with
``fix_norm`` each embedding is scaled to unit length where it is used (FixNorm, Nguyen & Chiang
2018, "Improving Lexical Choice in Neural Machine Translation"): rare words' embeddings
cannot stay short, and the tied projection's logits become ‖h‖ · cos(h, e_w).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["TokenEmbedding", "sinusoidal_encoding", "SinusoidalPositionalEncoding", "LearnedPositionalEmbedding"]


class TokenEmbedding(nn.Module):
    """Learned embeddings multiplied by √d_model (§3.4).

    The same matrix can serve as the pre-softmax projection (``project``), shared with the
    embedding layers as in the paper. ``fix_norm``: every row is used at unit length (FixNorm).
    Shape: ``(B, L)`` token ids -> ``(B, L, d_model)``.
    """

    def __init__(self, vocab_size: int, d_model: int, fix_norm: bool = False) -> None:
        super().__init__()
        self.d_model = d_model
        self.fix_norm = fix_norm
        self.weight = nn.Parameter(torch.empty(vocab_size, d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.d_model**-0.5)

    def table(self) -> Tensor:
        """The embedding matrix as it is used, ``(V, d_model)``: each row e_w / ‖e_w‖ with ``fix_norm``."""
        return F.normalize(self.weight, dim=-1) if self.fix_norm else self.weight

    def forward(self, tokens: Tensor) -> Tensor:
        e = F.embedding(tokens, self.weight)  # (B, L, d_model)
        if self.fix_norm:
            e = F.normalize(e, dim=-1)  # the looked-up rows only: table()'s rows, cheaper
        return e * math.sqrt(self.d_model)

    def project(self, x: Tensor) -> Tensor:
        """Pre-softmax linear transformation with the embedding matrix: ``(..., d_model) -> (..., V)``."""
        return F.linear(x, self.table())

    def extra_repr(self) -> str:
        return f"{self.weight.size(0)}, {self.d_model}" + (", fix_norm=True" if self.fix_norm else "")


def sinusoidal_encoding(length: int, d_model: int, base: float = 10000.0) -> Tensor:
    """PE(pos, 2i) = sin(pos / base^(2i/d_model)), PE(pos, 2i+1) = cos(pos / base^(2i/d_model))  (§3.5).

    Shape: ``(length, d_model)``; computed in float64, returned in float32.
    """
    pos = torch.arange(length, dtype=torch.float64)[:, None]  # (L, 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)  # (d_model/2,)
    angle = pos / base ** (two_i / d_model)  # (L, ceil(d_model/2))
    pe = torch.zeros(length, d_model, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(angle)
    pe[:, 1::2] = torch.cos(angle[:, : d_model // 2])
    return pe.float()


class SinusoidalPositionalEncoding(nn.Module):
    """Adds the fixed sinusoidal encoding of §3.5 to the embeddings (no parameters).

    The table is precomputed for ``max_len`` positions and extended on demand, so any length
    works. ``offset`` is the position of the first element (for incremental decoding).
    Shape: ``(B, L, d_model) -> (B, L, d_model)``.
    """

    def __init__(self, d_model: int, max_len: int = 1024) -> None:
        super().__init__()
        self.d_model = d_model
        # not saved in checkpoints: it is a function of the config
        self.register_buffer("pe", sinusoidal_encoding(max_len, d_model), persistent=False)

    def forward(self, x: Tensor, offset: int | Tensor = 0) -> Tensor:
        """``offset``: the position of ``x[:, 0]``, or one per row ``(B,)`` (rows at different steps)."""
        end = _end(offset, x.size(1))
        if end > self.pe.size(0):
            self.pe = sinusoidal_encoding(max(end, 2 * self.pe.size(0)), self.d_model).to(self.pe.device)
        return x + _rows(self.pe, offset, x.size(1)).to(x.dtype)


class LearnedPositionalEmbedding(nn.Module):
    """Learned absolute position embeddings (the alternative of §3.5 / Table 3 row E).

    Shape: ``(B, L, d_model) -> (B, L, d_model)``; at most ``max_len`` positions.
    """

    def __init__(self, d_model: int, max_len: int = 1024) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(max_len, d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.weight.size(1) ** -0.5)

    def forward(self, x: Tensor, offset: int | Tensor = 0) -> Tensor:
        """``offset``: the position of ``x[:, 0]``, or one per row ``(B,)`` (rows at different steps)."""
        end = _end(offset, x.size(1))
        if end > self.weight.size(0):
            raise ValueError(
                f"sequence reaches position {end}, but learned positional embeddings have max_len={self.weight.size(0)}"
            )
        return x + _rows(self.weight, offset, x.size(1))


def _end(offset: int | Tensor, T: int) -> int:
    """One past the last position that ``T`` positions from ``offset`` reach."""
    return (int(offset.max()) if isinstance(offset, Tensor) else offset) + T


def _rows(table: Tensor, offset: int | Tensor, T: int) -> Tensor:
    """The rows of a position table for ``T`` positions from ``offset``: ``(T, d_model)``, or
    ``(B, T, d_model)`` for one offset per row ``(B,)``."""
    if isinstance(offset, Tensor):
        return table[offset[:, None] + torch.arange(T, device=offset.device)]
    return table[offset : offset + T]
