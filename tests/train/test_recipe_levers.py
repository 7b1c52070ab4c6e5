"""The trainer's recipe levers end to end, each on a few steps of a tiny model: ``data.phrase_tag``
(the <phrase> tag on dictionary pairs' sources, never produced), ``train.word_dropout`` and
``train.bpe_dropout`` (training batches only), ``data.substitute`` (a noun of Ding swapped on both
sides of sentence pairs, training batches only), and ``train.amp`` (the precision chosen, logged,
checkpointed, kept on resume; the probe leaving the run as it would have been). The corpus of
test_trainer.py."""

import json
from pathlib import Path

import pytest
import torch
from tests.train.test_trainer import losses, write_config, write_corpus

from aiayn.data.tokenizer import Tokenizer
from aiayn.train import objectives
from aiayn.train import precision as precision_module
from aiayn.train import trainer as trainer_module
from aiayn.train.config import DataConfig, RunConfig, TrainConfig, parse_overrides
from aiayn.train.objectives import Translation
from aiayn.train.trainer import train

UNK, PHRASE = 3, 5
QUIET = {"progress": False, "log": lambda _: None}
# dictionary entries with words of their own, so that a pair tells where it came from
ENTRIES = {"baum": "tree", "see": "lake", "berg": "mountain", "blau": "blue", "alt": "old"}


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    return write_corpus(root, n_train=60)


def write_entries(root: Path, n: int = 120) -> None:
    """``phrases.{de,en}``: n entries of one or two words of ``ENTRIES``."""
    g = torch.Generator().manual_seed(2)
    german = list(ENTRIES)
    de, en = [], []
    for _ in range(n):
        n_words = int(torch.randint(1, 3, (1,), generator=g))
        words = [german[i] for i in torch.randint(0, len(german), (n_words,), generator=g)]
        de.append(" ".join(words))
        en.append(" ".join(ENTRIES[w] for w in words))
    (root / "phrases.de").write_text("\n".join(de) + "\n")
    (root / "phrases.en").write_text("\n".join(en) + "\n")


def record_collates(monkeypatch) -> list[tuple[list, str, object]]:
    """Every ``Translation.collate`` call: (examples, phase, batch), the phase ``"train"`` for the
    training batches (train=True), ``"dev"`` inside ``evaluate_loss``, ``"other"`` else (the
    batches the precision probe would time)."""
    calls = []
    collate, evaluate_loss = Translation.collate, trainer_module.evaluate_loss
    in_dev = []

    def recording(self, examples, config, seed, train=False):
        batch = collate(self, examples, config, seed, train)
        calls.append((examples, "dev" if in_dev else "train" if train else "other", batch))
        assert not (train and in_dev)
        return batch

    def evaluating(*args, **kwargs):
        in_dev.append(1)
        try:
            return evaluate_loss(*args, **kwargs)
        finally:
            in_dev.pop()

    monkeypatch.setattr(Translation, "collate", recording)
    monkeypatch.setattr(trainer_module, "evaluate_loss", evaluating)
    return calls


# data.phrase_tag ---------------------------------------------------------------------------------


def test_phrase_tag_marks_exactly_the_phrase_pairs_and_the_model_never_produces_it(tmp_path, corpus, monkeypatch):
    """Every training example whose source starts with <phrase> is a line of phrases.{de,en},
    every other one a line of train.{de,en}; the tag is nowhere else (not in targets, not in the
    dev batches); the saved model suppresses it."""
    write_entries(corpus)
    config = write_config(tmp_path, corpus, max_steps=6, checkpoint_every=3, eval_every=3, amp=False)
    overrides = ["--data.phrases", "1.0", "--data.resample_phrases", "true", "--data.phrase_tag", "true"]
    calls = record_collates(monkeypatch)
    train(RunConfig.from_yaml(config, parse_overrides(overrides)), tmp_path / "run", **QUIET)

    out = tmp_path / "run"
    tokenizer = Tokenizer.load(out / "model" / "tokenizer.json")
    assert tokenizer.phrase_id == PHRASE
    for directory in (out / "model", out / "checkpoints" / "step_00000006"):
        assert json.loads((directory / "config.json").read_text())["suppress_ids"] == [PHRASE]

    phrases = {(de, en) for de, en in zip(
        (corpus / "phrases.de").read_text().splitlines(), (corpus / "phrases.en").read_text().splitlines(), strict=True
    )}  # fmt: skip
    sentences = set(zip((corpus / "train.de").read_text().splitlines(), (corpus / "train.en").read_text().splitlines(),
                        strict=True))  # fmt: skip
    tagged = untagged = 0
    training = [(examples, batch) for examples, phase, batch in calls if phase == "train"]
    dev = [batch for _, phase, batch in calls if phase == "dev"]
    assert training and dev
    for examples, batch in training:
        for row, (src, tgt) in enumerate(examples):
            assert PHRASE not in src[1:] and PHRASE not in tgt
            pair = (tokenizer.decode(src), tokenizer.decode(tgt))  # decode skips the tag
            if src[0] == PHRASE:
                tagged += 1
                assert pair in phrases, pair
                assert batch.src[row, 0] == PHRASE
            else:
                untagged += 1
                assert pair in sentences, pair
        assert not (batch.tgt_in == PHRASE).any() and not (batch.tgt_out == PHRASE).any()
    assert tagged > 10 and untagged > 10
    assert not any((batch.src == PHRASE).any() for batch in dev)  # dev sources are real sentences


def test_a_tagged_source_keeps_within_max_len(tmp_path, corpus, monkeypatch):
    """data.max_len bounds a tagged source as any other: tag, words and </s> (a phrase pair one
    token too long for the tag is skipped like a sentence that is too long)."""
    from collections import Counter

    write_entries(corpus)
    entries = (corpus / "phrases.de").read_text().splitlines()  # English: the first word's only, so that
    (corpus / "phrases.en").write_text("".join(ENTRIES[de.split()[0]] + "\n" for de in entries))  # sources are longer
    config = write_config(tmp_path, corpus, max_steps=1, checkpoint_every=None, eval_every=100, amp=False)
    overrides = ["--data.phrases", "1.0", "--data.resample_phrases", "true", "--data.phrase_tag", "true"]
    train(RunConfig.from_yaml(config, parse_overrides(overrides)), tmp_path / "a", **QUIET)
    tokenizer = Tokenizer.load(tmp_path / "a" / "model" / "tokenizer.json")  # max_len does not change it
    pairs = [(len(tokenizer.encode(de)), len(tokenizer.encode(en))) for de, en in zip(
        (corpus / "phrases.de").read_text().splitlines(), (corpus / "phrases.en").read_text().splitlines(), strict=True
    )]  # fmt: skip
    # the commonest source length among pairs whose target is not longer: such pairs fit untagged only
    max_len = Counter(s for s, t in pairs if t <= s).most_common(1)[0][0] + 1
    pools = []  # the (source, target) lengths with </s> of the phrase pairs the batcher draws from

    class Recording(trainer_module.ResampledBatcher):
        def __init__(self, lengths, fixed, *args, **kwargs):
            pools.append(lengths[fixed:])
            super().__init__(lengths, fixed, *args, **kwargs)

    monkeypatch.setattr(trainer_module, "ResampledBatcher", Recording)
    run = RunConfig.from_yaml(config, parse_overrides([*overrides, "--data.max_len", str(max_len)]))
    train(run, tmp_path / "b", **QUIET)
    (pool,) = pools
    fitting = [(s, t) for s, t in pairs if s + 1 < max_len and t < max_len]  # + the tag, with </s> <= max_len
    assert len(pool) == len(fitting) > 0 and max(s for s, _ in pool) <= max_len
    assert any(s + 1 == max_len and t < max_len for s, t in pairs)  # what it leaves out


def test_phrase_tag_needs_resampled_phrases(tmp_path, corpus):
    with pytest.raises(ValueError, match=r"phrase_tag.*resample_phrases"):
        DataConfig(dir=str(corpus), phrases=1.0, phrase_tag=True)
    assert DataConfig(dir=str(corpus), phrases=1.0, resample_phrases=True, phrase_tag=True).phrase_tag
    config = write_config(tmp_path, corpus, max_steps=1)
    with pytest.raises(ValueError, match="phrase_tag"):
        RunConfig.from_yaml(config, parse_overrides(["--data.phrases", "1.0", "--data.phrase_tag", "true"]))


# train.word_dropout -------------------------------------------------------------------------------


def test_word_dropout_applies_to_training_batches_only(tmp_path, corpus, monkeypatch):
    """Training batches are collated with train=True and hold <unk> in place of about p of the
    source words (the corpus has no unknown word, so every <unk> is a dropped word); the dev
    batches (evaluate_loss) are collated with train=False and hold none."""
    config = write_config(tmp_path, corpus, max_steps=4, checkpoint_every=None, eval_every=2, amp=False)
    calls = record_collates(monkeypatch)
    train(RunConfig.from_yaml(config, parse_overrides(["--train.word_dropout", "0.3"])), tmp_path / "run", **QUIET)
    training = [batch for _, phase, batch in calls if phase == "train"]
    dev = [batch for _, phase, batch in calls if phase == "dev"]
    assert len(training) == 4 and dev
    dropped = sum(int((b.src == UNK).sum()) for b in training)
    words = sum(int((b.src >= 6).sum()) + int((b.src == UNK).sum()) for b in training)
    assert 0.2 < dropped / words < 0.4
    assert all(not (b.src == UNK).any() and not (b.tgt_in == UNK).any() for b in dev)
    assert all(not (b.tgt_out == UNK).any() for b in training)


# train.bpe_dropout --------------------------------------------------------------------------------


def test_bpe_dropout_batches_each_epochs_split_examples_by_their_lengths(tmp_path, corpus, monkeypatch):
    """The training batches hold the corpus's sentence pairs, split: more tokens than their plain
    encodings, a sentence in other segmentations in other epochs, and each batch within
    ``max_tokens`` by its split lengths (batched after the split, not before); dev batches hold
    the plain encodings."""
    max_tokens = 160
    config = write_config(tmp_path, corpus, max_steps=24, checkpoint_every=None, eval_every=12, amp=False)
    run = RunConfig.from_yaml(config, parse_overrides(["--train.bpe_dropout", "0.3"]))
    calls = record_collates(monkeypatch)
    result = train(run, tmp_path / "run", **QUIET)
    assert result.epoch >= 2
    tokenizer = Tokenizer.load(tmp_path / "run" / "tokenizer.json")
    pairs = set(zip((corpus / "train.de").read_text().splitlines(), (corpus / "train.en").read_text().splitlines(),
                    strict=True))  # fmt: skip
    training = [(examples, batch) for examples, phase, batch in calls if phase == "train"]
    assert len(training) == 24
    split = plain = 0
    segmentations: dict[tuple[str, str], set] = {}
    for examples, batch in training:
        assert batch.src.numel() <= max_tokens and batch.tgt_in.numel() <= max_tokens
        for s, t in examples:
            pair = tokenizer.decode(s), tokenizer.decode(t)
            assert pair in pairs
            segmentations.setdefault(pair, set()).add((tuple(s), tuple(t)))
            split += len(s) + len(t)
            plain += len(tokenizer.encode(pair[0])) + len(tokenizer.encode(pair[1]))
    assert split > plain
    assert any(len(seen) > 1 for seen in segmentations.values())
    dev = [examples for examples, phase, _ in calls if phase == "dev"]
    assert dev
    for examples in dev:
        de = [tokenizer.decode(s) for s, _ in examples]
        assert [s for s, _ in examples] == [tokenizer.encode(text) for text in de]


def test_bpe_dropout_from_an_epoch_splits_no_token_before_it_and_splits_from_it_on(tmp_path, corpus, monkeypatch):
    """``train.bpe_dropout_from 2``: the training batches of epochs 0 and 1 hold exactly the plain
    encodings of their sentence pairs; those of epoch 2 on hold the same pairs split, more tokens
    than their plain encodings (the epoch of each step as metrics.jsonl logs it)."""
    config = write_config(tmp_path, corpus, max_steps=40, checkpoint_every=None, eval_every=100, amp=False)
    run = RunConfig.from_yaml(config, parse_overrides(["--train.bpe_dropout", "0.3", "--train.bpe_dropout_from", "2"]))
    calls = record_collates(monkeypatch)
    train(run, tmp_path / "run", **QUIET)
    tokenizer = Tokenizer.load(tmp_path / "run" / "tokenizer.json")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    epochs = [r["epoch"] for r in records if r["kind"] == "train"]  # one batch a step
    training = [examples for examples, phase, _ in calls if phase == "train"]
    assert len(training) == len(epochs) == 40 and max(epochs) >= 3
    assert set(epochs) == set(range(max(epochs) + 1))
    tokens: dict[int, list[int]] = {}  # per epoch: [tokens as batched, as plainly encoded]
    for examples, epoch in zip(training, epochs, strict=True):
        counts = tokens.setdefault(epoch, [0, 0])
        for s, t in examples:
            plain = tokenizer.encode(tokenizer.decode(s)), tokenizer.encode(tokenizer.decode(t))
            if epoch < 2:
                assert (s, t) == plain
            counts[0] += len(s) + len(t)
            counts[1] += len(plain[0]) + len(plain[1])
    for epoch, (batched, plain_tokens) in tokens.items():
        if epoch < 2:
            assert batched == plain_tokens > 0
        else:
            assert batched > 1.05 * plain_tokens, epoch


def test_bpe_dropout_from_is_validated():
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="bpe_dropout_from must be an epoch"):
            TrainConfig(bpe_dropout=0.1, bpe_dropout_from=bad, max_steps=1)
    # the preset sets bpe_dropout_from: switching BPE-dropout off (for data.substitute, a Marian init) still loads
    preset = Path(__file__).parents[2] / "configs" / "ding.yaml"
    for extra in ([], ["--data.substitute", "0.5"]):
        run = RunConfig.from_yaml(preset, parse_overrides(["--train.bpe_dropout", "0", *extra]))
        assert run.train.bpe_dropout == 0 and run.train.bpe_dropout_from == 10
    assert TrainConfig(bpe_dropout=0.1, bpe_dropout_from=3, max_steps=1).bpe_dropout_from == 3


def resumes_exactly(tmp_path: Path, corpus: Path, levers: list[str], max_steps: int, stop: int) -> None:
    """Stopped at ``stop`` and resumed, a run with ``levers`` logs the uninterrupted run's losses,
    step for step, over at least two epochs."""
    config = write_config(tmp_path, corpus, max_steps=max_steps, checkpoint_every=None, eval_every=100, amp=False)
    full = RunConfig.from_yaml(config, parse_overrides(levers))
    assert train(full, tmp_path / "full", **QUIET).epoch >= 2
    first = RunConfig.from_yaml(config, parse_overrides([*levers, "--train.max_steps", str(stop)]))
    train(first, tmp_path / "parts", **QUIET)
    train(full, tmp_path / "parts", resume=True, **QUIET)
    assert losses(tmp_path / "parts") == losses(tmp_path / "full")


def test_bpe_dropout_with_resampled_phrases_resumes_exactly(tmp_path, corpus):
    """BPE-dropout, a fresh draw of phrase pairs each epoch and two batches a step."""
    write_entries(corpus)
    levers = ["--train.bpe_dropout", "0.3", "--train.accumulate", "2",
              "--data.phrases", "1.0", "--data.resample_phrases", "true"]  # fmt: skip
    resumes_exactly(tmp_path, corpus, levers, max_steps=10, stop=5)


def test_bpe_dropout_from_an_epoch_resumes_exactly_across_it(tmp_path, corpus):
    """Stopped in epoch 0 and resumed, a run with BPE-dropout from epoch 2 splits from the same
    epoch with the same draws as the uninterrupted run."""
    resumes_exactly(tmp_path, corpus, ["--train.bpe_dropout", "0.3", "--train.bpe_dropout_from", "2"], 24, 2)
    records = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert {r["step"]: r["epoch"] for r in records if r["kind"] == "train"}[2] == 0  # the stop is before the gate


# data.substitute -----------------------------------------------------------------------------------

NOUNS = {"Hund": ("dog", "m"), "Katze": ("cat", "f"), "Pferd": ("horse", "n"),  # in the framed pairs
         "Kater": ("tomcat", "m"), "Vogel": ("bird", "m"), "Maus": ("mouse", "f"), "Schaf": ("sheep", "n")}  # fmt: skip
ARTICLE = {"m": "den", "f": "die", "n": "das"}


def write_noun_corpus(root: Path, n: int = 60) -> tuple[set, set]:
    """``nouns.tsv`` with the seven NOUNS, and train/dev pairs, each ending in a marker of its
    own line (``x7``): framed pairs "er sieht den Hund heute x0" :: "he sees the dog today x0"
    with the nouns Hund, Katze and Pferd, and (every fourth line) pairs "wo ist der Kater x3" ::
    "where is it x3" that align no noun; the first training pair is too long for max_len 32.
    Returns the framed and the other training pairs."""
    framed, other = set(), set()
    pairs = [(" ".join(["sehr"] * 40) + " Hund", " ".join(["very"] * 40) + " dog")]  # skipped: too long
    for i in range(n):
        noun = ["Hund", "Katze", "Pferd"][i % 3]
        word, gender = NOUNS[noun]
        if i % 4 == 3:
            pair = (f"wo ist der {list(NOUNS)[i % 7]} x{i}", f"where is it x{i}")
            other.add(pair)
        else:
            pair = (f"er sieht {ARTICLE[gender]} {noun} heute x{i}", f"he sees the {word} today x{i}")
            framed.add(pair)
        pairs.append(pair)
    for split, chosen in (("train", pairs), ("dev", pairs[1:9])):
        (root / f"{split}.de").write_text("".join(de + "\n" for de, _ in chosen))
        (root / f"{split}.en").write_text("".join(en + "\n" for _, en in chosen))
    (root / "nouns.tsv").write_text("".join(f"{d}\t{e}\t{g}\t3\n" for d, (e, g) in NOUNS.items()))
    return framed, other


def check_framed(pair: tuple[str, str]) -> str:
    """A framed pair's noun, after checking that its article, noun and translation agree."""
    _, _, article, noun, _, marker = pair[0].split()
    word, gender = NOUNS[noun]
    assert article == ARTICLE[gender]
    assert pair[1] == f"he sees the {word} today {marker}"
    return noun


@pytest.mark.parametrize("german_first", [True, False])
def test_substitution_remakes_each_example_from_its_own_pair(tmp_path, german_first):
    """Each remade example is its own line's pair (the marker; the over-long first line skipped
    by the encoding, not shifting the rest) with, at data.substitute 1.0, every framed pair's
    noun swapped for another of its gender on both sides, the other pairs as they were; the
    same with English as the source (German is found on the target side)."""
    root = tmp_path / "data"
    root.mkdir()
    framed, other = write_noun_corpus(root)
    raw = list(zip((root / "train.de").read_text().splitlines(), (root / "train.en").read_text().splitlines(),
                   strict=True))  # fmt: skip
    languages = {} if german_first else {"src_lang": "en", "tgt_lang": "de"}
    raw = raw if german_first else [pair[::-1] for pair in raw]
    data = DataConfig(dir=str(root), substitute=1.0, max_len=32, **languages)
    tokenizer = Tokenizer.train([text for pair in raw for text in pair], 300)
    objective = Translation()
    examples, skipped = objective.encode(tokenizer, raw, data.max_len)
    assert skipped == 1 and len(examples) == len(raw) - 1
    lexicon = trainer_module._nouns(data)
    remake = trainer_module._substitution(lexicon, examples, raw, tokenizer, objective, data, 0, lambda _: None)
    for epoch in (0, 1):
        remade = remake(list(range(len(examples))), epoch)
        changed = 0
        for (s, t), before in zip(remade, raw[1:], strict=True):
            pair = (tokenizer.decode(s), tokenizer.decode(t))
            pair, before = (pair, before) if german_first else (pair[::-1], before[::-1])
            if before in other:
                assert pair == before
                continue
            assert pair[0].split()[-1] == before[0].split()[-1]  # its own line
            noun, was = check_framed(pair), before[0].split()[3]
            assert NOUNS[noun][1] == NOUNS[was][1] and noun != was
            changed += 1
        assert changed == len(framed)
    assert remake(list(range(len(examples))), 0) == remake(list(range(len(examples))), 0)  # a function of the epoch


@pytest.mark.parametrize("bpe_dropout", [[], ["--train.bpe_dropout", "0.3", "--train.bpe_dropout_from", "1"]])
def test_substitute_changes_sentence_pairs_in_training_batches_only(tmp_path, monkeypatch, bpe_dropout):
    """Trained with data.substitute 1.0 and the preset's phrase pairs (drawn afresh each epoch,
    tagged), and with BPE-dropout from epoch 1 too: the framed pairs hold the nouns no framed
    line has, and only those, agreeing on both sides; the tagged phrase pairs, the other pairs
    and the dev batches are the corpus's own (read as text, whatever their segmentation)."""
    root = tmp_path / "data"
    root.mkdir()
    framed, other = write_noun_corpus(root)
    write_entries(root)
    phrases = set(zip((root / "phrases.de").read_text().splitlines(), (root / "phrases.en").read_text().splitlines(),
                      strict=True))  # fmt: skip
    config = write_config(tmp_path, root, max_steps=12, checkpoint_every=None, eval_every=6, amp=False)
    levers = ["--data.substitute", "1.0", "--data.phrases", "0.5", "--data.resample_phrases", "true",
              "--data.phrase_tag", "true", *bpe_dropout]  # fmt: skip
    calls = record_collates(monkeypatch)
    train(RunConfig.from_yaml(config, parse_overrides(levers)), tmp_path / "run", **QUIET)
    tokenizer = Tokenizer.load(tmp_path / "run" / "tokenizer.json")
    nouns, tagged, split = set(), 0, 0
    for examples, phase, _ in calls:
        for s, t in examples:
            pair = tokenizer.decode(s), tokenizer.decode(t)
            if phase == "train":
                split += len(t) > len(tokenizer.encode(pair[1]))
            if phase == "dev":
                assert pair in framed | other
            elif s[0] == PHRASE:
                assert pair in phrases
                tagged += 1
            elif pair[0].startswith("wo ist"):
                assert pair in other
            else:
                nouns.add(check_framed(pair))
    assert tagged > 10
    assert nouns == {"Kater", "Vogel", "Maus", "Schaf"}  # at 1.0 every framed pair's noun is swapped
    assert (split > 10) == bool(bpe_dropout)  # targets split (from epoch 1) only with BPE-dropout


def test_substitute_resumes_exactly(tmp_path):
    """data.substitute with a fresh draw of phrase pairs each epoch (each epoch's swaps are a
    function of the seed and the epoch)."""
    root = tmp_path / "data"
    root.mkdir()
    write_noun_corpus(root)
    write_entries(root)
    levers = ["--data.substitute", "0.5", "--data.phrases", "0.5", "--data.resample_phrases", "true"]
    resumes_exactly(tmp_path, root, levers, max_steps=20, stop=9)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"substitute": 1.5}, "between 0 and 1"),
        ({"substitute": 0.5, "format": "tsv"}, "nouns.tsv"),
        ({"substitute": 0.5, "dir": None}, "nouns.tsv"),
        ({"substitute": 0.5, "src_lang": "fr"}, "not fr-en"),
        ({"substitute": 0.5, "phrases": 0.5}, "resample_phrases true"),
    ],
)
def test_substitute_is_checked(fields, message):
    with pytest.raises(ValueError, match=message):
        DataConfig(**{"dir": "data", **fields})


def test_substitute_then_bpe_dropout_from_an_epoch(tmp_path, monkeypatch):
    """data.substitute 1.0 with BPE-dropout from epoch 1: every training batch's framed pair holds
    a swapped noun, agreeing on both sides; in epoch 0 as plainly encoded, from epoch 1 on split
    (more tokens than the plain encodings, batched within max_tokens by the split lengths)."""
    root = tmp_path / "data"
    root.mkdir()
    _, other = write_noun_corpus(root)
    config = write_config(tmp_path, root, max_steps=30, checkpoint_every=None, eval_every=100, amp=False)
    levers = ["--data.substitute", "1.0", "--train.bpe_dropout", "0.3", "--train.bpe_dropout_from", "1"]
    calls = record_collates(monkeypatch)
    train(RunConfig.from_yaml(config, parse_overrides(levers)), tmp_path / "run", **QUIET)
    tokenizer = Tokenizer.load(tmp_path / "run" / "tokenizer.json")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    epochs = [r["epoch"] for r in records if r["kind"] == "train"]  # one batch a step
    training = [(examples, batch) for examples, phase, batch in calls if phase == "train"]
    assert len(training) == len(epochs) == 30 and max(epochs) >= 2
    nouns, tokens = set(), {0: [0, 0], 1: [0, 0]}  # before and from the gate: [as batched, plainly encoded]
    for (examples, batch), epoch in zip(training, epochs, strict=True):
        assert batch.src.numel() <= 160 and batch.tgt_in.numel() <= 160
        for s, t in examples:
            pair = tokenizer.decode(s), tokenizer.decode(t)
            if pair[0].startswith("wo ist"):
                assert pair in other
            else:
                nouns.add(check_framed(pair))
            plain = tokenizer.encode(pair[0]), tokenizer.encode(pair[1])
            if epoch < 1:
                assert (s, t) == plain
            counts = tokens[min(epoch, 1)]
            counts[0] += len(s) + len(t)
            counts[1] += len(plain[0]) + len(plain[1])
    assert nouns == {"Kater", "Vogel", "Maus", "Schaf"}  # at 1.0 every framed pair's noun is swapped
    assert tokens[0][0] == tokens[0][1] > 0 and tokens[1][0] > 1.05 * tokens[1][1]


def test_substitute_with_bpe_dropout_resumes_exactly(tmp_path):
    """data.substitute then BPE-dropout, stopped after the gate (epoch 1) and resumed: each
    epoch's swaps and splits are a function of the seed and the epoch."""
    root = tmp_path / "data"
    root.mkdir()
    write_noun_corpus(root)
    levers = ["--data.substitute", "0.5", "--train.bpe_dropout", "0.3", "--train.bpe_dropout_from", "1"]
    resumes_exactly(tmp_path, root, levers, max_steps=20, stop=9)


def test_substitute_without_nouns_is_refused_before_training(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    write_noun_corpus(root)
    (root / "nouns.tsv").unlink()
    config = write_config(tmp_path, root, max_steps=2, checkpoint_every=None, eval_every=100, amp=False)
    with pytest.raises(FileNotFoundError, match=r"nouns\.tsv not found; aiayn data ding"):
        train(RunConfig.from_yaml(config, parse_overrides(["--data.substitute", "0.5"])), tmp_path / "run", **QUIET)
    assert not (tmp_path / "run" / "tokenizer.json").exists()  # refused before the BPE is learnt


# train.amp ------------------------------------------------------------------------------------------


def precision_records(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "precision"]


def no_probe(*args, **kwargs):
    raise AssertionError("the probe must not run here")


def test_amp_true_trains_in_bf16_and_a_resumed_run_keeps_it(tmp_path, corpus, monkeypatch):
    """The training steps' logits come out of bfloat16 autocast (the dev loss's do not); the
    choice is said, logged and checkpointed; resumed with train.amp false, the run keeps
    bfloat16 (its losses would otherwise change precision mid-run). What was done with freed host
    memory (``allocator.keep_freed_memory``; here turned off) is said and logged beside it."""
    monkeypatch.setattr(trainer_module, "_probe", no_probe)
    monkeypatch.setenv("AIAYN_KEEP_MEMORY", "0")
    logits = []  # (dtype, eps_ls): training steps smooth the labels, the dev loss does not
    loss = objectives.label_smoothed_loss
    monkeypatch.setattr(objectives, "label_smoothed_loss", lambda x, t, e: logits.append((x.dtype, e)) or loss(x, t, e))
    config = write_config(tmp_path, corpus, max_steps=3, checkpoint_every=3, eval_every=3, amp=True)
    said: list[str] = []
    train(RunConfig.from_yaml(config), tmp_path / "run", progress=False, log=said.append)
    out = tmp_path / "run"
    assert any(line.startswith("precision: bf16 (train.amp true") for line in said), said
    assert [(r["step"], r["precision"]) for r in precision_records(out)] == [(0, "bf16")]
    assert "freed host memory: off (AIAYN_KEEP_MEMORY=0)" in said
    assert precision_records(out)[0]["host_memory"] == "off (AIAYN_KEEP_MEMORY=0)"
    state = json.loads((out / "checkpoints" / "step_00000003" / "trainer_state.json").read_text())
    assert state["precision"] == "bf16"
    assert all(v == v and abs(v) < 1e3 for v in losses(out).values())  # finite
    assert {dtype for dtype, eps in logits if eps} == {torch.bfloat16}
    assert {dtype for dtype, eps in logits if not eps} == {torch.float32}

    said.clear()
    logits.clear()
    resumed = RunConfig.from_yaml(config, parse_overrides(["--train.amp", "false", "--train.max_steps", "5"]))
    train(resumed, out, resume=True, progress=False, log=said.append)
    assert any(line == "precision: bf16 (as the run it resumes)" for line in said), said
    assert [(r["step"], r["precision"]) for r in precision_records(out)] == [(0, "bf16"), (3, "bf16")]
    assert sorted(losses(out)) == [1, 2, 3, 4, 5]
    assert {dtype for dtype, eps in logits if eps} == {torch.bfloat16}


def test_auto_without_native_bf16_trains_in_fp32_without_probing(tmp_path, corpus, monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(trainer_module, "_probe", no_probe)
    config = write_config(tmp_path, corpus, max_steps=2, checkpoint_every=None, eval_every=100, amp="auto")
    train(RunConfig.from_yaml(config), tmp_path / "run", **QUIET)
    [record] = precision_records(tmp_path / "run")
    assert record["precision"] == "fp32" and "no native bfloat16" in record["reason"]


def test_the_probe_leaves_the_run_as_without_it(tmp_path, corpus, monkeypatch):
    """train.amp auto on a CPU with native bfloat16 (AMX, as far as the run knows) runs the real
    probe on real batches; with the bar for bfloat16 out of reach it chooses float32, and the
    losses are those of train.amp false, step for step: the probe changed no weight, gradient,
    dropout draw or batch."""
    config = write_config(tmp_path, corpus, max_steps=4, checkpoint_every=None, eval_every=100, amp=False)
    train(RunConfig.from_yaml(config), tmp_path / "fp32", **QUIET)

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(precision_module, "MIN_GAIN", 1e9)
    probed = []
    probe = trainer_module._probe
    monkeypatch.setattr(trainer_module, "_probe", lambda *a: probed.append(1) or probe(*a))
    train(RunConfig.from_yaml(config, parse_overrides(["--train.amp", "auto"])), tmp_path / "auto", **QUIET)
    assert probed == [1]
    [record] = precision_records(tmp_path / "auto")
    assert record["precision"] == "fp32" and record["reason"].startswith("AMX: ") and "probe" in record["reason"]
    assert losses(tmp_path / "auto") == losses(tmp_path / "fp32")


def test_bleu_every_scores_the_models_greedy_translations_without_changing_the_run(tmp_path, corpus):
    """``train.bleu_every``: at every such step the dev BLEU and chrF of the model's greedy
    translations (sacreBLEU on the saved model's own output at the last step), with the minutes
    elapsed; the run's losses stay those of a run without it (eval mode, no RNG drawn)."""
    import sacrebleu

    from aiayn.decode import greedy_decode
    from aiayn.model import Transformer

    plain = write_config(tmp_path, corpus, max_steps=4, checkpoint_every=None, eval_every=100)
    train(RunConfig.from_yaml(plain), tmp_path / "plain", **QUIET)
    config = write_config(tmp_path, corpus, max_steps=4, checkpoint_every=None, eval_every=100, bleu_every=2)
    train(RunConfig.from_yaml(config), tmp_path / "scored", **QUIET)
    assert losses(tmp_path / "scored") == losses(tmp_path / "plain")
    records = [json.loads(line) for line in (tmp_path / "scored" / "metrics.jsonl").read_text().splitlines()]
    scored = [r for r in records if r["kind"] == "dev_bleu"]
    assert [r["step"] for r in scored] == [2, 4]
    assert 0 < scored[0]["elapsed"] <= scored[1]["elapsed"]
    (final,) = [r for r in records if r["kind"] == "final"]
    assert final["elapsed"] >= scored[1]["elapsed"]

    model = Transformer.from_pretrained(tmp_path / "scored" / "model").eval()
    tokenizer = Tokenizer.load(tmp_path / "scored" / "model" / "tokenizer.json")
    sources = (corpus / "dev.de").read_text().splitlines()
    references = (corpus / "dev.en").read_text().splitlines()
    hypotheses = []
    for sentence in sources:
        src = torch.tensor([[*tokenizer.encode(sentence), model.config.eos_id]])
        output = greedy_decode(model, src)[0].tolist()
        eos = model.config.eos_id
        hypotheses.append(tokenizer.decode(output[: output.index(eos)] if eos in output else output))
    assert scored[1]["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hypotheses, [references]).score)
    assert scored[1]["chrf"] == pytest.approx(sacrebleu.corpus_chrf(hypotheses, [references]).score)
    assert final["dev_bleu"] == pytest.approx(scored[1]["bleu"])


@pytest.mark.parametrize(
    ("fields", "message"),
    [({"bleu_every": 0}, "train.bleu_every must be a positive integer"),
     ({"bleu_every": 2, "task": "lm"}, "needs train.task translation")],
)  # fmt: skip
def test_bleu_every_is_checked(fields, message):
    from aiayn.train.config import TrainConfig

    with pytest.raises(ValueError, match=message):
        TrainConfig(max_steps=1, **fields)
