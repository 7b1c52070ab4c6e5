"""Synthetic tasks that exercise the whole model end to end.

The copy task: random symbol sequences mapped to themselves. A working encoder-decoder learns it
to 100% exact match in a few hundred steps; a broken mask, cache or positional encoding does not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .decode import greedy_decode
from .model import ModelConfig, Transformer
from .progress import progress_bar
from .train.schedule import inverse_sqrt_schedule

__all__ = ["CopyTask", "copy_task_batch", "copy_task_accuracy", "train_copy_task"]

FIRST_SYMBOL = 3  # ids 0, 1, 2 are pad, bos, eos


@dataclass(frozen=True)
class CopyTask:
    """Settings of a copy-task run: symbols, sequence length, and the training budget."""

    vocab_size: int = 16
    length: int = 10
    steps: int = 700
    batch_size: int = 128
    warmup: int = 100
    lr_scale: float = 0.5
    seed: int = 0


def copy_task_batch(batch_size: int, length: int, vocab_size: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Random sequences of symbols ``FIRST_SYMBOL .. vocab_size - 1`` with varying lengths
    (1 .. ``length``), right-padded. Returns ``src (B, length)`` and the target
    ``bos + src + eos`` ``(B, length + 2)``, both padded with 0."""
    symbols = torch.randint(FIRST_SYMBOL, vocab_size, (batch_size, length), generator=generator)
    lengths = torch.randint(1, length + 1, (batch_size,), generator=generator)
    positions = torch.arange(length)[None, :]
    src = symbols.masked_fill(positions >= lengths[:, None], 0)  # (B, length)
    tgt = torch.zeros(batch_size, length + 2, dtype=torch.long)
    tgt[:, 0] = 1
    tgt[:, 1 : length + 1] = src
    tgt[torch.arange(batch_size), lengths + 1] = 2
    return src, tgt


@torch.no_grad()
def copy_task_accuracy(model: Transformer, task: CopyTask, n: int = 256, seed: int = 12345) -> float:
    """Exact-match rate of greedy decoding on ``n`` fresh sequences."""
    model.eval()
    src, tgt = copy_task_batch(n, task.length, task.vocab_size, torch.Generator().manual_seed(seed))
    out = greedy_decode(model, src, max_len=task.length + 1)  # (n, L)
    expected = tgt[:, 1:]  # src + eos, padded
    width = max(out.size(1), expected.size(1))
    out = F.pad(out, (0, width - out.size(1)))
    expected = F.pad(expected, (0, width - expected.size(1)))
    return (out == expected).all(dim=1).float().mean().item()


def train_copy_task(
    task: CopyTask = CopyTask(), config: ModelConfig | None = None, progress: bool = False
) -> tuple[Transformer, list[float]]:
    """Train a small Transformer on the copy task with the paper's optimizer (Adam 0.9/0.98/1e-9,
    warmup then inverse-sqrt rate, label smoothing 0.1). Returns the model and the losses."""
    torch.manual_seed(task.seed)
    config = config or ModelConfig.tiny(task.vocab_size, d_model=64, d_ff=128, h=4, N=2)
    model = Transformer(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    schedule = inverse_sqrt_schedule(optimizer, config.d_model, task.warmup, task.lr_scale)
    generator = torch.Generator().manual_seed(task.seed)
    losses = []
    model.train()
    for _ in progress_bar(range(task.steps), desc="copy task", disable=not progress):
        src, tgt = copy_task_batch(task.batch_size, task.length, task.vocab_size, generator)
        logits = model(src, tgt[:, :-1])  # (B, T, V)
        loss = F.cross_entropy(
            logits.flatten(0, 1), tgt[:, 1:].flatten(), ignore_index=config.pad_id, label_smoothing=0.1
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    model.eval()
    return model, losses
