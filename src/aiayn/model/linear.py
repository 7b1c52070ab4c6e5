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

On a CPU with AVX-512 (torch's capability ``AVX512``) there is a faster product still: oneDNN's,
on a copy of the weight kept in oneDNN's own blocked layout (``packed``), made once and reused
while the weight is unchanged. On an AMD Zen 4 it ran 1.2-2.2x MKL's better orientation at every
row count measured (1 to 1,730 rows; 155-182 GFLOP/s at 64 rows against 90-159), so ``linear``
takes it there for float32 on the CPU with autograd and autocast off, at any row count: decoding
steps and the encoder alike. On AVX2 (a Zen 3) it was level with MKL over a decoding step, and is
not taken. ``AIAYN_CPU_GEMM=onednn`` or ``=mkl`` overrides the choice. The packed copies hold a
second copy of the weights they serve (4 bytes per parameter), for as long as the weights live.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["Linear", "PACKED", "SMALL_ROWS", "inference_path", "linear", "packed", "packed_linear", "transposed"]

SMALL_ROWS = 128  # above it an A/B of beam search (256 rows) showed no gain end to end


def _packed_default() -> bool:
    """Whether ``linear`` uses oneDNN on packed weights: ``AIAYN_CPU_GEMM`` (``onednn``, ``mkl``),
    else where torch runs AVX-512 kernels and has oneDNN."""
    choice = os.environ.get("AIAYN_CPU_GEMM", "auto").strip().lower()
    if choice not in ("auto", "onednn", "mkl"):
        warnings.warn(f"AIAYN_CPU_GEMM={choice!r} is not one of auto, onednn, mkl: using auto", stacklevel=2)
        choice = "auto"
    if choice == "auto":
        return torch.backends.cpu.get_cpu_capability() == "AVX512" and torch.backends.mkldnn.is_available()
    return choice == "onednn" and torch.backends.mkldnn.is_available()


PACKED = _packed_default()  # read at each call, so a test (or a user) may switch it


def inference_path(x: Tensor, weight: Tensor | None = None) -> str:
    """How ``linear`` computes x Wᵀ + b: ``"packed"`` (oneDNN on the packed weight), ``"transposed"``
    ((W xᵀ + b)ᵀ by MKL) or ``"linear"`` (``F.linear``). The first two only for float32 on the
    CPU with autograd and autocast off (``weight=None``: as for a float32 weight); ``"transposed"``
    at most ``SMALL_ROWS`` rows. A weight made under ``torch.inference_mode`` (no version counter
    to keep a packed copy by) is never ``"packed"``: MKL's two paths as without oneDNN. Under
    torch.compile, ``F.linear``: the compiler picks its kernels."""
    rows = x.numel() // x.size(-1) if x.size(-1) else 0
    if (
        rows == 0
        or torch.compiler.is_compiling()
        or torch.is_grad_enabled()
        or torch.is_autocast_enabled("cpu")  # autocast's mm would run in bf16 and the bias add promote it back
        or x.device.type != "cpu"
        or x.dtype != torch.float32
        or (weight is not None and weight.dtype != torch.float32)
    ):
        return "linear"
    if PACKED and not (weight is not None and weight.is_inference()):
        return "packed"
    return "transposed" if rows <= SMALL_ROWS else "linear"


# weight (or the tensor a weight is a view of) -> {view: ((data_ptr, version), packed copy, storage)}
_packs: WeakIdKeyDictionary = WeakIdKeyDictionary()


def packed(weight: Tensor) -> Tensor:
    """``weight`` ``(d_out, d_in)`` in oneDNN's blocked layout, made at the first call and kept
    until the weight changes (its version counter, bumped by every in-place update such as an
    optimizer step or ``load_state_dict``, or its storage). A view (e.g. the query rows of a fused
    in-projection) is kept under the tensor it views, so it is packed once too. A weight made
    under ``torch.inference_mode`` has no version counter: it is packed anew at every call."""
    if weight.is_inference():
        return torch.ops.mkldnn._reorder_linear_weight(weight)
    base = weight if weight._base is None else weight._base
    view = (weight.storage_offset(), tuple(weight.shape), weight.stride())
    entries = _packs.get(base)
    if entries is None:
        entries = _packs[base] = {}
    entry = entries.get(view)
    stamp = (weight.data_ptr(), weight._version)
    if entry is None or entry[0] != stamp:
        # the entry holds the weight's storage: while it lives, no new tensor (a new .data, a
        # dtype round trip) can get its address and pass for it with an equal version count
        entry = entries[view] = (
            stamp,
            torch.ops.mkldnn._reorder_linear_weight(weight.detach()),
            weight.untyped_storage(),
        )
    return entry[1]


def packed_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, relu: bool = False) -> Tensor:
    """x Wᵀ + b by oneDNN on the packed weight, no checks (autograd must be off): ``(..., d_in)
    -> (..., d_out)``, contiguous; ``relu=True`` applies max(0, ·) inside the same product (§3.3).
    Callers: ``linear``, and the flat decoding step (``model/incremental.py``)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed(weight), bias, "relu" if relu else "none", [], "")


def transposed(x2: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x Wᵀ + b computed as (W xᵀ + b)ᵀ, no checks: ``x2`` ``(R, d_in) -> (R, d_out)``, the
    transposed view of the ``(d_out, R)`` product. Callers: ``linear``, and the flat decoding
    step (``model/incremental.py``), which checks ``inference_path`` once a step."""
    # (d_out, d_in) @ (d_in, R) -> (d_out, R); a bias joins inside the GEMM (beta = 1 on a broadcast
    # copy of it), 5-10% faster than adding it afterwards
    y = torch.mm(weight, x2.t()) if bias is None else torch.addmm(bias[:, None], weight, x2.t())
    return y.t()  # (R, d_out)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """y = x Wᵀ + b, the values of ``F.linear``. Shape: ``(..., d_in) -> (..., d_out)``.

    On the ``"transposed"`` path the result is the transposed view of the ``(d_out, R)`` product,
    not contiguous: making it row-major costs as much as the orientation saves, and what follows
    (the next projection, layer norm, attention) takes either layout. Use ``reshape`` (or
    ``.contiguous()``) rather than ``view`` to merge its dimensions.
    """
    path = inference_path(x, weight)
    if path == "packed":
        return packed_linear(x, weight, bias)
    if path == "linear":
        return F.linear(x, weight, bias)
    y = transposed(x.reshape(-1, x.size(-1)), weight, bias)  # (R, d_out)
    return y.view(*x.shape[:-1], weight.size(0))  # viewed as (..., d_out)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and state dict) whose forward is ``linear``."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)
