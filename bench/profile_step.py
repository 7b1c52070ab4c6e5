"""Where the time of one training step goes: torch.profiler tables for aiayn and torch.nn.Transformer
at the shapes of bench/model_speed.py.

    python bench/profile_step.py [--model aiayn|torch|both] [--rows 25]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from aiayn import ModelConfig, Transformer
from model_speed import VOCAB, TorchTransformerLM, make_batch, step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["aiayn", "torch", "both"], default="both")
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=32)
    args = parser.parse_args()
    torch.manual_seed(0)
    batch = make_batch(args.batch, args.length, torch.Generator().manual_seed(0))
    models = {}
    if args.model in ("aiayn", "both"):
        models["aiayn"] = Transformer(ModelConfig.base(VOCAB))
    if args.model in ("torch", "both"):
        models["torch"] = TorchTransformerLM(512, 8, 6, 2048, 0.1)
    for name, model in models.items():
        model.train()
        step(model, batch)  # warm up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(model, batch)
        print(f"\n=== {name} ===")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=50))


if __name__ == "__main__":
    main()
