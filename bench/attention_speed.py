"""Attention at decoding steps: aiayn's CPU kernel (engine/kernels.py) against torch's fused
``F.scaled_dot_product_attention``, per call and end to end.

(i)  Per call, at the shapes of bench/decode_speed.py (base shape: 8 heads of 64; 64 sentences,
     or 64 x 4 beams): one new query per row against keys and values viewed from the
     engine's reserved cache buffers, as it holds them, including merging the heads for W^O.
     6 layers' worth of K/V are cycled through, so that each call reads its keys from memory as
     in a decoding step rather than from cache. The peer is what the engine's step calls with the
     kernels off: aiayn's ``scaled_dot_product_attention`` (torch's fused kernel).
(ii) End to end: greedy, beam 4 and int8 greedy decoding of decode_speed.py's 64 sentences x 40
     tokens on the engine, ``EngineOptions(kernels=True)`` and ``(kernels=False)`` alternating in
     one process, and how many of the 64 outputs differ
     (random weights leave near ties; int8's on-the-fly quantization of activations turns
     rounding-level differences into different tokens: docs/benchmarks.md).

The fraction of the CPU's bandwidth is not reported: at these sizes the K/V of 6 layers
(8-17 MB each) half fit in the 32 MB L3 here, so neither the L3 nor the DRAM figure is the bound.

    python bench/attention_speed.py [--repeats 5] [--skip-decoding]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from aiayn import ModelConfig, Transformer, engine
from aiayn.decode import beam_search, greedy_decode
from aiayn.engine import EngineOptions
from aiayn.engine import kernels as cpu_kernels
from aiayn.model.attention import scaled_dot_product_attention
from common import machine, median, table, write_result
from decode_speed import VOCAB, sources

H, D, LAYERS = 8, 64, 6
CASES = [  # name, query rows, beams per cached row (encoder-decoder), keys, cache capacity, padding mask
    ("self-attention, greedy, 20 cached", 64, 1, 20, 40, False),
    ("self-attention, greedy, 40 cached", 64, 1, 40, 40, False),
    ("encoder-decoder, greedy, 31 keys", 64, 1, 31, 31, True),
    ("self-attention, beam 4, 20 cached", 256, 1, 20, 40, False),
    ("encoder-decoder, beam 4 (shared), 31 keys", 256, 4, 31, 31, True),
]


def attend(q: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor], S: int, mask: torch.Tensor | None, on: bool):
    """One call as the engine's step makes it: keys and values viewed from the cache,
    ``(B, H, capacity, D)`` -> ``(B, H, S, D)``, and the heads merged for W^O afterwards."""
    k, v = (t[:, :, :S] for t in cache)  # (B, H, S, D)
    if on:
        out = cpu_kernels.decode_attention(q, k, v, mask)  # (B, H, T, D)
    else:  # torch's fused kernel wants each head's vectors contiguous (engine/step.py: _attend)
        out, _ = scaled_dot_product_attention(q if q.stride(-1) == 1 else q.contiguous(), k, v, mask)
    return out.transpose(1, 2).reshape(q.size(0), -1, H * D)  # (B, T, H*D)


def per_call(repeats: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for name, B, G, S, capacity, padded in CASES:
        Bk = B // G
        caches = [(torch.randn(Bk, H, capacity, D, generator=g), torch.randn(Bk, H, capacity, D, generator=g))
                  for _ in range(LAYERS)]  # fmt: skip
        q = torch.randn(H * D, B, generator=g).t().reshape(B, 1, H, D).transpose(1, 2)  # a step's projection
        mask = None
        if padded:
            lengths = torch.randint(20, S + 1, (Bk,), generator=g)
            mask = (torch.arange(S) < lengths[:, None]).view(Bk, 1, 1, S)
        if G > 1:  # the G beams of a sentence as G queries of its one cached row (MultiHeadAttention)
            q = q.reshape(Bk, G, H, 1, D).transpose(1, 2).reshape(Bk, H, G, D)

        times: dict[bool, list[float]] = {True: [], False: []}
        outs = {}
        for _ in range(repeats):
            for on in (False, True):
                outs[on] = attend(q, caches[0], S, mask, on)
                start = time.perf_counter()
                for _ in range(20):
                    for cache in caches:
                        attend(q, cache, S, mask, on)
                times[on].append((time.perf_counter() - start) / (20 * LAYERS))
        torchs, ours = median(times[False]), median(times[True])
        rows.append({
            "case": name, "torch_ms": round(1e3 * torchs, 3), "kernel_ms": round(1e3 * ours, 3),
            "speedup": round(torchs / ours, 2), "max_abs_diff": float((outs[True] - outs[False]).abs().max()),
        })  # fmt: skip
        print(table(rows[-1:], CALL_COLUMNS).splitlines()[-1], flush=True)
    return rows


def end_to_end(repeats: int, length: int = 40) -> list[dict]:
    src = sources(torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    paper = Transformer(ModelConfig.base(VOCAB, P_drop=0.0)).eval()
    fp32 = {on: engine.prepare(paper, options=EngineOptions(kernels=on)) for on in (False, True)}
    int8 = {on: engine.prepare(paper, "int8", EngineOptions(kernels=on)) for on in (False, True)}
    runs = {
        "greedy (fp32)": lambda on: greedy_decode(fp32[on], src, max_len=length, min_len=length),
        "beam 4 (fp32)": lambda on: [
            h[0].tokens for h in beam_search(fp32[on], src, beam=4, max_len=length, min_len=length)
        ],
        "greedy (int8)": lambda on: greedy_decode(int8[on], src, max_len=length, min_len=length),
    }
    rows = []
    for name, fn in runs.items():
        times: dict[bool, list[float]] = {True: [], False: []}
        outs = {}
        for r in range(repeats + 1):  # round 0 warms up
            for on in (False, True):
                start = time.perf_counter()
                outs[on] = fn(on)
                if r:
                    times[on].append(time.perf_counter() - start)
        on, off = outs[True], outs[False]
        on, off = (on.tolist(), off.tolist()) if isinstance(on, torch.Tensor) else (on, off)
        differ = sum(a != b for a, b in zip(on, off, strict=True))  # sentences whose outputs differ
        torchs, ours = median(times[False]), median(times[True])
        rows.append({
            "decoding": name, "torch_s": round(torchs, 3), "kernel_s": round(ours, 3),
            "speedup": round(torchs / ours, 3), "outputs_differ": differ,
        })  # fmt: skip
        print(table(rows[-1:], RUN_COLUMNS).splitlines()[-1], flush=True)
    return rows


CALL_COLUMNS = [
    ("case", "attention call (8 heads x 64, 1 query per row)"), ("torch_ms", "torch fused ms"),
    ("kernel_ms", "aiayn kernel ms"), ("speedup", "speed-up"), ("max_abs_diff", "max abs diff"),
]  # fmt: skip
RUN_COLUMNS = [
    ("decoding", "64 sentences x 40 tokens"), ("torch_s", "torch attention s"), ("kernel_s", "aiayn kernel s"),
    ("speedup", "speed-up"), ("outputs_differ", "outputs that differ (of 64)"),
]  # fmt: skip


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="alternating rounds (median; default %(default)s)")
    parser.add_argument("--skip-decoding", action="store_true", help="only the per-call table")
    args = parser.parse_args()
    if not cpu_kernels.available():
        sys.exit("the CPU kernel is not available (no C++ compiler, or a failed build)")
    info = machine()
    print(f"{info['cpu']}, {info['torch_threads']} threads, torch {info['torch']}")
    print(table([], CALL_COLUMNS))
    calls = per_call(args.repeats)
    result = {"machine": info, "per_call": calls}
    if not args.skip_decoding:
        print()
        print(table([], RUN_COLUMNS))
        result["decoding"] = end_to_end(args.repeats)
    print()
    print(table(calls, CALL_COLUMNS))
    if "decoding" in result:
        print(table(result["decoding"], RUN_COLUMNS))
    print(f"written {write_result('attention_speed', result)}")


if __name__ == "__main__":
    main()
