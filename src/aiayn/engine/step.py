"""One incremental decoding step of a prepared model, written flat (not in the paper: an
inference device, like the cache itself).

Legend: B rows (sentences, or beams), G beams sharing one row of the encoder-decoder K/V
(``EngineCache.expand``), H heads, D_k / D_v per-head sizes, L cached positions, S source length,
V vocabulary.

At a decoding step every sublayer of §3.1 sees one new position per row: short, wide matrix
products and small element-wise operations. Run module by module (``Decoder.forward``), the step
also pays Python for each module call, the head splits and the dropout modules that are
identities in eval mode: a large share of a small model's step. With the Ding preset's shape
(d_model 128, N 3) the flat step made greedy translation of the Ding test split 1.12x faster
(beam 4 1.02-1.10x; at the base shape 1.01-1.04x, where the products dominate:
docs/benchmarks.md). ``Decoding.__call__`` runs the arithmetic of ``Transformer.decode`` for one
token per row, in the same order, with each decision taken once a step: the products by
``PackedLinear.step``, attention by the C++ kernel (``kernels.py``) where ``EngineOptions.kernels``
and ``kernels.eligible`` hold for the first layer (the layers share their shapes, dtypes and
cache layouts), and the residual and layer norm of post-norm or pre-norm without dropout.
Tests compare its logits with the model's teacher-forced ones, with random weights, biases and
layer-norm parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..model import Transformer, masks
from ..model.attention import MultiHeadAttention, scaled_dot_product_attention
from ..model.feed_forward import PositionwiseFeedForward
from ..model.layers import ResidualNorm
from . import kernels
from .cache import AttentionCache, EngineCache
from .linear import PackedLinear
from .options import EngineOptions

__all__ = ["Decoding"]


class Decoding:
    """The rows of a search on the engine: their cache and the step that extends it.

    ``Decoding(model, src, beam, steps)`` encodes ``src`` ``(B, S)`` and sets up ``beam`` rows
    per sentence (sharing its encoder-decoder K/V), with room for ``steps`` positions;
    ``decoding(tokens)`` takes each row's next input token ``(R,)`` and returns the next-token
    logits ``(R, V)``; ``reorder`` gathers rows (beam parents, or the rows still decoding);
    ``add(src)`` brings in new sentences at position 0 while the others go on (continuous
    batching: ``aiayn.decode.translate_continuous``).
    """

    def __init__(self, model: Transformer, src: Tensor, beam: int = 1, steps: int = 0) -> None:
        self.model, self.beam = model, beam
        self.options: EngineOptions = model.engine
        self.cache = self._start(src).reserve(steps)
        self._kernel: dict[str, bool] = {}  # per kind of attention, decided at the first step

    def _start(self, src: Tensor) -> EngineCache:
        """Encode ``src`` and compute every layer's encoder-decoder K/V once (``init_cache``), in the
        engine's layout, for ``beam`` rows each."""
        enc = self.model.encode(src)
        plain = self.model.init_cache(enc.memory, enc.mask)
        cache = EngineCache(len(plain.cross_attn), cross=True, memory_mask=enc.mask)
        for layer_cache, computed in zip(cache.cross_attn, plain.cross_attn, strict=True):
            layer_cache.set(computed.k, computed.v)
        return cache.expand(self.beam)

    def add(self, src: Tensor) -> None:
        """New sentences ``(B', S')`` join: ``beam`` rows each after the current ones, starting at
        position 0 (an attention window's mask counts positions from a shared start: not with one)."""
        if self.model.config.attention_window is not None:
            raise ValueError("sentences cannot join a search under an attention window")
        self.cache.add_rows(self._start(src))

    def reorder(self, rows: Tensor, sentences_changed: bool = True) -> None:
        """Row r becomes row ``rows[r]``; ``sentences_changed=False`` when every row stays within
        its sentence's beams (the encoder-decoder K/V need no gathering). Then the leading
        positions no row attends to any more are forgotten (rows that joined later)."""
        self.cache.reorder(rows, cross=sentences_changed)
        self.cache.drop_leading()

    def freeze(self, rows: Tensor) -> None:
        """Ended rows ``(R,)`` (True) that stay in the batch a while wait at position 0, so that
        they never walk past a learned positional table while rows that joined later go on."""
        if self.cache.positions is not None:
            self.cache.positions.masked_fill_(rows, 0)

    @torch.no_grad()
    def __call__(self, tokens: Tensor) -> Tensor:
        """``Transformer.decode`` of one new token per row on the cache: ``(R,) -> (R, V)``
        logits (possibly a transposed view: use ``reshape``, not ``view``)."""
        model, cache, config = self.model, self.cache, self.model.config
        B = tokens.size(0)
        if cache.positions is not None:  # rows at different steps (rows added): one position each
            offset, cache.positions = cache.positions, cache.positions + 1  # (B,)
        else:
            offset = cache.length
        start = offset == 0 if config.bos_id == config.pad_id else False  # Marian's start token is its padding id
        self_mask = cache.extend_key_mask(masks.padding_mask(tokens[:, None], config.pad_id, start))  # (B, 1, 1, L + 1)
        if config.attention_window is not None:  # never with per-row positions (Decoding.add refuses)
            window = masks.window_mask(1, r=config.attention_window, offset=offset, device=tokens.device)
            self_mask = window if self_mask is None else self_mask & window
        x = model.tgt_positional(model.tgt_embedding(tokens[:, None]), offset).reshape(B, -1)  # (B, d_model)
        for i, layer in enumerate(model.decoder.layers):
            norm = layer.self_attn_norm
            y = self._self_attention(layer.self_attn, _before(norm, x), cache.self_attn[i], self_mask)
            x = _after(norm, x, y)
            norm = layer.cross_attn_norm
            x = _after(norm, x, self._cross_attention(layer.cross_attn, _before(norm, x), cache.cross_attn[i]))
            norm = layer.feed_forward_norm
            x = _after(norm, x, _feed_forward(layer.feed_forward, _before(norm, x)))
        if model.decoder.norm is not None:
            x = model.decoder.norm(x)
        logits = _project(model.engine_projection, x)  # (B, V)
        store = model.datastore  # kNN-MT (aiayn.retrieval), given to prepare
        return logits if store is None else store.mix(x, logits)  # (B, V) logits, or log p

    def _attend(self, kind: str, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """softmax(Q Kᵀ / √d_k) V (§3.2.1, eq. 1): ``(B, H, T, D_k)`` queries -> ``(B, H, T, D_v)``."""
        kernel = self._kernel.get(kind)
        if kernel is None:  # decided at the first layer: the layers share their shapes
            kernel = self._kernel[kind] = self.options.kernels and kernels.eligible(q, k, v, mask)
        if kernel:
            return kernels.decode_attention(q, k, v, mask)
        # torch's fused CPU kernel needs each head's vectors contiguous (the products may come
        # transposed: linear.py); without it torch falls back to its slow math path
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        return scaled_dot_product_attention(q, k, v, mask)[0]

    def _self_attention(self, mha: MultiHeadAttention, x: Tensor, cache: AttentionCache, mask: Tensor | None) -> Tensor:
        """Masked self-attention of the new position over the cached ones and itself (§3.2.3):
        ``(B, d_model) -> (B, d_model)``."""
        B, H, D_k, D_v = x.size(0), mha.h, mha.d_k, mha.d_v
        qkv = _project(mha.in_proj, x)  # (B, H (2 D_k + D_v))
        q, k, v = qkv.split([H * D_k, H * D_k, H * D_v], dim=-1)  # (B, H D_k), (B, H D_k), (B, H D_v)
        k, v = cache.append(k.view(B, H, 1, D_k), v.view(B, H, 1, D_v))  # (B, H, L, D_k), (B, H, L, D_v)
        out = self._attend("self", q.view(B, H, 1, D_k), k, v, mask)  # (B, H, 1, D_v)
        return _project(mha.out_proj, out.transpose(1, 2).reshape(B, H * D_v))  # (B, d_model)

    def _cross_attention(self, mha: MultiHeadAttention, x: Tensor, cache: AttentionCache) -> Tensor:
        """Encoder-decoder attention over the cached source K/V (§3.2.3); the G beams of a sentence
        attend together, as G queries of its one row. ``(B, d_model) -> (B, d_model)``."""
        B, H, D_k, D_v, G = x.size(0), mha.h, mha.d_k, mha.d_v, cache.group
        q = _project(mha.q_proj, x)  # (B, H D_k)
        k, v = cache.k, cache.v  # (B / G, H, S, D_k), (B / G, H, S, D_v)
        if G * k.size(0) != B:
            raise ValueError(f"{B} query rows do not fill {k.size(0)} cached rows of {G} beams each")
        q = q.reshape(-1, G, H, D_k).transpose(1, 2)  # (B / G, H, G, D_k)
        out = self._attend("cross", q, k, v, self.cache.memory_mask)  # (B / G, H, G, D_v)
        return _project(mha.out_proj, out.transpose(1, 2).reshape(B, H * D_v))  # (B, d_model)


def _project(module: nn.Module, x: Tensor, relu: bool = False) -> Tensor:
    """``module(x)`` for a linear layer, then max(0, ·) if ``relu``: ``(B, d_in) -> (B, d_out)``."""
    if isinstance(module, PackedLinear):
        return module.step(x, relu)
    y = module(x)  # int8 (quantized) layers
    return y.relu_() if relu else y  # y is a fresh tensor


def _before(norm: ResidualNorm, x: Tensor) -> Tensor:
    """``ResidualNorm.before`` in eval mode: LayerNorm(x) (or ScaleNorm) for pre-norm, x for
    post-norm (§3.1)."""
    return norm.norm(x) if norm.norm_first else x


def _after(norm: ResidualNorm, x: Tensor, y: Tensor) -> Tensor:
    """``ResidualNorm.after`` in eval mode (dropout is the identity): LayerNorm(x + y) (or
    ScaleNorm) for post-norm (§3.1), x + y for pre-norm."""
    return x + y if norm.norm_first else norm.norm(x + y)


def _feed_forward(ff: PositionwiseFeedForward, x: Tensor) -> Tensor:
    """FFN(x) = max(0, x W1 + b1) W2 + b2 (§3.3, eq. 2), or GELU: ``(B, d_model) -> (B, d_model)``."""
    relu = ff.activation is F.relu  # max(0, ·) inside oneDNN's product
    h = _project(ff.linear1, x, relu=True) if relu else ff.activation(_project(ff.linear1, x))  # (B, d_ff)
    return _project(ff.linear2, h)
