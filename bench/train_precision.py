"""Training speed in bfloat16 autocast against float32, at the Ding preset's settings and a few
model widths, in one run: what ``train.amp: auto`` decides between (``aiayn/train/precision.py``).

Real Ding training batches as the trainer makes them (joint BPE of ``--vocab`` tokens, batches of
<= ``--max-tokens`` positions a side; the training sentences alone, or with ``--phrases 0.5`` the
preset's mix: a seeded draw of 0.5 dictionary phrase pairs per sentence pair, tagged, as in the
trainer's first epoch), a pre-norm encoder-decoder of ``--layers`` + ``--dec-layers``
layers (the preset's 1 + 5; 3 + 3 before it), d_ff = 4 d_model, ``--heads`` heads (the preset's 2; 4
before it), P_drop 0.1, label smoothing 0.1, Adam;
one training step = forward, backward and the update. The two precisions take their steps on the
same batches, alternating in blocks of ``--block`` steps after a warm-up, so that a slow spell of
the machine falls on both. Tokens/s
counts non-pad source + target tokens; each precision's model FLOPs are stated as a fraction of
its own matmul peak (fp32's, or bf16's, measured in the same run). It times the first ~100 steps
from initialisation, where bf16's lead was largest before its products ran on rows padded to a
multiple of 64 (``precision._CpuBf16``: until oneDNN's cache of per-shape kernels filled): the
trainer's over whole runs is ``bench/train_ab.py``'s to measure (at the preset on a Zen 4, before
the padding 1.28-1.31x against this bench's ~1.45x; with it 1.30-1.39x against 1.39x). Like the trainer
(since a6f7a8e), the bench keeps freed host memory for reuse (``aiayn/train/allocator.py``).

With ``--compare adam`` the variants are instead fp32 and bf16, each with Adam's multi-tensor
(foreach) update and with its fused CPU kernel (the trainer's): an A/B of the optimizer.
With ``--compare compile`` they are fp32 eager (the trainer's default), fp32 under
``torch.compile(model, dynamic=True)`` (``train.compile``) and bf16 under both; the table adds
the seconds the warm-up steps took, compiling included.

With ``--compare loss`` the four variants are fp32 and bf16, each with the loss by torch's
operations (``AIAYN_CPU_KERNELS=0``) and by the C++ loss kernel (``aiayn.engine.kernels``): an
A/B of the kernel in both precisions.

With ``--profile N`` each variant then takes N more steps under ``torch.profiler``: the rows add
the seconds of the matrix products (``aten::mm``, ``addmm``, ``bmm``) and of the copies
(``aten::copy_``: autocast's casts among them) as fractions of the profiled CPU time, and the
products' speed-up over fp32's; with them, the most a faster product could give
(1 / (1 - products)) is read off the table. With ``--compare precision``, the last column,
``if_rest_as_fp32``, is the profiled gain bf16 would have if its time outside the products
were fp32's: fp32's profiled time over bf16's products plus fp32's time outside them (autocast's
casts and copies free, the products as fast as measured, padded rows included); against the
profiled times' own ratio, it says what bf16 loses outside its products.

    python bench/train_precision.py [--d-model 128 256 512] [--steps 30] [--compare precision|adam|compile|loss]
        [--profile 20] [--phrases 0.5]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from aiayn import ModelConfig, Transformer
from aiayn.data.batching import TokenBatcher
from aiayn.data.tokenizer import Tokenizer
from aiayn.train.allocator import keep_freed_memory
from aiayn.train.config import RunConfig
from aiayn.train.data import load_phrases, sample_phrases
from aiayn.train.objectives import Translation
from aiayn.train.precision import Precision, native_bf16
from common import bf16_peak, machine, matmul_peak, table, write_result

DATA = Path(__file__).parent.parent / "data" / "ding"
PRESET = RunConfig.from_yaml(Path(__file__).parent.parent / "configs" / "ding.yaml")


def useful_flops(model: Transformer, batch) -> int:
    """Model FLOPs of a training step at non-pad positions: 6 per parameter and token (forward and
    backward products), the encoder's at source tokens, the decoder's and the output projection's
    at target tokens; attention scores left out."""
    encoder = sum(p.numel() for p in model.encoder.parameters())
    decoder = sum(p.numel() for p in model.decoder.parameters()) + model.config.vocab_size * model.config.d_model
    return 6 * (encoder * batch.num_src_tokens + decoder * batch.num_tokens)


def profile_steps(step, batches: list) -> dict[str, float]:
    """Seconds of self CPU time under ``torch.profiler`` while ``step`` takes ``batches``: in
    all, in the matrix products and in ``aten::copy_`` (none: nothing profiled)."""
    if not batches:
        return {"total": 0.0, "products": 0.0, "copies": 0.0}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for batch in batches:
            step(batch)
    events = prof.key_averages()
    seconds = {e.key: e.self_cpu_time_total / 1e6 for e in events}
    return {
        "total": sum(seconds.values()),
        "products": sum(seconds.get(k, 0.0) for k in ("aten::mm", "aten::addmm", "aten::bmm")),
        "copies": seconds.get("aten::copy_", 0.0),
    }


def ding_batches(vocab: int, max_tokens: int, count: int, phrases: float = 0.0) -> tuple[list, int]:
    """The first ``count`` batches of a shuffled epoch: the training sentences and, with ``phrases``
    > 0, that many of Ding's phrase pairs per sentence pair (a seeded draw, as the trainer's epoch
    0 has; ``<phrase>``-tagged where the preset tags them); the BPE learnt on what is batched."""
    src = (DATA / "train.de").read_text(encoding="utf-8").splitlines()
    tgt = (DATA / "train.en").read_text(encoding="utf-8").splitlines()
    pairs = list(zip(src, tgt, strict=True))
    pool = load_phrases(PRESET.data, log=lambda _: None) if phrases > 0 else []
    extra = sample_phrases(pool, phrases, len(pairs), PRESET.train.seed)
    tag = bool(extra) and PRESET.data.phrase_tag
    tokenizer = Tokenizer.train([text for pair in pairs + extra for text in pair], vocab, phrase_tag=tag)
    objective = Translation()
    examples, _ = objective.encode(tokenizer, pairs, PRESET.data.max_len)
    drawn, _ = objective.encode(tokenizer, extra, PRESET.data.max_len - tag)
    examples += [([tokenizer.phrase_id, *s], t) if tag else (s, t) for s, t in drawn]
    batches = TokenBatcher(objective.lengths(examples), max_tokens, seed=0).epoch(0)[:count]
    config = ModelConfig.tiny(tokenizer.vocab_size)
    return [objective.collate([examples[i] for i in b], config, 0) for b in batches], tokenizer.vocab_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-model", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per precision and width")
    parser.add_argument("--block", type=int, default=5, help="steps per turn")
    parser.add_argument("--vocab", type=int, default=PRESET.train.vocab_size, help="joint BPE size (the preset's)")
    parser.add_argument("--max-tokens", type=int, default=PRESET.train.max_tokens, help="per side (the preset's)")
    parser.add_argument("--heads", type=int, default=PRESET.model["h"], help="h, the heads (the preset's)")
    parser.add_argument("--layers", type=int, default=PRESET.model["N"], help="the encoder's layers (the preset's)")
    parser.add_argument(
        "--dec-layers", type=int, default=PRESET.model.get("N_dec"),
        help="the decoder's layers (the preset's, also when --layers is given)",
    )  # fmt: skip
    parser.add_argument("--adam", choices=["foreach", "fused"], default="fused", help="Adam's CPU implementation")
    parser.add_argument(
        "--compare", choices=["precision", "adam", "compile", "loss"], default="precision",
        help="precision: fp32 against bf16 (with --adam); adam: fp32 and bf16, each with foreach and fused Adam; "
        "compile: fp32 eager against fp32 and bf16 under torch.compile; loss: fp32 and bf16 with torch's "
        "loss and with the C++ loss kernel",
    )  # fmt: skip
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="profile N more steps per variant (0: off)")
    parser.add_argument(
        "--phrases", type=float, default=0.0,
        help=f"phrase pairs per sentence pair mixed into the batches (the preset's: {PRESET.data.phrases:g})",
    )  # fmt: skip
    args = parser.parse_args()
    device = torch.device("cpu")
    print(f"freed host memory: {keep_freed_memory()}")  # as the trainer does
    print("measuring the matmul peaks ...", flush=True)
    peak32, peak16 = matmul_peak(), bf16_peak()
    peaks = {"fp32": peak32, "bf16": peak16}
    print(f"fp32 {peak32 / 1e9:.0f} GFLOP/s, bf16 {peak16 / 1e9:.0f} GFLOP/s; native bf16: {native_bf16(device)}")
    batches, vocab = ding_batches(args.vocab, args.max_tokens, args.steps + args.block, args.phrases)
    objective = Translation()
    rows = []
    for d_model in args.d_model:
        config = ModelConfig(
            vocab_size=vocab, N=args.layers, N_dec=args.dec_layers, d_model=d_model, d_ff=4 * d_model, h=args.heads,
            P_drop=0.1, norm_first=True,
        )  # fmt: skip
        runs = {}
        variants = {"fp32": ("fp32", args.adam, False), "bf16": ("bf16", args.adam, False)}
        kernel = {}  # variant -> whether the loss kernel runs (unset: as the environment says)
        if args.compare == "adam":
            variants = {
                "fp32": ("fp32", "foreach", False), "fp32, fused Adam": ("fp32", "fused", False),
                "bf16": ("bf16", "foreach", False), "bf16, fused Adam": ("bf16", "fused", False),
            }  # fmt: skip
        if args.compare == "compile":
            variants = {
                "fp32": ("fp32", args.adam, False), "fp32, compiled": ("fp32", args.adam, True),
                "bf16, compiled": ("bf16", args.adam, True),
            }  # fmt: skip
        if args.compare == "loss":
            variants = {
                "fp32, torch's loss": ("fp32", args.adam, False), "fp32, loss kernel": ("fp32", args.adam, False),
                "bf16, torch's loss": ("bf16", args.adam, False), "bf16, loss kernel": ("bf16", args.adam, False),
            }  # fmt: skip
            kernel = {name: name.endswith("kernel") for name in variants}
        for name, (precision, adam, compiled) in variants.items():
            torch.manual_seed(0)
            model = Transformer(config).train()
            fused = adam == "fused"
            optimizer = torch.optim.Adam(
                model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=fused, foreach=not fused
            )  # fmt: skip
            forward = torch.compile(model, dynamic=True) if compiled else model
            runs[name] = (model, optimizer, Precision(precision, "bench").autocast(device), [0.0, 0, 0, 0.0], forward)

        def step(name: str, batch, runs=runs, kernel=kernel) -> None:
            _, optimizer, amp, _, forward = runs[name]
            if name in kernel:
                os.environ["AIAYN_CPU_KERNELS"] = "1" if kernel[name] else "0"
            loss, _ = objective.loss(forward, batch, 0.1, amp)
            (loss / batch.num_tokens).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        print(f"d_model {d_model}: warm-up ...", flush=True)
        for name in runs:
            t0 = time.perf_counter()
            for batch in batches[: args.block]:
                step(name, batch)
            runs[name][3][3] = time.perf_counter() - t0
        timed = batches[args.block :]
        for start in range(0, len(timed), args.block):
            for name in runs:
                for batch in timed[start : start + args.block]:
                    t0 = time.perf_counter()
                    step(name, batch)
                    runs[name][3][0] += time.perf_counter() - t0
                    runs[name][3][1] += batch.num_positions
                    runs[name][3][2] += useful_flops(runs[name][0], batch)
        profiles = {name: profile_steps(lambda b, name=name: step(name, b), timed[: args.profile]) for name in runs}
        rate = {name: r[3][1] / r[3][0] for name, r in runs.items()}
        steps = len(timed)
        params = sum(p.numel() for p in next(iter(runs.values()))[0].parameters())
        for name in runs:
            rows.append(
                {
                    "d_model": d_model, "precision": name, "params": params, "tokens_per_s": round(rate[name]),
                    "steps_per_s": round(steps / runs[name][3][0], 2),
                    "ratio_vs_fp32": round(rate[name] / rate[next(iter(runs))], 2),
                    "mfu": round(runs[name][3][2] / runs[name][3][0] / peaks[variants[name][0]], 3),
                    "warmup_s": round(runs[name][3][3], 1),
                }
            )  # fmt: skip
            if args.profile:
                prof, base = profiles[name], profiles[next(iter(runs))]
                rows[-1].update(
                    profiled_s=round(prof["total"], 2), products=round(prof["products"] / prof["total"], 3),
                    copies=round(prof["copies"] / prof["total"], 3),
                    products_speedup=round(base["products"] / prof["products"], 2),
                )  # fmt: skip
                if args.compare == "precision" and name != next(iter(runs)):
                    rest = base["total"] - base["products"]  # fp32's profiled time outside the products
                    rows[-1]["if_rest_as_fp32"] = round(base["total"] / (rest + prof["products"]), 2)
        short = [("d_model", "d_model"), ("precision", "precision"), ("tokens_per_s", "tokens/s"),
                 ("ratio_vs_fp32", "× fp32")]  # fmt: skip
        print(table(rows[-len(runs) :], short), flush=True)
    name = {"precision": "train_precision", "adam": "train_adam", "compile": "train_compile", "loss": "train_loss"}[
        args.compare
    ]
    result = {
        "benchmark": name, "command": "python " + " ".join(sys.argv), "machine": machine(),
        "native_bf16": native_bf16(device), "layers": [args.layers, args.dec_layers], "heads": args.heads,
        "phrases": args.phrases,
        "matmul_peak_gflops": round(peak32 / 1e9, 1),
        "bf16_matmul_peak_gflops": round(peak16 / 1e9, 1), "rows": rows,
    }  # fmt: skip
    path = write_result(name, result)
    print()
    columns = [("d_model", "d_model"), ("params", "parameters"), ("precision", "precision"),
               ("tokens_per_s", "tokens/s"), ("steps_per_s", "steps/s"), ("ratio_vs_fp32", "× fp32"),
               ("mfu", "of its precision's peak"), ("warmup_s", f"first {args.block} steps, s")]  # fmt: skip
    if args.profile:
        columns += [("profiled_s", f"profiled CPU s ({args.profile} steps)"), ("products", "products"),
                    ("copies", "copies"), ("products_speedup", "products × fp32"),
                    ("if_rest_as_fp32", "× fp32 if the rest took fp32's time")]  # fmt: skip
    print(table(rows, columns))
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
