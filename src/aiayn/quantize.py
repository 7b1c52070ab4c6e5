"""Dynamic int8 quantization for CPU inference (not in the paper).

Every ``nn.Linear`` (the attention projections, the feed-forward layers and the pre-softmax
projection) gets int8 weights (one scale per matrix, quantized once) and its input is
quantized on the fly at each call (``torch.ao.quantization.quantize_dynamic``); the arithmetic
runs in int8 with int32 accumulation. Embeddings, layer norms and softmax stay float32.

Two modules are reshaped first so that every matrix product is an ``nn.Linear``:
- encoder-decoder attention computes Q and [K; V] as two slices of one fused ``in_proj``
  (``MultiHeadAttention.project_q`` / ``project_kv``); here they become two Linear layers;
- a tied pre-softmax projection (``TokenEmbedding.project``) becomes an untied Linear copy.
aiayn's own ``Linear`` layers (``nn.Linear`` with a faster float32 CPU path) become plain
``nn.Linear`` ones, which is what ``quantize_dynamic`` replaces.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import Tensor, nn

from .model import MultiHeadAttention, Transformer
from .model.linear import Linear
from .model.masks import Packing

__all__ = ["quantize_int8"]


class _SplitCrossAttention(MultiHeadAttention):
    """Encoder-decoder attention with separate Q and [K; V] projections (same weights)."""

    def __init__(self, source: MultiHeadAttention) -> None:
        nn.Module.__init__(self)
        self.h, self.d_k, self.d_v, self.cross = source.h, source.d_k, source.d_v, True
        self.attention_dropout = source.attention_dropout
        q_size = self.h * self.d_k
        weight, bias = source.in_proj.weight.detach(), source.in_proj.bias.detach()
        self.q_proj = nn.Linear(weight.size(1), q_size)
        self.kv_proj = nn.Linear(weight.size(1), weight.size(0) - q_size)
        with torch.no_grad():
            self.q_proj.weight.copy_(weight[:q_size])
            self.q_proj.bias.copy_(bias[:q_size])
            self.kv_proj.weight.copy_(weight[q_size:])
            self.kv_proj.bias.copy_(bias[q_size:])
        self.out_proj = source.out_proj

    def project_q(self, x: Tensor) -> Tensor:
        return self._heads(self.q_proj(x), self.d_k)  # (B, H, T, D_k)

    def project_kv(self, memory: Tensor, packing: Packing | None = None) -> tuple[Tensor, Tensor]:
        kv = self.kv_proj(memory)
        if packing is not None:
            kv = packing.unpack(kv)
        k, v = kv.split([self.h * self.d_k, self.h * self.d_v], dim=-1)
        return self._heads(k, self.d_k), self._heads(v, self.d_v)  # (B, H, S, D_k), (B, H, S, D_v)


@torch.no_grad()
def quantize_int8(model: Transformer) -> Transformer:
    """A copy of ``model`` (in eval mode) with dynamically quantized int8 Linear layers, for CPU.

    The result decodes with the same code (``greedy_decode``, ``beam_search``); it cannot be
    trained or saved with ``save_pretrained``. Quantize the float model again after loading.
    """
    model = copy.deepcopy(model).eval()
    for layer in model.decoder.layers:
        if getattr(layer, "cross_attn", None) is not None:
            layer.cross_attn = _SplitCrossAttention(layer.cross_attn)
    if model.output_projection is None:
        projection = nn.Linear(model.config.d_model, model.config.tgt_vocab_size, bias=False)
        projection.weight.copy_(model.tgt_embedding.weight)
        model.output_projection = projection
    for module in model.modules():
        if type(module) is Linear:  # same parameters; quantize_dynamic matches the exact type
            module.__class__ = nn.Linear
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization announces its move to torchao
        try:
            from torch.ao.quantization import quantize_dynamic
        except ImportError as e:  # a torch that has moved it out (to torchao)
            raise ValueError(
                f"int8 quantization needs torch.ao.quantization.quantize_dynamic, which torch {torch.__version__} "
                f"does not have ({e}); decode in fp32 (no --quantize, or quantize=None), "
                "or use torch 2.13 (constraints.txt)"
            ) from None

        return quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8, inplace=True)
