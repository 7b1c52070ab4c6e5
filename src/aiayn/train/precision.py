"""Training precision: float32, or bfloat16 autocast where the machine runs it faster (``train.amp``).

Not in the paper (which trained in float32 on P100s). bfloat16 keeps float32's exponent range, so
no loss scaling is needed; parameters, gradients as accumulated and Adam's state stay float32,
and autocast runs the products (``mm``, ``addmm``) in bfloat16 while layer norm, softmax and the
label-smoothed loss stay in float32 (the loss reads bfloat16 logits and accumulates in float32:
``loss.py``).

``train.amp``:
- ``auto`` (default): bfloat16 on CUDA where the GPU supports it; on a CPU only where it has
  native bfloat16 products (AMX or AVX512_BF16) *and* a probe of this very model, forward and
  backward passes over the first training batches in each precision, finds bfloat16 at least
  ``MIN_GAIN`` times faster. Small models gain little: at the Ding preset's d_model 128
  the products are small against the casts and the rest of the step; the probe read 0.92-1.07x
  on a Xeon with AMX and 1.12-1.30x on a Zen 4, then 1.52x there once the loss kernel read bf16
  logits without a float32 copy (bf16 chosen: 1.2x fp32's steps; docs/benchmarks.md). A CPU
  without native bfloat16 (AVX2) emulates it, ~100x slower than float32: never chosen there.
- ``true``: bfloat16 autocast regardless (on a CPU without native bfloat16, with a warning).
- ``false``: float32.

On CUDA, bf16 autocast keeps attention off cuDNN's SDPA kernel, which builds a plan for every new
batch shape (``_CudaBf16``). On a CPU, bf16 autocast runs each linear layer's product on its rows
padded to a multiple of ``ROWS`` (``_CpuBf16``): oneDNN compiles its bf16 kernels per shape, and
token batches of varied (B, T) made ~8 new kernels a step, so many that its cache of 1,024
evicted and recompiled them, and a process's steps slowed with age; ``AIAYN_BF16_ROWS=0`` turns
the padding off.

The choice, and why, is printed and recorded in ``metrics.jsonl`` (``kind: precision``).
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["Precision", "MIN_GAIN", "ROWS", "native_bf16", "choose_precision", "time_passes"]

# Rows of a linear layer's bfloat16 product on the CPU are padded to a multiple of this (``_CpuBf16``).
# A batch of <= 1,536 positions then makes one of 24 row counts instead of one of hundreds: in 300
# steps of the Ding preset oneDNN compiled 213 kernels instead of 2,355, for at most 63 padded rows
# a product (about 2% of a batch's rows on average; more for the output projection, which sees
# the target's tokens only) (Zen 4, docs/benchmarks.md)
ROWS = 64

# bf16 must beat fp32 by this factor in the probe. The probe's forward and backward passes flatter
# bf16 against whole training steps: at d_model 128 it read 0.92-1.07x where training ran 0.86x
# (bench/train_precision.py); at 512 it read 1.92x against 1.63-1.67x (2-core Xeon with AMX). On
# a Zen 4 (AVX512_BF16) the Ding preset read 1.12-1.30x in seven runs, and a run it chose bf16 for
# trained at 0.95x fp32's tokens/s: at 1.25 the same command flipped between precisions there, so
# it became 1.4. Part of that flattery was a bf16 process slowing with age (oneDNN's kernels per
# shape, before ``ROWS``): with the padding the preset's probe read 1.41-1.59x in 11 runs where the
# trainer gains 1.30-1.39x by turns; the lowest reading was 0.01 above 1.4, and 1.3 leaves a margin
# (one CPU model, a Zen 4; the probe's bias with the padding is unmeasured elsewhere). Since the
# trainer keeps freed memory (``allocator.py``, before the probe) it read 1.33-1.44x in 8 runs and
# 1.37x and 1.28x in two fresh-clone demos (the second then trained in fp32), where the trainer
# gains 1.26-1.39x by turns: the probe no longer flatters bf16 there, and at 1.3 the same command
# flipped between precisions again, so it became 1.2 (one CPU model, a Zen 4)
MIN_GAIN = 1.2


def _rows() -> int:
    """``ROWS``, or what ``AIAYN_BF16_ROWS`` says (0 or 1: no padding)."""
    return int(os.environ.get("AIAYN_BF16_ROWS", ROWS))


@dataclass(frozen=True)
class Precision:
    """The precision a run trains in: ``bf16`` (bfloat16 autocast) or ``fp32``, and why; for
    bf16 on the CPU, ``rows``: the multiple the products' rows are padded to (``_CpuBf16``; 0 or
    1: none), read once from ``AIAYN_BF16_ROWS`` (default ``ROWS``) when the choice is made."""

    name: str
    reason: str
    rows: int = field(default_factory=_rows)

    @property
    def bf16(self) -> bool:
        return self.name == "bf16"

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        """The context the forward pass runs in (reusable: entered at every step)."""
        if self.bf16 and device.type == "cuda":
            return _CudaBf16()
        if self.bf16 and device.type == "cpu" and self.rows > 1:
            return _CpuBf16(self.rows)
        if self.bf16:
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()


class _CpuBf16:
    """bfloat16 autocast on the CPU, with every linear layer's product run on its rows (all but
    the last dimension, flattened) padded with zeros to a multiple of ``rows``, the padding sliced
    off the result. oneDNN compiles a bf16 product's kernels for each shape and keeps 1,024 of
    them; the trainer's token batches vary in (B, T), so nearly every step met new row counts,
    and beyond the cache's 1,024 each kernel was compiled again when its shape came back. The
    padding cannot change another row's values: each output row is its input row times the
    weight. Autocast's own ``linear`` (cast to the autocast dtype, then the product) is replaced,
    for as long as the context is entered, by a kernel registered for ``aten::linear`` at the
    ``AutocastCPU`` dispatch key, which does the same on the padded rows; leaving the context
    (or an error while entering it) removes it. The kernel is the process's, so one such context
    may be entered at a time (entering a second raises), and another thread under CPU autocast
    meanwhile would pad too. Reusable: entered at every step."""

    _entered = False  # a context of this class is entered somewhere in the process
    _quiet = False  # torch's warning that an aten kernel is overridden (once a process) was silenced

    def __init__(self, rows: int) -> None:
        self.rows = rows

    def __enter__(self) -> None:
        if _CpuBf16._entered:
            raise RuntimeError("bf16 on the CPU: a padded-rows context is already entered (one at a time)")
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
            library = torch.library.Library("aten", "IMPL")
            stack.callback(library._destroy)
            with contextlib.ExitStack() as quiet:
                if not _CpuBf16._quiet:
                    quiet.enter_context(warnings.catch_warnings())
                    warnings.simplefilter("ignore")
                library.impl("linear", self._linear, "AutocastCPU")
            _CpuBf16._quiet = True
            self._stack = stack.pop_all()
        _CpuBf16._entered = True

    def __exit__(self, *exc: object) -> None:
        _CpuBf16._entered = False
        self._stack.__exit__(*exc)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # (..., d_in) -> (..., d_out), as autocast's linear: float32 (and float16) operands cast
        dtype = torch.get_autocast_dtype("cpu")
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):  # what it calls runs below autocast
            x, weight, bias = (_cast(t, dtype) for t in (x, weight, bias))
            if x.dim() < 2 or weight.dim() != 2 or x.shape[-1] == 0:  # nothing to gain: as autocast
                return torch.ops.aten.linear(x, weight, bias)
            rows = x.reshape(-1, x.shape[-1])  # (M, d_in)
            m = rows.shape[0]
            padded = -(-m // self.rows) * self.rows
            if padded != m:
                rows = torch.nn.functional.pad(rows, (0, 0, 0, padded - m))  # (M', d_in)
            y = torch.ops.aten.linear(rows, weight, bias)[:m]  # (M, d_out)
            return y.reshape(*x.shape[:-1], weight.shape[0])


_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def _cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """What autocast casts for a lower-precision product: floating tensors but float64."""
    if t is None or not t.is_floating_point() or t.dtype in (torch.float64, dtype):
        return t
    return t.to(dtype)


class _CudaBf16:
    """bfloat16 autocast on CUDA, with attention on the flash, memory-efficient or math kernels
    of ``F.scaled_dot_product_attention`` but not cuDNN's. cuDNN's kernel (torch's first choice
    for bf16 on an H100/H200) builds a plan for each new shape: token batches of varied (B, T, S)
    made a Ding-preset step take 404 ms on an H200 against 17 ms once every shape had been seen,
    and 24 ms on the memory-efficient kernel (bench/gpu_profile.py, docs/benchmarks.md)."""

    BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)

    def __enter__(self) -> None:
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(torch.autocast("cuda", dtype=torch.bfloat16))
        self._stack.enter_context(sdpa_kernel(list(self.BACKENDS)))

    def __exit__(self, *exc: object) -> None:
        self._stack.__exit__(*exc)


def native_bf16(device: torch.device) -> str | None:
    """What runs bfloat16 products natively on ``device`` (``"AMX"``, ``"AVX512_BF16"``,
    ``"CUDA"``), or None where bfloat16 is emulated or unsupported."""
    if device.type == "cuda":
        return "CUDA" if torch.cuda.is_bf16_supported() else None
    if device.type != "cpu":
        return None
    if torch.cpu._is_amx_tile_supported():
        return "AMX"
    if torch.cpu._is_avx512_bf16_supported():
        return "AVX512_BF16"
    return None


def choose_precision(
    amp: bool | str, device: torch.device, probe: Callable[[], tuple[float, float]] | None = None
) -> Precision:
    """The precision for ``train.amp`` (``"auto"``, True, False) on ``device``. ``probe`` times
    the model's passes and returns ``(fp32 seconds, bf16 seconds)``; ``auto`` calls it only on a
    CPU with native bfloat16 (and then needs it)."""
    if amp is False:
        return Precision("fp32", "train.amp false")
    native = native_bf16(device)
    if amp is True:
        return Precision("bf16", "train.amp true" + ("" if native else f" (no native bfloat16 on this {device.type})"))
    if device.type == "cuda":
        return Precision("bf16", "CUDA with bfloat16") if native else Precision("fp32", "this GPU has no bfloat16")
    if native is None:
        return Precision("fp32", f"no native bfloat16 on this {device.type} (AMX or AVX512_BF16)")
    if probe is None:
        raise ValueError("choose_precision: train.amp auto on a CPU with native bfloat16 needs a probe")
    fp32, bf16 = probe()
    gain = fp32 / bf16
    verdict = "bf16" if gain >= MIN_GAIN else "fp32"
    return Precision(
        verdict,
        f"{native}: bfloat16 autocast ran {gain:.2f}x float32 in a probe of this model "
        f"({fp32:.2f} s against {bf16:.2f} s over the same batches; bf16 needs >= {MIN_GAIN:g}x)",
    )


def time_passes(passes: Callable[[bool, int], None], count: int) -> tuple[float, float]:
    """Total seconds of ``passes(bf16, i)`` over batches ``i = 1 .. count - 1`` for float32 and for
    bfloat16, after an untimed ``passes(·, 0)`` warm-up of each; the two alternate batch by batch,
    so that a slow spell of the machine falls on both. Each batch is timed once per precision,
    as a training step meets a new batch: bfloat16 products (oneDNN's AMX kernels) are compiled
    for each new shape, and a probe that repeats one batch hides that cost (it chose bf16 at
    d_model 128, 1.33x in the probe, where training then ran at 0.6-0.7x float32's tokens/s)."""
    times = {False: 0.0, True: 0.0}
    for bf16 in (False, True):
        passes(bf16, 0)
    for i in range(1, count):
        for bf16 in (False, True):
            start = time.perf_counter()
            passes(bf16, i)
            times[bf16] += time.perf_counter() - start
    return times[False], times[True]
