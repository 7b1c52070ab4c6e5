"""Greedy and beam search (§6.1) against independent truths: recomputation without the cache,
one sentence at a time, and a brute-force search over every output of a toy model. Continuous
batching (``translate_continuous``: sentences joining a running search) against each sentence
decoded alone on the paper's model."""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from aiayn import decode, engine
from aiayn.decode import beam_search, greedy_decode, length_penalty, translate_continuous, translate_ids
from aiayn.engine.step import Decoding
from aiayn.model import ModelConfig, Transformer
from helpers import randomize_

PAD, BOS, EOS = 0, 1, 2


def _model(seed: int = 0, vocab_size: int = 16, eos_boost: float = 2.5, **kw) -> Transformer:
    """A random tiny model (every parameter random, biases and layer norms too: ``randomize_``)
    whose EOS is likely enough that outputs end at different lengths."""
    torch.manual_seed(seed)
    model = randomize_(Transformer(ModelConfig.tiny(vocab_size=vocab_size, **kw)).eval(), seed)
    with torch.no_grad():
        model.tgt_embedding.weight[EOS] *= eos_boost  # tied: raises the EOS logit's spread
    return model


def _ending_model(eos_boost: float = 4.0) -> Transformer:
    """A tiny model (seed chosen by a search over seeds) whose outputs end by choosing EOS, at
    many different steps, rather than by reaching the length limit: greedy and beam search then
    exercise sentences and beams finishing mid-search, and the cache reordered around them.
    ``_ends_by_choice`` checks it where a test relies on it."""
    return _model(seed=276, eos_boost=eos_boost)


def _ends_by_choice(lengths: list[int], sources: list[int], max_len_a: int = 50) -> int:
    """How many outputs (token counts without EOS) ended before their limit: source length + 1
    (its EOS) + ``max_len_a`` tokens, the last of them the EOS forced at the limit."""
    return sum(n + 1 < s + 1 + max_len_a for n, s in zip(lengths, sources, strict=True))


def _sources(lengths, vocab_size=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    src = torch.full((len(lengths), max(lengths) + 1), PAD)
    for row, n in enumerate(lengths):
        src[row, :n] = torch.randint(5, vocab_size, (n,), generator=g)
        src[row, n] = EOS
    return src


def _trim(row: list[int]) -> list[int]:
    return row[: row.index(EOS)] if EOS in row else row


def _prepared(model: Transformer) -> Transformer:
    """The model on the engine (``engine.prepare``)."""
    return engine.prepare(model)


def _spy_steps(monkeypatch, record) -> None:
    """Call ``record(state, tokens)`` before every engine decoding step."""
    real = Decoding.__call__

    def spy(self, tokens):
        record(self, tokens)
        return real(self, tokens)

    monkeypatch.setattr(Decoding, "__call__", spy)


def test_length_penalty_formula():
    assert length_penalty(1, 0.6) == 1.0  # (5 + 1) / 6 = 1
    assert length_penalty(7, 0.6) == pytest.approx(2**0.6)  # (5 + 7) / 6 = 2
    assert length_penalty(13, 0.5) == pytest.approx(math.sqrt(3))
    assert length_penalty(30, 0.0) == 1.0


def test_fixture_outputs_end_by_choice_at_different_lengths():
    """So that the tests below exercise sentences and beams finishing early: most outputs end by
    choosing EOS (not forced at the limit), at several different steps."""
    lengths, model = [3, 7, 5, 9, 2, 6], _ending_model()
    greedy = [len(_trim(row)) for row in greedy_decode(model, _sources(lengths)).tolist()]
    assert _ends_by_choice(greedy, lengths) == 6 and len(set(greedy)) >= 5 and min(greedy) > 0, greedy
    beams = beam_search(model, _sources(lengths), beam=4, nbest=4)
    ends = [_ends_by_choice([len(h.tokens) for h in hyps], [s] * 4) for hyps, s in zip(beams, lengths, strict=True)]
    assert sum(ends) >= 18 and len({len(h.tokens) for hyps in beams for h in hyps}) >= 8, ends


def test_greedy_with_cache_equals_recomputation():
    model, src = _ending_model(), _sources([3, 7, 5, 9, 2, 6])
    assert torch.equal(greedy_decode(model, src), greedy_decode(model, src, use_cache=False))


@pytest.mark.parametrize("fraction", [1, 2, 4])  # never, at half the rows, at a quarter (the default)
def test_greedy_output_does_not_depend_on_when_finished_rows_leave_the_batch(monkeypatch, fraction):
    """Finished rows stay in the batch until a fraction of it has ended (``COMPACT_FRACTION``);
    the output, pads after EOS included, must not change, with or without the cache."""
    model, src = _ending_model(), _sources([3, 7, 5, 9, 2, 6, 4, 8])
    monkeypatch.setattr(decode, "COMPACT_FRACTION", 10**9)
    compact_every_time = greedy_decode(model, src, max_len_a=10)
    lengths = [len(_trim(row)) for row in compact_every_time.tolist()]
    assert len(set(lengths)) > 3, lengths  # sentences end at several different steps,
    assert _ends_by_choice(lengths, [3, 7, 5, 9, 2, 6, 4, 8], max_len_a=10) >= 4, lengths  # half of them by EOS
    monkeypatch.setattr(decode, "COMPACT_FRACTION", fraction)
    for use_cache in (True, False):
        assert torch.equal(greedy_decode(model, src, max_len_a=10, use_cache=use_cache), compact_every_time)


def test_greedy_is_argmax_of_teacher_forced_logits():
    """Each output token is the argmax (pad excluded) of the full forward pass on the output so far."""
    model, src = _model(seed=3), _sources([4, 6])
    out = greedy_decode(model, src, max_len_a=8)
    for row in range(src.size(0)):
        tokens = [*_trim(out[row].tolist()), EOS]
        tgt = torch.tensor([[BOS, *tokens[:-1]]])
        logits = model(src[row : row + 1], tgt)[0]
        logits[:, PAD] = -torch.inf
        best = logits.argmax(-1).tolist()
        limit = int((src[row] != PAD).sum()) + 8
        assert best[: len(tokens) - 1] == tokens[:-1]
        assert best[len(tokens) - 1] == EOS or len(tokens) == limit  # EOS chosen, or forced at the limit


def test_greedy_limits_and_min_len():
    model, src = _model(), _sources([3, 5])
    out = greedy_decode(model, src, max_len_a=2)  # limit = source length (with EOS) + 2
    for row, n in zip(out.tolist(), [3 + 1 + 2, 5 + 1 + 2], strict=True):
        assert EOS in row and row.index(EOS) + 1 <= n and PAD not in row[: row.index(EOS)]
    exact = greedy_decode(model, src, max_len=6, min_len=6)  # forced to exactly 6 tokens, EOS last
    assert exact.shape == (2, 6) and (exact[:, -1] == EOS).all() and not (exact[:, :-1] == EOS).any()


def test_beam_one_equals_greedy():
    model, src = _ending_model(), _sources([3, 7, 5, 9, 2, 6])
    greedy = [_trim(row) for row in greedy_decode(model, src).tolist()]
    beam = [h[0].tokens for h in beam_search(model, src, beam=1)]
    assert beam == greedy


@pytest.mark.parametrize("beam", [2, 4])
def test_beam_with_cache_equals_recomputation(beam):
    model, src = _ending_model(eos_boost=4.5), _sources([3, 7, 5, 9, 2, 6])
    cached = beam_search(model, src, beam=beam, nbest=beam)
    recomputed = beam_search(model, src, beam=beam, nbest=beam, use_cache=False)
    lengths = [len(h.tokens) for hyps in cached for h in hyps]
    assert _ends_by_choice(lengths, [n for n in [3, 7, 5, 9, 2, 6] for _ in range(beam)]) >= 5 * beam, lengths
    for a, b in zip(cached, recomputed, strict=True):
        assert [h.tokens for h in a] == [h.tokens for h in b]
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-5)


def test_batch_equals_one_sentence_at_a_time():
    """Padding invariance: a sentence's output does not depend on the others in its batch."""
    model, src = _ending_model(eos_boost=5.0), _sources([3, 7, 5, 9, 2, 6])
    batched_beam = beam_search(model, src, beam=3, nbest=2)
    batched_greedy = [_trim(r) for r in greedy_decode(model, src).tolist()]
    assert _ends_by_choice([len(t) for t in batched_greedy], [3, 7, 5, 9, 2, 6]) >= 5, batched_greedy
    assert len({len(h.tokens) for hyps in batched_beam for h in hyps}) >= 5  # beams end at different steps
    for row in range(src.size(0)):
        alone = src[row : row + 1, : int((src[row] != PAD).sum())]
        one = beam_search(model, alone, beam=3, nbest=2)[0]
        assert [h.tokens for h in one] == [h.tokens for h in batched_beam[row]]
        assert [h.score for h in one] == pytest.approx([h.score for h in batched_beam[row]], abs=1e-5)
        assert _trim(greedy_decode(model, alone)[0].tolist()) == batched_greedy[row]


@torch.no_grad()
def _sequence_log_prob(model, src, tokens):
    """log P(tokens | src) by one teacher-forced forward pass (pad never allowed: its logit is
    kept in the softmax, as in the search)."""
    tgt = torch.tensor([[BOS, *tokens[:-1]]])
    logp = F.log_softmax(model(src, tgt)[0].float(), dim=-1)  # (T, V)
    return float(logp[torch.arange(len(tokens)), torch.tensor(tokens)].sum())


@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
def test_wide_beam_finds_the_best_sequence_by_brute_force(alpha):
    """Vocabulary of 5 (pad, bos, eos and two words), outputs of at most 4 tokens: every
    sequence ending in EOS is enumerated and scored log P / lp; a beam wide enough to keep every
    prefix must return exactly that ranking."""
    model = _model(seed=5, vocab_size=5, eos_boost=1.0)
    src = torch.tensor([[3, 4, 3, EOS]])
    L = 4
    truth = []
    for n in range(1, L + 1):
        for words in itertools.product([BOS, 3, 4], repeat=n - 1):  # any non-pad, non-EOS token
            tokens = [*words, EOS]
            log_prob = _sequence_log_prob(model, src, tokens)
            truth.append((log_prob / length_penalty(n, alpha), list(words)))
    truth.sort(key=lambda x: x[0], reverse=True)
    assert len(truth) == 1 + 3 + 9 + 27
    found = beam_search(model, src, beam=len(truth), nbest=len(truth), alpha=alpha, max_len=L)[0]
    assert [h.tokens for h in found] == [words for _, words in truth]
    assert [h.score for h in found] == pytest.approx([score for score, _ in truth], abs=1e-5)
    narrow = beam_search(model, src, beam=2, alpha=alpha, max_len=L)[0][0]  # a real hypothesis, truly scored
    assert any(words == narrow.tokens and score == pytest.approx(narrow.score, abs=1e-5) for score, words in truth)


@torch.no_grad()
def _reference_beam_search(model, src, K: int, alpha: float, limit: int):
    """Beam search written out plainly, after ``beam_search``'s docstring and the module's
    conventions, on full recomputation: every candidate (a live prefix and one more token, pad
    never) is scored log P by its own teacher-forced pass (``_sequence_log_prob``), not from its
    parent's score. Of the 2K best candidates, the EOS ones among the first K are finalized
    (score log P / lp(|Y|), |Y| with the EOS) while fewer than K are; the K best non-EOS ones
    go on. Only EOS is allowed at the limit; the search stops with K finished or at the limit.
    Returns the finished ``(score, log_prob, tokens)``, best first, and what happened:
    ``events`` counts EOS candidates finalized before the limit, EOS candidates ranked K..2K-1
    (not finalized), candidates pruned, and how the search stopped."""
    V = model.config.tgt_vocab_size
    live, finished, events = [[]], [], dict.fromkeys(["early eos", "eos below K", "pruned", "K finished", "limit"], 0)
    for t in range(1, limit + 1):
        words = [EOS] if t == limit else [v for v in range(V) if v != PAD]
        candidates = [[*prefix, v] for prefix in live for v in words]
        scored = sorted(((_sequence_log_prob(model, src, c), c) for c in candidates), key=lambda x: x[0], reverse=True)
        top = scored[: 2 * K]
        for log_prob, c in top[:K]:
            if c[-1] == EOS and len(finished) < K:
                finished.append((log_prob / length_penalty(t, alpha), log_prob, c[:-1]))
                events["early eos"] += t < limit
        events["eos below K"] += sum(c[-1] == EOS for _, c in top[K:])
        live = [c for _, c in top if c[-1] != EOS][:K]
        events["pruned"] += len(candidates) - len(live) - sum(c[-1] == EOS for _, c in top[:K])
        if len(finished) >= K or t >= limit:
            events["K finished" if len(finished) >= K and t < limit else "limit"] += 1
            break
    return sorted(finished, key=lambda h: h[0], reverse=True), events


@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
def test_narrow_beam_equals_a_plain_beam_search_on_recomputed_scores(alpha):
    """K = 2 on a vocabulary of 7 with outputs of at most 5 tokens: the pruning itself (which
    candidates go on, which EOS candidates are finalized, when a sentence stops) against
    ``_reference_beam_search``, sentence by sentence; the search runs them batched (padded
    sources, the cache reordered by parent beam). The sentences are chosen so that every rule
    matters here: EOS candidates finalized early and left unfinalized below the first K,
    sentences stopping with K finished and at the limit, and the narrow beam missing outputs
    that a wide one finds."""
    model, K, L = _model(seed=2, vocab_size=7, eos_boost=1.0), 2, 5
    sources = [[3, 4, 5, 6], [6, 5], [4, 4, 3, 6, 5, 3], [5], [3, 6, 4]]
    src = torch.tensor([[*s, EOS] + [PAD] * (6 - len(s)) for s in sources])
    found = beam_search(model, src, beam=K, nbest=K, alpha=alpha, max_len=L)
    wide = beam_search(model, src, beam=50, nbest=K, alpha=alpha, max_len=L)
    events = dict.fromkeys(["early eos", "eos below K", "pruned", "K finished", "limit"], 0)
    for s, hyps in zip(sources, found, strict=True):
        truth, seen = _reference_beam_search(model, torch.tensor([[*s, EOS]]), K, alpha, L)
        events = {k: events[k] + seen[k] for k in events}
        assert [h.tokens for h in hyps] == [tokens for _, _, tokens in truth], s
        assert [h.score for h in hyps] == pytest.approx([score for score, _, _ in truth], abs=1e-5)
        assert [h.log_prob for h in hyps] == pytest.approx([log_prob for _, log_prob, _ in truth], abs=1e-5)
    assert all(events.values()), events  # every rule was exercised
    assert [[h.tokens for h in hyps] for hyps in found] != [[h.tokens for h in hyps] for hyps in wide]  # K = 2 prunes


def test_hypotheses_are_sorted_distinct_and_scored():
    model, src = _model(seed=6), _sources([5, 8])
    for row, hyps in enumerate(beam_search(model, src, beam=4, nbest=4, alpha=0.6)):
        assert len(hyps) == 4
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
        assert len({tuple(h.tokens) for h in hyps}) == 4
        for h in hyps:
            assert h.score == pytest.approx(h.log_prob / length_penalty(len(h.tokens) + 1, 0.6))
            alone = src[row : row + 1, : int((src[row] != PAD).sum())]
            assert h.log_prob == pytest.approx(_sequence_log_prob(model, alone, [*h.tokens, EOS]), abs=1e-4)


def test_beam_search_rejects_bad_arguments():
    model, src = _model(), _sources([3])
    with pytest.raises(ValueError, match="nbest"):
        beam_search(model, src, beam=2, nbest=3)
    with pytest.raises(ValueError, match="beam"):
        beam_search(model, src, beam=0)


def test_translate_ids_keeps_input_order_across_batches():
    model = _ending_model()
    lengths = [9, 2, 5, 1, 7, 3, 4, 8]
    src = _sources(lengths)
    sources = [src[i, :n].tolist() for i, n in enumerate(lengths)]
    expected = [h[0].tokens for h in beam_search(model, src, beam=3)]
    assert len({tuple(t) for t in expected}) >= 6  # distinct outputs: a reordering would show
    assert translate_ids(model, sources, max_tokens=12, beam=3) == expected  # several small batches
    greedy = [_trim(r) for r in greedy_decode(model, src).tolist()]
    assert len({tuple(t) for t in greedy}) >= 6
    assert translate_ids(model, sources, max_tokens=10) == greedy


@pytest.mark.parametrize("beam", [1, 3])
def test_a_sentence_longer_than_max_tokens_gets_a_batch_of_its_own(monkeypatch, beam):
    """The other sentences' batches keep to ``max_tokens`` (source positions times the beam);
    every output is the sentence's own."""
    model = _prepared(_ending_model())
    lengths = [3, 20, 2, 3, 1, 2, 3, 2]
    src = _sources(lengths)
    sources = [src[i, :n].tolist() for i, n in enumerate(lengths)]
    alone = [translate_ids(model, [s], beam=beam) for s in sources]
    encoded = []  # (sentences, padded source length) of each batch encoded
    encode = model.encode
    monkeypatch.setattr(model, "encode", lambda s, **kw: encoded.append(tuple(s.shape)) or encode(s, **kw))
    max_tokens = 12 * beam  # 12 source positions a batch: 3 sentences of 3 tokens and EOS
    assert translate_ids(model, sources, max_tokens=max_tokens, beam=beam) == [a[0] for a in alone]
    assert (1, 21) in encoded  # the long one, alone
    assert all(S * B <= 12 for B, S in encoded if S < 21)  # the others keep to the budget
    assert sum(B for B, _ in encoded) == len(sources)  # each sentence encoded once


def _repeats_an_ngram(tokens: list[int], n: int) -> bool:
    ngrams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(ngrams) != len(set(ngrams))


@pytest.mark.parametrize("n", [1, 2, 3])
def test_no_repeat_ngram_size_leaves_no_ngram_twice(n):
    model, src = _model(seed=8, eos_boost=1.0), _sources([3, 6, 4, 8], seed=1)
    plain = [_trim(r) for r in greedy_decode(model, src, max_len=20).tolist()]
    assert any(_repeats_an_ngram(out, n) for out in plain)  # the rule has something to do here
    assert len({tuple(out) for out in plain}) == len(plain)  # and the rows differ
    greedy = [_trim(r) for r in greedy_decode(model, src, max_len=20, no_repeat_ngram_size=n).tolist()]
    beams = beam_search(model, src, beam=3, nbest=3, max_len=20, no_repeat_ngram_size=n)
    assert not any(_repeats_an_ngram(out, n) for out in greedy)
    assert not any(_repeats_an_ngram(h.tokens, n) for hyps in beams for h in hyps)
    # the same with recomputation instead of the cache
    recomputed = greedy_decode(model, src, max_len=20, no_repeat_ngram_size=n, use_cache=False).tolist()
    assert [_trim(r) for r in recomputed] == greedy
    again = beam_search(model, src, beam=3, nbest=3, max_len=20, no_repeat_ngram_size=n, use_cache=False)
    assert [[h.tokens for h in hyps] for hyps in again] == [[h.tokens for h in hyps] for hyps in beams]
    assert [_trim(r) for r in greedy_decode(model, src, max_len=20, no_repeat_ngram_size=0).tolist()] == plain


def test_wide_beam_without_repeated_bigrams_finds_the_best_such_sequence_by_brute_force():
    """As the brute-force test above, over the sequences whose outputs have no bigram twice."""
    model = _model(seed=5, vocab_size=5, eos_boost=1.0)
    src = torch.tensor([[3, 4, 3, EOS]])
    L, alpha = 5, 0.6
    truth = []
    for n in range(1, L + 1):
        for words in itertools.product([BOS, 3, 4], repeat=n - 1):
            tokens = [*words, EOS]
            if not _repeats_an_ngram(tokens, 2):
                truth.append((_sequence_log_prob(model, src, tokens) / length_penalty(n, alpha), list(words)))
    truth.sort(key=lambda x: x[0], reverse=True)
    assert len(truth) < 1 + 3 + 9 + 27 + 81  # some sequences are excluded
    found = beam_search(model, src, beam=len(truth), nbest=len(truth), alpha=alpha, max_len=L, no_repeat_ngram_size=2)
    assert [h.tokens for h in found[0]] == [words for _, words in truth]
    assert [h.score for h in found[0]] == pytest.approx([score for score, _ in truth], abs=1e-5)


def test_banned_tokens_are_exactly_those_that_would_repeat_an_ngram():
    """Against a brute-force reference: token v is banned after a prefix iff the n-gram that
    appending it completes already occurs in the output (BOS excluded)."""
    from aiayn.decode import _ban_repeated_ngrams

    g = torch.Generator().manual_seed(0)
    V = 6
    for _ in range(200):
        n, t, R = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(0, 9, (1,), generator=g)), 3
        prefixes = torch.cat([torch.full((R, 1), BOS), torch.randint(3, V, (R, t), generator=g)], dim=1)
        logp = _ban_repeated_ngrams(torch.zeros(R, V), prefixes, n, EOS)
        for r in range(R):
            out = prefixes[r, 1:].tolist()
            seen = {tuple(out[i : i + n]) for i in range(len(out) - n + 1)}
            expected = [len(out) + 1 >= n and tuple([*out, v][-n:]) in seen for v in range(V)]
            assert logp[r].isneginf().tolist() == expected, (n, out)


def test_banned_tokens_for_rows_of_different_lengths_are_those_of_each_row_alone():
    """Greedy batches hold rows of different lengths (ended rows stay until they leave together),
    right-aligned after -1s (``_histories``):
    each row's bans must be those of its own tokens by brute force, the -1s never banned nor
    matched (a row with no tokens yet bans nothing); where scores already ruled out (EOS before
    min_len) and the bans would leave a row nothing, the row stays as it was."""
    from aiayn.decode import _ban_repeated_ngrams, _histories

    g = torch.Generator().manual_seed(1)
    V, R, W = 6, 5, 10
    seen_lengths, yielded = set(), 0
    for _ in range(300):
        n = int(torch.randint(1, 5, (1,), generator=g))
        out = torch.randint(3, V, (R, W), generator=g)
        lengths = torch.randint(0, W + 1, (R,), generator=g)
        seen_lengths.update(lengths.tolist())
        # scores already ruled out, as min_len rules out EOS and the limit all but EOS
        ruled_out = torch.rand(R, V, generator=g) < 0.3
        ruled_out[:, EOS] = torch.rand(R, generator=g) < 0.5
        logp = _ban_repeated_ngrams(
            torch.zeros(R, V).masked_fill(ruled_out, -torch.inf), _histories(out, lengths, BOS), n, EOS
        )
        for r in range(R):
            tokens = out[r, : lengths[r]].tolist()
            seen = {tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)}
            banned = [len(tokens) + 1 >= n and tuple([*tokens, v][-n:]) in seen for v in range(V)]
            expected = [bool(x) or b for x, b in zip(ruled_out[r].tolist(), banned, strict=True)]
            if all(expected):  # the rule would leave no token: it yields
                expected, yielded = ruled_out[r].tolist(), yielded + 1
            assert logp[r].isneginf().tolist() == expected, (n, tokens)
    assert {0, 1, W} <= seen_lengths  # empty rows, one token, and full rows among them
    assert yielded > 10


@pytest.mark.parametrize("n", [1, 2, 3])
def test_batched_translation_keeps_the_no_repeat_ngram_rule_of_each_sentence_alone(n):
    """With ``no_repeat_ngram_size`` the batched searches on the engine (greedy rows ending at
    different steps, so histories of different lengths) give each sentence what it gets decoded
    alone with the rule."""
    model = _model(seed=3, max_len=64)
    g = torch.Generator().manual_seed(12)
    sources = [torch.randint(5, 16, (int(k),), generator=g).tolist() for k in torch.randint(1, 12, (30,), generator=g)]
    one = [torch.tensor([[*ids, EOS]]) for ids in sources]
    greedy = [_trim(greedy_decode(model, src, max_len_a=6, no_repeat_ngram_size=n)[0].tolist()) for src in one]
    plain = [_trim(greedy_decode(model, src, max_len_a=6)[0].tolist()) for src in one]
    assert sum(a != b for a, b in zip(greedy, plain, strict=True)) >= 5  # the rule changes many outputs
    assert len({len(x) for x in greedy}) > 4  # sentences end at many different steps
    beams = [beam_search(model, src, beam=3, nbest=2, max_len_a=6, no_repeat_ngram_size=n)[0] for src in one]
    prepared = _prepared(model)
    assert translate_ids(prepared, sources, max_tokens=40, max_len_a=6, no_repeat_ngram_size=n) == greedy
    batched = translate_ids(prepared, sources, beam=3, nbest=2, max_tokens=60, max_len_a=6, no_repeat_ngram_size=n)
    for got, want in zip(batched, beams, strict=True):
        assert [h.tokens for h in got] == [h.tokens for h in want]
        assert [h.score for h in got] == pytest.approx([h.score for h in want], abs=1e-5)
    with pytest.raises(ValueError, match="no_repeat_ngram_size must be >= 0"):
        translate_ids(model, sources, no_repeat_ngram_size=-1)


def test_no_repeat_ngram_yields_where_min_len_leaves_no_other_token():
    """Vocabulary of 6 (3 words), n = 1 and min_len 8: after 3 words nothing may come but EOS,
    which min_len forbids; the rule yields, so no padding and no empty beam result."""
    model, src = _model(seed=7, eos_boost=1.0, vocab_size=6), _sources([3, 4], vocab_size=6)
    out = greedy_decode(model, src, max_len=10, min_len=8, no_repeat_ngram_size=1).tolist()
    for row in out:
        assert PAD not in _trim(row) and EOS in row and row.index(EOS) >= 7
    for hyps in beam_search(model, src, beam=2, max_len=10, min_len=8, no_repeat_ngram_size=1):
        assert hyps and len(hyps[0].tokens) >= 7 and PAD not in hyps[0].tokens
    with pytest.raises(ValueError, match="no_repeat_ngram_size must be >= 0"):
        beam_search(model, src, no_repeat_ngram_size=-1)


@pytest.mark.parametrize("positional", ["sinusoidal", "learned"])
def test_translating_in_batches_on_the_engine_equals_greedy_alone(monkeypatch, positional):
    """``translate_ids`` on the engine decodes batches of sentences ending at different steps:
    each output must be what ``greedy_decode`` gives the sentence alone on the paper's model."""
    model = _model(seed=1, positional=positional, max_len=64)
    g = torch.Generator().manual_seed(9)
    sources = [torch.randint(5, 16, (int(n),), generator=g).tolist() for n in torch.randint(1, 12, (60,), generator=g)]
    alone = []
    for ids in sources:
        row = greedy_decode(model, torch.tensor([[*ids, EOS]]), max_len_a=6)[0].tolist()
        alone.append(_trim(row))
    assert len({len(x) for x in alone}) > 4  # sentences end at many different steps
    rows: dict[Decoding, set[int]] = {}  # each batch's decoding state (kept alive): its steps' row counts
    _spy_steps(monkeypatch, lambda state, tokens: rows.setdefault(state, set()).add(tokens.size(0)))
    assert translate_ids(_prepared(model), sources, max_tokens=40, max_len_a=6) == alone  # batches of a few
    assert len(rows) > 1 and any(len(counts) > 1 for counts in rows.values())  # ended rows left their batch


@pytest.mark.parametrize("positional", ["sinusoidal", "learned"])
def test_beam_search_in_batches_on_the_engine_equals_beam_search_alone(positional):
    model = _model(seed=3, positional=positional, max_len=64)
    g = torch.Generator().manual_seed(10)
    sources = [torch.randint(5, 16, (int(n),), generator=g).tolist() for n in torch.randint(1, 12, (40,), generator=g)]
    alone = [beam_search(model, torch.tensor([[*ids, EOS]]), beam=3, nbest=2, max_len_a=6)[0] for ids in sources]
    assert len({len(h[0].tokens) for h in alone}) > 4  # sentences end at many different steps
    batched = translate_ids(_prepared(model), sources, beam=3, nbest=2, max_tokens=60, max_len_a=6)
    for got, want in zip(batched, alone, strict=True):
        assert [h.tokens for h in got] == [h.tokens for h in want]
        assert [h.score for h in got] == pytest.approx([h.score for h in want], abs=1e-5)
        assert [h.log_prob for h in got] == pytest.approx([h.log_prob for h in want], abs=1e-5)
    best = translate_ids(_prepared(model), sources, beam=3, max_tokens=60, max_len_a=6)  # nbest 1: the best tokens
    assert best == [h[0].tokens for h in alone]


def test_ended_rows_waiting_to_leave_stay_within_learned_positions():
    """Ended greedy rows stay until a quarter of the rows have ended; while the others go on
    they must not walk past the learned positional table (max_len 20)."""
    model = _model(seed=1, positional="learned", max_len=20)
    g = torch.Generator().manual_seed(3)
    sources = [torch.randint(5, 16, (int(n),), generator=g).tolist() for n in torch.randint(1, 18, (120,), generator=g)]
    alone = [_trim(greedy_decode(model, torch.tensor([[*s, EOS]]), max_len_a=10)[0].tolist()) for s in sources]
    assert translate_ids(_prepared(model), sources, max_tokens=60, max_len_a=10) == alone


# Suppressed tokens (ModelConfig.suppress_ids: the <phrase> tag of data.phrase_tag) ----------------


def _suppressing(model: Transformer, ids: tuple[int, ...]) -> Transformer:
    """The same weights, with ``ids`` in ``suppress_ids``."""
    other = Transformer(model.config.replace(suppress_ids=ids)).eval()
    other.load_state_dict(model.state_dict())
    return other


def _favourite(model: Transformer, src: torch.Tensor) -> int:
    """The word the model picks most often when decoding greedily without suppression."""
    counts = torch.bincount(greedy_decode(model, src, max_len_a=10).flatten(), minlength=model.config.vocab_size)
    counts[[PAD, BOS, EOS]] = 0
    return int(counts.argmax())


@torch.no_grad()
def _greedy_by_hand(model: Transformer, src: torch.Tensor, banned: list[int], max_len_a: int) -> list[int]:
    """Greedy decoding of one sentence by full teacher-forced recomputation at every step: the
    argmax of the last position's logits with ``banned`` (and padding) at -inf, only EOS at the
    limit (source tokens with EOS + max_len_a)."""
    limit = int((src != PAD).sum()) + max_len_a
    tokens: list[int] = []
    while not tokens or tokens[-1] != EOS:
        logits = model(src, torch.tensor([[BOS, *tokens]]))[0, -1]
        logits[[PAD, *banned]] = -torch.inf
        tokens.append(EOS if len(tokens) + 1 >= limit else int(logits.argmax()))
    return tokens[:-1]


def test_greedy_never_produces_a_suppressed_token_and_is_the_argmax_without_it():
    lengths = [3, 7, 5, 9, 2, 6]
    model, src = _ending_model(), _sources(lengths)
    word = _favourite(model, src)
    plain = [_trim(r) for r in greedy_decode(model, src, max_len_a=10).tolist()]
    assert sum(r.count(word) for r in plain) >= 5, plain  # suppressing it changes the outputs
    suppressed = _suppressing(model, (word,))
    for use_cache in (True, False):
        out = [_trim(r) for r in greedy_decode(suppressed, src, max_len_a=10, use_cache=use_cache).tolist()]
        assert not any(word in r for r in out)
        for row, n in enumerate(lengths):
            assert out[row] == _greedy_by_hand(model, src[row : row + 1, : n + 1], [word], max_len_a=10)
    assert out != plain


def test_beam_search_never_produces_a_suppressed_token():
    lengths = [3, 7, 5, 9, 2, 6]
    model, src = _ending_model(), _sources(lengths)
    word = _favourite(model, src)
    assert any(word in h.tokens for hyps in beam_search(model, src, beam=4, nbest=4) for h in hyps)
    suppressed = _suppressing(model, (word,))
    for use_cache in (True, False):
        beams = beam_search(suppressed, src, beam=4, nbest=4, use_cache=use_cache)
        assert not any(word in h.tokens for hyps in beams for h in hyps)
    # beam 1 is the hand-made greedy search without the word
    one = beam_search(suppressed, src, beam=1, max_len_a=10)
    for row, n in enumerate(lengths):
        assert one[row][0].tokens == _greedy_by_hand(model, src[row : row + 1, : n + 1], [word], max_len_a=10)


def test_wide_beam_with_a_suppressed_word_finds_the_best_sequence_without_it_by_brute_force():
    """As ``test_wide_beam_finds_the_best_sequence_by_brute_force``, the suppressed token (the one
    greedy decoding starts with, here BOS) taken out of the enumeration; its probability stays
    in the softmax, as padding's does."""
    model = _model(seed=5, vocab_size=5, eos_boost=1.0)
    src = torch.tensor([[3, 4, 3, EOS]])
    L, alpha = 4, 0.6
    word = int(greedy_decode(model, src, max_len=L)[0, 0])
    kept = [t for t in (BOS, 3, 4) if t != word]
    assert len(kept) == 2
    truth = []
    for n in range(1, L + 1):
        for words in itertools.product(kept, repeat=n - 1):
            score = _sequence_log_prob(model, src, [*words, EOS]) / length_penalty(n, alpha)
            truth.append((score, list(words)))
    truth.sort(key=lambda x: x[0], reverse=True)
    assert len(truth) == 1 + 2 + 4 + 8
    found = beam_search(_suppressing(model, (word,)), src, beam=len(truth), nbest=len(truth), alpha=alpha, max_len=L)
    assert [h.tokens for h in found[0]] == [words for _, words in truth]
    assert [h.score for h in found[0]] == pytest.approx([score for score, _ in truth], abs=1e-5)


@pytest.mark.parametrize("beam", [1, 3])
def test_translate_ids_in_batches_never_produces_a_suppressed_token(beam):
    """``translate_ids`` (batches on the engine, greedy and beam) gives each sentence what
    greedy or beam search gives it alone without the word; the greedy outputs are the
    hand-made search's."""
    model = _model(seed=1, max_len=64)
    g = torch.Generator().manual_seed(9)
    sources = [torch.randint(5, 16, (int(n),), generator=g).tolist() for n in torch.randint(1, 12, (30,), generator=g)]
    src = torch.tensor([[*s, EOS] + [PAD] * (11 - len(s)) for s in sources])
    word = _favourite(model, src)
    assert sum(t.count(word) for t in translate_ids(model, sources, max_tokens=40, max_len_a=6, beam=beam)) >= 5
    suppressed = _suppressing(model, (word,))
    out = translate_ids(_prepared(suppressed), sources, max_tokens=40, max_len_a=6, beam=beam)  # small batches
    assert not any(word in t for t in out)
    for ids, tokens in zip(sources, out, strict=True):
        one = torch.tensor([[*ids, EOS]])
        if beam == 1:
            assert tokens == _greedy_by_hand(model, one, [word], max_len_a=6)
        else:
            assert tokens == beam_search(suppressed, one, beam=beam, max_len_a=6)[0][0].tokens


# Continuous batching (translate_continuous): sentences join a running search as others end -------

CONTINUOUS = {  # (seed, eos_boost, config): outputs of many lengths, many ending by EOS
    "sinusoidal": (11, 2.5, {}),
    "learned": (8, 4.0, {"positional": "learned"}),
    "marian's": (7, 4.0, {"bos_id": 0, "activation": "silu", "output_bias": True}),  # starts from the pad id
}


class _Feed:
    """A feed for ``translate_continuous``: at its i-th call it brings the next ``sizes[i]``
    sentences (cycling through ``sizes``; at least one when nothing decodes, so that the search
    goes on) while fewer than ``cap`` decode, keyed ``keys[j]`` (default ``1000 + 7 j``: keys
    that are not the indices). Records each ``live`` it is told and the keys it gave."""

    def __init__(self, sources, sizes=(1,), cap=None, keys=None) -> None:
        keys = [1000 + 7 * j for j in range(len(sources))] if keys is None else keys
        self.pending, self.sizes, self.cap = list(zip(keys, sources, strict=True)), itertools.cycle(sizes), cap
        self.asked: list[int] = []  # every live it was told
        self.done: list[int] = []  # the keys the search has yielded so far (``_continuous``)
        self.gave_at: list[int] = []  # the lives at which it brought sentences
        self.given: list[int] = []

    def __call__(self, live: int):
        assert live == len(self.given) - len(self.done)  # the sentences decoding, those ended not counted
        self.asked.append(live)
        size = next(self.sizes)
        if live == 0:
            size = max(size, 1)
        if not self.pending or not size or (self.cap is not None and live >= self.cap):
            return None
        taken, self.pending = self.pending[:size], self.pending[size:]
        self.gave_at.append(live)
        self.given += [key for key, _ in taken]
        return [key for key, _ in taken], [ids for _, ids in taken]


def _continuous(model, feed: _Feed, **kw) -> dict:
    """``translate_continuous``'s results by key; each key fed comes back exactly once."""
    found = {}
    for key, result in translate_continuous(model, feed, **kw):
        assert key in feed.given and key not in found
        feed.done.append(key)
        found[key] = result
    assert sorted(found) == sorted(feed.given)
    return found


def _spy_joins(monkeypatch) -> list[int]:
    """The number of sentences of each ``Decoding.add`` (sentences joining a running search)."""
    joins = []
    real = Decoding.add
    monkeypatch.setattr(Decoding, "add", lambda self, src: joins.append(src.size(0)) or real(self, src))
    return joins


def _random_sources(n: int, longest: int = 11, seed: int = 9) -> list[list[int]]:
    """``n`` random sources of 1 to ``longest`` words."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, longest + 1, (n,), generator=g)
    return [torch.randint(5, 16, (int(k),), generator=g).tolist() for k in lengths]


def _greedy_alone(model, sources, **kw) -> list[list[int]]:
    return [_trim(greedy_decode(model, torch.tensor([[*ids, EOS]]), **kw)[0].tolist()) for ids in sources]


def _beams_alone(model, sources, **kw) -> list:
    return [beam_search(model, torch.tensor([[*ids, EOS]]), **kw)[0] for ids in sources]


def _assert_same_hypotheses(got, want) -> None:
    assert [h.tokens for h in got] == [h.tokens for h in want]
    assert [h.score for h in got] == pytest.approx([h.score for h in want], abs=1e-5)
    assert [h.log_prob for h in got] == pytest.approx([h.log_prob for h in want], abs=1e-5)


FEEDS = {  # when the sentences come
    "one a step": {"sizes": (1,)},
    "a few now and then": {"sizes": (3, 0, 0, 2, 0, 0, 0, 1, 0)},
    "under a cap": {"sizes": (2,), "cap": 5},
}


@pytest.mark.parametrize("feeding", list(FEEDS))
@pytest.mark.parametrize("variant", list(CONTINUOUS))
def test_translate_continuous_equals_greedy_alone(monkeypatch, variant, feeding):
    """Sentences join the running greedy search at many different steps, beside rows at other
    positions: each result is what ``greedy_decode`` gives the sentence alone on the paper's
    model, under its own key."""
    seed, eos_boost, config = CONTINUOUS[variant]
    model = _model(seed=seed, eos_boost=eos_boost, max_len=64, **config)
    sources = _random_sources(30)
    alone = _greedy_alone(model, sources, max_len_a=6)
    assert len({len(x) for x in alone}) > 5  # sentences end at many different steps
    assert _ends_by_choice([len(x) for x in alone], [len(s) for s in sources], max_len_a=6) >= 9  # by EOS
    joins = _spy_joins(monkeypatch)
    feed = _Feed(sources, **FEEDS[feeding])
    found = _continuous(_prepared(model), feed, max_len_a=6)
    assert [found[key] for key in feed.given] == alone
    assert sum(joins) >= 15 and len(set(feed.asked)) > 2  # most sentences joined a running search


@pytest.mark.parametrize("variant", list(CONTINUOUS))
def test_translate_continuous_beam_search_equals_beam_search_alone(monkeypatch, variant):
    """Beam 3, nbest 2: each sentence's hypotheses (tokens, scores, log-probabilities) are those
    of ``beam_search`` alone; with nbest 1 the best tokens."""
    seed, eos_boost, config = CONTINUOUS[variant]
    model = _model(seed=seed, eos_boost=eos_boost, max_len=64, **config)
    sources = _random_sources(24, seed=10)
    alone = _beams_alone(model, sources, beam=3, nbest=2, max_len_a=6)
    assert len({len(h.tokens) for hyps in alone for h in hyps}) > 3  # beams end at different steps
    joins = _spy_joins(monkeypatch)
    feed = _Feed(sources, sizes=(2, 0, 1), cap=4)
    found = _continuous(_prepared(model), feed, beam=3, nbest=2, max_len_a=6)
    for key, want in zip(feed.given, alone, strict=True):
        _assert_same_hypotheses(found[key], want)
    assert sum(joins) >= 10
    feed = _Feed(sources, sizes=(1,))
    best = _continuous(_prepared(model), feed, beam=3, max_len_a=6)  # nbest 1: the best tokens
    assert [best[key] for key in feed.given] == [hyps[0].tokens for hyps in alone]


@pytest.mark.parametrize("beam", [1, 3])
def test_an_ensemble_of_prepared_models_takes_sentences_into_its_running_search(monkeypatch, beam):
    """Two prepared models of different shapes as one ``Ensemble``: sentences join its running
    search (each member's ``Decoding.add``), and each result is what the unprepared ensemble
    gives the sentence alone."""
    a = _model(seed=11, eos_boost=2.5, max_len=64)
    b = _model(seed=12, eos_boost=2.5, max_len=64, N=1, d_ff=48, norm_first=True)
    sources = _random_sources(20, seed=12)
    plain = decode.Ensemble([a, b])
    if beam == 1:
        alone = _greedy_alone(plain, sources, max_len_a=6)
        assert len({len(x) for x in alone}) > 4  # sentences end at different steps
    else:
        alone = [hyps[0].tokens for hyps in _beams_alone(plain, sources, beam=beam, max_len_a=6)]
    joins = _spy_joins(monkeypatch)
    feed = _Feed(sources, sizes=(2, 0, 1), cap=5)
    found = _continuous(decode.Ensemble([_prepared(a), _prepared(b)]), feed, beam=beam, max_len_a=6)
    assert [found[key] for key in feed.given] == alone
    assert len(joins) % 2 == 0 and sum(joins) >= 2 * 10  # both members took each join; most sentences joined


def test_continuous_rows_stay_within_learned_positions(monkeypatch):
    """A learned positional table of 20 positions, outputs up to 19 tokens: ended greedy rows
    wait in the batch (until a quarter of it has ended) while later sentences keep the search
    going; they must wait at a position inside the table (``Decoding.freeze``), and every row's
    position is its own, not the steps the search has taken."""
    model = _model(seed=1, positional="learned", max_len=20)
    sources = _random_sources(40, longest=17, seed=3)
    alone = _greedy_alone(model, sources, max_len_a=10)
    assert max(len(x) for x in alone) == 18  # limits of 19 with EOS: the table's last position
    positions, steps, waiting = [], [], []
    _spy_steps(monkeypatch, lambda state, tokens: positions.append(state.cache.positions) or steps.append(1))
    freeze = Decoding.freeze
    monkeypatch.setattr(Decoding, "freeze", lambda self, rows: waiting.append(int(rows.sum())) or freeze(self, rows))
    feed = _Feed(sources, sizes=(1, 0), cap=12)
    found = _continuous(_prepared(model), feed, max_len_a=10)
    assert [found[key] for key in feed.given] == alone
    assert len(steps) > 60 and len(waiting) > 10  # more steps than the table has; ended rows waited
    joined = [p for p in positions if p is not None]
    assert joined and max(int(p.max()) for p in joined) < 20


@pytest.mark.parametrize("n", [1, 2, 3])
def test_translate_continuous_keeps_the_no_repeat_ngram_rule_of_each_sentence_alone(monkeypatch, n):
    """Rows joining at different steps hold histories of different lengths: each sentence's
    result under ``no_repeat_ngram_size`` n is what it gets decoded alone with the rule, greedy
    and beam search."""
    model = _ending_model()
    sources = _random_sources(20, seed=12)
    greedy = _greedy_alone(model, sources, max_len_a=6, no_repeat_ngram_size=n)
    plain = _greedy_alone(model, sources, max_len_a=6)
    assert sum(a != b for a, b in zip(greedy, plain, strict=True)) >= 5  # the rule changes many outputs
    beams = _beams_alone(model, sources, beam=3, nbest=2, max_len_a=6, no_repeat_ngram_size=n)
    assert len({len(x) for x in greedy}) > 1 and len({len(h.tokens) for hyps in beams for h in hyps}) > 2
    joins = _spy_joins(monkeypatch)
    prepared = _prepared(model)
    feed = _Feed(sources, sizes=(1, 2, 0), cap=6)
    found = _continuous(prepared, feed, max_len_a=6, no_repeat_ngram_size=n)
    assert [found[key] for key in feed.given] == greedy
    assert sum(joins) >= 10
    joins.clear()
    feed = _Feed(sources, sizes=(1, 2, 0), cap=3)
    found = _continuous(prepared, feed, beam=3, nbest=2, max_len_a=6, no_repeat_ngram_size=n)
    for key, want in zip(feed.given, beams, strict=True):
        _assert_same_hypotheses(found[key], want)
    assert sum(joins) >= 10


@pytest.mark.parametrize("beam", [1, 3])
def test_continuous_batching_takes_fewer_steps_than_batch_after_batch(monkeypatch, beam):
    """The same sentences in the same groups of four: joining the running search as soon as
    fewer than eight decode takes fewer decoding steps than waiting for each batch's last
    sentence (the feed given only when nothing decodes, as ``translate_ids`` goes), with the
    same results, which are ``translate_ids``'s."""
    model = _prepared(_ending_model())
    sources = _random_sources(24, seed=13)
    steps = []
    _spy_steps(monkeypatch, lambda state, tokens: steps.append(tokens.size(0)))
    options = {"beam": beam, "nbest": 1, "max_len_a": 6}
    joining = _Feed(sources, sizes=(4,), cap=8)
    found = _continuous(model, joining, **options)
    joined_steps = len(steps)
    steps.clear()
    in_turn = _Feed(sources, sizes=(4,), cap=1)  # only when nothing decodes
    assert _continuous(model, in_turn, **options) == found
    assert set(in_turn.gave_at) == {0} and max(joining.gave_at) > 0
    assert joined_steps < 0.8 * len(steps)
    assert [found[key] for key in joining.given] == translate_ids(model, sources, beam=beam, max_len_a=6)


@pytest.mark.parametrize("beam", [1, 3])
def test_a_long_source_joining_short_ones(monkeypatch, beam):
    """A 50-token source joins short ones mid-search: the encoder-decoder K/V of every row are
    padded to its 51 positions while it decodes and trimmed back once it has ended, in the same
    search (the short ones go on); shorter sentences fed after it end before it; every result is
    the sentence's own."""
    model = _ending_model()
    g = torch.Generator().manual_seed(14)
    sources = [torch.randint(5, 16, (int(k),), generator=g).tolist() for k in torch.randint(1, 7, (30,), generator=g)]
    sources.insert(4, torch.randint(5, 16, (50,), generator=g).tolist())
    widths = []  # (search, source positions) at each step
    _spy_steps(monkeypatch, lambda state, tokens: widths.append((state, state.cache.cross_attn[0].k.size(2))))
    feed = _Feed(sources, sizes=(1, 0, 0), cap=4, keys=list(range(len(sources))))
    found = _continuous(_prepared(model), feed, beam=beam, max_len_a=4)
    if beam == 1:
        want = _greedy_alone(model, sources, max_len_a=4)
    else:
        want = [hyps[0].tokens for hyps in _beams_alone(model, sources, beam=beam, max_len_a=4)]
    assert found == dict(enumerate(want))
    assert feed.done.index(4) > feed.done.index(5)  # a later short sentence ended first
    assert max(w for _, w in widths) == 51 and widths[0][1] <= 7
    last = max(i for i, (_, w) in enumerate(widths) if w == 51)
    state = widths[last][0]
    after = [w for s, w in widths[last + 1 :] if s is state]
    assert after and max(after) <= 7  # the same search went on, its source K/V trimmed


@pytest.mark.parametrize("kind", ["the paper's model", "the engine under an attention window"])
def test_models_that_cannot_join_take_the_feed_only_between_batches(monkeypatch, kind):
    """On the paper's model, or on the engine with an attention window (positions counted from
    a shared start), the feed is asked only when nothing decodes; the results are still each
    sentence's own."""
    model = _model(seed=11, eos_boost=2.5, max_len=64, **({"attention_window": 3} if "window" in kind else {}))
    sources = _random_sources(16, seed=15)
    alone = _greedy_alone(model, sources, max_len_a=6)
    beams = _beams_alone(model, sources, beam=3, nbest=2, max_len_a=6)
    joins = _spy_joins(monkeypatch)
    searched = model if kind == "the paper's model" else _prepared(model)
    feed = _Feed(sources, sizes=(3,))
    found = _continuous(searched, feed, max_len_a=6)
    assert [found[key] for key in feed.given] == alone
    assert set(feed.asked) == {0} and len(feed.asked) == 16 // 3 + 2  # between batches, and once at the end
    feed = _Feed(sources, sizes=(5,))
    found = _continuous(searched, feed, beam=3, nbest=2, max_len_a=6)
    for key, want in zip(feed.given, beams, strict=True):
        _assert_same_hypotheses(found[key], want)
    assert set(feed.asked) == {0} and not joins


def test_translate_continuous_with_nothing_to_translate_and_empty_batches():
    """A feed that brings nothing ends the search at once; an empty batch counts as nothing."""
    model = _prepared(_ending_model())
    asked = []
    assert list(translate_continuous(model, lambda live: asked.append(live))) == [] and asked == [0]
    assert list(translate_continuous(model, lambda live: ([], []))) == []


def test_translate_continuous_rejects_mismatched_keys_and_bad_arguments():
    """A feed's keys and sources must pair up, at the start or mid-search, and no key may come
    twice while decoding; beam, nbest, no_repeat_ngram_size and max_len_a are checked as
    ``translate_ids`` checks them, when called (before the first step)."""
    model = _prepared(_ending_model())
    with pytest.raises(ValueError, match="2 keys for 1 sources"):
        list(translate_continuous(model, lambda live: ([1, 2], [[5, 6]])))
    with pytest.raises(ValueError, match="0 keys for 1 sources"):  # not an empty batch: a lost sentence
        list(translate_continuous(model, lambda live: ([], [[5, 6]])))
    with pytest.raises(ValueError, match="a key twice"):
        list(translate_continuous(model, lambda live: ([3, 3], [[5], [6]])))
    calls = iter([([7], [[5, 6, 7]]), ([7], [[6]])])  # key 7 again while the first 7 decodes
    with pytest.raises(ValueError, match="one still decoding"):
        list(translate_continuous(model, lambda live: next(calls, None)))
    calls = iter([([7], [[5, 6, 7]]), None, None])
    ended = list(translate_continuous(model, lambda live: next(calls, None) if live == 0 else None))
    again = iter([([7], [[6]])])
    assert [k for k, _ in ended] == [7] and list(translate_continuous(model, lambda live: next(again, None)))
    calls, asked = iter([([1], [[5, 6, 7]]), ([2], [[5], [6]])]), []
    with pytest.raises(ValueError, match="1 keys for 2 sources"):
        list(translate_continuous(model, lambda live: asked.append(live) or next(calls, None)))
    assert asked == [0, 1]  # the second batch, mid-search
    feed = _Feed([[5, 6]])
    for bad, match in [
        ({"beam": 0}, "beam"),
        ({"beam": 2, "nbest": 3}, "nbest"),
        ({"beam": 2, "nbest": 0}, "nbest"),
        ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size must be >= 0"),
        ({"max_len_a": -1}, "max_len_a"),
    ]:
        with pytest.raises(ValueError, match=match):
            translate_ids(model, [[5, 6]], **bad)
        with pytest.raises(ValueError, match=match):
            translate_continuous(model, feed, **bad)  # no iteration needed
    assert feed.asked == []  # rejected before the feed was asked
