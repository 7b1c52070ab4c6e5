"""Fast inference, kept apart from the paper's code (``aiayn.model``) behind one explicit step.

    model = aiayn.engine.prepare(model)                   # float32: packed weights, kernels
    model = aiayn.engine.prepare(model, quantize="int8")  # dynamic int8 products (CPU)
    aiayn.decode.beam_search(model, src)                  # the same searches, prepared or not

``prepare`` returns a copy of the model for inference that shares its parameters. What it holds
beyond them, made once there and never re-checked at a call:
- the projections as ``PackedLinear`` layers (``linear.py``), with packed oneDNN weights where
  ``EngineOptions.gemm`` takes them, or dynamically quantized int8 ones (``quantize.py``);
- encoder-decoder attention with separate Q and [K; V] projections, and the pre-softmax
  projection as one layer (``engine_projection``), holding the tied embedding's weight and any
  output bias, so that every product is one layer;
- the ``EngineOptions`` it was prepared with (``engine``).
The searches of ``aiayn.decode`` run a prepared model through ``step.Decoding``: the engine's
cache (``cache.py``: reserved buffers, beams sharing the source's K/V) and the flat decoding
step, with the C++ attention kernel (``kernels.py``) where it serves.

Prepare a model after moving it to its device and after training: the packed copies do not
follow later changes to the weights. The prepared model cannot be trained or saved.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from ..model import MultiHeadAttention, Transformer
from .linear import PackedLinear
from .options import EngineOptions
from .quantize import quantize_dynamic_int8

if TYPE_CHECKING:
    from ..retrieval import Datastore

__all__ = ["EngineOptions", "is_prepared", "prepare"]

QUANTIZE = (None, "int8")


class SplitCrossAttention(MultiHeadAttention):
    """Encoder-decoder attention with separate Q and [K; V] projections: the rows of the fused
    ``in_proj`` (views, no copy), as two linear layers (§3.2.2, eq. of MultiHead)."""

    def __init__(self, source: MultiHeadAttention) -> None:
        nn.Module.__init__(self)
        self.h, self.d_k, self.d_v, self.cross = source.h, source.d_k, source.d_v, True
        self.attention_dropout = source.attention_dropout
        q_size = self.h * self.d_k
        weight, bias = source.in_proj.weight, source.in_proj.bias
        self.q_proj = _linear(weight[:q_size], bias[:q_size])
        self.kv_proj = _linear(weight[q_size:], bias[q_size:])
        self.out_proj = source.out_proj

    def project_q(self, x: Tensor) -> Tensor:
        return self._heads(self.q_proj(x), self.d_k)  # (B, H, T, D_k)

    def project_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        kv = self.kv_proj(memory)  # (B, S, H*(D_k+D_v))
        k, v = kv.split([self.h * self.d_k, self.h * self.d_v], dim=-1)
        return self._heads(k, self.d_k), self._heads(v, self.d_v)  # (B, H, S, D_k), (B, H, S, D_v)


def _linear(weight: Tensor, bias: Tensor | None) -> nn.Linear:
    """An ``nn.Linear`` holding ``weight`` and ``bias`` (the same storage: views stay views)."""
    layer = nn.Linear(weight.size(1), weight.size(0), bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(weight.detach(), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach(), requires_grad=False)
    return layer


def is_prepared(model: nn.Module) -> bool:
    """Whether ``model`` came from ``prepare``."""
    return isinstance(getattr(model, "engine", None), EngineOptions)


@torch.no_grad()
def prepare(
    model: Transformer,
    quantize: str | None = None,
    options: EngineOptions | None = None,
    datastore: Datastore | None = None,
) -> Transformer:
    """A copy of the encoder-decoder ``model`` ready for fast inference, in eval mode, sharing
    its parameters (module docstring). ``quantize="int8"``: dynamic int8 products on the CPU
    (one scale per weight matrix, activations quantized at each call). ``options``: the
    engine's choices (default ``EngineOptions()``, the fastest measured). ``datastore``: the
    model's kNN-MT store (``aiayn.retrieval``), mixed into every decoding step's distribution."""
    if not isinstance(model, Transformer):
        raise TypeError(f"prepare takes an encoder-decoder Transformer, got {type(model).__name__}")
    if quantize not in QUANTIZE:
        raise ValueError(f"quantize must be 'int8' or None, got {quantize!r}")
    if is_prepared(model):
        raise ValueError("this model is already prepared; prepare the original model")
    options = EngineOptions() if options is None else options
    device = next(model.parameters()).device
    if quantize == "int8" and device.type != "cpu":
        raise ValueError("int8 quantization runs on the CPU only")
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    prepared = copy.deepcopy(model, memo=shared).eval()
    for layer in prepared.decoder.layers:
        layer.cross_attn = SplitCrossAttention(layer.cross_attn)
    own_layer = prepared.output_projection is None or prepared.output_bias is not None
    if own_layer:  # tied to the embedding, or with an output bias: one layer on the weight and bias
        tied = prepared.output_projection is None
        weight = prepared.tgt_embedding.table() if tied else prepared.output_projection.weight  # FixNorm's rows
        prepared.engine_projection = _linear(weight, prepared.output_bias)
    if quantize == "int8":
        quantize_dynamic_int8(prepared)
    else:
        _pack(prepared, options)
    if not own_layer:  # the untied projection itself, packed or quantized above
        prepared.engine_projection = prepared.output_projection
    prepared.engine = options
    prepared.datastore = datastore
    return prepared


def _pack(module: nn.Module, options: EngineOptions) -> None:
    """Replace every ``nn.Linear`` under ``module`` with a ``PackedLinear`` on the same tensors,
    on oneDNN's packed weights where ``options.onednn_for`` its shape, MKL's transposed products
    at decoding steps where ``options.transposed``."""
    for name, child in module.named_children():
        if type(child) is nn.Linear:
            onednn = options.onednn_for(child.in_features, child.out_features)
            setattr(module, name, PackedLinear.of(child, onednn, options.transposed))
        else:
            _pack(child, options)
