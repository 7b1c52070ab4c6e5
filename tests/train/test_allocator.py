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
# unless kept. The second allocation's faults: one per fresh page, or none on reused pages.
SIZE = 64 * 2**20
PAGES = SIZE // resource.getpagesize()
SCRIPT = f"""
import json, resource, sys, torch
from aiayn.train.allocator import keep_freed_memory
said = keep_freed_memory() if sys.argv[1] == "keep" else "not called"
torch.empty({SIZE // 4}).fill_(1.0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.empty({SIZE // 4}).fill_(1.0)
print(json.dumps({{"said": said, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}}))
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
    assert stock["faults"] > PAGES * 9 // 10  # glibc's default: fresh mmap pages, one fault each
    kept = faults("keep")
    assert kept["said"] == "kept for reuse (glibc: no mmap, no trim)"
    assert kept["faults"] < PAGES // 16
    off = faults("keep", AIAYN_KEEP_MEMORY="0")
    assert off["said"] == "off (AIAYN_KEEP_MEMORY=0)"
    assert off["faults"] > PAGES * 9 // 10
