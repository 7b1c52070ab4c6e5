"""Decoding: generating target sequences from a trained model (§6.1).

Legend: B batch, S source length, L output length.

Greedy decoding runs on the KV cache: the encoder-decoder keys and values are computed once
per source, the self-attention keys and values grow one step at a time.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .model import Transformer

__all__ = ["greedy_decode", "translate_ids"]


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


@torch.no_grad()
def translate_ids(
    model: Transformer, sources: list[list[int]], max_tokens: int = 4096, max_len_a: int = 50
) -> list[list[int]]:
    """Greedy-decode many sources (token ids without EOS), batched by length; results in input order.

    Each batch holds at most ``max_tokens`` source positions; outputs are cut at EOS (exclusive).
    """
    config = model.config
    device = next(model.parameters()).device
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    results: list[list[int]] = [[] for _ in sources]
    start = 0
    while start < len(order):
        end = start + 1
        while end < len(order) and (end - start + 1) * (len(sources[order[end]]) + 1) <= max_tokens:
            end += 1
        batch = order[start:end]
        longest = max(len(sources[i]) for i in batch) + 1
        src = torch.full((len(batch), longest), config.pad_id, dtype=torch.long)
        for row, i in enumerate(batch):
            src[row, : len(sources[i]) + 1] = torch.tensor([*sources[i], config.eos_id])
        out = greedy_decode(model, src.to(device), max_len=longest + max_len_a).tolist()
        for row, i in enumerate(batch):
            ids = out[row]
            results[i] = ids[: ids.index(config.eos_id)] if config.eos_id in ids else ids
        start = end
    return results
