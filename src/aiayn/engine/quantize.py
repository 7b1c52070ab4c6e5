"""Dynamic int8 quantization for CPU inference (not in the paper): ``prepare(model, quantize="int8")``.

Every ``nn.Linear`` (the attention projections, the feed-forward layers and the pre-softmax
projection, which ``prepare`` has made separate layers) gets int8 weights (one scale per matrix,
quantized once) and its input is quantized on the fly at each call
(``torch.ao.quantization.quantize_dynamic``); the arithmetic runs in int8 with int32
accumulation. Embeddings, layer norms and softmax stay float32.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

__all__ = ["quantize_dynamic_int8"]


def quantize_dynamic_int8(model: nn.Module) -> nn.Module:
    """Replace, in place, every ``nn.Linear`` of ``model`` with a dynamically quantized int8 one."""
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
