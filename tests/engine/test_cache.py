"""The engine's cache (engine/cache.py) under beam search's life: K beams sharing one row of the
source K/V, gathered by parent within each sentence, a finished sentence dropped, past the
reserved capacity; against teacher forcing on an explicitly replicated batch, with random
parameters. And its reserved ``(B, H, capacity, D)`` buffers, never reallocated within the
reserve. And rows joining while others decode (continuous batching: ``Decoding.add``), each at
its own position, against each row's teacher forcing alone: the source K/V trimmed after a long
source leaves, the leading self-attention positions no row attends to dropped."""

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


# Rows joining while others decode (continuous batching: Decoding.add, EngineCache.add_rows) -----

JOINING = {
    "post-norm": {},
    "pre-norm": {"norm_first": True},
    # converted from Marian: the decoder starts from the padding id, real at position 0
    "marian's": {"activation": "silu", "output_bias": True, "bos_id": 0},
}


class Truth:
    """Teacher forcing, row by row: each decoder row's own source (unpadded) and the tokens it has
    been fed, checked against ``model(source, tokens)`` as if the row were decoded alone."""

    def __init__(self, model) -> None:
        self.model, self.rows = model, []  # rows: [(source (S,), tokens fed)]

    def add(self, src: torch.Tensor, beam: int = 1) -> None:
        for row in src:
            self.rows += [(row[row != 0], []) for _ in range(beam)]

    def reorder(self, rows: torch.Tensor) -> None:
        self.rows = [(self.rows[r][0], list(self.rows[r][1])) for r in rows.tolist()]

    @torch.no_grad()
    def step(self, state: Decoding, tokens: torch.Tensor) -> None:
        """One step of ``state`` on ``tokens`` ``(R,)``: every row's logits equal its teacher-forced ones."""
        assert tokens.size(0) == len(self.rows)
        got = state(tokens)  # (R, V)
        for r, (src, fed) in enumerate(self.rows):
            fed.append(int(tokens[r]))
            want = self.model(src[None], torch.tensor([fed]))[0, -1]  # (V,)
            torch.testing.assert_close(got[r], want, atol=1e-5, rtol=1e-5)


def next_tokens(truth: Truth, g: torch.Generator) -> torch.Tensor:
    """Each row's next input: the start token for a row not fed yet (a joining row's first
    step), a random word otherwise."""
    tokens = torch.randint(3, V, (len(truth.rows),), generator=g)
    fresh = torch.tensor([not fed for _, fed in truth.rows])
    return tokens.masked_fill(fresh, truth.model.config.bos_id)


@pytest.mark.parametrize("beam", [1, 2])
@pytest.mark.parametrize("variant", list(JOINING))
def test_rows_added_while_others_decode_equal_decoding_them_alone(variant, beam):
    """``Decoding.add``: a new sentence (beam rows) joins at position 0 while the first ones are
    at step 4, then every sentence's beams are gathered by parent; each row's logits stay its
    teacher-forced ones. With Marian's start token (the padding id) the joining rows' position 0
    must count as a real token although the first rows' cached positions are masked for them."""
    model = random_model(vocab_size=V, **JOINING[variant])
    prepared, src, truth = engine.prepare(model), padded_source(), Truth(model)
    g = torch.Generator().manual_seed(4)
    joins = []
    with torch.no_grad():
        state = Decoding(prepared, src[:2], beam=beam, steps=8)
        truth.add(src[:2], beam)
        for t in range(7):
            if t == 4:
                state.add(src[2:])
                truth.add(src[2:], beam)
                joins.append(state.cache.positions.tolist())
            if beam > 1 and t in (2, 5):  # beams gathered by parent within each sentence
                R = len(truth.rows)
                parents = torch.randint(0, beam, (R,), generator=g) + torch.arange(R) // beam * beam
                assert len(set(parents.tolist())) < R  # some beam copied, another dropped
                state.reorder(parents, sentences_changed=False)
                truth.reorder(parents)
            truth.step(state, next_tokens(truth, g))
    assert joins == [[4] * 2 * beam + [0] * beam]  # the joining rows start at position 0, the others go on
    assert state.cache.memory_mask.shape == (3, 1, 1, 9) and state.cache.cross_attn[0].k.size(0) == 3


@pytest.mark.parametrize("beam", [1, 2])
@torch.no_grad()
def test_after_the_long_source_leaves_the_source_keys_shrink_to_the_longest_left(beam):
    """A long source (9 tokens) joins two short ones (5 and 2): every sentence's encoder-decoder
    K/V and memory mask are padded to 9. Once it has ended (a reorder that changes the
    sentences), positions that are padding in every remaining sentence go (width 5); a sentence
    that joins after that (3 tokens, padded to 6) widens them to 6 until the next such reorder;
    the logits stay each row's own throughout, beams sharing their sentence's K/V."""
    model = random_model(vocab_size=V)
    prepared, src, truth = engine.prepare(model), padded_source(), Truth(model)
    g = torch.Generator().manual_seed(5)
    width = lambda: (state.cache.cross_attn[0].k.size(2), state.cache.memory_mask.size(-1))  # noqa: E731

    def keep(*sentences: int) -> None:  # the beams of these sentences go on, in this order
        rows = torch.tensor([s * beam + k for s in sentences for k in range(beam)])
        state.reorder(rows, sentences_changed=True)
        truth.reorder(rows)
        assert state.cache.cross_attn[-1].k.size(0) == state.cache.memory_mask.size(0) == len(sentences)

    state = Decoding(prepared, src[1:, :5], beam=beam, steps=6)  # the short ones: 5 and 2 tokens
    truth.add(src[1:, :5], beam)
    for _ in range(3):
        truth.step(state, next_tokens(truth, g))
    assert width() == (5, 5)
    state.add(src[:1])  # the long one: 9 tokens
    truth.add(src[:1], beam)
    assert width() == (9, 9)
    for _ in range(2):
        truth.step(state, next_tokens(truth, g))
    keep(2, 0)  # the 2-token sentence ended, the long one goes on
    assert width() == (9, 9)  # still needed
    truth.step(state, next_tokens(truth, g))
    keep(1)  # the long one ended
    assert width() == (5, 5) and state.cache.cross_attn[-1].k.size(2) == 5
    truth.step(state, next_tokens(truth, g))
    joining = torch.tensor([[7, 8, 9, 0, 0, 0]])  # 3 tokens, padded past them
    state.add(joining)
    truth.add(joining, beam)
    assert width() == (6, 6)
    for _ in range(3):
        truth.step(state, next_tokens(truth, g))
    keep(1, 0)
    assert width() == (5, 5)
    truth.step(state, next_tokens(truth, g))


@torch.no_grad()
def test_drop_leading_keeps_the_cache_bounded_while_sentences_come_and_go():
    """Thirty steps, a sentence joining every third step and leaving seven steps after it came:
    the cached self-attention positions stay those of the oldest row left (``drop_leading`` on
    every reorder), not the thirty steps taken; every row's logits stay its own, and its
    positions its own (a learned table of 16 positions, which thirty shared steps would pass)."""
    model = random_model(vocab_size=V, positional="learned", max_len=16, norm_first=True)
    prepared, src, truth = engine.prepare(model), padded_source(), Truth(model)
    g = torch.Generator().manual_seed(6)
    state = Decoding(prepared, src[:1], beam=1, steps=8)
    truth.add(src[:1])
    born, lengths = [0], []  # the step each row joined
    for t in range(30):
        if t % 3 == 0 and t:
            new = src[t // 3 % 3 : t // 3 % 3 + 1]
            state.add(new)
            truth.add(new)
            born.append(t)
        if t - born[0] >= 7:  # the oldest row ends
            keep = torch.arange(1, len(born))
            state.reorder(keep, sentences_changed=True)
            truth.reorder(keep)
            born = born[1:]
        truth.step(state, next_tokens(truth, g))
        lengths.append(state.cache.length)
        assert state.cache.length == t + 1 - born[0]  # from the oldest row's first position on
        if t >= 3:  # rows joined: which cached positions each row attends to
            assert state.cache.key_mask.size(-1) == state.cache.length == state.cache.self_attn[-1].k.size(2)
    assert max(lengths) <= 8 and len(set(lengths)) > 3
