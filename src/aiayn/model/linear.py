"""Linear layers y = x Wᵀ + b: every projection of §3 (W^Q, W^K, W^V and W^O of §3.2.2, W1 and
W2 of §3.3, the pre-softmax projection of §3.4), with a faster CPU path for decoding steps.

Legend: R rows (every dimension of x but the last), d_in, d_out the sizes of W ``(d_out, d_in)``.

Not in the paper: at a decoding step each projection sees one row per sentence (or beam), a
short, wide product. For those the CPU GEMM under torch 2.13 (MKL sgemm) is mostly faster
when asked for the transposed product W xᵀ, (d_out, R), than for x Wᵀ: 1.1-2.8x at 2-128
rows for most base shapes, as fast at 1 row, 0.8-0.9x only for 512 -> 512 at 8 rows (2-core
AMD EPYC; docs/benchmarks.md). ``linear`` takes that orientation for at most
``SMALL_ROWS`` rows of float32 on the CPU with autograd off (decoding), and ``F.linear``
otherwise: training, large batches, other devices and dtypes are untouched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Linear", "SMALL_ROWS", "linear", "takes_transposed", "transposed"]

SMALL_ROWS = 128  # above it an A/B of beam search (256 rows) showed no gain end to end


def takes_transposed(x: Tensor) -> bool:
    """Whether ``linear`` computes the transposed product for this input (float32 weights
    aside): at most ``SMALL_ROWS`` rows of float32 on the CPU, autograd and autocast off."""
    rows = x.numel() // x.size(-1) if x.size(-1) else 0
    return (
        0 < rows <= SMALL_ROWS
        and not torch.is_grad_enabled()
        and not torch.is_autocast_enabled("cpu")  # autocast's mm would run in bf16 and the bias add promote it back
        and x.device.type == "cpu"
        and x.dtype == torch.float32
    )


def transposed(x2: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x Wᵀ + b computed as (W xᵀ + b)ᵀ, no checks: ``x2`` ``(R, d_in) -> (R, d_out)``, the
    transposed view of the ``(d_out, R)`` product. Callers: ``linear``, and the flat decoding
    step (``model/incremental.py``), which checks ``takes_transposed`` once a step."""
    # (d_out, d_in) @ (d_in, R) -> (d_out, R); a bias joins inside the GEMM (beta = 1 on a broadcast
    # copy of it), 5-10% faster than adding it afterwards
    y = torch.mm(weight, x2.t()) if bias is None else torch.addmm(bias[:, None], weight, x2.t())
    return y.t()  # (R, d_out)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """y = x Wᵀ + b, the values of ``F.linear``. Shape: ``(..., d_in) -> (..., d_out)``.

    On the decoding path the result is the transposed view of the ``(d_out, R)`` product, not
    contiguous: making it row-major costs as much as the orientation saves, and what follows
    (the next projection, layer norm, attention) takes either layout. Use ``reshape`` (or
    ``.contiguous()``) rather than ``view`` to merge its dimensions.
    """
    if weight.dtype != torch.float32 or not takes_transposed(x):
        return F.linear(x, weight, bias)
    y = transposed(x.reshape(-1, x.size(-1)), weight, bias)  # (R, d_out)
    return y.view(*x.shape[:-1], weight.size(0))  # viewed as (..., d_out)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and state dict) whose forward is ``linear``."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)
