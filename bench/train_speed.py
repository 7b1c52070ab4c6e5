"""Training speed (forward, backward, Adam step) of aiayn against Hugging Face's MarianMTModel and
torch.nn.Transformer at the base shape, in one run.

Two settings:
- ``equal``: the same padded batch for every model (64 sentences of 28-32 tokens a side, 4,096
  positions), each model computing what its usual training loop computes: aiayn its logits only at
  non-pad target positions, Marian and torch.nn.Transformer at every position;
- ``ding``: real Ding training batches. aiayn uses its token-based batches (length-sorted buckets
  of <= 4,096 positions a side); the peers get the same sentences in random order, as a plain
  shuffled DataLoader of the same number of sentences per batch gives them, padded to the longest.

All models: d_model 512, d_ff 2048, h 8, 6 + 6 layers, ReLU, vocabulary 8,000 shared and tied,
√d_model-scaled embeddings, sinusoidal positions, dropout 0.1 on sublayers and embeddings,
label-smoothed cross-entropy (0.1), Adam (0.9, 0.98, 1e-9). Each model runs in its own process,
so its peak memory (max RSS) is its own. Tokens/s counts non-pad source + target tokens. With
``--interleave`` (equal batches) the three processes stay alive and take their timed steps in
turn, so that slow spells of a shared machine fall on every model alike.

``--precision bf16`` runs every model's forward pass under ``torch.autocast(dtype=bfloat16)``
(parameters and Adam fp32), as ``train.amp`` does: aiayn's label-smoothed loss in fp32 outside
the autocast region, as its trainer computes it; the peers' cross-entropy inside it, as their
usual loops do (autocast runs it in fp32). The default is both precisions where the CPU has
native bf16 (AMX or AVX512_BF16), fp32 elsewhere. MFU is against each precision's own peak.

    python bench/train_speed.py [--setting equal|ding|both] [--precision fp32|bf16|both] [--steps 4] [--interleave]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from aiayn import ModelConfig, Transformer
from aiayn.data.batching import Batch, TokenBatcher, collate
from aiayn.train.loss import label_smoothed_loss
from aiayn.train.precision import Precision, native_bf16
from common import bf16_peak, machine, matmul_peak, median, table, write_result
from model_speed import VOCAB, TorchTransformerLM, make_batch

MODELS = ["aiayn", "marian", "torch"]


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "aiayn":
        return Transformer(ModelConfig.base(VOCAB))
    if name == "torch":
        return TorchTransformerLM(512, 8, 6, 2048, 0.1)
    from transformers import MarianConfig, MarianMTModel

    config = MarianConfig(
        vocab_size=VOCAB, d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
        decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048, activation_function="relu",
        dropout=0.1, attention_dropout=0.0, activation_dropout=0.0, scale_embedding=True, pad_token_id=0,
        eos_token_id=2, decoder_start_token_id=1, max_position_embeddings=512, share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True,
    )  # fmt: skip
    return MarianMTModel(config)


def loss_of(name: str, model: torch.nn.Module, batch: Batch, amp: contextlib.AbstractContextManager) -> torch.Tensor:
    if name == "aiayn":  # as Translation.loss: the forward under autocast, the loss in fp32
        select = batch.tgt_out != 0
        with amp:
            logits = model(batch.src, batch.tgt_in, select=select)  # only at non-pad targets
        loss, _ = label_smoothed_loss(logits, batch.tgt_out[select], 0.1)
        return loss / logits.shape[0]
    with amp:
        if name == "torch":
            logits = model(batch.src, batch.tgt_in).flatten(0, 1)
        else:
            logits = model(
                input_ids=batch.src, attention_mask=batch.src != 0, decoder_input_ids=batch.tgt_in,
                decoder_attention_mask=batch.tgt_in != 0,
            ).logits.flatten(0, 1)  # fmt: skip
        return F.cross_entropy(logits, batch.tgt_out.flatten(), ignore_index=0, label_smoothing=0.1)


def ding_batches(n_batches: int) -> tuple[list[Batch], list[Batch]]:
    """Token batches for aiayn, and the same number of sentences per batch in random order for the peers."""
    from aiayn.data.ding import find_ding, parse_ding, split_ding
    from aiayn.data.tokenizer import Tokenizer

    train = split_ding(parse_ding(find_ding(download=False)).sentences)["train"]
    tokenizer = Tokenizer.train((t for pair in train for t in pair), vocab_size=VOCAB)
    src = tokenizer.encode_batch([s for s, _ in train])
    tgt = tokenizer.encode_batch([t for _, t in train])
    examples = list(zip(src, tgt, strict=True))
    batcher = TokenBatcher([(len(s) + 1, len(t) + 1) for s, t in examples], 4096, seed=0)
    chosen = batcher.epoch(0)[:n_batches]
    ours = [collate([examples[i] for i in b], 0, 1, 2) for b in chosen]
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(examples), generator=g).tolist()
    theirs, start = [], 0
    for b in chosen:  # same sentence counts, random sentences (a shuffled DataLoader)
        theirs.append(collate([examples[i] for i in perm[start : start + len(b)]], 0, 1, 2))
        start += len(b)
    return ours, theirs


ENCODER_LAYERS, DECODER_LAYERS = 6 * 3_152_384, 6 * 4_204_032  # parameters at the base shape (docs/model.md)


def useful_flops(src_tokens: int, tgt_tokens: int) -> int:
    """Model FLOPs of a training step at non-pad positions: 6 per parameter and token (forward +
    backward matmuls), the output projection at target tokens only; attention scores left out."""
    return 6 * (ENCODER_LAYERS * src_tokens + (DECODER_LAYERS + 512 * VOCAB) * tgt_tokens)


def worker(name: str, setting: str, steps: int, interleave: bool = False, precision: str = "fp32") -> dict:
    """Time ``steps`` training steps of one model after a warm-up step. With ``interleave`` the
    worker says ``ready`` after the warm-up and then runs one step per ``step`` line on stdin
    (answering ``ok``), so the parent can alternate the models step by step."""
    amp = Precision(precision, "bench").autocast(torch.device("cpu"))
    model = build(name).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
    if setting == "equal":
        src, tgt_in, tgt_out = make_batch(64, 32, torch.Generator().manual_seed(0))
        batches = [Batch(src, tgt_in, tgt_out, 0)] * (steps + 1)
    else:
        ours, theirs = ding_batches(steps + 1)
        batches = ours if name == "aiayn" else theirs
    times, tokens, positions, flops = [], [], [], []
    for i, batch in enumerate(batches):
        if interleave and i == 1:
            print("ready", flush=True)
        if interleave and i > 0 and sys.stdin.readline().strip() != "step":
            break
        start = time.perf_counter()
        loss = loss_of(name, model, batch, amp)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i > 0:  # the first step warms up
            times.append(time.perf_counter() - start)
            tokens.append(batch.num_tokens + batch.num_src_tokens)
            positions.append(batch.src.numel() + batch.tgt_out.numel())
            flops.append(useful_flops(batch.num_src_tokens, batch.num_tokens))
            if interleave:
                print("ok", flush=True)
    return {
        "seconds": times, "tokens": tokens, "positions": positions, "flops": flops,
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "params": sum(p.numel() for p in model.parameters()),
    }  # fmt: skip


def run_interleaved(setting: str, steps: int, precision: str) -> dict[str, dict]:
    """One worker process per model, all alive at once, their timed steps taken in turn
    (aiayn, Marian, torch, aiayn, ...), so that a slow spell of the machine falls on every model."""
    procs = {}
    for name in MODELS:  # set up one after the other: building and warming up are not timed
        print(f"{setting}: {name} (set up) ...", flush=True)
        cmd = [sys.executable, __file__, "--worker", name, setting, "--steps", str(steps), "--interleave",
               "--precision", precision]  # fmt: skip
        procs[name] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if procs[name].stdout.readline().strip() != "ready":
            raise RuntimeError(f"the {name} worker did not start")
    for step in range(steps):
        print(f"{setting}: step {step + 1}/{steps} of each model ...", flush=True)
        for name, proc in procs.items():
            proc.stdin.write("step\n")
            proc.stdin.flush()
            if proc.stdout.readline().strip() != "ok":
                raise RuntimeError(f"the {name} worker failed at step {step + 1}")
    results = {}
    for name, proc in procs.items():
        out, _ = proc.communicate("")
        results[name] = json.loads(out.strip().splitlines()[-1])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", choices=["equal", "ding", "both"], default="both")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per model and setting")
    parser.add_argument(
        "--precision", choices=["fp32", "bf16", "both"],
        help="default: both where the CPU has native bf16 (AMX, AVX512_BF16), else fp32",
    )  # fmt: skip
    parser.add_argument(
        "--interleave", action="store_true",
        help="keep one process per model alive and alternate their steps (equal batches only: the "
        "three models' memory must fit at once)",
    )  # fmt: skip
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "SETTING"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, args.steps, args.interleave, args.precision or "fp32")))
        return
    settings = ["equal", "ding"] if args.setting == "both" else [args.setting]
    native = native_bf16(torch.device("cpu"))
    precisions = {None: ["fp32", "bf16"] if native else ["fp32"], "both": ["fp32", "bf16"]}.get(
        args.precision, [args.precision]
    )  # fmt: skip
    if "bf16" in precisions and not native:
        print("warning: this CPU has no native bf16 (AMX, AVX512_BF16): bf16 products are emulated", flush=True)
    print("measuring the matmul peaks ...", flush=True)
    peaks = {"fp32": matmul_peak(), **({"bf16": bf16_peak()} if "bf16" in precisions else {})}
    rows = []
    for setting in settings:
        for precision in precisions:
            results = {}
            if args.interleave and setting == "equal":
                results = run_interleaved(setting, args.steps, precision)
            for name in MODELS if not results else []:
                print(f"{setting}, {precision}: {name} ...", flush=True)
                out = subprocess.run(
                    [sys.executable, __file__, "--worker", name, setting, "--steps", str(args.steps),
                     "--precision", precision],
                    capture_output=True, text=True, check=True,
                )  # fmt: skip
                results[name] = json.loads(out.stdout.strip().splitlines()[-1])
            rates = {n: sum(r["tokens"]) / sum(r["seconds"]) for n, r in results.items()}
            for name, r in results.items():
                rows.append(
                    {
                        "setting": setting, "precision": precision, "model": name,
                        "tokens_per_s": round(rates[name], 1),
                        "ratio_vs_marian": round(rates[name] / rates["marian"], 3),
                        "median_step_s": round(median(r["seconds"]), 3),
                        "padding": round(1 - sum(r["tokens"]) / sum(r["positions"]), 3),
                        "mfu": round(sum(r["flops"]) / sum(r["seconds"]) / peaks[precision], 3),
                        "peak_rss_mib": round(r["max_rss_mib"]), "params": r["params"],
                    }
                )  # fmt: skip
    result = {
        "benchmark": "train_speed", "command": "python " + " ".join(sys.argv), "machine": machine(),
        "native_bf16": native, "matmul_peak_gflops": round(peaks["fp32"] / 1e9, 1),
        **({"bf16_matmul_peak_gflops": round(peaks["bf16"] / 1e9, 1)} if "bf16" in peaks else {}), "rows": rows,
    }  # fmt: skip
    path = write_result("train_speed", result)
    print("\n" + ", ".join(f"{p} matmul peak: {v / 1e9:.1f} GFLOP/s" for p, v in peaks.items()))
    columns = [("setting", "batches"), ("precision", "precision"), ("model", "model"), ("tokens_per_s", "tokens/s"),
               ("ratio_vs_marian", "× Marian"), ("median_step_s", "s/step"), ("padding", "padding"),
               ("mfu", "MFU"), ("peak_rss_mib", "peak RSS MiB")]  # fmt: skip
    print(table(rows, columns))
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
