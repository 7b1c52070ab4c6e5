"""CPU kernels (not in the paper): attention (eq. 1) for a few queries at decoding steps, and the
label-smoothed cross-entropy (§5.4) with its gradient for training.

At a decoding step each row (sentence or beam) brings one new query per head, or a few when
the beams of a sentence share its encoder-decoder keys and values (``EngineCache.expand``).
``F.scaled_dot_product_attention``'s fused CPU kernel tiles for long queries; with one query it
spends most of a call on per-tile work (1.2-1.6 ms for 64 rows x 8 heads x 66 cached keys at the
base shape, where the keys and values are 17 MB, read from L3 in ~0.3 ms). The C++ kernel in
``csrc/cpu_kernels.cpp`` streams each row's keys and values once for all of its heads and
queries: 1.6-2.4x faster per call (bench/attention_speed.py, docs/benchmarks.md).

The loss kernel (``label_smoothed_ce``) makes the loss, the NLL and the gradient p - q in three
passes over each row of logits while it is in cache, reading bfloat16 logits (autocast's output
projection) without a float32 copy of them and writing the gradient in their dtype. At the Ding
preset (1,500 target tokens x 8,000 BPE tokens) torch's log_softmax, exp and copies took about 40
ms of a bf16 training step on a Zen 4, the kernel about 10 (docs/benchmarks.md). Caller:
``aiayn.train.loss``.

Both are built from source by ``torch.utils.cpp_extension`` the first time either is needed (about
20 s here, once), in torch's own extension cache (``$TORCH_EXTENSIONS_DIR`` or
``~/.cache/torch_extensions``), one build per checkout and torch installation (``build_name``).
Without a C++ compiler torch's operations do the work; ``EngineOptions(kernels=False)`` turns
off the attention kernel for a prepared model, and ``AIAYN_CPU_KERNELS=0`` both (the CLI maps it
into the options; the loss reads it). Callers: the engine's decoding step (``step.py``) and the training
loss; tests check each kernel against its formula. (A kernel for greedy search's argmax went by
issue 25's 5% rule: 0.99-1.02x end to end on the Xeon with AMX.)

Legend: B rows, H heads, T queries, S keys, D_k / D_v per-head sizes.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
import threading
import warnings
from pathlib import Path

import torch
from torch import Tensor

__all__ = [
    "MAX_QUERIES", "MAX_SCORES", "available", "eligible", "decode_attention", "loss_eligible", "label_smoothed_ce",
]  # fmt: skip

MAX_QUERIES = 16  # queries per row and head; longer ones (training, prompts) are torch's work
MAX_SCORES = 128  # queries x keys per row and head above one query: beyond it torch's GEMMs win
SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.cpp"
_state: dict[str, bool] = {}  # "ok": whether the build succeeded, once it has been tried
_lock = threading.Lock()
log = logging.getLogger("aiayn")


def _flags() -> tuple[list[str], list[str]]:
    """Compiler and linker flags: OpenMP so that ``at::parallel_for`` splits the rows over torch's
    threads (not with Apple's clang, which has no ``-fopenmp``: one thread there), and vector
    instructions only where torch itself found them on this CPU."""
    vector = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    if sys.platform == "win32":
        return ["/O2", "/openmp", *(["/arch:AVX2"] if vector else [])], []
    openmp = [] if sys.platform == "darwin" else ["-fopenmp"]
    # without -fno-trapping-math GCC vectorizes no loop that compares floats (exp_nonpositive):
    # the loss kernel's exp ran 2.8x slower (scalar). The kernels never read the FP exception flags.
    return ["-O3", *openmp, "-fno-trapping-math", *(["-mavx2", "-mfma"] if vector else [])], openmp


def build_name() -> str:
    """The build's name, and so its directory in torch's extension cache: the CPU's vector
    capability and a hash of what ninja's build file holds (this source file's path, torch's
    directory, where its headers are, and its version, the flags). torch's cache is shared by every checkout and venv of
    a user; under one name, two of them (a clone and its CI copy, a venv and a pip install) each
    rewrote the other's build file and rebuilt, ~15 s without a word, each time the other had
    run; a process could also load a library another was rewriting."""
    capability = torch.backends.cpu.get_cpu_capability().lower()
    cflags, ldflags = _flags()
    torch_dir = str(Path(torch.__file__).resolve().parent)  # its headers are under it: torch/include
    key = "\n".join([str(SOURCE.resolve()), torch_dir, torch.__version__, *cflags, *ldflags])
    return f"aiayn_cpu_kernels_{capability}_{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def available() -> bool:
    """Whether the kernels are built (building them on the first call; never while torch.compile
    traces, and once per process, under a lock; an interrupted build is tried again)."""
    ok = _state.get("ok")
    if ok is None:
        if torch.compiler.is_compiling():
            return False
        with _lock:
            if "ok" not in _state:
                _state["ok"] = _build()
            ok = _state["ok"]
    return ok


def _build() -> bool:
    from torch.utils import cpp_extension

    name = build_name()
    cached = _built(cpp_extension, name)
    if not cached:
        log.info("building the CPU kernels (once, about 20 s; AIAYN_CPU_KERNELS=0 skips them)")
    cflags, ldflags = _flags()
    path = os.environ.get("PATH")
    with contextlib.suppress(ImportError, AttributeError):
        import ninja

        # torch runs the first `ninja` on PATH; make it the pip package's (a dependency) wherever it
        # is installed. Ninja versions hash a build's commands differently (Debian's 1.11 and the
        # package's 1.13 did), so a system ninja found outside the venv and the package's found
        # inside it each took the other's build for stale and rebuilt it, ~15 s each time.
        if ninja.BIN_DIR:  # "" where the package found no ninja binary of its own
            os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, *([path] if path else [])])
    try:
        # the resolved path, as in build_name: a checkout reached through a link names its real source
        cpp_extension.load(
            name, [str(SOURCE.resolve())], extra_cflags=cflags, extra_ldflags=ldflags, is_python_module=False
        )
    except Exception as e:  # no compiler, no ninja, a failed build: torch's kernels still work
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        warnings.warn(
            f"the CPU kernels could not be built ({reason}); using torch's kernels instead",
            RuntimeWarning,
            stacklevel=4,
        )
        return False
    finally:
        if path is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = path
    register_fake = getattr(torch.library, "register_fake", None) or torch.library.impl_abstract  # torch < 2.4
    with contextlib.suppress(RuntimeError):  # already registered (a second load in this process)
        register_fake("aiayn_cpu::decode_attention")(_fake)
    return True


def _built(cpp_extension, name: str) -> bool:
    """Whether a build of this source is already cached under ``name`` (then loading it takes
    ~0.2 s); ``build_name`` differs between torch installations and versions, so it is this
    torch's build."""
    try:
        extension = getattr(cpp_extension, "LIB_EXT", ".so")  # .pyd on Windows
        library = Path(cpp_extension._get_build_directory(name, verbose=False)) / f"{name}{extension}"
        return library.stat().st_mtime >= SOURCE.stat().st_mtime
    except (AttributeError, OSError):  # torch's private helper moved, or nothing built yet
        return False


def _fake(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """The output's shape for tracing (torch.compile, meta tensors): ``(B, T, H, D_v)``."""
    return q.new_empty(q.size(0), q.size(2), q.size(1), v.size(3))


def eligible(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> bool:
    """Whether the kernel computes this call: float32 on the CPU without autograd, at most
    ``MAX_QUERIES`` queries, keys and values with one row per query row and head and unit stride
    in their last dimension, and a head-independent boolean mask ``(B|1, 1, T|1, S)``; with more
    than one query, at most ``MAX_SCORES`` scores per row and head (one dot product per query and
    key loses to torch's matrix products beyond that: 8 rows x 4 queries x 66 keys ran level).
    (Dropout and returned weights are the caller's to exclude.)"""
    if not (q.device.type == "cpu" and q.dtype == k.dtype == v.dtype == torch.float32):
        return False
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return False
    if getattr(torch.autograd.forward_ad, "_current_level", -1) >= 0:  # forward-mode AD: torch's kernels
        return False
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.size(2) > MAX_QUERIES:
        return False
    if q.size(2) > 1 and q.size(2) * k.size(2) > MAX_SCORES:
        return False
    if k.shape[:2] != q.shape[:2] or v.shape[:2] != q.shape[:2] or k.stride(-1) != 1 or v.stride(-1) != 1:
        return False
    if mask is not None and not (
        mask.dtype == torch.bool
        and mask.dim() == 4
        and mask.size(1) == 1
        and mask.size(0) in (1, q.size(0))
        and mask.size(2) in (1, q.size(2))
        and mask.size(3) == k.size(2)
    ):
        return False
    return available()


def decode_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
    """softmax(Q Kᵀ / √d_k) V  (§3.2.1, eq. 1) by the kernel; a query with no allowed key gives zeros.

    Shape: q ``(B, H, T, D_k)``, k ``(B, H, S, D_k)``, v ``(B, H, S, D_v)``, mask ``(B|1, 1, T|1, S)``
    (True = may attend) -> ``(B, H, T, D_v)``, a view of a ``(B, T, H, D_v)`` tensor (so that
    merging the heads afterwards copies nothing). Call only where ``eligible`` holds.
    """
    out = torch.ops.aiayn_cpu.decode_attention(q, k, v, mask)  # (B, T, H, D_v)
    return out.transpose(1, 2)  # (B, H, T, D_v)


def loss_eligible(logits: Tensor) -> bool:
    """Whether the loss kernel computes ``label_smoothed_loss`` for these logits: float32 or
    bfloat16 on the CPU, not under torch.compile or forward-mode AD, and the kernels not turned
    off (``AIAYN_CPU_KERNELS=0``)."""
    if logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.bfloat16):
        return False
    if getattr(torch.autograd.forward_ad, "_current_level", -1) >= 0 or torch.compiler.is_compiling():
        return False
    return loss_kernel_on()


def loss_kernel_on() -> bool:
    """Whether the loss kernel is turned on (``AIAYN_CPU_KERNELS`` is not 0) and built, building
    it now if need be: the trainer calls it before its clock starts."""
    return os.environ.get("AIAYN_CPU_KERNELS", "1") != "0" and available()


def label_smoothed_ce(logits: Tensor, target: Tensor, eps_ls: float, want_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Per row: the label-smoothed loss and the NLL (float32, ``(N,)``), and with ``want_grad`` the
    gradient of the loss with respect to the logits, p - q, in the logits' dtype ``(N, V)``
    (else an empty tensor). Call only where ``loss_eligible`` holds."""
    return torch.ops.aiayn_cpu.label_smoothed_ce(logits, target, eps_ls, want_grad)
