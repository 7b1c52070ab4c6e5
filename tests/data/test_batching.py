"""Token-based batching (§5.1): length-sorted, bounded, every example once, deterministic."""

from pathlib import Path

import pytest
import torch

from aiayn.data.batching import RemadeBatcher, ResampledBatcher, TokenBatcher, collate, padding_fraction


def random_lengths(n: int, seed: int = 0) -> list[tuple[int, int]]:
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(2, 40, (n,), generator=g)
    tgt = (src + torch.randint(-3, 4, (n,), generator=g)).clamp(min=2)
    return list(zip(src.tolist(), tgt.tolist(), strict=True))


def test_every_example_once_per_epoch_within_max_tokens():
    lengths = random_lengths(2000)
    batcher = TokenBatcher(lengths, max_tokens=500, seed=3)
    for epoch in range(3):
        batches = batcher.epoch(epoch)
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
        for b in batches:
            assert len(b) * max(max(lengths[i][0], lengths[i][1]) for i in b) <= 500


def test_deterministic_under_seed_and_reshuffled_each_epoch():
    lengths = random_lengths(1000)
    a, b = TokenBatcher(lengths, 300, seed=1), TokenBatcher(lengths, 300, seed=1)
    assert a.epoch(0) == b.epoch(0) and a.epoch(5) == b.epoch(5)
    assert a.epoch(0) != a.epoch(1)  # bucket order shuffled each epoch
    assert sorted(map(sorted, a.epoch(0))) == sorted(map(sorted, a.epoch(1)))  # same buckets
    assert TokenBatcher(lengths, 300, seed=2).epoch(0) != a.epoch(0)
    assert TokenBatcher(lengths, 300, shuffle=False).epoch(7) == TokenBatcher(lengths, 300, shuffle=False).batches


def test_resampled_batcher_keeps_the_fixed_examples_and_draws_the_pool_without_repeats():
    lengths = random_lengths(1000)
    fixed, draw = 300, 200  # a pool of 700: epochs 0-2 draw 600 distinct, epoch 3 wraps around
    batcher = ResampledBatcher(lengths, fixed, draw, max_tokens=400, seed=5)
    drawn = []
    for epoch in range(4):
        batches = batcher.epoch(epoch)
        members = sorted(i for b in batches for i in b)
        assert members == sorted(batcher.members(epoch))  # every member once, nothing else
        assert members[:fixed] == list(range(fixed)) and len(members) == fixed + draw
        assert all(fixed <= i < 1000 for i in members[fixed:])
        for b in batches:
            assert len(b) * max(max(lengths[i]) for i in b) <= 400
        drawn.append(set(members[fixed:]))
    assert len(drawn[0] | drawn[1] | drawn[2]) == 600  # disjoint until the pool is used up
    assert drawn[3] >= set(range(fixed, 1000)) - (drawn[0] | drawn[1] | drawn[2])  # the last 100, then the start
    again = ResampledBatcher(lengths, fixed, draw, max_tokens=400, seed=5)
    assert again.epoch(2) == batcher.epoch(2) and again.epoch(0) == batcher.epoch(0)  # a function of (seed, epoch)
    assert ResampledBatcher(lengths, fixed, draw, max_tokens=400, seed=6).members(0) != batcher.members(0)


def test_resampled_batcher_with_a_draw_larger_than_the_pool_takes_the_pool_once():
    lengths = random_lengths(50)
    batcher = ResampledBatcher(lengths, fixed=40, draw=25, max_tokens=200)
    assert sorted(batcher.members(0)) == list(range(50)) == sorted(batcher.members(1))
    with pytest.raises(ValueError, match="fixed"):
        ResampledBatcher(lengths, fixed=60, draw=1, max_tokens=200)


def test_padding_fraction_hand_computed():
    lengths = [(2, 3), (4, 3), (1, 1)]
    # batch [0, 1]: src 2+4 of 2*4, tgt 3+3 of 2*3; batch [2]: no padding
    assert padding_fraction(lengths, [[0, 1], [2]]) == pytest.approx(1 - (6 + 6 + 2) / (8 + 6 + 2))


def test_example_longer_than_max_tokens_is_an_error():
    with pytest.raises(ValueError, match="longer than max_tokens"):
        TokenBatcher([(3, 3), (50, 4)], max_tokens=20)


def test_collate_layout():
    batch = collate([([5, 6, 7], [8]), ([9], [10, 11])], pad_id=0, bos_id=1, eos_id=2)
    assert batch.src.tolist() == [[5, 6, 7, 2], [9, 2, 0, 0]]
    assert batch.tgt_in.tolist() == [[1, 8, 0], [1, 10, 11]]
    assert batch.tgt_out.tolist() == [[8, 2, 0], [10, 11, 2]]
    assert batch.num_tokens == 5 and batch.num_src_tokens == 6


DING_TRAIN = Path(__file__).resolve().parents[2] / "data" / "ding"


def test_padding_under_10_percent_on_ding_train(tmp_path):
    from aiayn.data.ding import find_ding, parse_ding, split_ding
    from aiayn.data.tokenizer import Tokenizer

    try:
        path = find_ding(download=False)
    except FileNotFoundError:
        pytest.skip("the Ding dictionary is not installed (make ding)")
    train = split_ding(parse_ding(path).sentences)["train"]
    tokenizer = Tokenizer.train((t for pair in train for t in pair), vocab_size=8000)
    src = tokenizer.encode_batch([s for s, _ in train])
    tgt = tokenizer.encode_batch([t for _, t in train])
    lengths = [(len(s) + 1, len(t) + 1) for s, t in zip(src, tgt, strict=True)]
    for max_tokens in (1500, 2048, 4096):  # 25,000 (the paper's) spans too many lengths here: ~15%
        batcher = TokenBatcher(lengths, max_tokens, seed=0)
        fraction = padding_fraction(lengths, batcher.batches)
        print(f"max_tokens {max_tokens}: {len(batcher)} batches, padding {fraction:.2%}")
        assert fraction < 0.10


def test_for_evaluation_an_example_longer_than_max_tokens_gets_a_batch_of_its_own():
    lengths = [(3, 3), (50, 4), (4, 2), (30, 40), (2, 2)]
    batches = TokenBatcher(lengths, max_tokens=20, shuffle=False, long_alone=True).batches
    assert sorted(i for b in batches for i in b) == [0, 1, 2, 3, 4]
    assert [1] in batches and [3] in batches
    assert all(len(b) * max(max(lengths[i]) for i in b) <= 20 for b in batches if b not in ([1], [3]))


def test_remade_batcher_batches_each_epochs_remade_examples_as_token_batcher_does():
    """Each epoch's examples are remade (here: every one lengthened by a per-epoch amount) and
    batched exactly as ``TokenBatcher`` batches the remade lengths; every member once per epoch;
    ``examples(epoch)`` what the batches index, also for the epoch before (a step may straddle)."""
    examples = [[7] * (1 + i % 9) for i in range(50)]

    def remake(chosen, epoch):
        return [x + [8] * ((epoch + len(x)) % 4) for x in chosen]

    def lengths(chosen):
        return [(len(x) + 1, len(x) + 1) for x in chosen]

    members = [i for i in range(50) if i % 5]  # some examples left out, as a draw leaves them
    batcher = RemadeBatcher(examples, lambda epoch: members, remake, lengths, max_tokens=24, seed=3)
    for epoch in (0, 1, 2):
        remade = remake([examples[i] for i in members], epoch)
        expected = TokenBatcher(lengths(remade), 24, seed=3).epoch(epoch)
        assert batcher.epoch(epoch) == [[members[i] for i in batch] for batch in expected]
        assert batcher.examples(epoch) == dict(zip(members, remade, strict=True))
        assert sorted(i for batch in batcher.epoch(epoch) for i in batch) == members
        for batch in batcher.epoch(epoch):
            assert len(batch) * max(len(batcher.examples(epoch)[i]) + 1 for i in batch) <= 24
    assert batcher.examples(1) == dict(zip(members, remake([examples[i] for i in members], 1), strict=True))
    assert batcher.epoch(0) != batcher.epoch(1)
