"""Encoder and decoder layers: sublayers with residual connections and layer norm (§3.1).

Legend: B batch, T target length, S source length.

Post-norm, as in the paper: ``LayerNorm(x + Dropout(Sublayer(x)))`` (§3.1, §5.4).
Pre-norm (``norm_first=True``): ``x + Dropout(Sublayer(LayerNorm(x)))``; it trains more
stably without warmup but needs a final LayerNorm after the stack (``ModelConfig.final_norm``).
``norm="scale"`` puts ScaleNorm (Nguyen & Salazar 2019) wherever a LayerNorm would be.

Masks are boolean, ``True`` = may attend.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .attention import MultiHeadAttention
from .cache import LayerCache
from .config import ModelConfig
from .dropout import Dropout
from .feed_forward import PositionwiseFeedForward

__all__ = ["ScaleNorm", "make_norm", "ResidualNorm", "EncoderLayer", "DecoderLayer"]


class ScaleNorm(nn.Module):
    """ScaleNorm(x) = g · x / ‖x‖, one learned scalar g initialised to √d_model (Nguyen & Salazar
    2019, "Transformers without Tears", arXiv 1910.05895): LayerNorm without the mean, the per-unit
    gains or the bias. ‖x‖ is clamped below at ``eps``. Shape: ``(..., d_model)`` -> same."""

    def __init__(self, d_model: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.d_model = d_model
        self.eps = eps
        self.g = nn.Parameter(torch.empty(()))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.constant_(self.g, math.sqrt(self.d_model))

    def forward(self, x: Tensor) -> Tensor:
        return x * (self.g / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp(min=self.eps))

    def extra_repr(self) -> str:
        return f"{self.d_model}, eps={self.eps}"


def make_norm(config: ModelConfig) -> nn.Module:
    """The normalisation layer ``config.norm`` names: LayerNorm (§3.1) or ScaleNorm."""
    if config.norm == "scale":
        return ScaleNorm(config.d_model, eps=config.layer_norm_eps)
    return nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)


class ResidualNorm(nn.Module):
    """The residual connection and layer norm (or ScaleNorm) around one sublayer (§3.1), with
    dropout (§5.4).

    ``before(x)`` is the sublayer's input and ``after(x, y)`` combines the sublayer output ``y``
    with the residual ``x``:
    post-norm (paper): ``before(x) = x``, ``after(x, y) = LayerNorm(x + Dropout(y))``;
    pre-norm: ``before(x) = LayerNorm(x)``, ``after(x, y) = x + Dropout(y)``.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm = make_norm(config)
        self.dropout = Dropout(config.P_drop)
        self.norm_first = config.norm_first

    def before(self, x: Tensor) -> Tensor:
        return self.norm(x) if self.norm_first else x

    def after(self, x: Tensor, y: Tensor) -> Tensor:
        return x + self.dropout(y) if self.norm_first else self.norm(x + self.dropout(y))


def _attention(config: ModelConfig, cross: bool = False) -> MultiHeadAttention:
    return MultiHeadAttention(config.d_model, config.h, config.d_k, config.d_v, config.attention_dropout, cross)


def _feed_forward(config: ModelConfig) -> PositionwiseFeedForward:
    return PositionwiseFeedForward(config.d_model, config.d_ff, config.activation, config.activation_dropout)


class EncoderLayer(nn.Module):
    """One encoder layer (§3.1, Figure 1 left): self-attention, then the feed-forward network."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = _attention(config)
        self.self_attn_norm = ResidualNorm(config)
        self.feed_forward = _feed_forward(config)
        self.feed_forward_norm = ResidualNorm(config)

    def forward(
        self, x: Tensor, mask: Tensor | None = None, need_weights: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """x ``(B, S, d_model)``; mask ``(B, 1, 1, S)`` or ``(B, 1, S, S)``, True = may attend.

        Returns ``(B, S, d_model)`` and the self-attention weights ``(B, H, S, S)`` or None.
        """
        y, weights = self.self_attn(self.self_attn_norm.before(x), mask=mask, need_weights=need_weights)
        x = self.self_attn_norm.after(x, y)
        x = self.feed_forward_norm.after(x, self.feed_forward(self.feed_forward_norm.before(x)))
        return x, weights


class DecoderLayer(nn.Module):
    """One decoder layer (§3.1, Figure 1 right): masked self-attention, encoder-decoder
    attention over the encoder output, then the feed-forward network. ``cross=False`` drops the
    encoder-decoder attention (a decoder-only language model)."""

    def __init__(self, config: ModelConfig, cross: bool = True) -> None:
        super().__init__()
        self.self_attn = _attention(config)
        self.self_attn_norm = ResidualNorm(config)
        self.cross_attn = _attention(config, cross=True) if cross else None
        self.cross_attn_norm = ResidualNorm(config) if cross else None
        self.feed_forward = _feed_forward(config)
        self.feed_forward_norm = ResidualNorm(config)

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        self_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        self_cache: LayerCache | None = None,
        cross_cache: LayerCache | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """x ``(B, T, d_model)``; memory ``(B, S, d_model)``; self_mask ``(B|1, 1, T, T')``
        (causal, True = may attend); memory_mask ``(B, 1, 1, S)``. With caches, ``x`` holds only
        the new positions and ``T'`` counts the cached ones too.

        Returns ``(B, T, d_model)``, self-attention weights ``(B, H, T, T')`` and
        encoder-decoder attention weights ``(B, H, T, S)`` (None unless ``need_weights``).
        """
        y, self_weights = self.self_attn(self.self_attn_norm.before(x), None, self_mask, self_cache, need_weights)
        x = self.self_attn_norm.after(x, y)
        cross_weights = None
        if self.cross_attn is not None:
            y, cross_weights = self.cross_attn(
                self.cross_attn_norm.before(x), memory, memory_mask, cross_cache, need_weights
            )
            x = self.cross_attn_norm.after(x, y)
        x = self.feed_forward_norm.after(x, self.feed_forward(self.feed_forward_norm.before(x)))
        return x, self_weights, cross_weights
