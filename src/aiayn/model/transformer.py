"""The stacks and the models (§3.1, Figure 1): Encoder, Decoder, Transformer, and the
encoder-only and decoder-only variants built from the same layers.

Legend: B batch, S source length, T target length, H heads, V vocabulary size.

Masks are boolean, ``True`` = may attend; padding is derived from ``config.pad_id``.

What differs from the paper, and why:
- ``DecoderOnly`` (a causal language model, as in GPT) and ``EncoderOnly`` (a bidirectional
  encoder with a masked-LM head, as in BERT) are not in the paper; they reuse its layers.
- ``ModelConfig.final_norm`` optionally adds a LayerNorm after each stack (needed by pre-norm).
- Incremental decoding with a KV cache (``init_cache`` / ``decode``, ``model/cache.py``) is an
  inference device, exactly equal to recomputing the whole prefix. The fast inference paths
  (packed weights, kernels, the flat decoding step) live apart, in ``aiayn.engine``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from . import masks
from .attention import MultiHeadAttention
from .cache import KVCache
from .config import ModelConfig
from .dropout import Dropout
from .embedding import LearnedPositionalEmbedding, SinusoidalPositionalEncoding, TokenEmbedding
from .feed_forward import ACTIVATION
from .layers import DecoderLayer, EncoderLayer, ScaleNorm, make_norm
from .pretrained import PretrainedMixin

__all__ = [
    "Encoder",
    "Decoder",
    "Transformer",
    "DecoderOnly",
    "EncoderOnly",
    "EncoderOutput",
    "DecoderOutput",
    "Attention",
    "init_weights",
]


class EncoderOutput(NamedTuple):
    memory: Tensor  # (B, S, d_model)
    mask: Tensor  # (B, 1, 1, S) source padding mask, True = real token
    attention: list[Tensor] | None  # per layer (B, H, S, S)


class DecoderOutput(NamedTuple):
    """The decoder's result."""

    logits: Tensor  # (B, T, V)
    cache: KVCache | None
    self_attention: list[Tensor] | None  # per layer (B, H, T, T)
    cross_attention: list[Tensor] | None  # per layer (B, H, T, S)
    hidden: Tensor | None = None  # (B, T, d_model), or (N, d_model) with select: what the projection read


class Attention(NamedTuple):
    """Every layer's attention weights, returned by ``forward(..., return_attention=True)``."""

    encoder: list[Tensor] | None  # encoder self-attention, per layer (B, H, S, S)
    decoder_self: list[Tensor] | None  # decoder masked self-attention, per layer (B, H, T, T)
    decoder_cross: list[Tensor] | None  # encoder-decoder attention, per layer (B, H, T, S)


class Encoder(nn.Module):
    """A stack of N encoder layers (§3.1), plus a final LayerNorm (or ScaleNorm) if
    ``config.final_norm``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.N))
        self.norm = make_norm(config) if config.final_norm else None

    def forward(
        self, x: Tensor, mask: Tensor | None = None, return_attention: bool = False
    ) -> tuple[Tensor, list[Tensor] | None]:
        """x ``(B, S, d_model)`` embedded source; mask ``(B, 1, 1|S, S)``, True = may attend.

        Returns ``(B, S, d_model)`` and, if asked, each layer's weights ``(B, H, S, S)``.
        """
        attention = [] if return_attention else None
        for layer in self.layers:
            x, weights = layer(x, mask, need_weights=return_attention)
            if attention is not None:
                attention.append(weights)
        if self.norm is not None:
            x = self.norm(x)
        return x, attention


class Decoder(nn.Module):
    """A stack of N decoder layers (§3.1), plus a final LayerNorm (or ScaleNorm) if ``config.final_norm``.
    ``cross=False`` builds the decoder of a decoder-only model (no encoder-decoder attention)."""

    def __init__(self, config: ModelConfig, cross: bool = True) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(config, cross) for _ in range(config.N_dec))
        self.norm = make_norm(config) if config.final_norm else None

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        self_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        cache: KVCache | None = None,
        return_attention: bool = False,
    ) -> tuple[Tensor, list[Tensor] | None, list[Tensor] | None]:
        """x ``(B, T, d_model)`` embedded target; memory ``(B, S, d_model)``; self_mask
        ``(B|1, 1, T, T')`` and memory_mask ``(B, 1, 1, S)``, True = may attend. With a cache,
        ``x`` holds only the new positions; the cache is updated in place.

        Returns ``(B, T, d_model)`` and, if asked, per-layer self-attention ``(B, H, T, T')``
        and encoder-decoder attention ``(B, H, T, S)`` weights.
        """
        self_attention = [] if return_attention else None
        cross_attention = [] if return_attention else None
        for i, layer in enumerate(self.layers):
            self_cache = cache.self_attn[i] if cache is not None else None
            cross_cache = cache.cross_attn[i] if cache is not None and cache.cross_attn is not None else None
            x, self_w, cross_w = layer(x, memory, self_mask, memory_mask, self_cache, cross_cache, return_attention)
            if return_attention:
                self_attention.append(self_w)
                cross_attention.append(cross_w)
        if self.norm is not None:
            x = self.norm(x)
        return x, self_attention, cross_attention


def _positional(config: ModelConfig) -> nn.Module:
    if config.positional == "learned":
        return LearnedPositionalEmbedding(config.d_model, config.max_len)
    return SinusoidalPositionalEncoding(config.d_model, config.max_len)


def _self_mask(config: ModelConfig, T: int, offset: int, causal: bool, device: torch.device) -> Tensor | None:
    """The structural part of a self-attention mask (causal and/or restricted window)."""
    mask = masks.causal_mask(T, offset=offset, device=device) if causal else None
    if config.attention_window is not None:
        window = masks.window_mask(T, r=config.attention_window, offset=offset, device=device)
        mask = window if mask is None else mask & window
    return mask


def _decoder_self_mask(
    config: ModelConfig, tokens: Tensor, cache: KVCache | None
) -> tuple[int | Tensor, Tensor | None]:
    """The position offset of ``tokens`` ``(B, T)`` and their masked self-attention mask
    ``(B, 1, T, length + T)``: causal (and windowed) over the cached and the new positions,
    and no padded key, except the start token where it is the padding id (Marian's)."""
    T = tokens.size(1)
    offset = 0 if cache is None else cache.length
    key_mask = masks.padding_mask(tokens, config.pad_id, start=offset == 0 and config.bos_id == config.pad_id)
    if cache is None:
        return 0, _and(key_mask, _self_mask(config, T, 0, True, tokens.device))
    key_mask = cache.extend_key_mask(key_mask)  # (B, 1, 1, length + T)
    # a single new position may attend to every cached one: no causal mask needed
    return offset, _and(key_mask, _self_mask(config, T, offset, T > 1, tokens.device))


def _and(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    if a is None:
        return b
    return a if b is None else a & b


@torch.no_grad()
def init_weights(model: nn.Module) -> None:
    """Xavier-uniform projection matrices with zero biases; embeddings N(0, d_model^-0.5)
    (set by ``TokenEmbedding``), which suits their √d_model scaling; LayerNorm (1, 0); ScaleNorm's
    g = √d_model."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, (TokenEmbedding, LearnedPositionalEmbedding)):
            module.reset_parameters()
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, ScaleNorm):
            module.reset_parameters()
    for module in model.modules():
        if isinstance(module, MultiHeadAttention):
            # W^Q, W^K, W^V are three d_model x (h d_k) matrices: initialise each on its own,
            # not the fused (3 h d_k) x d_model block as a whole.
            sizes = [module.h * module.d_k, module.h * module.d_k, module.h * module.d_v]
            for block in module.in_proj.weight.split(sizes, dim=0):
                nn.init.xavier_uniform_(block)


class Transformer(PretrainedMixin, nn.Module):
    """The encoder-decoder Transformer (§3, Figure 1).

    Embeddings are scaled by √d_model and, when ``config.share_embeddings`` and
    ``config.tie_output``, one matrix serves the source embedding, the target embedding and the
    pre-softmax projection (§3.4). Sinusoidal (or learned) positional encodings are added and
    dropout is applied to the sum (§3.5, §5.4).

    Example::

        model = Transformer(ModelConfig.base(vocab_size=37000))
        logits = model(src, tgt)                      # (B, T, V), teacher forcing
        enc = model.encode(src)                       # memory (B, S, d_model), mask (B, 1, 1, S)
        cache = model.init_cache(enc.memory, enc.mask)
        out = model.decode(bos, cache=cache)          # one step: out.logits (B, 1, V)
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.src_embedding = TokenEmbedding(config.vocab_size, config.d_model, config.fix_norm)
        if config.share_embeddings:
            self.tgt_embedding = self.src_embedding
        else:
            self.tgt_embedding = TokenEmbedding(config.tgt_vocab_size, config.d_model, config.fix_norm)
        self.src_positional = _positional(config)
        self.tgt_positional = _positional(config)
        self.dropout = Dropout(config.P_drop)
        self.encoder = Encoder(config)
        self.decoder = Decoder(config, cross=True)
        self.output_projection = (
            None if config.tie_output else nn.Linear(config.d_model, config.tgt_vocab_size, bias=False)
        )
        # not in the paper: Marian's final_logits_bias (config.output_bias), zero until loaded
        self.output_bias = nn.Parameter(torch.zeros(config.tgt_vocab_size)) if config.output_bias else None
        init_weights(self)

    def _logits(self, x: Tensor) -> Tensor:
        """The pre-softmax linear transformation (§3.4): ``(..., d_model) -> (..., V)``."""
        projection = self.tgt_embedding.project if self.output_projection is None else self.output_projection
        logits = projection(x)  # (B, T, V)
        return logits if self.output_bias is None else logits + self.output_bias

    def encode(self, src: Tensor, return_attention: bool = False) -> EncoderOutput:
        """Run the encoder. Shape: src ``(B, S)`` token ids -> memory ``(B, S, d_model)``,
        source padding mask ``(B, 1, 1, S)`` (True = real token), optional attention per layer."""
        src_mask = masks.padding_mask(src, self.config.pad_id)  # (B, 1, 1, S)
        self_mask = _and(src_mask, _self_mask(self.config, src.size(1), 0, False, src.device))
        x = self.dropout(self.src_positional(self.src_embedding(src)))  # (B, S, d_model)
        memory, attention = self.encoder(x, self_mask, return_attention)
        return EncoderOutput(memory, src_mask, attention)

    def init_cache(self, memory: Tensor, memory_mask: Tensor | None = None) -> KVCache:
        """A KV cache for incremental decoding of this source: the encoder-decoder keys and
        values of every layer are computed here, once."""
        cache = KVCache(len(self.decoder.layers), cross=True, memory_mask=memory_mask)
        for layer, layer_cache in zip(self.decoder.layers, cache.cross_attn, strict=True):
            layer_cache.set(*layer.cross_attn.project_kv(memory))
        return cache

    def decode(
        self,
        tgt: Tensor,
        memory: Tensor | None = None,
        memory_mask: Tensor | None = None,
        cache: KVCache | None = None,
        return_attention: bool = False,
        select: Tensor | None = None,
    ) -> DecoderOutput:
        """Run the decoder and the output projection.

        Without a cache: ``tgt`` ``(B, T)`` is the whole (shifted) target, masked causally and
        by padding. With a cache from ``init_cache``: ``tgt`` holds only the new tokens
        ``(B, T_new)``; ``memory`` and ``memory_mask`` come from the cache; the cache is
        updated and returned. ``select`` ``(B, T)`` (boolean) computes the logits only at the
        selected positions (e.g. the non-pad targets in training), as ``(N, V)``.

        Shape: logits ``(B, T, V)``, or ``(N, V)`` with ``select``.
        """
        if cache is not None:
            if cache.memory_mask is None:  # a cache not made by init_cache: keep the mask with it
                cache.memory_mask = memory_mask
            memory_mask = cache.memory_mask
        elif memory is None:
            raise ValueError("decode needs memory (from encode) or a cache (from init_cache)")
        offset, self_mask = _decoder_self_mask(self.config, tgt, cache)
        x = self.dropout(self.tgt_positional(self.tgt_embedding(tgt), offset))  # (B, T, d_model)
        x, self_attention, cross_attention = self.decoder(x, memory, self_mask, memory_mask, cache, return_attention)
        if select is not None:
            x = x[select]  # (N, d_model): the output projection is the costliest matmul; skip padding
        return DecoderOutput(self._logits(x), cache, self_attention, cross_attention, x)

    def forward(
        self, src: Tensor, tgt: Tensor, return_attention: bool = False, select: Tensor | None = None
    ) -> Tensor | tuple[Tensor, Attention]:
        """Teacher-forced logits. Shape: src ``(B, S)``, tgt ``(B, T)`` -> ``(B, T, V)``, or
        ``(N, V)`` at the positions where ``select`` ``(B, T)`` is True; with
        ``return_attention`` also every layer's weights (``Attention``)."""
        enc = self.encode(src, return_attention)
        dec = self.decode(tgt, enc.memory, enc.mask, return_attention=return_attention, select=select)
        if return_attention:
            return dec.logits, Attention(enc.attention, dec.self_attention, dec.cross_attention)
        return dec.logits


class DecoderOnly(PretrainedMixin, nn.Module):
    """A decoder-only Transformer: a causal language model (GPT-style). Decoder layers without
    encoder-decoder attention; embedding tied to the output projection when ``tie_output``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = TokenEmbedding(config.vocab_size, config.d_model, config.fix_norm)
        self.positional = _positional(config)
        self.dropout = Dropout(config.P_drop)
        self.decoder = Decoder(config, cross=False)
        self.output_projection = None if config.tie_output else nn.Linear(config.d_model, config.vocab_size, bias=False)
        # not in the paper: a bias on the pre-softmax projection (config.output_bias), zero until trained
        self.output_bias = nn.Parameter(torch.zeros(config.vocab_size)) if config.output_bias else None
        init_weights(self)

    def init_cache(self) -> KVCache:
        """An empty KV cache for incremental decoding."""
        return KVCache(len(self.decoder.layers))

    def decode(
        self,
        tokens: Tensor,
        cache: KVCache | None = None,
        return_attention: bool = False,
        select: Tensor | None = None,
    ) -> DecoderOutput:
        """Next-token logits. Without a cache, ``tokens`` ``(B, T)`` is the whole sequence
        (causal and padding masks); with one, only the new tokens. ``select`` ``(B, T)``
        (boolean) computes the logits only at the selected positions, as ``(N, V)``.

        Shape: logits ``(B, T, V)``, or ``(N, V)`` with ``select``."""
        offset, self_mask = _decoder_self_mask(self.config, tokens, cache)
        x = self.dropout(self.positional(self.embedding(tokens), offset))  # (B, T, d_model)
        x, self_attention, _ = self.decoder(x, self_mask=self_mask, cache=cache, return_attention=return_attention)
        if select is not None:
            x = x[select]  # (N, d_model): skip the output projection at padding
        logits = self.embedding.project(x) if self.output_projection is None else self.output_projection(x)
        if self.output_bias is not None:
            logits = logits + self.output_bias
        return DecoderOutput(logits, cache, self_attention, None, x)

    def forward(
        self, tokens: Tensor, return_attention: bool = False, select: Tensor | None = None
    ) -> Tensor | tuple[Tensor, Attention]:
        """Shape: ``(B, T)`` -> logits ``(B, T, V)`` (position t predicts token t + 1), or
        ``(N, V)`` at the positions where ``select`` ``(B, T)`` is True."""
        out = self.decode(tokens, return_attention=return_attention, select=select)
        if return_attention:
            return out.logits, Attention(None, out.self_attention, None)
        return out.logits


class MaskedLMHead(nn.Module):
    """The masked-LM head of BERT: dense + activation + LayerNorm, then the (tied) vocabulary
    projection with a bias. Shape: ``(..., d_model) -> (..., V)``, e.g. ``(B, L, d_model) -> (B, L, V)``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.d_model, config.d_model)
        self.activation = ACTIVATION[config.activation]
        self.norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.projection = None if config.tie_output else nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, x: Tensor, embedding: TokenEmbedding) -> Tensor:
        """``embedding`` is the model's token embedding, used as the projection when tied."""
        x = self.norm(self.activation(self.dense(x)))
        logits = embedding.project(x) if self.projection is None else self.projection(x)
        return logits + self.bias


class EncoderOnly(PretrainedMixin, nn.Module):
    """An encoder-only Transformer: a bidirectional encoder with a masked-LM head (BERT-style)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.output_bias:
            raise ValueError("ModelConfig: output_bias is for models that decode; the masked-LM head has its own bias")
        self.config = config
        self.embedding = TokenEmbedding(config.vocab_size, config.d_model, config.fix_norm)
        self.positional = _positional(config)
        self.dropout = Dropout(config.P_drop)
        self.encoder = Encoder(config)
        self.mlm_head = MaskedLMHead(config)
        init_weights(self)

    def encode(self, tokens: Tensor, return_attention: bool = False) -> EncoderOutput:
        """Contextual representations. Shape: ``(B, L)`` -> ``(B, L, d_model)``."""
        mask = masks.padding_mask(tokens, self.config.pad_id)  # (B, 1, 1, L)
        self_mask = _and(mask, _self_mask(self.config, tokens.size(1), 0, False, tokens.device))
        x = self.dropout(self.positional(self.embedding(tokens)))
        x, attention = self.encoder(x, self_mask, return_attention)
        return EncoderOutput(x, mask, attention)

    def forward(
        self, tokens: Tensor, return_attention: bool = False, select: Tensor | None = None
    ) -> Tensor | tuple[Tensor, Attention]:
        """Masked-LM logits. Shape: ``(B, L)`` -> ``(B, L, V)``, or ``(N, V)`` at the positions
        where ``select`` ``(B, L)`` is True (in training, the masked ones: the head is costly)."""
        enc = self.encode(tokens, return_attention)
        memory = enc.memory if select is None else enc.memory[select]  # (B, L, d_model) or (N, d_model)
        logits = self.mlm_head(memory, self.embedding)
        if return_attention:
            return logits, Attention(enc.attention, None, None)
        return logits
