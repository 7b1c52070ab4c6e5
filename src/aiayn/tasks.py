"""Synthetic tasks that exercise the whole model end to end.

The copy task: random symbol sequences mapped to themselves. A working encoder-decoder learns it
to 100% exact match in a few hundred steps; a broken mask, cache or positional encoding does not.
As in §6.1, the model returned is the average of the last snapshots of training: the last step's
weights alone still move with the rate and miss some sequences (98.6-100% exact match over six
seeds, against 100% for the average of the last 10 snapshots, 20 steps apart; measured with
torch's cross-entropy before the copy task took the trainer's loss, the same function).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .decode import greedy_decode
from .model import ModelConfig, Transformer
from .progress import progress_bar
from .train.loss import label_smoothed_loss
from .train.precision import Precision
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
    average_last: int = 10  # snapshots averaged into the returned model (§6.1); 1 = the last step's
    average_every: int = 20  # steps between them, the last one at the final step

    def __post_init__(self) -> None:
        for name, least in (("steps", 0), ("batch_size", 1), ("average_last", 1), ("average_every", 1)):
            if getattr(self, name) < least:
                raise ValueError(f"CopyTask.{name} must be >= {least}, got {getattr(self, name)}")


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
    task: CopyTask = CopyTask(), config: ModelConfig | None = None, progress: bool = False, amp: bool = False
) -> tuple[Transformer, list[float]]:
    """Train a small Transformer on the copy task with the paper's optimizer (Adam 0.9/0.98/1e-9,
    warmup then inverse-sqrt rate, label smoothing 0.1). Returns the model, its parameters the mean
    of ``task.average_last`` snapshots ``task.average_every`` steps apart ending at the last step
    (fewer when training is shorter; §6.1), and the losses. The loss is the trainer's
    (``train/loss.py``) over the non-pad targets, per target token. ``amp``: the forward pass in
    the trainer's bfloat16 context (``train.amp true``: ``Precision.autocast``, on the CPU its
    own kernel for every linear layer; the copy task's products have 1,280 and 1,408 rows at the
    defaults, multiples of its ``ROWS``, so none is padded) and the loss reading the bfloat16
    logits; parameters, gradients and Adam's state stay float32."""
    torch.manual_seed(task.seed)
    config = config or ModelConfig.tiny(task.vocab_size, d_model=64, d_ff=128, h=4, N=2)
    model = Transformer(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    schedule = inverse_sqrt_schedule(optimizer, config.d_model, task.warmup, task.lr_scale)
    generator = torch.Generator().manual_seed(task.seed)
    precision = Precision("bf16" if amp else "fp32", "copy task")
    context = precision.autocast(torch.device("cpu"))  # reusable: entered at every step
    losses = []
    total: dict[str, Tensor] = {}  # sum of the snapshots, in float64
    snapshots = 0
    model.train()
    for step in progress_bar(range(1, task.steps + 1), desc="copy task", disable=not progress):
        src, tgt = copy_task_batch(task.batch_size, task.length, task.vocab_size, generator)
        # the context around the forward pass only, as in the trainer: the products of the
        # decoding after training run without it, and under plain autocast (AIAYN_BF16_ROWS=0)
        # the bfloat16 copies of the weights are kept until it is left
        with context:
            logits = model(src, tgt[:, :-1])  # (B, T, V)
        target = tgt[:, 1:].flatten()  # (B·T,)
        real = target != config.pad_id
        loss, _ = label_smoothed_loss(logits.flatten(0, 1)[real], target[real], 0.1)
        loss = loss / real.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        back = task.steps - step
        if back % task.average_every == 0 and back // task.average_every < task.average_last:
            with torch.no_grad():
                for name, tensor in model.state_dict().items():
                    total[name] = total.get(name, 0) + tensor.double()
            snapshots += 1
    if snapshots > 1:
        state = model.state_dict()
        model.load_state_dict({name: (tensor / snapshots).to(state[name].dtype) for name, tensor in total.items()})
    model.eval()
    return model, losses
