"""Decoding: generating target sequences from a trained model (§6.1).

Legend: B batch, S source length, L output length.

Greedy decoding runs on the KV cache: the encoder-decoder keys and values are computed once
per source, the self-attention keys and values grow one step at a time.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .model import Transformer

__all__ = ["greedy_decode"]


@torch.no_grad()
def greedy_decode(model: Transformer, src: Tensor, max_len: int | None = None) -> Tensor:
    """Pick the most likely token at every step until every sentence has produced EOS.

    Args:
        model: an encoder-decoder ``Transformer`` (put it in eval mode first).
        src: ``(B, S)`` source token ids, padded with ``config.pad_id``.
        max_len: the most output tokens; default S + 50 (§6.1).

    Returns:
        ``(B, L)`` output ids without BOS, each ending in EOS unless it hit ``max_len``;
        positions after EOS hold ``pad_id``.
    """
    config = model.config
    max_len = src.size(1) + 50 if max_len is None else max_len
    enc = model.encode(src)
    cache = model.init_cache(enc.memory, enc.mask)
    B = src.size(0)
    token = torch.full((B, 1), config.bos_id, dtype=torch.long, device=src.device)
    finished = torch.zeros(B, dtype=torch.bool, device=src.device)
    out = []
    for _ in range(max_len):
        logits = model.decode(token, cache=cache).logits[:, -1]  # (B, V)
        token = logits.argmax(dim=-1).masked_fill(finished, config.pad_id)  # (B,)
        out.append(token)
        finished |= token == config.eos_id
        token = token[:, None]
        if finished.all():
            break
    return torch.stack(out, dim=1) if out else src.new_empty(B, 0)
