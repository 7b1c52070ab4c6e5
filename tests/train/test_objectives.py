"""The per-task batches: BERT's masking rates on a large sample, the causal LM's shift, the masked
LM's targets; the ``select`` path of the language models; ``<mask>`` in the tokenizer."""

import random
from collections import Counter

import pytest
import torch

from aiayn import DecoderOnly, EncoderOnly, ModelConfig, Transformer
from aiayn.data.batching import collate
from aiayn.data.tokenizer import Tokenizer
from aiayn.train.config import TrainConfig
from aiayn.train.objectives import CausalLM, MaskedLM, Translation, drop_words, mask_tokens, objective_for, split_merges
from aiayn.train.trainer import evaluate_loss

PAD, BOS, EOS, UNK, MASK, PHRASE = 0, 1, 2, 3, 4, 5


def test_masking_rates_are_15_80_10_10():
    """200 x 500 tokens over a 1,000-token vocabulary, the last 100 positions of each row padding:
    80,000 maskable tokens, ~12,000 chosen. Tolerances are ~5 standard deviations."""
    V, B, L = 1000, 200, 500
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(5, V, (B, L), generator=g)
    tokens[:, 400:] = PAD
    maskable = tokens != PAD
    inputs, chosen = mask_tokens(tokens, maskable, V, g)
    n = int(maskable.sum())
    assert not (chosen & ~maskable).any() and torch.equal(inputs[~chosen], tokens[~chosen])
    assert abs(chosen.sum().item() / n - 0.15) < 5 * (0.15 * 0.85 / n) ** 0.5
    c = int(chosen.sum())
    masked = (inputs[chosen] == MASK).sum().item() / c
    kept = (inputs[chosen] == tokens[chosen]).sum().item() / c
    replaced = ((inputs[chosen] != MASK) & (inputs[chosen] != tokens[chosen])).sum().item() / c
    tolerance = 5 * (0.1 * 0.9 / c) ** 0.5
    assert abs(masked - 0.8) < 5 * (0.8 * 0.2 / c) ** 0.5
    # a random replacement equals the original token with probability 1 / 995: counted as kept
    assert abs(kept - (0.1 + 0.1 / (V - 5))) < tolerance
    assert abs(replaced - 0.1 * (1 - 1 / (V - 5))) < tolerance
    random_tokens = inputs[chosen & (inputs != MASK) & (inputs != tokens)]
    assert random_tokens.min() >= 5 and random_tokens.max() < V  # never a special token
    assert len(random_tokens.unique()) > 0.7 * (V - 5)  # spread over the vocabulary


def test_every_sequence_gets_a_target_and_masking_is_seeded():
    tokens = torch.tensor([[7, EOS, PAD, PAD], [8, 9, EOS, PAD], [PAD, PAD, PAD, PAD]])
    maskable = tokens >= 5
    for seed in range(20):
        a = mask_tokens(tokens, maskable, 50, torch.Generator().manual_seed(seed))
        b = mask_tokens(tokens, maskable, 50, torch.Generator().manual_seed(seed))
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert a[1][:2].any(dim=1).all() and not a[1][2].any()  # one target at least, none in an empty row
        assert not (a[1] & ~maskable).any()


def test_causal_lm_batch_is_the_shifted_sequence():
    config = ModelConfig.tiny(32)
    batch = CausalLM().collate([[5, 6, 7], [8]], config, seed=0)
    assert batch.inputs.tolist() == [[BOS, 5, 6, 7], [BOS, 8, PAD, PAD]]
    assert batch.targets.tolist() == [[5, 6, 7, EOS], [8, EOS, PAD, PAD]]
    assert (batch.num_tokens, batch.num_positions) == (6, 6)


def test_masked_lm_batch_scores_only_the_chosen_tokens():
    config = ModelConfig.tiny(32)
    examples = [[6 + i % 20 for i in range(n)] for n in (30, 12, 1)]  # words: ids >= 6
    batch = MaskedLM(0.15).collate(examples, config, seed=3)
    tokens = torch.tensor([[*x, EOS] + [PAD] * (30 - len(x)) for x in examples])
    chosen = batch.targets != PAD
    assert torch.equal(batch.targets[chosen], tokens[chosen])  # the original token, where chosen
    assert torch.equal(batch.inputs[~chosen], tokens[~chosen])  # the rest as it was
    assert not chosen[tokens == EOS].any() and chosen.any(dim=1).all()
    assert batch.num_positions == 30 + 12 + 1 + 3
    again = MaskedLM(0.15).collate(examples, config, seed=3)
    assert torch.equal(again.inputs, batch.inputs) and torch.equal(again.targets, batch.targets)
    assert not torch.equal(MaskedLM(0.15).collate(examples, config, seed=4).targets, batch.targets)


@pytest.mark.parametrize("cls", [DecoderOnly, EncoderOnly])
def test_select_computes_the_logits_of_the_selected_positions(cls):
    torch.manual_seed(0)
    model = cls(ModelConfig.tiny(32)).eval()
    tokens = torch.randint(5, 32, (3, 7))
    tokens[1, 4:] = PAD
    select = tokens != PAD
    select[0, 2] = False
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, select=select), model(tokens)[select])


@pytest.fixture(scope="module")
def tokenizer():
    text = ["Das ist ein rotes Haus.", "Das Haus ist groß.", "Ein kleines Haus ist gut."] * 20
    return Tokenizer.train(text, 300)


@pytest.mark.parametrize(
    "masked, plain, position",
    [
        ("Das ist ein <mask> Haus.", "Das ist ein rotes Haus.", 3),  # space before: the masked word carries it
        ("Das ist ein  <mask> Haus.", "Das ist ein rotes Haus.", 3),
        ("Das ist ein rotes <mask>.", "Das ist ein rotes Haus.", 4),  # no prefix space after a mask
        ("<mask> ist ein rotes Haus.", "Das ist ein rotes Haus.", 0),
    ],
)
def test_mask_text_encodes_as_the_masked_word_did_in_training(tokenizer, masked, plain, position):
    """Replacing the word's token by <mask> in the encoding of the plain text is the truth."""
    ids = tokenizer.encode(plain)
    word = tokenizer.encode(plain.split()[position].rstrip("."))
    assert len(word) == 1  # the fixture's words are single tokens
    expected = [MASK if i == word[0] else i for i in ids]
    assert tokenizer.encode(masked) == expected
    assert tokenizer.encode_batch([masked, plain]) == [expected, ids]
    assert tokenizer.tokens(masked)[position] == "<mask>"


# Word dropout (train.word_dropout) ------------------------------------------------------------------


@pytest.mark.parametrize("p", [0.1, 0.3])
def test_drop_words_replaces_words_by_unk_at_rate_p_and_nothing_else(p):
    """200 x 500 tokens, a sixth of them specials (padding, BOS, EOS, <unk>, <mask>) or the tag
    <phrase> (id 5, kept as ``data.phrase_tag``'s suppress_ids keeps it): each word (id >= 6)
    becomes <unk> with probability p (5 standard deviations), a special or a kept id never."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(6, 1000, (200, 500), generator=g)
    specials = torch.rand(tokens.shape, generator=g) < 1 / 6
    tokens[specials] = torch.randint(0, 6, (int(specials.sum()),), generator=g)
    out = drop_words(tokens, p, torch.Generator().manual_seed(1), keep=(PHRASE,))
    changed = out != tokens
    assert torch.all(out[changed] == UNK)
    assert not changed[tokens < 6].any()
    words = tokens >= 6
    n = int(words.sum())
    assert abs(changed.sum().item() / n - p) < 5 * (p * (1 - p) / n) ** 0.5
    again = drop_words(tokens, p, torch.Generator().manual_seed(1), keep=(PHRASE,))
    assert torch.equal(again, out)
    assert not torch.equal(drop_words(tokens, p, torch.Generator().manual_seed(2), keep=(PHRASE,)), out)
    assert torch.equal(drop_words(tokens, 0.0, torch.Generator().manual_seed(1)), tokens)
    # without the tag kept, id 5 is text (a tokenizer trained without <phrase>): it may be dropped
    unkept = drop_words(tokens, p, torch.Generator().manual_seed(1))
    assert (unkept[tokens == PHRASE] == UNK).any() and not (unkept[tokens < PHRASE] != tokens[tokens < PHRASE]).any()


def word_examples(n: int = 64, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Pairs of 1-12 words (ids 6-99), every third source tagged with <phrase> (data.phrase_tag)."""
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for i in range(n):
        src = torch.randint(6, 100, (int(torch.randint(1, 13, (1,), generator=g)),), generator=g).tolist()
        tgt = torch.randint(6, 100, (int(torch.randint(1, 13, (1,), generator=g)),), generator=g).tolist()
        pairs.append(([PHRASE, *src] if i % 3 == 0 else src, tgt))
    return pairs


def test_translation_word_dropout_replaces_source_and_decoder_input_words_only():
    """Against the plain batch (``collate``): tgt_out as it was; src and tgt_in differ only where a
    word became <unk>; padding, BOS, EOS and the <phrase> tag kept; about p of the words dropped
    on each side; seeded; and train=False (evaluation) gives the plain batch."""
    config, p = ModelConfig.tiny(100, suppress_ids=(PHRASE,)), 0.25  # as the trainer makes it with the tag
    pairs = word_examples()
    plain = collate(pairs, PAD, BOS, EOS)
    batch = Translation(p).collate(pairs, config, seed=5, train=True)
    assert torch.equal(batch.tgt_out, plain.tgt_out)
    for dropped, original in ((batch.src, plain.src), (batch.tgt_in, plain.tgt_in)):
        changed = dropped != original
        assert torch.all(dropped[changed] == UNK) and not changed[original < 6].any()
        n = int((original >= 6).sum())
        assert abs(changed.sum().item() / n - p) < 5 * (p * (1 - p) / n) ** 0.5
    assert torch.all(batch.src[::3, 0] == PHRASE) and torch.all(batch.tgt_in[:, 0] == BOS)
    again = Translation(p).collate(pairs, config, seed=5, train=True)
    assert torch.equal(again.src, batch.src) and torch.equal(again.tgt_in, batch.tgt_in)
    other = Translation(p).collate(pairs, config, seed=6, train=True)
    assert not torch.equal(other.src, batch.src) and not torch.equal(other.tgt_in, batch.tgt_in)
    for evaluation in (Translation(p).collate(pairs, config, seed=5), Translation().collate(pairs, config, 5, True)):
        assert torch.equal(evaluation.src, plain.src) and torch.equal(evaluation.tgt_in, plain.tgt_in)
        assert torch.equal(evaluation.tgt_out, plain.tgt_out)


def test_causal_lm_word_dropout_replaces_input_words_only():
    config, p = ModelConfig.tiny(100, suppress_ids=(PHRASE,)), 0.25
    texts = [src for src, _ in word_examples()]
    plain = CausalLM().collate(texts, config, seed=0)
    batch = CausalLM(p).collate(texts, config, seed=3, train=True)
    assert torch.equal(batch.targets, plain.targets)
    changed = batch.inputs != plain.inputs
    assert torch.all(batch.inputs[changed] == UNK) and not changed[plain.inputs < 6].any()
    n = int((plain.inputs >= 6).sum())
    assert abs(changed.sum().item() / n - p) < 5 * (p * (1 - p) / n) ** 0.5
    assert torch.equal(CausalLM(p).collate(texts, config, seed=3, train=True).inputs, batch.inputs)
    assert not torch.equal(CausalLM(p).collate(texts, config, seed=4, train=True).inputs, batch.inputs)
    assert torch.equal(CausalLM(p).collate(texts, config, seed=3).inputs, plain.inputs)


def test_word_dropout_reaches_the_objective_and_the_masked_lm_rejects_it():
    steps = dict(max_steps=1)
    assert objective_for(TrainConfig(word_dropout=0.2, **steps)).word_dropout == 0.2
    assert objective_for(TrainConfig(task="lm", word_dropout=0.3, **steps)).word_dropout == 0.3
    assert objective_for(TrainConfig(**steps)).word_dropout == 0.0  # off by default
    with pytest.raises(ValueError, match="word_dropout"):
        TrainConfig(task="mlm", word_dropout=0.1, **steps)
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="word_dropout"):
            TrainConfig(word_dropout=bad, **steps)


@pytest.mark.parametrize("task", ["translation", "lm"])
def test_dev_loss_is_unaffected_by_word_dropout(task):
    """``evaluate_loss`` with an objective that drops words equals the one without, although the
    same batches with word dropout applied (train=True) give another loss."""
    torch.manual_seed(0)
    config = ModelConfig.tiny(100)
    if task == "translation":
        model, examples, objective = Transformer(config), word_examples(), Translation
    else:
        model, examples, objective = DecoderOnly(config), [s for s, _ in word_examples()], CausalLM
    model.train()
    with_dropout = evaluate_loss(model, examples, 200, torch.device("cpu"), objective(0.5))
    without = evaluate_loss(model, examples, 200, torch.device("cpu"), objective())
    assert with_dropout == without
    assert model.training  # put back
    plain = objective(0.5).collate(examples, config, seed=0)
    dropped = objective(0.5).collate(examples, config, seed=0, train=True)
    with torch.no_grad():
        assert objective().loss(model, plain, 0.0)[1] != objective().loss(model, dropped, 0.0)[1]


# BPE-dropout (train.bpe_dropout) ------------------------------------------------------------------

# a hand-made merge tree: 10 = 6 + 7, 11 = 10 + 8, 12 = 11 + 9
TREE = {10: (6, 7), 11: (10, 8), 12: (11, 9)}


@pytest.mark.parametrize("p", [0.1, 0.4])
def test_bpe_dropout_draws_each_segmentation_with_its_probability(p):
    """Token 11 = (6 + 7) + 8 has three segmentations; splitting each merge with probability p
    top down gives [11] with 1 - p, [10, 8] with p (1 - p), [6, 7, 8] with p². 20,000 draws
    against those (5 standard deviations), and token 12's mean length against the recursion
    E n(t) = (1 - p) + p (E n(left) + E n(right))."""
    rng, n = random.Random(0), 20_000
    counts = Counter(tuple(split_merges([11], p, TREE, rng)) for _ in range(n))
    expected = {(11,): 1 - p, (10, 8): p * (1 - p), (6, 7, 8): p * p}
    assert set(counts) == set(expected)
    for outcome, q in expected.items():
        assert abs(counts[outcome] / n - q) < 5 * (q * (1 - q) / n) ** 0.5, outcome

    def mean_length(t):
        if t not in TREE:
            return 1.0
        return (1 - p) + p * (mean_length(TREE[t][0]) + mean_length(TREE[t][1]))

    lengths = [len(split_merges([12], p, TREE, rng)) for _ in range(n)]
    mean = sum(lengths) / n
    sd = (sum((x - mean) ** 2 for x in lengths) / n) ** 0.5
    assert abs(mean - mean_length(12)) < 5 * sd / n**0.5


def test_bpe_dropout_keeps_the_text_and_is_repeatable(tokenizer):
    """On a trained BPE: the split ids decode to the same text, are longer at p 0.3, equal at p 0;
    the same seed draws the same splits, another seed others; a token with no merge (a byte, a
    special, the tag) is never split."""
    parents = tokenizer.merge_parents()
    texts = ["Das ist ein rotes Haus.", "Ein kleines Haus ist groß.", "Das Haus ist gut, das rote nicht."]
    for text in texts:
        ids = tokenizer.encode(text)
        assert split_merges(ids, 0.0, parents, random.Random(0)) == ids
        split = [split_merges(ids, 0.3, parents, random.Random(seed)) for seed in range(20)]
        assert all(tokenizer.decode(s) == text for s in split)
        assert sum(map(len, split)) > 20 * len(ids)
        assert split_merges(ids, 0.3, parents, random.Random(3)) == split[3]
        assert len({tuple(s) for s in split}) > 1
    kept = [PAD, BOS, EOS, UNK, MASK, PHRASE, tokenizer.hf.token_to_id("a")]
    assert split_merges(kept, 0.9, parents, random.Random(0)) == kept
    ids = tokenizer.encode(texts[2])
    for max_len in (len(ids) - 1, len(ids), len(ids) + 3):  # splits stop at max_len tokens
        capped = [split_merges(ids, 0.9, parents, random.Random(seed), max_len) for seed in range(20)]
        assert all(len(c) == max(len(ids), max_len) and tokenizer.decode(c) == texts[2] for c in capped)


@pytest.mark.parametrize("task", ["translation", "lm"])
def test_split_examples_splits_every_sequence_and_collate_does_not(task, tokenizer):
    """``split_examples`` splits each sequence (both sides of a pair) so that it spells the same
    text, the same seed the same way and another seed otherwise, no sequence past ``max_len - 1``;
    ``collate`` leaves examples as they come, train or not (the trainer splits whole epochs
    before batching them); an objective never given the tokenizer's merges refuses rather than
    skip the splits."""
    config, p = ModelConfig.tiny(tokenizer.vocab_size), 0.3
    sentences = ["Das ist ein rotes Haus.", "Ein kleines Haus ist groß.", "Das Haus ist gut."] * 4
    objective = objective_for(TrainConfig(task=task, bpe_dropout=p, max_steps=1))
    assert objective.bpe_dropout == p
    if task == "translation":
        examples = [(tokenizer.encode(s), tokenizer.encode(s[::-1])) for s in sentences]
        texts = [(s, s[::-1]) for s in sentences]
    else:
        examples, texts = [tokenizer.encode(s) for s in sentences], [(s,) for s in sentences]

    def sides(example):
        return example if task == "translation" else (example,)

    with pytest.raises(ValueError, match="merge_parents"):  # never a silent no-op
        objective.split_examples(examples, 64, random.Random(0))
    objective.merge_parents = tokenizer.merge_parents()
    split = objective.split_examples(examples, 64, random.Random(1))
    assert [tuple(tokenizer.decode(x) for x in sides(e)) for e in split] == texts
    for side in range(len(texts[0])):
        assert sum(len(sides(e)[side]) for e in split) > sum(len(sides(e)[side]) for e in examples)
    assert objective.split_examples(examples, 64, random.Random(1)) == split
    assert objective.split_examples(examples, 64, random.Random(2)) != split
    longest = max(len(x) for e in examples for x in sides(e))
    capped = objective.split_examples(examples, longest + 2, random.Random(1))
    assert max(len(x) for e in capped for x in sides(e)) == longest + 1
    trained, plain = objective.collate(split, config, seed=1, train=True), objective.collate(split, config, seed=1)
    for name in ("src", "tgt_in", "tgt_out") if task == "translation" else ("inputs", "targets"):
        assert torch.equal(getattr(trained, name), getattr(plain, name))


def test_bpe_dropout_is_validated():
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="bpe_dropout"):
            TrainConfig(bpe_dropout=bad, max_steps=1)
    with pytest.raises(ValueError, match="bpe_dropout"):
        TrainConfig(task="mlm", bpe_dropout=0.1, max_steps=1)
    assert objective_for(TrainConfig(max_steps=1)).bpe_dropout == 0.0  # off by default
