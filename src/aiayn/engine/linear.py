"""Faster float32 CPU products for inference (not in the paper): every projection of §3 is
y = x Wᵀ + b; here it runs on a copy of W made once, by ``prepare``.

Legend: R rows (every dimension of x but the last), d_in, d_out the sizes of W ``(d_out, d_in)``.

Two measured paths, chosen by ``EngineOptions.gemm`` when the model is prepared:
- **oneDNN on packed weights** (``"onednn"``; ``"auto"`` on a CPU where torch runs AVX-512
  kernels, for weights of at least ``ONEDNN_MIN_WEIGHT`` elements): a copy of W in oneDNN's
  blocked layout, made once in ``PackedLinear.__init__``. On an AMD Zen 4 it ran 1.2-2.2x MKL's
  better orientation at every row count measured (1 to 1,730 rows, base shapes); on a Xeon with
  AMX it won on weights from 512x512 up and lost on d_model 128's smaller ones; on AVX2 (a Zen 3)
  it was level with MKL over a decoding step. It holds a second copy of the weights (4 bytes per
  parameter).
- **MKL, transposed for a few rows** (``"mkl"``; ``"auto"`` on a CPU without AVX-512): at a
  decoding step each projection sees one row per sentence (or beam), a short, wide product, and
  MKL's sgemm was mostly faster asked for W xᵀ, ``(d_out, R)``, than for x Wᵀ: 1.1-2.8x at 2-128
  rows for most base shapes on an AMD Zen 3 (1.15x greedy end to end); on the Xeon with AMX it
  lost end to end (0.96-0.98x), so ``"auto"`` there asks MKL for x Wᵀ. The result is the
  transposed view of that product; only the flat decoding step (``step.py``) takes it, as it
  merges dimensions with ``reshape``.

Both serve float32 on the CPU with autograd and autocast off; anything else is ``F.linear``.
A prepared model is for inference: the packed copy does not follow later changes to W.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["PackedLinear", "SMALL_ROWS", "transposed"]

SMALL_ROWS = 128  # above it an A/B of beam search (256 rows) showed no gain for the transposed product


def transposed(x2: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x Wᵀ + b computed as (W xᵀ + b)ᵀ: ``x2`` ``(R, d_in) -> (R, d_out)``, the transposed view
    of the ``(d_out, R)`` product."""
    # (d_out, d_in) @ (d_in, R) -> (d_out, R); a bias joins inside the GEMM (beta = 1 on a broadcast
    # copy of it), 5-10% faster than adding it afterwards
    y = torch.mm(weight, x2.t()) if bias is None else torch.addmm(bias[:, None], weight, x2.t())
    return y.t()  # (R, d_out)


def _plain(x: Tensor) -> bool:
    """Whether ``x`` may take the faster paths: float32 on the CPU, autograd and autocast off."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and not torch.is_grad_enabled()
        and not torch.is_autocast_enabled("cpu")  # autocast's mm would run in bf16
        and not torch.compiler.is_compiling()  # the compiler picks its own kernels
    )


class PackedLinear(nn.Module):
    """An ``nn.Linear``'s weight and bias (the same tensors, shared) with, for ``onednn``, a
    packed copy of the weight made here, once. Calling it gives ``F.linear``'s values in a
    contiguous tensor; ``step`` is the flat decoding step's product (possibly a transposed view).
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, onednn: bool, transpose_steps: bool = True) -> None:
        super().__init__()
        self.weight, self.bias, self.transpose_steps = weight, bias, transpose_steps
        self.in_features, self.out_features = weight.size(1), weight.size(0)
        packable = onednn and weight.dtype == torch.float32 and weight.device.type == "cpu"
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach()) if packable else None

    @classmethod
    def of(cls, linear: nn.Linear, onednn: bool, transpose_steps: bool = True) -> PackedLinear:
        return cls(linear.weight, linear.bias, onednn, transpose_steps)

    def forward(self, x: Tensor) -> Tensor:
        """y = x Wᵀ + b. Shape: ``(..., d_in) -> (..., d_out)``."""
        if self.packed is not None and x.numel() and _plain(x):
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def step(self, x2: Tensor, relu: bool = False) -> Tensor:
        """max(0, x Wᵀ + b) if ``relu`` else x Wᵀ + b, for the flat decoding step: ``(R, d_in) ->
        (R, d_out)``; on MKL's path for at most ``SMALL_ROWS`` rows, with ``transpose_steps``, a
        transposed view."""
        if x2.numel() and _plain(x2):
            if self.packed is not None:  # oneDNN applies max(0, ·) inside the same product (§3.3)
                attr = "relu" if relu else "none"
                return torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, attr, [], "")
            if self.transpose_steps and x2.size(0) <= SMALL_ROWS:
                y = transposed(x2, self.weight, self.bias)
                return y.relu_() if relu else y
        y = F.linear(x2, self.weight, self.bias)
        return y.relu_() if relu else y

    def extra_repr(self) -> str:
        sizes = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{sizes}, packed={self.packed is not None}, transpose_steps={self.transpose_steps}"
