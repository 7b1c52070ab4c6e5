"""aiayn on one GPU, in one run: correctness of the CUDA paths, training and decoding speed, the CLI.

1. Correctness on CUDA, each against an independent truth, on tiny seeded models whose every
   weight, bias and LayerNorm parameter is random (``tests/helpers.py``), TF32 off:
   a. teacher-forced logits (post-norm and pre-norm) and the gradients of the label-smoothed
      loss equal the CPU model's;
   b. greedy and beam-4 search on the CUDA model, unprepared and ``engine.prepare``-d, give the
      CPU model's tokens (near-ties may differ: counts, at most one sentence may differ), and
      ``translate_ids`` (batched by tokens) too;
   c. bfloat16 autocast logits against float32 (stated tolerance);
   d. ``torch.compile(model)`` logits equal eager (compile seconds; Dynamo's graph breaks);
   e. which kernel ``F.scaled_dot_product_attention`` takes for aiayn's attention in bfloat16
      (the aten op the profiler records; aiayn always passes a boolean mask, which flash
      attention does not take), and whether each backend runs when forced (``sdpa_kernel``),
      with torch's reasons where it does not.
2. Training speed at the base shape of Table 3 (d_model 512, d_ff 2048, h 8, N 6, vocabulary
   8,000 tied; dropout 0.1), batches of ~25,000 source + target tokens (200 sentences of 56-64
   tokens a side, right-padded: ``model_speed.make_batch``), forward + backward + fused Adam
   step: tokens/s of aiayn in fp32 (TF32 on), bf16 autocast, bf16 autocast + torch.compile, and
   of torch.nn.Transformer (``model_speed.TorchTransformerLM``) in fp32 and bf16; model FLOP/s
   (``torch.utils.flop_counter``) against the bf16 and TF32 matmul peaks measured in this run.
3. Decoding speed at the base shape (random weights): 256 sentences of 20-30 tokens, every
   output forced to 40 decoder steps (``min_len = max_len``, as ``decode_speed.py``), greedy and
   beam 4, in batches of 64 and of 256: sentences/s of the unprepared and the prepared model in
   float32 (TF32 off, torch's default: what ``aiayn translate --device cuda`` gets), and greedy
   under bf16 autocast.
4. The CLI on the GPU: ``aiayn train`` with ``configs/ding.yaml`` for 60 s (precision, steps,
   tokens/s, dev figures), the same for 30 s under ``torchrun --nproc_per_node 1`` (one process:
   the trainer then joins no process group and wraps no DDP), and a DistributedDataParallel step
   on NCCL in one process under torchrun whose gradients equal the plain model's. ``--budget``
   (seconds for the whole script, default 290) shortens the two trainings to fit, or skips them.

Every check runs in its own try/except; the results (pass / fail / skip / dry-run, numbers,
error text) go to ``--out DIR/cuda_check.json``, rewritten after every check. ``--quick`` shrinks
everything to run on a CPU in about two minutes; without CUDA the checks that compare against
CUDA still run their code on the CPU and say ``dry-run``.

    PYTHONPATH=src python3 bench/cuda_check.py --out DIR [--quick] [--parts 1,2,3,4]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))
from aiayn import ModelConfig, Transformer, engine  # noqa: E402
from aiayn.decode import beam_search, greedy_decode, translate_ids  # noqa: E402
from aiayn.train.loss import label_smoothed_loss  # noqa: E402
from common import machine, table  # noqa: E402
from helpers import random_model  # noqa: E402
from model_speed import VOCAB, TorchTransformerLM, make_batch  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


class SkipError(Exception):
    """A check that cannot run here (the reason is its message)."""


class Report:
    """The checks' rows, printed as they end and written to ``path`` after each."""

    def __init__(self, path: Path, header: dict) -> None:
        self.path, self.header = path, header
        self.parts: dict[str, list[dict]] = {}
        self.start = time.perf_counter()

    def write(self) -> None:
        result = dict(self.header, seconds=round(time.perf_counter() - self.start, 1), parts=self.parts)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=2, default=str) + "\n")
        tmp.replace(self.path)

    def check(self, part: str, name: str, fn, *args, dry_run: bool = False) -> dict:
        """Run ``fn(row, *args)``, which fills ``row`` with its numbers and asserts; the row
        keeps them whether it passes or not. ``dry_run``: the check needs CUDA and ran on the
        CPU only to run its code."""
        row: dict = {"check": name}
        print(f"\n[{part}] {name} ...", flush=True)
        start = time.perf_counter()
        try:
            fn(row, *args)
            row["status"] = "dry-run" if dry_run else "pass"
        except SkipError as e:
            row["status"], row["note"] = "skip", str(e)
        except Exception as e:
            row["status"] = "fail"
            row["error"] = f"{type(e).__name__}: {e}"[:2000]
            row["traceback"] = traceback.format_exc()[-4000:]
            print(row["traceback"], file=sys.stderr, flush=True)
        finally:
            if CUDA:
                with contextlib.suppress(Exception):
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
        row["seconds"] = round(time.perf_counter() - start, 1)
        self.parts.setdefault(part, []).append(row)
        print(f"[{part}] {name}: {row['status'].upper()} ({row['seconds']} s) {_short(_numbers(row))}", flush=True)
        self.write()
        return row

    def print_part(self, part: str, title: str) -> None:
        rows = [
            {"check": r["check"], "status": r["status"], "seconds": r["seconds"], "numbers": _short(_numbers(r), 150)}
            for r in self.parts.get(part, [])
        ]
        print(f"\n== part {part}: {title} ==")
        print(table(rows, [("check", "check"), ("status", "status"), ("seconds", "s"), ("numbers", "figures")]))


def _numbers(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in ("check", "status", "seconds", "traceback", "rows", "log_tail")}


def _short(d: dict, width: int = 400) -> str:
    text = ", ".join(f"{k}={v}" for k, v in d.items())
    return text if len(text) <= width else text[: width - 3] + "..."


def set_tf32(enabled: bool) -> None:
    """TF32 for float32 matmuls and convolutions (the trainer turns it on for CUDA)."""
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def timed(fn, repeats: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return times


def autocast_bf16():
    return torch.autocast(DEVICE.type, dtype=torch.bfloat16)


def random_batch(vocab: int, B: int, S: int, T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random sources ``(B, S)`` with EOS and right padding of varied lengths, and decoder
    input / output ``(B, T)`` (BOS first; padded likewise)."""
    g = torch.Generator().manual_seed(seed)
    src = torch.zeros(B, S, dtype=torch.long)
    tgt = torch.zeros(B, T + 1, dtype=torch.long)
    for b in range(B):
        n = int(torch.randint(max(2, S // 3), S, (1,), generator=g))
        src[b, :n] = torch.randint(3, vocab, (n,), generator=g)
        src[b, n] = 2
        m = int(torch.randint(max(2, T // 3), T, (1,), generator=g))
        tgt[b, 0] = 1
        tgt[b, 1 : m + 1] = torch.randint(3, vocab, (m,), generator=g)
        tgt[b, m + 1] = 2
    return src, tgt[:, :-1], tgt[:, 1:]


def sources(n: int, vocab: int, lo: int, hi: int, seed: int) -> torch.Tensor:
    """``n`` random sentences of ``lo``-``hi`` tokens plus EOS (id 2), right-padded with 0."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g)
    src = torch.zeros(n, int(lengths.max()) + 1, dtype=torch.long)
    for i, k in enumerate(lengths.tolist()):
        src[i, :k] = torch.randint(5, vocab, (k,), generator=g)
        src[i, k] = 2
    return src


def until_eos(row: list[int], eos: int = 2) -> list[int]:
    return row[: row.index(eos)] if eos in row else row


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double().cpu() - b.detach().double().cpu()).abs().max())


# Part 1: correctness ------------------------------------------------------------------------------

TINY = {"vocab_size": 48}


def check_logits(row: dict) -> None:
    set_tf32(False)
    src, tgt_in, _ = random_batch(TINY["vocab_size"], 6, 14, 12, seed=1)
    for norm_first in (False, True):
        cpu = random_model(0, norm_first=norm_first, **TINY)
        dev = copy.deepcopy(cpu).to(DEVICE)
        with torch.no_grad():
            want, got = cpu(src, tgt_in), dev(src.to(DEVICE), tgt_in.to(DEVICE))
        key = "prenorm" if norm_first else "postnorm"
        row[f"{key}_max_abs_diff"] = float(f"{max_abs(want, got):.3g}")
        row[f"{key}_max_abs_logit"] = round(float(want.abs().max()), 3)
        assert torch.isfinite(got).all(), "non-finite logits on the device"
        assert row[f"{key}_max_abs_diff"] <= 1e-4, f"{key}: logits differ by {row[f'{key}_max_abs_diff']}"


def check_grads(row: dict) -> None:
    set_tf32(False)
    src, tgt_in, tgt_out = random_batch(TINY["vocab_size"], 6, 14, 12, seed=2)
    cpu = random_model(0, **TINY).train()
    dev = copy.deepcopy(cpu).to(DEVICE)
    for model, device in ((cpu, torch.device("cpu")), (dev, DEVICE)):
        s, ti, to = src.to(device), tgt_in.to(device), tgt_out.to(device)
        select = to != 0
        loss, _ = label_smoothed_loss(model(s, ti, select=select), to[select], 0.1)
        (loss / select.sum()).backward()
        row["loss_" + device.type] = round(float(loss.detach()), 6)
    worst, worst_name, scale = 0.0, "", 0.0
    for (name, p), q in zip(cpu.named_parameters(), dev.parameters(), strict=True):
        d = max_abs(p.grad, q.grad)
        scale = max(scale, float(p.grad.abs().max()))
        if d > worst:
            worst, worst_name = d, name
    row["grad_max_abs_diff"] = float(f"{worst:.3g}")
    row["grad_worst_param"] = worst_name
    row["grad_max_abs"] = float(f"{scale:.3g}")
    assert worst <= 1e-4 * max(1.0, scale), f"gradients differ by {worst} ({worst_name})"


def check_decode(row: dict) -> None:
    set_tf32(False)
    n, max_len = 16, 24
    src = sources(n, TINY["vocab_size"], 3, 12, seed=3)
    cpu = random_model(1, **TINY)
    dev = copy.deepcopy(cpu).to(DEVICE)
    models = {"cpu": cpu, "device": dev, "device_prepared": engine.prepare(dev)}
    out: dict[str, dict[str, list]] = {}
    scores: dict[str, list[float]] = {}
    for name, model in models.items():
        s = src.to(next(model.parameters()).device)
        greedy = greedy_decode(model, s, max_len=max_len)
        hyps = beam_search(model, s, beam=4, max_len=max_len)
        out[name] = {"greedy": [until_eos(r) for r in greedy.tolist()], "beam4": [h[0].tokens for h in hyps]}
        scores[name] = [h[0].score for h in hyps]
    for name in ("device", "device_prepared"):
        for search in ("greedy", "beam4"):
            agree = sum(a == b for a, b in zip(out["cpu"][search], out[name][search], strict=True))
            row[f"{name}_{search}_agree"] = f"{agree}/{n}"
            assert agree >= n - 1, f"{name} {search}: only {agree} of {n} sentences equal the CPU model's"
        same = [i for i in range(n) if out["cpu"]["beam4"][i] == out[name]["beam4"][i]]
        row[f"{name}_beam4_score_max_diff"] = float(
            f"{max((abs(scores['cpu'][i] - scores[name][i]) for i in same), default=0.0):.3g}"
        )
    row["mean_output_len"] = round(statistics.mean(len(r) for r in out["cpu"]["greedy"]), 1)


def check_translate_ids(row: dict) -> None:
    """translate_ids: batches by tokens, on the CUDA model prepared and on the CPU model."""
    set_tf32(False)
    src = sources(40, TINY["vocab_size"], 3, 20, seed=4)
    ids = [until_eos(r) for r in src.tolist()]
    cpu = random_model(2, **TINY)
    dev = engine.prepare(copy.deepcopy(cpu).to(DEVICE))
    for beam in (1, 4):
        want = translate_ids(cpu, ids, max_tokens=64, max_len_a=10, beam=beam)
        got = translate_ids(dev, ids, max_tokens=64, max_len_a=10, beam=beam)
        agree = sum(a == b for a, b in zip(want, got, strict=True))
        row[f"beam{beam}_agree"] = f"{agree}/{len(ids)}"
        assert agree >= len(ids) - 1, f"beam {beam}: only {agree} of {len(ids)} equal the CPU model's"


def check_bf16(row: dict, tolerance: float) -> None:
    set_tf32(False)
    src, tgt_in, _ = random_batch(TINY["vocab_size"], 6, 14, 12, seed=5)
    model = random_model(0, **TINY).to(DEVICE)
    s, t = src.to(DEVICE), tgt_in.to(DEVICE)
    with torch.no_grad():
        fp32 = model(s, t)
        with autocast_bf16():
            bf16 = model(s, t)
    row["logits_dtype"] = str(bf16.dtype)
    diff = max_abs(fp32, bf16.float())
    scale = float(fp32.abs().max())
    row["max_abs_diff"] = float(f"{diff:.3g}")
    row["max_abs_logit"] = round(scale, 3)
    row["relative"] = float(f"{diff / scale:.3g}")
    row["tolerance_relative"] = tolerance
    row["argmax_agree"] = round(float((fp32.argmax(-1) == bf16.argmax(-1)).float().mean()), 4)
    assert diff <= tolerance * scale, f"bf16 logits differ by {diff} ({diff / scale:.3g} of the largest)"


def check_compile(row: dict) -> None:
    set_tf32(False)
    src, tgt_in, _ = random_batch(TINY["vocab_size"], 6, 14, 12, seed=6)
    model = random_model(0, **TINY).to(DEVICE)
    s, t = src.to(DEVICE), tgt_in.to(DEVICE)
    compiled = torch.compile(model)
    with torch.no_grad():
        eager = model(s, t)
        sync()
        start = time.perf_counter()
        first = compiled(s, t)
        sync()
        row["compile_seconds"] = round(time.perf_counter() - start, 1)
        start = time.perf_counter()
        again = compiled(s, t)
        sync()
        row["second_call_ms"] = round(1000 * (time.perf_counter() - start), 1)
    row["max_abs_diff"] = float(f"{max_abs(eager, first):.3g}")
    row["max_abs_diff_second_call"] = float(f"{max_abs(eager, again):.3g}")
    try:
        import torch._dynamo as dynamo

        with torch.no_grad():
            explained = dynamo.explain(model)(s, t)
        row["graphs"] = explained.graph_count
        row["graph_breaks"] = explained.graph_break_count
        row["break_reasons"] = sorted(
            {str(getattr(b, "reason", b)).splitlines()[0][:160] for b in explained.break_reasons}
        )[:5]
    except Exception as e:
        row["explain_error"] = f"{type(e).__name__}: {e}"[:300]
    assert row["max_abs_diff"] <= 1e-4 and row["max_abs_diff_second_call"] <= 1e-4, "compiled logits differ"


def check_sdpa(row: dict, quick: bool) -> None:
    """Which SDPA kernel aiayn's attention takes in bf16 (by the aten op the profiler records),
    and whether each backend runs when it is the only one allowed (forward + backward)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    set_tf32(False)
    config = ModelConfig.base(VOCAB, P_drop=0.0) if not quick else ModelConfig.tiny(VOCAB, d_model=64, h=4)
    torch.manual_seed(0)
    model = Transformer(config).to(DEVICE).train()
    B, L = (64, 64) if not quick else (4, 16)
    src, tgt_in, tgt_out = (x.to(DEVICE) for x in make_batch(B, L, torch.Generator().manual_seed(0)))

    def step() -> torch.Tensor:
        with autocast_bf16():
            logits = model(src, tgt_in)
        loss = F.cross_entropy(logits.float().flatten(0, 1), tgt_out.flatten(), ignore_index=0)
        loss.backward()
        model.zero_grad(set_to_none=True)
        return logits.detach().float()

    step()
    try:  # the aten ops (CPU activity) name the backend; the CUDA kernels need CUPTI
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
        with profile(activities=activities) as prof:
            step()
            sync()
        marks = ("scaled_dot_product", "attention", "fmha", "flash", "cudnn")
        ops = sorted({e.key for e in prof.key_averages() if any(m in e.key.lower() for m in marks)})
        row["default_ops"] = [o for o in ops if o.startswith("aten::")][:10]
        row["default_kernels"] = [o[:100] for o in ops if not o.startswith(("aten::", "autograd::"))][:8]
    except Exception as e:
        row["profile_error"] = f"{type(e).__name__}: {e}"[:300]
    row["default_ms_per_step"] = round(1000 * statistics.median(timed(step, 3)), 2)
    reference = step()
    backends = {
        name: getattr(SDPBackend, name)
        for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")
        if hasattr(SDPBackend, name)
    }
    runs = {}
    for name, backend in backends.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with sdpa_kernel([backend]):
                    out = step()
                    ms = 1000 * statistics.median(timed(step, 3))
                runs[name] = {
                    "runs": True, "ms_per_step": round(ms, 2),
                    "max_abs_diff_vs_default": float(f"{max_abs(out, reference):.3g}"),
                }  # fmt: skip
            except Exception as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                runs[name] = {"runs": False, "error": f"{type(e).__name__}: {first}"[:300]}
        why = sorted({str(w.message).splitlines()[0][:200] for w in caught if "ttention" in str(w.message)})
        if why:
            runs[name]["warnings"] = why[:6]
    row["backends"] = runs
    row["flash_runs"] = runs.get("FLASH_ATTENTION", {}).get("runs")
    row["efficient_runs"] = runs.get("EFFICIENT_ATTENTION", {}).get("runs")
    row["batch"] = f"B={B} L={L} d_model={config.d_model}"


def part1(report: Report, quick: bool) -> None:
    dry = not CUDA
    report.check("1", "a. logits cuda == cpu (fp32, TF32 off, <= 1e-4)", check_logits, dry_run=dry)
    report.check("1", "a. loss gradients cuda == cpu", check_grads, dry_run=dry)
    report.check("1", "b. greedy/beam4: cpu, cuda, cuda prepared", check_decode, dry_run=dry)
    report.check("1", "b. translate_ids cuda prepared == cpu", check_translate_ids, dry_run=dry)
    report.check("1", "c. bf16 autocast logits vs fp32", check_bf16, 5e-2, dry_run=dry)
    report.check("1", "d. torch.compile == eager (<= 1e-4)", check_compile, dry_run=dry)
    report.check("1", "e. SDPA backends in bf16", check_sdpa, quick, dry_run=dry)
    report.print_part("1", "correctness on " + DEVICE.type)


# Part 2: training speed -----------------------------------------------------------------------------


def matmul_rate(dtype: torch.dtype, n: int, seconds: float) -> float:
    """FLOP/s of an ``n``^3 matmul in ``dtype`` (float32 with TF32 allowed)."""
    set_tf32(True)
    a = torch.randn(n, n, device=DEVICE, dtype=dtype)
    b = torch.randn(n, n, device=DEVICE, dtype=dtype)
    for _ in range(3):
        a @ b
    sync()
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(5):
            a @ b
        reps += 5
        sync()
    return 2 * n**3 * reps / (time.perf_counter() - start)


def check_peaks(row: dict, quick: bool, peaks: dict) -> None:
    n = 512 if quick else 8192
    peaks["bf16"] = matmul_rate(torch.bfloat16, n, 0.5 if quick else 2.0)
    peaks["tf32"] = matmul_rate(torch.float32, n, 0.5 if quick else 2.0)
    row["n"] = n
    row["bf16_tflops"] = round(peaks["bf16"] / 1e12, 3 if quick else 1)
    row["tf32_tflops"] = round(peaks["tf32"] / 1e12, 3 if quick else 1)


def train_row(row: dict, spec: dict, shape: dict, batch: tuple, peaks: dict, flops: dict) -> None:
    """Time ``spec`` (arch aiayn|torch, bf16, compile) over ``shape``'s steps on ``batch``."""
    set_tf32(True)
    torch.manual_seed(0)
    d, h, N, d_ff = shape["d_model"], shape["h"], shape["N"], shape["d_ff"]
    if spec["arch"] == "aiayn":
        model = Transformer(ModelConfig.base(VOCAB, d_model=d, h=h, N=N, d_ff=d_ff, P_drop=0.1))
    else:
        model = TorchTransformerLM(d, h, N, d_ff, 0.1)
    model = model.to(DEVICE).train()
    # --quick on a CPU: Dynamo and AOTAutograd without inductor's C++ code generation (~30 s on 2 cores)
    backend = "aot_eager" if shape["quick"] and not CUDA else "inductor"
    forward = torch.compile(model, backend=backend) if spec["compile"] else model
    if spec["compile"]:
        row["compile_backend"] = backend
    fused = CUDA
    optimizer = torch.optim.Adam(
        model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=fused, foreach=not fused
    )
    src, tgt_in, tgt_out = batch
    select = tgt_out != 0
    n_tokens = int(select.sum())
    context = autocast_bf16 if spec["bf16"] else contextlib.nullcontext

    def fwd_bwd() -> torch.Tensor:
        # aiayn: (N, V) at the real target positions, as the trainer; torch: (B, T, V)
        aiayn = spec["arch"] == "aiayn"
        with context():
            logits = forward(src, tgt_in, select=select) if aiayn else forward(src, tgt_in)
        if aiayn:
            loss, _ = label_smoothed_loss(logits, tgt_out[select], 0.1)
        else:
            loss = F.cross_entropy(
                logits.float().flatten(0, 1), tgt_out.flatten(), ignore_index=0, label_smoothing=0.1, reduction="sum"
            )
        (loss / n_tokens).backward()
        return loss.detach()

    def step() -> torch.Tensor:
        loss = fwd_bwd()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    if spec["arch"] not in flops:  # one forward + backward, counted in eager mode
        from torch.utils.flop_counter import FlopCounterMode

        saved, forward = forward, model
        with FlopCounterMode(display=False) as counter:
            fwd_bwd()
        model.zero_grad(set_to_none=True)
        forward = saved
        flops[spec["arch"]] = counter.get_total_flops()
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    sync()
    start = time.perf_counter()
    first_loss = float(step()) / n_tokens
    sync()
    row["first_step_s"] = round(time.perf_counter() - start, 1)  # compile time for the compiled row
    for _ in range(shape["warmup"] - 1):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(shape["steps"]):
        loss = step()
    sync()
    seconds = (time.perf_counter() - start) / shape["steps"]
    tokens = shape["tokens"]
    rate = flops[spec["arch"]] / seconds
    row.update(
        ms_per_step=round(1000 * seconds, 1),
        tokens_per_s=round(tokens / seconds),
        model_tflops=round(rate / 1e12, 3 if shape["quick"] else 1),
        gflop_per_step=round(flops[spec["arch"]] / 1e9, 1),
        fraction_of_bf16_peak=round(rate / peaks["bf16"], 3) if peaks.get("bf16") else None,
        fraction_of_tf32_peak=round(rate / peaks["tf32"], 3) if peaks.get("tf32") else None,
        first_loss_per_token=round(first_loss, 4),
        last_loss_per_token=round(float(loss) / n_tokens, 4),
    )
    if CUDA:
        row["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    assert math.isfinite(row["last_loss_per_token"]), "non-finite loss"


def part2(report: Report, quick: bool) -> None:
    if quick:
        shape = {"d_model": 64, "h": 4, "N": 2, "d_ff": 256, "B": 8, "L": 16, "warmup": 2, "steps": 2}
    else:
        shape = {"d_model": 512, "h": 8, "N": 6, "d_ff": 2048, "B": 200, "L": 64, "warmup": 3, "steps": 10}
    shape["quick"] = quick
    peaks: dict = {}
    report.check("2", "matmul peaks (bf16, fp32 with TF32)", check_peaks, quick, peaks)
    batch = tuple(t.to(DEVICE) for t in make_batch(shape["B"], shape["L"], torch.Generator().manual_seed(0)))
    shape["tokens"] = int((batch[0] != 0).sum() + (batch[1] != 0).sum())
    positions = batch[0].numel() + batch[1].numel()
    print(f"batch: {shape['B']} sentences, {shape['tokens']} source + target tokens of {positions} positions")
    flops: dict = {}
    specs = {
        "aiayn fp32 (TF32)": {"arch": "aiayn", "bf16": False, "compile": False},
        "aiayn bf16 autocast": {"arch": "aiayn", "bf16": True, "compile": False},
        "aiayn bf16 autocast + torch.compile": {"arch": "aiayn", "bf16": True, "compile": True},
        "torch.nn.Transformer fp32 (TF32)": {"arch": "torch", "bf16": False, "compile": False},
        "torch.nn.Transformer bf16 autocast": {"arch": "torch", "bf16": True, "compile": False},
    }
    rows = []
    for name, spec in specs.items():
        row = report.check("2", name, train_row, spec, shape, batch, peaks, flops)
        row["batch"] = {"sentences": shape["B"], "tokens": shape["tokens"], "positions": positions}
        rows.append(dict(row, model=name))
    report.write()
    print(f"\n== part 2: training speed on {DEVICE.type} (d_model {shape['d_model']}, N {shape['N']}) ==")
    print(
        table(
            rows,
            [("model", "model"), ("status", "status"), ("tokens_per_s", "tokens/s"), ("ms_per_step", "ms/step"),
             ("model_tflops", "TFLOP/s"), ("fraction_of_bf16_peak", "of bf16 peak"),
             ("fraction_of_tf32_peak", "of TF32 peak"), ("first_step_s", "1st step s"), ("peak_memory_gib", "GiB")],
        )
    )  # fmt: skip


# Part 3: decoding speed ------------------------------------------------------------------------------


def decode_rows(row: dict, quick: bool) -> None:
    set_tf32(False)  # torch's default: what `aiayn translate --device cuda` runs with
    n, L = (16, 8) if quick else (256, 40)
    batches = (4, 16) if quick else (64, 256)
    repeats = 1 if quick else 2
    config = ModelConfig.base(VOCAB, P_drop=0.0)
    if quick:
        config = config.replace(d_model=64, h=4, N=2, d_ff=256)
    torch.manual_seed(0)
    paper = Transformer(config).eval().to(DEVICE)
    models = {"unprepared": paper, "prepared": engine.prepare(paper)}
    src = sources(n, VOCAB, 20, 30, seed=0).to(DEVICE)
    out = greedy_decode(models["prepared"], src[:2], max_len=L, min_len=L)
    assert out.size(1) == L and bool((out[:, -1] == 2).all()), f"outputs not forced to {L} steps: {out.shape}"
    results, outputs = [], {}
    print(table([], COLUMNS), flush=True)

    def run(model, beam: int, size: int, keep: str | None = None):
        def fn():
            got = []
            for i in range(0, n, size):
                s = src[i : i + size]
                if beam == 1:
                    got += greedy_decode(model, s, max_len=L, min_len=L).tolist()
                else:
                    got += [h[0].tokens for h in beam_search(model, s, beam=4, max_len=L, min_len=L)]
            if keep:
                outputs[keep] = got

        return fn

    for size in batches:
        for beam in (1, 4):
            for which, model in models.items():
                key = f"{which} beam{beam} batch{size}"
                times = timed(run(model, beam, size, key), repeats)
                seconds = statistics.median(times)
                results.append({
                    "model": which, "precision": "fp32", "beam": beam, "batch": size,
                    "sent_per_s": round(n / seconds, 1), "seconds": round(seconds, 3),
                    "ms_per_step": round(1000 * seconds / (L * math.ceil(n / size)), 2),
                })  # fmt: skip
                print(table([results[-1]], COLUMNS).splitlines()[-1], flush=True)
    for size in batches:
        for beam in (1, 4):
            a, b = outputs[f"unprepared beam{beam} batch{size}"], outputs[f"prepared beam{beam} batch{size}"]
            row[f"prepared_vs_unprepared_beam{beam}_batch{size}_agree"] = (
                f"{sum(x == y for x, y in zip(a, b, strict=True))}/{n}"
            )
    # greedy in bf16 autocast (the decoders upcast the logits: decode._search)
    size = batches[-1]
    for which, model in models.items():
        key = f"{which} bf16 greedy batch{size}"
        try:
            with autocast_bf16():
                times = timed(run(model, 1, size, key), repeats)
            seconds = statistics.median(times)
            fp32 = outputs[f"{which} beam1 batch{size}"]
            same = sum(x == y for x, y in zip(fp32, outputs[key], strict=True))
            results.append({
                "model": which, "precision": "bf16 autocast", "beam": 1, "batch": size,
                "sent_per_s": round(n / seconds, 1), "seconds": round(seconds, 3),
                "ms_per_step": round(1000 * seconds / (L * math.ceil(n / size)), 2),
                "same_as_fp32": f"{same}/{n}",
            })  # fmt: skip
            print(table([results[-1]], COLUMNS).splitlines()[-1], flush=True)
        except Exception as e:
            row[f"{which}_bf16_error"] = f"{type(e).__name__}: {e}"[:500]
    row["rows"] = results
    row["setup"] = f"{n} sentences, {L} decoder steps each, d_model {config.d_model}, N {config.N}, TF32 off"
    print(f"\n== part 3: decoding on {DEVICE.type} ({row['setup']}) ==")
    print(table(results, COLUMNS))


COLUMNS = [
    ("model", "model"), ("precision", "precision"), ("beam", "beam"), ("batch", "batch"),
    ("sent_per_s", "sentences/s"), ("seconds", "s"), ("ms_per_step", "ms/step"), ("same_as_fp32", "= fp32"),
]  # fmt: skip


def part3(report: Report, quick: bool) -> None:
    report.check("3", "decoding speed (greedy, beam 4; unprepared, prepared; fp32, bf16)", decode_rows, quick)


# Part 4: the CLI -------------------------------------------------------------------------------------


def run_logged(cmd: list[str], log: Path, timeout: float, env: dict) -> tuple[int, str, float]:
    """Run ``cmd`` in its own process group from the repository root, output to ``log``; on
    ``timeout``, kill that group. Returns (exit status, output, seconds)."""
    print("$ " + " ".join(cmd), flush=True)
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = -9
    text = log.read_text(errors="replace")
    return rc, text, time.perf_counter() - start


def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    env.setdefault("TQDM_MININTERVAL", "5")
    return env


def cli_train(
    row: dict, launcher: list[str], max_time: float, out: Path, logs: Path, name: str, extra: list[str]
) -> None:
    if not (ROOT / "data/ding/train.de").exists():
        raise SkipError("data/ding/train.de is missing (aiayn data ding --out data/ding)")
    run_dir = out / name
    cmd = [*launcher, "aiayn", "train", "--config", "configs/ding.yaml", "--out", str(run_dir),
           "--device", DEVICE.type, "--train.max_time", str(max_time), *extra]  # fmt: skip
    rc, text, seconds = run_logged(cmd, logs / f"{name}.log", max_time + 240, child_env())
    row["exit_status"], row["wall_s"] = rc, round(seconds, 1)
    lines = [
        ln for ln in text.splitlines() if ln.startswith(("precision:", "stopped at", "dev:", "model:", "batches:"))
    ]
    for ln in lines:
        print("   " + ln[:300])
    precision = next((ln for ln in lines if ln.startswith("precision:")), None)
    row["precision_line"] = precision
    step_of = re.search(r"step = (\d+) x (\d+) batches", text)
    if step_of:
        row["world"] = int(step_of[2])
    stopped = re.search(r"stopped at step (\d+) \((\w+)\); (\d+) s", text)
    if stopped:
        row["steps"], row["stop_reason"], row["train_s"] = int(stopped[1]), stopped[2], int(stopped[3])
    metrics = run_dir / "metrics.jsonl"
    records = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip()] if metrics.exists() else []
    train = [r for r in records if r.get("kind") == "train"]
    if train:
        rates = [r["tokens_per_s"] for r in train[min(10, len(train) // 2) :]]
        row["tokens_per_s_median"] = round(statistics.median(rates))
        row["tokens_per_s_overall"] = round(sum(r["tokens"] for r in train) / max(train[-1]["elapsed"], 1e-9))
        row["last_train_loss"] = round(train[-1]["loss"], 3)
    devs = [r for r in records if r.get("kind") == "dev"]
    if devs:
        row["dev_evals"] = len(devs)
    final = next((r for r in reversed(records) if r.get("kind") == "final"), None)
    if final:
        row["final"] = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in final.items() if k != "kind"}
    row["command"] = " ".join(cmd)
    for key in ("precision_line", "exit_status", "wall_s", "command"):  # the figures first in the table
        row[key] = row.pop(key)
    if rc != 0:
        row["log_tail"] = text[-1500:]
    assert rc == 0, f"exit status {rc} (log {logs / f'{name}.log'})"
    assert precision is not None, "no precision line"
    if CUDA:
        assert precision.startswith("precision: bf16"), f"expected bf16 on CUDA: {precision}"
    assert row.get("steps", 0) > 0, "no training step"
    assert final is not None, "no final record in metrics.jsonl"


DDP_WORKER = "--ddp-worker"
MIN_TRAIN_S = 8  # the shortest CLI training part 4 runs to fit --budget
OVERHEAD_S = 35  # a CLI run's seconds beside max_time (Python start, BPE, final dev scores, saving)


def ddp_worker(path: str) -> None:
    """Under torchrun: one DistributedDataParallel step (NCCL on CUDA, gloo on the CPU) on a tiny
    random model; its gradients must equal the plain model's. Writes a JSON result to ``path``."""
    import torch.distributed as dist

    result: dict = {"world": int(os.environ.get("WORLD_SIZE", "0")), "rank": int(os.environ.get("RANK", "-1"))}
    try:
        backend = "nccl" if CUDA else "gloo"
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if CUDA else DEVICE
        if CUDA:
            torch.cuda.set_device(device)
        dist.init_process_group(backend)
        result["backend"] = dist.get_backend()
        set_tf32(False)
        plain = random_model(0, **TINY).train().to(device)
        ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(plain), device_ids=[device] if CUDA else None)
        src, tgt_in, tgt_out = (x.to(device) for x in random_batch(TINY["vocab_size"], 6, 14, 12, seed=7))
        for model in (plain, ddp):
            select = tgt_out != 0
            loss, _ = label_smoothed_loss(model(src, tgt_in, select=select), tgt_out[select], 0.1)
            (loss / select.sum()).backward()
        diff = max(max_abs(p.grad, q.grad) for p, q in zip(plain.parameters(), ddp.module.parameters(), strict=True))
        value = torch.ones(4, device=device) * (dist.get_rank() + 1)
        dist.all_reduce(value)
        result.update(grad_max_abs_diff=float(f"{diff:.3g}"), all_reduce=value.tolist(), ok=diff <= 1e-6)
        dist.barrier()
        dist.destroy_process_group()
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"[:1000]
        result["traceback"] = traceback.format_exc()[-3000:]
    Path(path).write_text(json.dumps(result))


def check_ddp(row: dict, logs: Path, out: Path) -> None:
    result_path = out / "ddp_worker.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
           str(Path(__file__).resolve()), DDP_WORKER, str(result_path)]  # fmt: skip
    rc, text, seconds = run_logged(cmd, logs / "ddp_worker.log", 180, child_env())
    row["exit_status"], row["wall_s"] = rc, round(seconds, 1)
    assert result_path.exists(), f"no result from the worker (exit status {rc}): {text[-1000:]}"
    result = json.loads(result_path.read_text())
    row.update({k: v for k, v in result.items() if k != "traceback"})
    row["command"] = " ".join(cmd)
    assert "error" not in result, result.get("traceback", result.get("error"))
    assert result["ok"], f"DDP gradients differ by {result['grad_max_abs_diff']}"
    if CUDA:
        assert result["backend"] == "nccl", result["backend"]


def part4(report: Report, quick: bool, out_dir: Path, deadline: float) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="aiayn-cuda-check-"))
    logs = out_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    extra = ["--data.dev_size", "100"] if quick else []
    python_m = [sys.executable, "-m"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", "-m"]
    # a run takes max_time + OVERHEAD_S (start, BPE, final dev scores); max_time shrinks to fit
    # --budget (keeping room for what follows: the next run at MIN_TRAIN_S, the DDP step), not below
    # MIN_TRAIN_S, and the run is skipped when even that does not fit
    ddp_s = 15
    for name, launcher, wanted, after in (
        ("train_cli", python_m, 10 if quick else 60, OVERHEAD_S + MIN_TRAIN_S + ddp_s),
        ("train_torchrun", torchrun, 10 if quick else 30, ddp_s),
    ):
        left = deadline - time.perf_counter()
        max_time = int(min(wanted, left - OVERHEAD_S - after))
        if max_time < MIN_TRAIN_S:  # no room for both trainings: the first takes what there is
            max_time = int(min(wanted, left - OVERHEAD_S - ddp_s))
        if max_time < MIN_TRAIN_S:
            report.check("4", f"aiayn train via {name}", _skip, f"{left:.0f} s of --budget left: too little")
            continue
        report.check(
            "4", f"aiayn train via {name} ({max_time} s)", cli_train, launcher, max_time, tmp, logs, name, extra
        )
    report.check("4", "DDP step under torchrun (NCCL on CUDA), grads == plain", check_ddp, logs, tmp)
    report.print_part("4", "the CLI on " + DEVICE.type)
    print(f"(run directories under {tmp}; logs under {logs})")


def _skip(row: dict, reason: str) -> None:
    raise SkipError(reason)


# Main ----------------------------------------------------------------------------------------------


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == DDP_WORKER:
        ddp_worker(sys.argv[2])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for cuda_check.json and the CLI logs")
    parser.add_argument("--quick", action="store_true", help="tiny shapes: the whole script in ~2 min on a CPU")
    parser.add_argument("--parts", default="1,2,3,4", help="which parts to run (default %(default)s)")
    parser.add_argument(
        "--budget", type=float, default=None,
        help="seconds for the whole run: part 4 skips a CLI run that would not fit (default 290; --quick 150)",
    )  # fmt: skip
    args = parser.parse_args()
    t0 = time.perf_counter()
    deadline = t0 + (args.budget or (150 if args.quick else 290))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    try:
        info = machine()
    except Exception as e:
        info = {"error": f"{type(e).__name__}: {e}"}
    header = {
        "benchmark": "cuda_check",
        "command": "python " + " ".join(sys.argv),
        "quick": args.quick,
        "device": str(DEVICE),
        "torch": torch.__version__,
        "cuda_version": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if CUDA else None,
        "gpu_capability": ".".join(map(str, torch.cuda.get_device_capability())) if CUDA else None,
        "bf16_supported": torch.cuda.is_bf16_supported() if CUDA else None,
        "machine": info,
    }
    print(json.dumps(header, indent=1, default=str), flush=True)
    if not CUDA:
        print("no CUDA: the checks against CUDA run on the CPU as a dry run of their code", flush=True)
    report = Report(out_dir / "cuda_check.json", header)
    report.write()
    for part, fn in (("1", part1), ("2", part2), ("3", part3)):
        if part in parts:
            print(f"\n######## part {part} at {time.perf_counter() - t0:.0f} s ########", flush=True)
            try:
                fn(report, args.quick)
            except Exception:
                traceback.print_exc()
    if "4" in parts:
        print(f"\n######## part 4 at {time.perf_counter() - t0:.0f} s ########", flush=True)
        try:
            part4(report, args.quick, out_dir, deadline)
        except Exception:
            traceback.print_exc()
    report.write()
    counts: dict[str, int] = {}
    for rows in report.parts.values():
        for r in rows:
            counts[r["status"]] = counts.get(r["status"], 0) + 1
    print(f"\nsummary: {counts}; {time.perf_counter() - t0:.0f} s; written to {report.path}")


if __name__ == "__main__":
    main()
