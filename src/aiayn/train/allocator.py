"""Host memory for training: freed memory kept for reuse (a speed seam, not the paper's).

A training step allocates and frees the same large tensors every step: the logits and their
gradient (rows x vocabulary, 49 MB in float32 for 1,536 rows of 8,000 types), the activations
saved for backward. glibc's ``malloc`` serves requests above its mmap threshold (at most 32 MiB)
with fresh ``mmap`` pages and hands them back on ``free``, so each step touches those pages anew:
a page fault and a zeroed page per 4 KiB. At the Ding preset that was ~21,000 faults a step in
float32 and ~8,800 in bfloat16, and a fresh 49 MB tensor took 13.6 ms to fill where a reused one
took 1.2 ms (Zen 4). ``keep_freed_memory`` tells glibc to serve every request from its heap
(``M_MMAP_MAX`` 0) and never to give the heap's top back (``M_TRIM_THRESHOLD`` -1), so freed
blocks are reused by the next step: the trainer's tokens/s rose 1.09x in float32 and 1.12x in
bfloat16 (600 steps by turns, ``bench/train_ab.py``; docs/benchmarks.md). The cost: the process
keeps the largest footprint of anything it does after the call until it ends (as PyTorch's CUDA
caching allocator does); other threads' arenas may still hand back their empty heaps.

Process-wide and one-way (glibc has no undo that returns to its adaptive defaults); called once
by the trainer. Elsewhere than glibc (macOS, musl) nothing changes. ``AIAYN_KEEP_MEMORY=0``
turns it off.
"""

from __future__ import annotations

import ctypes
import os
import platform

# mallopt(3) parameters, from glibc's <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4


def keep_freed_memory() -> str:
    """Keep freed memory in the process for reuse (glibc only); what was done, for the log."""
    if os.environ.get("AIAYN_KEEP_MEMORY", "1") == "0":
        return "off (AIAYN_KEEP_MEMORY=0)"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return f"unchanged (no glibc: {platform.system()})"
    libc = ctypes.CDLL(None)
    if libc.mallopt(M_MMAP_MAX, 0) != 1 or libc.mallopt(M_TRIM_THRESHOLD, -1) != 1:  # 1: success
        return "unchanged (glibc's mallopt refused)"
    return "kept for reuse (glibc: no mmap, no trim)"
