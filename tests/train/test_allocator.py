"""Freed host memory kept for reuse (``aiayn.train.allocator``): measured by the page faults a
process takes when it allocates a large tensor again, in a fresh process each (the change is
process-wide and one-way)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# 64 MiB of float32, beyond glibc's largest mmap threshold (32 MiB): served by mmap unless kept.
# The second allocation's faults: fresh pages (64 MiB / 4 KiB = 16,384 faults) or reused ones.
SCRIPT = """
import json, resource, sys, torch
from aiayn.train.allocator import keep_freed_memory
said = keep_freed_memory() if sys.argv[1] == "keep" else "not called"
torch.empty(16 * 2**20).fill_(1.0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.empty(16 * 2**20).fill_(1.0)
print(json.dumps({"said": said, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def faults(mode: str, **env: str) -> dict:
    environ = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], env=environ, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt: elsewhere the allocator is left as it is")
def test_a_large_tensor_allocated_again_reuses_the_freed_pages():
    stock = faults("stock")
    assert stock["faults"] > 16_000  # glibc's default: fresh mmap pages, one fault per 4 KiB
    kept = faults("keep")
    assert kept["said"] == "kept for reuse (glibc: no mmap, no trim)"
    assert kept["faults"] < 1_000
    off = faults("keep", AIAYN_KEEP_MEMORY="0")
    assert off["said"] == "off (AIAYN_KEEP_MEMORY=0)"
    assert off["faults"] > 16_000
