"""Sampling from a decoder-only model and filling masks with an encoder-only one, against
independent truths: greedy decoding by full recomputation, brute-force nucleus sets, the
softmax the draws must follow."""

import itertools

import pytest
import torch

from aiayn import DecoderOnly, EncoderOnly, ModelConfig
from aiayn.decode import fill_mask, filter_logits, generate_ids, sample, sample_next
from helpers import randomize_

V = 24
PAD, BOS, EOS, MASK = 0, 1, 2, 4


def tiny(cls, seed: int = 0):
    torch.manual_seed(seed)
    model = randomize_(cls(ModelConfig.tiny(V)).eval(), seed)  # every parameter random: biases and layer norms too
    with torch.no_grad():  # sharper than the initialisation: distinct argmaxes, varied samples
        model.embedding.weight.mul_(4)
    return model


def greedy_by_recomputation(model: DecoderOnly, prompt: list[int], steps: int) -> list[int]:
    """The most likely next token, recomputing the whole prefix without a cache; never padding."""
    tokens = [BOS, *prompt]
    out = []
    for _ in range(steps):
        logits = model(torch.tensor([tokens]))[0, -1]
        logits[PAD] = float("-inf")
        token = int(logits.argmax())
        out.append(token)
        if token == EOS:
            break
        tokens.append(token)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_temperature_to_zero_equals_greedy(seed):
    model = tiny(DecoderOnly, seed)
    prompt = [5 + seed, 9, 11]
    expected = greedy_by_recomputation(model, prompt, 20)
    expected = expected[: expected.index(EOS)] if EOS in expected else expected
    assert len(expected) >= 3
    for temperature in (0.0, 1e-4):
        for draw_seed in (0, 1):
            got = generate_ids(model, prompt, max_new_tokens=20, temperature=temperature, seed=draw_seed)
            assert got == [expected]


def test_top_k_1_is_greedy_whatever_the_temperature():
    model = tiny(DecoderOnly)
    expected = generate_ids(model, [7, 8], max_new_tokens=15, temperature=0.0)
    assert generate_ids(model, [7, 8], max_new_tokens=15, temperature=5.0, top_k=1, seed=3) == expected


@pytest.mark.parametrize("k", [1, 3, 7])
def test_top_k_never_emits_a_token_outside_the_k_most_likely(k):
    g = torch.Generator().manual_seed(k)
    logits = torch.randn(64, 50, generator=g) * 3
    allowed = logits.topk(k, dim=-1).indices  # (B, k)
    seen = set()
    for _ in range(50):
        token = sample_next(logits, temperature=2.0, top_k=k, generator=g)  # a high temperature spreads the draws
        assert (allowed == token[:, None]).any(dim=-1).all()
        seen.update(zip(range(64), token.tolist(), strict=True))
    assert len(seen) > 64 * min(k, 2) * 0.9  # and the draws do vary among the k


def test_top_k_is_exactly_k_with_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0]])
    assert torch.isfinite(filter_logits(logits, top_k=2)).sum() == 2


def brute_force_nucleus(probs: list[float], p: float) -> set[int]:
    """The smallest set of tokens whose probability mass reaches p (of the smallest sets, the
    one of largest mass), by trying every subset."""
    for size in range(1, len(probs) + 1):
        reaching = [s for s in itertools.combinations(range(len(probs)), size) if sum(probs[i] for i in s) >= p]
        if reaching:
            return set(max(reaching, key=lambda s: sum(probs[i] for i in s)))
    raise AssertionError("p above the total mass")


@pytest.mark.parametrize("p", [0.05, 0.3, 0.5, 0.75, 0.9, 0.99])
def test_top_p_keeps_the_smallest_set_whose_mass_reaches_p(p):
    g = torch.Generator().manual_seed(int(p * 100))
    logits = torch.randn(20, 8, generator=g, dtype=torch.float64) * 1.5
    kept = torch.isfinite(filter_logits(logits, top_p=p))
    for row in range(logits.size(0)):
        expected = brute_force_nucleus(logits[row].softmax(-1).tolist(), p)
        assert set(kept[row].nonzero().flatten().tolist()) == expected


def test_top_p_after_top_k_renormalises_the_k():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    # among the top 2 (0.4, 0.3 -> 4/7, 3/7), p = 0.5 needs only the first
    assert torch.isfinite(filter_logits(logits, top_k=2, top_p=0.5)).tolist() == [[True, False, False, False]]
    assert torch.isfinite(filter_logits(logits, top_p=0.5)).tolist() == [[True, True, False, False]]


@pytest.mark.parametrize("temperature, top_p", [(1.0, None), (2.0, None), (0.5, 0.8)])
def test_draws_follow_the_tempered_filtered_softmax(temperature, top_p):
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    n = 40_000
    draws = sample_next(logits.expand(n, -1), temperature, top_p=top_p, generator=g)
    frequencies = torch.bincount(draws, minlength=5).double() / n
    expected = filter_logits((logits / temperature)[None], top_p=top_p)[0].double().softmax(-1)
    torch.testing.assert_close(frequencies, expected, atol=0.01, rtol=0)


def test_bad_sampling_arguments_are_errors():
    logits = torch.zeros(1, 5)
    with pytest.raises(ValueError, match="temperature"):
        sample_next(logits, temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        filter_logits(logits, top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        filter_logits(logits, top_k=-2)


def test_sampling_is_seeded_and_stops_at_eos_and_max_len():
    model = tiny(DecoderOnly)
    a = generate_ids(model, [5, 6], num_samples=6, max_new_tokens=12, temperature=1.5, seed=7)
    assert a == generate_ids(model, [5, 6], num_samples=6, max_new_tokens=12, temperature=1.5, seed=7)
    assert a != generate_ids(model, [5, 6], num_samples=6, max_new_tokens=12, temperature=1.5, seed=8)
    assert all(len(row) <= 12 and EOS not in row and PAD not in row for row in a)
    out = sample(model, torch.tensor([[BOS, 5, 6]] * 6), max_new_tokens=12, temperature=1.5,
                 generator=torch.Generator().manual_seed(7))  # fmt: skip
    for row in out.tolist():  # after EOS only padding
        if EOS in row:
            assert set(row[row.index(EOS) + 1 :]) <= {PAD}
    # the positions of a learned-position model end at max_len
    torch.manual_seed(0)
    short = DecoderOnly(ModelConfig.tiny(V, positional="learned", max_len=8)).eval()
    assert sample(short, torch.tensor([[BOS, 5, 6]]), max_new_tokens=50, temperature=0.0).size(1) <= 5


def test_fill_mask_gives_the_softmax_at_each_mask_most_likely_first():
    model = tiny(EncoderOnly)
    ids = [5, MASK, 7, 8, MASK, 9]
    result = fill_mask(model, ids, MASK, top_k=4)
    with torch.no_grad():
        probs = model(torch.tensor([[*ids, EOS]]))[0].softmax(-1)  # (L, V): EOS appended, as in training
    assert len(result) == 2
    for position, candidates in zip((1, 4), result, strict=True):
        expected = probs[position].topk(4)
        assert [t for t, _ in candidates] == expected.indices.tolist()
        assert [p for _, p in candidates] == pytest.approx(expected.values.tolist(), abs=1e-6)
    with pytest.raises(ValueError, match="no mask"):
        fill_mask(model, [5, 6], MASK)


def test_sampling_never_draws_a_suppressed_token():
    """``ModelConfig.suppress_ids``: greedy sampling is the recomputed argmax without the token,
    and hot draws that pick it without suppression never do with it."""
    model = tiny(DecoderOnly)
    expected = greedy_by_recomputation(model, [7, 8], 15)
    expected = expected[: expected.index(EOS)] if EOS in expected else expected
    word = max(set(expected), key=expected.count)  # the greedy output's most frequent word
    suppressed = DecoderOnly(model.config.replace(suppress_ids=(word,))).eval()
    suppressed.load_state_dict(model.state_dict())

    tokens, out = [BOS, 7, 8], []
    with torch.no_grad():
        while len(out) < 15 and (not out or out[-1] != EOS):
            logits = model(torch.tensor([tokens]))[0, -1]
            logits[[PAD, word]] = float("-inf")
            out.append(int(logits.argmax()))
            tokens.append(out[-1])
    out = out[: out.index(EOS)] if EOS in out else out
    assert generate_ids(suppressed, [7, 8], max_new_tokens=15, temperature=0.0) == [out] != [expected]

    prompt = torch.tensor([[BOS, 7, 8]] * 64)
    hot = dict(max_new_tokens=20, temperature=3.0, generator=torch.Generator().manual_seed(0))
    assert (sample(model, prompt, **hot) == word).sum() > 10
    hot["generator"] = torch.Generator().manual_seed(0)
    assert not (sample(suppressed, prompt, **hot) == word).any()
