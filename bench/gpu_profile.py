"""Where a CUDA training step's time goes: torch.profiler tables of one aiayn step in float32
(TF32) and in bfloat16 autocast at the base shape, and step times at the Ding preset's shapes
(d_model 128, batches of varied shape, as token batching gives) per SDPA backend.

    PYTHONPATH=src python3 bench/gpu_profile.py [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from aiayn import ModelConfig, Transformer
from aiayn.train.loss import label_smoothed_loss
from cuda_check import random_batch, sync

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.backends.cuda.matmul.allow_tf32 = True


def make(d: int, N: int, d_ff: int, h: int, vocab: int):
    torch.manual_seed(0)
    model = Transformer(ModelConfig.base(vocab, d_model=d, h=h, N=N, d_ff=d_ff, P_drop=0.1)).to(DEV).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=DEV.type == "cuda")
    return model, opt


def step(model, opt, batch, bf16: bool) -> None:
    src, tgt_in, tgt_out = batch
    select = tgt_out != 0
    with torch.autocast(DEV.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
        logits = model(src, tgt_in, select=select)
    loss, _ = label_smoothed_loss(logits, tgt_out[select], 0.1)
    (loss / int(select.sum())).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def base_profiles(out: dict, quick: bool) -> None:
    B, L = (8, 16) if quick else (200, 64)
    model, opt = make(512, 6, 2048, 8, 8000)
    batch = tuple(t.to(DEV) for t in random_batch(8000, B, L, L, seed=0))
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV.type == "cuda" else [])
    for bf16 in (False, True):
        for _ in range(3):
            step(model, opt, batch, bf16)
        sync()
        t = time.perf_counter()
        for _ in range(5):
            step(model, opt, batch, bf16)
        sync()
        ms = (time.perf_counter() - t) / 5 * 1000
        with profile(activities=acts) as p:
            step(model, opt, batch, bf16)
            sync()
        key = "device_time_total" if DEV.type == "cuda" else "self_cpu_time_total"
        table = p.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=70)
        events = p.key_averages()
        cuda_total = sum(e.self_device_time_total for e in events) / 1000 if DEV.type == "cuda" else None
        cpu_total = sum(e.self_cpu_time_total for e in events) / 1000
        name = "bf16" if bf16 else "fp32"
        print(f"\n==== base step {name}: {ms:.1f} ms/step; profiled: GPU {cuda_total} ms, CPU self {cpu_total:.1f} ms")
        print(table)
        out[f"base_{name}"] = {
            "ms_per_step": round(ms, 2),
            "gpu_busy_ms": cuda_total,
            "cpu_self_ms": round(cpu_total, 1),
            "table": table,
        }


def ding_shapes(out: dict, quick: bool) -> None:
    model, opt = make(128, 3, 512, 4, 4000)
    g = torch.Generator().manual_seed(1)
    batches = []
    for i in range(12 if quick else 40):
        L = int(torch.randint(6, 48, (1,), generator=g))
        B = max(2, 1536 // (L + 2))
        batches.append(tuple(t.to(DEV) for t in random_batch(4000, B, L, L, seed=i)))
    backends = {
        "default": None,
        "efficient": [SDPBackend.EFFICIENT_ATTENTION],
        "math": [SDPBackend.MATH],
        "cudnn": [SDPBackend.CUDNN_ATTENTION],
    }
    rows = {}
    for bf16 in (False, True):
        for name, chosen in backends.items():
            if DEV.type != "cuda" and name != "default":
                continue
            ctx = sdpa_kernel(chosen) if chosen else contextlib.nullcontext()
            key = f"{'bf16' if bf16 else 'fp32'} {name}"
            try:
                with ctx:
                    times = []
                    for _round in range(2):  # first round meets each shape for the first time
                        sync()
                        t = time.perf_counter()
                        for b in batches:
                            step(model, opt, b, bf16)
                        sync()
                        times.append((time.perf_counter() - t) / len(batches) * 1000)
                rows[key] = {"first_round_ms": round(times[0], 2), "second_round_ms": round(times[1], 2)}
            except Exception as e:
                rows[key] = {"error": repr(e)[:300]}
            print(key, rows[key], flush=True)
    out["ding_shapes"] = rows
    print("\n==== Ding-preset shapes (d_model 128, N 3), ms per step, new shapes then repeated:")
    for k, v in rows.items():
        print(f"{k:20s} {v}")
    # a profile of the first bf16 round on fresh shapes, default backend
    model, opt = make(128, 3, 512, 4, 4000)
    fresh = [
        tuple(t.to(DEV) for t in random_batch(4000, max(2, 1536 // (L + 2)), L, L, seed=100 + L)) for L in range(7, 19)
    ]
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV.type == "cuda" else [])
    with profile(activities=acts) as p:
        for b in fresh:
            step(model, opt, b, True)
        sync()
    table = p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70)
    print("\n==== Ding shapes, bf16 default, 12 fresh shapes, by CPU self time")
    print(table)
    out["ding_fresh_profile"] = table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=".")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    out = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu"}
    for part in (base_profiles, ding_shapes):
        try:
            part(out, args.quick)
        except Exception as e:
            print(f"{part.__name__} failed: {e!r}")
            out[part.__name__] = repr(e)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_profile.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
