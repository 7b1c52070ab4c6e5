"""Freed host memory kept for reuse (``aiayn.train.allocator``): measured by the page faults a
process takes when it allocates a large tensor again, in a fresh process each (the change is
process-wide and one-way)."""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
from pathlib import Path

import pytest

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
THP_ALWAYS = THP.is_file() and "[always]" in THP.read_text()

# 64 MiB of float32, beyond glibc's largest adaptive mmap threshold (32 MiB): served by mmap
# unless kept. Allocated and freed ROUNDS times; each round's faults: one per fresh page, or none
# on reused pages. With kept memory one round after the first may still take fresh pages: a small
# block that lands in the freed chunk's tail leaves it a few bytes short of the next aligned
# request (seen on a Zen 5 with glibc 2.36: rounds 16,351, 16,385, 0, 0, ...), after which the
# chunk at the heap's top is reused.
SIZE = 64 * 2**20
PAGES = SIZE // resource.getpagesize()
ROUNDS = 6
SCRIPT = f"""
import json, resource, sys, torch
from aiayn.train.allocator import keep_freed_memory
said = keep_freed_memory() if sys.argv[1] == "keep" else "not called"
faults = []
for _ in range({ROUNDS}):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty({SIZE // 4}).fill_(1.0)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({{"said": said, "faults": faults}}))
"""
# what would change the allocator under the test: glibc's own settings, another malloc, torch's huge pages
SCRUB = ("AIAYN_KEEP_MEMORY", "GLIBC_TUNABLES", "LD_PRELOAD", "THP_MEM_ALLOC_ENABLE")


def faults(mode: str, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if k not in SCRUB and not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], env={**environ, "OMP_NUM_THREADS": "1", **env},
        capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt: elsewhere the allocator is left as it is")
@pytest.mark.skipif(THP_ALWAYS, reason="transparent huge pages always on: few faults either way")
def test_a_large_tensor_allocated_again_reuses_the_freed_pages():
    stock = faults("stock")
    # glibc's default: fresh mmap pages every round, one fault each
    assert all(f > PAGES * 9 // 10 for f in stock["faults"]), stock
    kept = faults("keep")
    assert kept["said"] == "kept for reuse (glibc: no mmap, no trim)"
    again = kept["faults"][1:]
    assert sum(f > PAGES // 16 for f in again) <= 1, kept  # at most one round takes fresh pages
    assert all(f < PAGES // 16 for f in again[-3:]), kept  # and the last rounds reuse them
    off = faults("keep", AIAYN_KEEP_MEMORY="0")
    assert off["said"] == "off (AIAYN_KEEP_MEMORY=0)"
    assert all(f > PAGES * 9 // 10 for f in off["faults"]), off
