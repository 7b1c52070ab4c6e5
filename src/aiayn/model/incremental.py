"""One incremental decoding step of the decoder stack on the KV cache, written flat (not in
the paper: an inference device, like the cache itself).

Legend: B rows (sentences, or beams), G beams sharing one row of the encoder-decoder K/V
(``KVCache.expand``), H heads, D_k / D_v per-head sizes, L cached positions, S source length.

At a decoding step every sublayer of §3.1 sees one new position per row: short, wide matrix
products and small element-wise operations. Run module by module (``Decoder.forward``), the
step also pays Python for each module call, each ``linear`` call's checks, each attention
call's eligibility checks, the head splits and the dropout modules that are identities in
eval mode. That is a large share of a small model's step: with the Ding preset's shape
(d_model 128, N 3) ``step`` makes greedy translation of the Ding test split 1.12x faster
(1.24x on its first 256 lines) and beam 4 1.02-1.10x; at the base shape 1.01-1.04x, where the
products dominate (docs/benchmarks.md). ``step`` runs the same arithmetic in the same order,
with each decision taken once a step instead of once a call: the products computed as
``model/linear.py`` would compute them, attention by the CPU kernel where ``cpu_kernels.eligible``
holds for the first layer (the layers share their shapes, dtypes and cache layouts), and the
residual and layer norm of post-norm or pre-norm (``ResidualNorm``) without the dropout
modules. Its results are bit-identical to ``Decoder.forward`` (tests compare them for both
norms, both activations, beams, padding, decoder-only models and int8 models).

It serves what decoding needs: the decoder in eval mode with autograd off, one new position
per row, no attention weights returned (the self-attention mask of a step, over its keys only,
is passed on: padded prompts and windowed attention). It is a second copy of the sublayers'
forward passes (``DecoderLayer``, ``MultiHeadAttention``, ``PositionwiseFeedForward``,
``ResidualNorm``), kept equal to them by the tests; what it leaves out: forward hooks on the
decoder's submodules do not fire, and submodules put back in train mode inside an eval-mode
decoder (Monte Carlo dropout) get no dropout. For those, set ``AIAYN_FAST_STEP=0`` in the
environment before importing aiayn, or ``aiayn.model.incremental.enabled = False``.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import cpu_kernels
from .attention import AttentionCache, KVCache, MultiHeadAttention, scaled_dot_product_attention
from .feed_forward import PositionwiseFeedForward
from .layers import ResidualNorm
from .linear import Linear, inference_path, packed_linear, transposed

__all__ = ["enabled", "applies", "step"]

enabled = os.environ.get("AIAYN_FAST_STEP", "1") != "0"


def applies(decoder: nn.Module, x: Tensor, cache: KVCache | None, need_weights: bool) -> bool:
    """Whether ``step`` computes this call of ``Decoder.forward``: a decoding step in eval mode
    with autograd off (one new position per row, a cache with the encoder-decoder K/V already
    set, no weights asked for). With autograd on, the module path decides per layer whether
    attention may run in the CPU kernel (which has no backward)."""
    if not enabled or cache is None or need_weights or decoder.training or torch.is_grad_enabled():
        return False
    if x.dim() != 3 or x.size(1) != 1 or len(cache.self_attn) != len(decoder.layers):
        return False
    if decoder.layers[0].cross_attn is None:
        return True
    return cache.cross_attn is not None and all(layer_cache.static for layer_cache in cache.cross_attn)


def step(decoder: nn.Module, x: Tensor, self_mask: Tensor | None, memory_mask: Tensor | None, cache: KVCache) -> Tensor:
    """The decoder stack (``Decoder.forward``) for one new position per row, appending its keys
    and values to ``cache``. Call only where ``applies`` holds.

    Shape: x ``(B, 1, d_model)``; self_mask ``(B|1, 1, 1, L + 1)`` over the cached keys and the
    new one, memory_mask ``(B / G, 1, 1, S)``, both True = may attend, or None -> ``(B, 1, d_model)``.
    """
    B = x.size(0)
    x = x.reshape(B, x.size(-1))  # (B, d_model)
    plan = _Plan(inference_path(x))
    for i, layer in enumerate(decoder.layers):
        norm = layer.self_attn_norm
        x = _after(norm, x, _self_attention(layer.self_attn, _before(norm, x), cache.self_attn[i], self_mask, plan))
        if layer.cross_attn is not None:
            norm = layer.cross_attn_norm
            y = _cross_attention(layer.cross_attn, _before(norm, x), cache.cross_attn[i], memory_mask, plan)
            x = _after(norm, x, y)
        norm = layer.feed_forward_norm
        x = _after(norm, x, _feed_forward(layer.feed_forward, _before(norm, x), plan))
    if decoder.norm is not None:
        x = decoder.norm(x)
    return x[:, None]  # (B, 1, d_model)


class _Plan:
    """The decisions of one step: how the float32 products run (``linear.inference_path``) and,
    once known at the first layer, whether the CPU attention kernel serves self- and
    encoder-decoder attention."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.kernel: dict[str, bool] = {}

    def attend(self, kind: str, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """softmax(Q Kᵀ / √d_k) V (§3.2.1, eq. 1): ``(B, H, T, D_k)`` queries -> ``(B, H, T, D_v)``."""
        kernel = self.kernel.get(kind)
        if kernel is None:
            kernel = self.kernel[kind] = cpu_kernels.eligible(q, k, v, mask)
        if kernel:
            return cpu_kernels.decode_attention(q, k, v, mask)
        return scaled_dot_product_attention(q, k, v, mask)[0]

    def project(self, module: nn.Module, x: Tensor, relu: bool = False) -> Tensor:
        """``module(x)`` for a linear layer, then max(0, ·) if ``relu`` (in place, or inside
        oneDNN's product): ``(B, d_in) -> (B, d_out)``."""
        path = self.path if type(module) is Linear and module.weight.dtype == torch.float32 else "linear"
        if path == "packed" and not module.weight.is_inference():
            return packed_linear(x, module.weight, module.bias, relu=relu)
        # module(x): int8 (quantized) layers, large batches, other devices and dtypes, inference-mode weights
        y = transposed(x, module.weight, module.bias) if path == "transposed" else module(x)
        return y.relu_() if relu else y  # y is a fresh tensor


def _before(norm: ResidualNorm, x: Tensor) -> Tensor:
    """``ResidualNorm.before`` in eval mode: LayerNorm(x) for pre-norm, x for post-norm (§3.1)."""
    if not norm.norm_first:
        return x
    n = norm.norm
    return F.layer_norm(x, n.normalized_shape, n.weight, n.bias, n.eps)


def _after(norm: ResidualNorm, x: Tensor, y: Tensor) -> Tensor:
    """``ResidualNorm.after`` in eval mode (dropout is the identity): LayerNorm(x + y) for
    post-norm (§3.1), x + y for pre-norm."""
    if norm.norm_first:
        return x + y
    n = norm.norm
    return F.layer_norm(x + y, n.normalized_shape, n.weight, n.bias, n.eps)


def _self_attention(
    mha: MultiHeadAttention, x: Tensor, cache: AttentionCache, mask: Tensor | None, plan: _Plan
) -> Tensor:
    """Masked self-attention of the new position over the cached ones and itself (§3.2.3):
    ``(B, d_model) -> (B, d_model)``."""
    B, H, D_k, D_v = x.size(0), mha.h, mha.d_k, mha.d_v
    qkv = plan.project(mha.in_proj, x)  # (B, H (2 D_k + D_v))
    q, k, v = qkv.split([H * D_k, H * D_k, H * D_v], dim=-1)  # (B, H D_k), (B, H D_k), (B, H D_v)
    k, v = cache.append(k.view(B, H, 1, D_k), v.view(B, H, 1, D_v))  # (B, H, L, D_k), (B, H, L, D_v)
    out = plan.attend("self", q.view(B, H, 1, D_k), k, v, mask)  # (B, H, 1, D_v)
    return plan.project(mha.out_proj, out.transpose(1, 2).reshape(B, H * D_v))  # (B, H D_v) -> (B, d_model)


def _cross_attention(
    mha: MultiHeadAttention, x: Tensor, cache: AttentionCache, mask: Tensor | None, plan: _Plan
) -> Tensor:
    """Encoder-decoder attention over the cached source K/V (§3.2.3); the G beams of a sentence
    attend together as G queries of its one row, as in ``MultiHeadAttention.forward``.
    ``(B, d_model) -> (B, d_model)``."""
    B, H, D_k, D_v, G = x.size(0), mha.h, mha.d_k, mha.d_v, cache.group
    q = mha.project_q(x[:, None])  # (B, H, 1, D_k)
    k, v = cache.k, cache.v  # (B / G, H, S, D_k), (B / G, H, S, D_v)
    if G > 1:
        if G * k.size(0) != B:
            raise ValueError(f"{B} query rows do not fill {k.size(0)} cached rows of {G} beams each")
        q = q.view(-1, G, H, 1, D_k).transpose(1, 2).reshape(-1, H, G, D_k)  # (B / G, H, G, D_k)
    out = plan.attend("cross", q, k, v, mask)  # (B / G, H, G, D_v)
    out = out.transpose(1, 2).reshape(B, H * D_v)  # (B / G, G, H, D_v) -> (B, H D_v)
    return plan.project(mha.out_proj, out)


def _feed_forward(ff: PositionwiseFeedForward, x: Tensor, plan: _Plan) -> Tensor:
    """FFN(x) = max(0, x W1 + b1) W2 + b2 (§3.3, eq. 2), or GELU; ``(B, d_model) -> (B, d_model)``."""
    if ff.activation is F.relu:
        h = plan.project(ff.linear1, x, relu=True)  # (B, d_ff)
    else:
        h = ff.activation(plan.project(ff.linear1, x))  # (B, d_ff)
    return plan.project(ff.linear2, h)
