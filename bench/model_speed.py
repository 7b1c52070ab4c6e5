"""Forward + backward speed of aiayn's Transformer against torch.nn.Transformer, in one run.

Both models get the same shapes and the same surroundings: the base configuration of Table 3
(d_model 512, d_ff 2048, h 8, N = 6 + 6), a shared vocabulary of 8,000 tied to the output
projection, √d_model-scaled embeddings, sinusoidal positional encoding, dropout 0.1, the same
batches with source and target padding, and a cross-entropy loss over all target positions.

Reported: source + target (non-pad) tokens per second of one forward + backward pass, the
model FLOPs counted by torch.utils.flop_counter, and the fraction of this machine's fp32 matmul
peak (measured here, in the same run) that those FLOPs reach.

    python bench/model_speed.py [--batch 64] [--length 32] [--rounds 5] [--device cpu]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).parent))
from aiayn import ModelConfig, Transformer
from aiayn.model.embedding import sinusoidal_encoding
from common import machine, matmul_peak, median, table, time_call, write_result

VOCAB = 8000


class TorchTransformerLM(nn.Module):
    """torch.nn.Transformer with the same embeddings, positional encoding and tied projection."""

    def __init__(self, d_model: int, h: int, N: int, d_ff: int, dropout: float) -> None:
        super().__init__()
        self.d_model = d_model
        self.embedding = nn.Embedding(VOCAB, d_model)
        nn.init.normal_(self.embedding.weight, std=d_model**-0.5)
        self.register_buffer("pe", sinusoidal_encoding(1024, d_model), persistent=False)
        self.dropout = nn.Dropout(dropout)
        self.transformer = nn.Transformer(d_model, h, N, N, d_ff, dropout, batch_first=True)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.embedding(x) * math.sqrt(self.d_model) + self.pe[: x.size(1)])

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        T = tgt.size(1)
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool, device=tgt.device), 1)  # True = masked
        h = self.transformer(
            self.embed(src),
            self.embed(tgt),
            tgt_mask=causal,
            src_key_padding_mask=src == 0,
            tgt_key_padding_mask=tgt == 0,
            memory_key_padding_mask=src == 0,
            tgt_is_causal=True,
        )
        return F.linear(h, self.embedding.weight)


def make_batch(B: int, L: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random sentences of 7/8 L .. L tokens (as length-sorted token batches give), right-padded."""

    def side(length: int) -> torch.Tensor:
        x = torch.randint(3, VOCAB, (B, length), generator=generator)
        lengths = torch.randint(length * 7 // 8, length + 1, (B,), generator=generator)
        return x.masked_fill(torch.arange(length)[None] >= lengths[:, None], 0)

    src, tgt = side(L), side(L + 1)
    return src, tgt[:, :-1], tgt[:, 1:]


def step(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> None:
    src, tgt_in, tgt_out = batch
    logits = model(src, tgt_in)
    loss = F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=0)
    loss.backward()
    model.zero_grad(set_to_none=True)


def count_flops(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> int:
    with FlopCounterMode(display=False) as counter:
        step(model, batch)
    return counter.get_total_flops()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64, help="sentences per batch")
    parser.add_argument("--length", type=int, default=32, help="longest source/target sentence (tokens)")
    parser.add_argument("--rounds", type=int, default=5, help="timed steps per model (after 2 warm-up steps)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = args.device

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    batch = tuple(t.to(device) for t in make_batch(args.batch, args.length, generator))
    tokens = int((batch[0] != 0).sum() + (batch[1] != 0).sum())
    positions = batch[0].numel() + batch[1].numel()

    base = ModelConfig.base(VOCAB)
    models = {
        "aiayn Transformer (paper: dropout on sublayers and embeddings)": Transformer(base),
        "aiayn Transformer (+ dropout on attention and FFN, as torch)": Transformer(
            base.replace(attention_dropout=0.1, activation_dropout=0.1)
        ),
        "torch.nn.Transformer (+ same embeddings and projection)": TorchTransformerLM(512, 8, 6, 2048, 0.1),
    }
    peer = "torch.nn.Transformer (+ same embeddings and projection)"
    for model in models.values():
        model.to(device).train()

    print(f"measuring the fp32 matmul peak on {device} ...", flush=True)
    peak = matmul_peak(device)
    flops = {name: count_flops(model, batch) for name, model in models.items()}
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(2):
        for model in models.values():
            step(model, batch)
    for r in range(args.rounds):
        for name, model in models.items():  # interleaved, so drift affects all alike
            times[name].append(time_call(lambda m=model: step(m, batch), device))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{t[-1]:.2f} s" for t in times.values()), flush=True)

    rows = []
    peer_rate = tokens / median(times[peer])
    for name in models:
        seconds = median(times[name])
        rows.append(
            {
                "model": name,
                "params": sum(p.numel() for p in models[name].parameters()),
                "seconds_per_step": round(seconds, 3),
                "tokens_per_s": round(tokens / seconds, 1),
                "ratio_vs_torch": round(tokens / seconds / peer_rate, 3),
                "gflop_per_step": round(flops[name] / 1e9, 1),
                "mfu": round(flops[name] / seconds / peak, 3),
            }
        )
    result = {
        "benchmark": "model_speed",
        "command": "python " + " ".join(sys.argv),
        "machine": machine(),
        "device": device,
        "matmul_peak_gflops": round(peak / 1e9, 1),
        "batch": {"sentences": args.batch, "positions": positions, "tokens": tokens, "vocab": VOCAB},
        "rows": rows,
    }
    path = write_result(f"model_speed_{device}", result)
    print()
    print(
        f"fp32 matmul peak: {peak / 1e9:.1f} GFLOP/s; batch: {args.batch} sentences, {tokens} tokens "
        f"({positions} positions, {1 - tokens / positions:.1%} padding)"
    )
    print(
        table(
            rows,
            [
                ("model", "model"),
                ("tokens_per_s", "tokens/s"),
                ("ratio_vs_torch", "× torch"),
                ("seconds_per_step", "s/step"),
                ("gflop_per_step", "GFLOP/step"),
                ("mfu", "fraction of peak"),
            ],
        )
    )
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
