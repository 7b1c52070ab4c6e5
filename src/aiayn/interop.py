"""Copy weights from ``torch.nn.Transformer`` / ``torch.nn.TransformerEncoder`` into aiayn.

The layouts match one for one: ``nn.MultiheadAttention.in_proj_weight`` is our
``MultiHeadAttention.in_proj.weight`` ([W^Q; W^K; W^V]); ``linear1``/``linear2`` are the
feed-forward network; ``norm1``/``norm2``/``norm3`` are the LayerNorms after (post-norm) or
before (pre-norm) self-attention, encoder-decoder attention and the feed-forward network.
``torch.nn.Transformer`` always ends each stack with a LayerNorm, so the aiayn config needs
``final_norm=True`` to match it.

Only the stacks are copied: torch's modules have no embeddings or output projection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .model import EncoderOnly, ModelConfig, Transformer
from .model.attention import MultiHeadAttention
from .model.layers import ResidualNorm
from .model.transformer import Decoder, Encoder

__all__ = ["load_torch_transformer"]


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{name}: shape {tuple(src.shape)} in torch, {tuple(dst.shape)} in aiayn; configs differ")
    dst.copy_(src)


def _attention(dst: MultiHeadAttention, src: nn.MultiheadAttention, name: str) -> None:
    if not src._qkv_same_embed_dim or src.in_proj_bias is None:
        raise ValueError(f"{name}: only nn.MultiheadAttention with one in_proj and biases is supported")
    if not src.batch_first:
        raise ValueError(f"{name}: the torch module must be built with batch_first=True")
    _copy(dst.in_proj.weight, src.in_proj_weight, f"{name}.in_proj_weight")
    _copy(dst.in_proj.bias, src.in_proj_bias, f"{name}.in_proj_bias")
    _copy(dst.out_proj.weight, src.out_proj.weight, f"{name}.out_proj.weight")
    _copy(dst.out_proj.bias, src.out_proj.bias, f"{name}.out_proj.bias")


def _linear(dst: nn.Linear, src: nn.Linear, name: str) -> None:
    _copy(dst.weight, src.weight, f"{name}.weight")
    _copy(dst.bias, src.bias, f"{name}.bias")


def _norm(dst: nn.LayerNorm | ResidualNorm | None, src: nn.LayerNorm | None, name: str) -> None:
    dst = dst.norm if isinstance(dst, ResidualNorm) else dst
    if (dst is None) != (src is None):
        raise ValueError(
            f"{name}: {'missing in aiayn' if dst is None else 'missing in torch'}; set final_norm to match"
        )
    if dst is not None:
        if dst.eps != src.eps:
            raise ValueError(f"{name}: eps {src.eps} in torch, {dst.eps} in aiayn")
        _copy(dst.weight, src.weight, f"{name}.weight")
        _copy(dst.bias, src.bias, f"{name}.bias")


def _check_layer(layer: nn.Module, config: ModelConfig, name: str) -> None:
    if layer.norm_first != config.norm_first:
        raise ValueError(f"{name}: norm_first={layer.norm_first} in torch, {config.norm_first} in aiayn")
    activation = {F.relu: "relu", F.gelu: "gelu"}.get(layer.activation)
    if activation != config.activation:
        raise ValueError(f"{name}: activation {layer.activation} in torch, {config.activation!r} in aiayn")


def _stack(
    dst: Encoder | Decoder, src: nn.TransformerEncoder | nn.TransformerDecoder, config: ModelConfig, name: str
) -> None:
    """Copy every layer of a torch encoder or decoder stack, then its final norm."""
    if len(dst.layers) != len(src.layers):
        raise ValueError(f"{name}: {len(src.layers)} layers in torch, {len(dst.layers)} in aiayn")
    for i, (ours, theirs) in enumerate(zip(dst.layers, src.layers, strict=True)):
        prefix = f"{name}.layers.{i}"
        _check_layer(theirs, config, prefix)
        _attention(ours.self_attn, theirs.self_attn, f"{prefix}.self_attn")
        norms = [ours.self_attn_norm, ours.feed_forward_norm]  # torch: norm1, norm2 (encoder)
        if isinstance(theirs, nn.TransformerDecoderLayer):
            _attention(ours.cross_attn, theirs.multihead_attn, f"{prefix}.multihead_attn")
            norms.insert(1, ours.cross_attn_norm)  # torch: norm1, norm2, norm3 (decoder)
        _linear(ours.feed_forward.linear1, theirs.linear1, f"{prefix}.linear1")
        _linear(ours.feed_forward.linear2, theirs.linear2, f"{prefix}.linear2")
        for j, norm in enumerate(norms, start=1):
            _norm(norm, getattr(theirs, f"norm{j}"), f"{prefix}.norm{j}")
    _norm(dst.norm, src.norm, f"{name}.norm")


@torch.no_grad()
def load_torch_transformer(model: Transformer | EncoderOnly, module: nn.Transformer | nn.TransformerEncoder) -> None:
    """Copy the encoder and decoder stacks of a ``torch.nn.Transformer`` (``batch_first=True``,
    either norm order) into ``model``, an aiayn ``Transformer`` built with the matching config
    (``d_model``, ``h``, ``d_ff``, ``N``, ``norm_first``, ``activation``, ``layer_norm_eps``,
    ``final_norm=True``). For an ``EncoderOnly`` model, ``module`` is a
    ``torch.nn.TransformerEncoder``. Raises ``ValueError`` naming the first mismatch."""
    config = model.config
    if isinstance(model, EncoderOnly):
        if not isinstance(module, nn.TransformerEncoder):
            raise TypeError("an EncoderOnly model loads from a torch.nn.TransformerEncoder")
        _stack(model.encoder, module, config, "encoder")
        return
    if not isinstance(module, nn.Transformer):
        raise TypeError("a Transformer loads from a torch.nn.Transformer")
    _stack(model.encoder, module.encoder, config, "encoder")
    _stack(model.decoder, module.decoder, config, "decoder")
