"""Shared helpers for the benchmarks: the machine's fp32 matmul peak and timing."""

from __future__ import annotations

import functools
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def machine() -> dict:
    """What the numbers were measured on. A "model name" such as "AMD EPYC" can hide different
    chips: the CPU family and model and torch's vector capability (AVX2, AVX512; VNNI speeds up
    int8) tell them apart."""
    cpu = platform.processor() or platform.machine()
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "cpu family", "model") and key not in info:
                info[key] = value.strip()
            if key == "flags" and "vnni" not in info:
                info["vnni"] = str("avx512_vnni" in value.split() or "avx_vnni" in value.split())
    except OSError:
        pass
    cpu = info.get("model name", cpu)
    return {
        "cpu": cpu,
        "cpu_family_model": f"{info['cpu family']}/{info['model']}" if {"cpu family", "model"} <= info.keys() else None,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "vnni": info.get("vnni") == "True",
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def matmul_peak(device: str = "cpu", sizes: tuple[int, ...] = (1024, 2048, 3072), seconds: float = 1.5) -> float:
    """The best fp32 matmul rate (FLOP/s) of this machine over a few square sizes, and on the CPU
    over both of torch's libraries (MKL's ``a @ b``, and oneDNN's product on a packed weight,
    which aiayn takes on AVX-512: ``engine/linear.py``): the physical limit every other number is
    stated against."""
    best = 0.0
    for n in sizes:
        a = torch.randn(n, n, device=device)
        b = torch.randn(n, n, device=device)
        products = [functools.partial(torch.mm, a, b)]
        if device == "cpu" and torch.backends.mkldnn.is_available():
            packed = torch.ops.mkldnn._reorder_linear_weight(b)
            products.append(functools.partial(torch.ops.mkldnn._linear_pointwise, a, packed, None, "none", [], ""))
        for product in products:
            product()  # warm up
            reps, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds / len(sizes) / len(products):
                product()
                reps += 1
            if device != "cpu":
                torch.cuda.synchronize()
            best = max(best, 2 * n**3 * reps / (time.perf_counter() - start))
    return best


def bf16_peak(n: int = 2048, seconds: float = 1.0) -> float:
    """The bf16 matmul rate (FLOP/s) at one square size: AMX or AVX512_BF16 where the CPU has them."""
    a, b = torch.randn(n, n, dtype=torch.bfloat16), torch.randn(n, n, dtype=torch.bfloat16)
    a @ b
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        reps += 1
    return 2 * n**3 * reps / (time.perf_counter() - start)


def time_call(fn: Callable[[], None], device: str = "cpu") -> float:
    if device != "cpu":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device != "cpu":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def write_result(name: str, result: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """A Markdown table of ``rows`` with ``columns`` = [(key, header)]."""
    cells = [[h for _, h in columns]] + [[str(r.get(k, "")) for k, _ in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def alternating(fns: dict, repeats: int) -> dict[str, list[float]]:
    """Seconds of each function in each round: one warm-up each, then ``repeats`` rounds that run
    them in turn (in reverse order every other round). A function that returns a float has timed
    itself (a CTranslate2 process: its ``translate_batch`` alone): that float is its time."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(repeats):
        for name, fn in list(fns.items())[:: 1 if r % 2 == 0 else -1]:
            start = time.perf_counter()
            own = fn()
            elapsed = time.perf_counter() - start
            times[name].append(own if isinstance(own, float) else elapsed)
    return times


def paired(peer: list[float], ours: list[float]) -> dict:
    """The speed-up round by round (the peer's time over ours in the same round): its median and
    range show how far the machine's spread moves the ratio of medians."""
    ratios = sorted(p / o for p, o in zip(peer, ours, strict=True))
    return {"median": round(median(ratios), 2), "min": round(ratios[0], 2), "max": round(ratios[-1], 2)}
