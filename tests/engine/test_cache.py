"""The engine's cache (engine/cache.py) under beam search's life: K beams sharing one row of the
source K/V, gathered by parent within each sentence, a finished sentence dropped, past the
reserved capacity; against teacher forcing on an explicitly replicated batch, with random
parameters. And its reserved ``(B, H, capacity, D)`` buffers, never reallocated within the
reserve."""

import pytest
import torch

from aiayn import engine
from aiayn.engine.step import Decoding
from helpers import random_model

V = 29


def padded_source() -> torch.Tensor:
    src = torch.randint(3, V, (3, 9), generator=torch.Generator().manual_seed(1))
    for b, length in enumerate([9, 5, 2]):
        src[b, length:] = 0
    return src


def feed(state: Decoding, tokens: torch.Tensor) -> torch.Tensor:
    """Logits ``(R, T, V)`` of feeding ``tokens`` ``(R, T)`` one position at a time."""
    return torch.stack([state(tokens[:, t]) for t in range(tokens.size(1))], dim=1)


@pytest.mark.parametrize("variant", [{}, {"norm_first": True}])
def test_beams_reorder_and_drop_equal_the_replicated_batch(variant):
    model = random_model(vocab_size=V, **variant)
    prepared, src, K = engine.prepare(model), padded_source(), 2
    g = torch.Generator().manual_seed(3)
    cont1, cont2, cont3 = (torch.randint(3, V, (n, L), generator=g) for n, L in ((6, 5), (6, 5), (4, 20)))
    parents = torch.tensor([1, 1, 2, 3, 5, 4])  # rows stay within their sentence's two beams
    keep = torch.tensor([0, 1, 5, 4])  # sentence 1 finished; sentence 2's beams swapped
    with torch.no_grad():
        state = Decoding(prepared, src, beam=K, steps=12)
        cache = state.cache
        assert cache.self_attn[0].reserved == 12 and cache.group == K
        assert cache.cross_attn[0].k.size(0) == 3 and cache.memory_mask.size(0) == 3  # one copy per sentence
        got1 = feed(state, cont1)
        assert cache.self_attn[0]._k.size(2) == 16  # reserved 12, at least 16
        state.reorder(parents, sentences_changed=False)
        got2 = feed(state, cont2)
        state.reorder(keep, sentences_changed=True)
        assert cache.cross_attn[0].k.size(0) == 2 and cache.memory_mask.size(0) == 2
        got3 = feed(state, cont3)  # 30 positions: past the 16 allocated, the buffers grow
        rows = torch.arange(3).repeat_interleave(K)
        hist1, src1 = cont1, src[rows]
        hist2, src2 = torch.cat([hist1[parents], cont2], 1), src1[parents]
        hist3, src3 = torch.cat([hist2[keep], cont3], 1), src2[keep]
        want = [model(src1, hist1), model(src2, hist2)[:, 5:], model(src3, hist3)[:, 10:]]
    for got, expected in zip([got1, got2, got3], want, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_expand_rejects_a_group_below_one_and_a_batch_that_does_not_fill_the_groups():
    prepared = engine.prepare(random_model(vocab_size=V))
    with torch.no_grad():
        state = Decoding(prepared, padded_source(), beam=2, steps=4)
        with pytest.raises(ValueError, match="at least 1"):
            state.cache.expand(0)
        with pytest.raises(ValueError, match="5 query rows do not fill 3 cached rows of 2 beams"):
            state(torch.full((5,), 1))


@torch.no_grad()
def test_the_cache_holds_what_was_appended_in_reserved_buffers():
    """Buffers (B, H, capacity, D) reserved for the output: the (B, H, L, D) views hold exactly
    what was appended, before and after a reorder, and no append re-allocates them."""
    model = random_model(vocab_size=V)
    H, D = model.config.h, model.config.d_k
    state = Decoding(engine.prepare(model), padded_source(), beam=1, steps=5)
    appended, buffers = [], []
    for t in range(5):
        state(torch.randint(3, V, (3,), generator=torch.Generator().manual_seed(t)))
        appended.append(state.cache.self_attn[0].k[:, :, -1:].clone())  # (B, H, 1, D) the new keys
        buffers.append(state.cache.self_attn[0]._k.data_ptr())
    assert len(set(buffers)) == 1  # reserved at the first step
    state.reorder(torch.tensor([2, 0, 0]))
    for layer_cache in state.cache.self_attn + state.cache.cross_attn:
        assert layer_cache.k.shape[1::2] == (H, D) and layer_cache.k.stride(-1) == 1
    assert torch.equal(state.cache.self_attn[0].k, torch.cat(appended, dim=2)[[2, 0, 0]])
