"""Joint BPE: special-token ids, exact round trips (umlauts, ß, unseen characters), save/load."""

import json

import pytest

from aiayn.data.tokenizer import PHRASE_TOKEN, SPECIAL_TOKENS, Tokenizer
from aiayn.model import ModelConfig

CORPUS = [
    "Es war purer Zufall.",
    "It was sheer/pure coincidence.",
    "Die Straße ist naß und die Größe ändert sich über Nacht.",
    "Äpfel, Öl und Übermut: schön!",
    "The weather is nice today.",
] * 20


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.train(CORPUS, vocab_size=400)


def test_special_ids_match_model_config(tokenizer):
    config = ModelConfig.tiny(tokenizer.vocab_size)
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == (config.pad_id, config.bos_id, config.eos_id)
    assert [tokenizer.hf.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert tokenizer.phrase_id is None and tokenizer.hf.token_to_id(PHRASE_TOKEN) is None  # only with phrase_tag
    assert tokenizer.vocab_size <= 400


@pytest.mark.parametrize(
    "text",
    [
        "Es war purer Zufall.",
        "Größe, Straße, Äpfel, Öl, Übermut, süß",
        "ẞ and ß and « guillemets » and 日本語 never seen in training",
        "  two  spaces  inside",
        "Zahlen 1234 und Satzzeichen?!",
    ],
)
def test_round_trip_is_exact(tokenizer, text):
    ids = tokenizer.encode(text)
    assert all(i >= len(SPECIAL_TOKENS) for i in ids)  # no <unk>, no specials
    assert tokenizer.decode(ids) == text.strip()


def test_decode_stops_at_eos_and_skips_specials(tokenizer):
    ids = tokenizer.encode("Es war")
    assert tokenizer.decode([tokenizer.bos_id, *ids, tokenizer.eos_id, *tokenizer.encode("garbage")]) == "Es war"
    assert tokenizer.decode([tokenizer.pad_id, *ids, tokenizer.pad_id]) == "Es war"


def test_merges_learned_from_corpus(tokenizer):
    # a frequent word becomes a single token (with its leading space marker)
    assert len(tokenizer.encode("Zufall")) == 1
    assert len(tokenizer.encode("Zufall")) < len(b"Zufall")


def test_save_load_round_trip(tokenizer, tmp_path):
    tokenizer.save(tmp_path / "tokenizer.json")
    loaded = Tokenizer.load(tmp_path / "tokenizer.json")
    for text in CORPUS[:5]:
        assert loaded.encode(text) == tokenizer.encode(text)


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"missing\.json"):
        Tokenizer.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"bad\.json"):
        Tokenizer.load(bad)


def test_pieces_are_readable_and_spell_the_text(tokenizer):
    text = "Die Straße ist naß, schön!"
    pieces = tokenizer.pieces([tokenizer.bos_id, *tokenizer.encode(text), tokenizer.eos_id])
    assert pieces[0] == "<s>" and pieces[-1] == "</s>" and pieces[1].startswith("▁")
    assert "".join(pieces[1:-1]).replace("▁", " ") == " " + text
    # a character never seen in training is split into bytes, each shown as \xNN
    assert tokenizer.pieces(tokenizer.encode("日"))[-3:] == ["\\xe6", "\\x97", "\\xa5"]
    with pytest.raises(ValueError, match="no token has id"):
        tokenizer.pieces([tokenizer.vocab_size])


@pytest.mark.parametrize("text", ["Das ist <s>falsch</s> richtig.", "a <pad> b <unk> c", "<s>", "x</s>"])
def test_special_tokens_written_in_a_text_are_text(tokenizer, text):
    """Only ids can be control tokens: "<s>" in an input is three characters, or a translation
    would hold a BOS and an EOS in its source, and "<pad>" would be masked as padding."""
    ids = tokenizer.encode(text)
    assert all(i >= len(SPECIAL_TOKENS) for i in ids), ids
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode_batch([text, "ok"])[0] == ids
    assert "".join(tokenizer.tokens(text)).replace("Ġ", " ").strip() == text


def test_a_literal_mask_still_encodes_as_the_mask_token(tokenizer):
    ids = tokenizer.encode("Es war <mask> Zufall, <s>.")
    assert ids.count(tokenizer.mask_id) == 1 and min(i for i in ids if i != tokenizer.mask_id) >= len(SPECIAL_TOKENS)


def test_a_tokenizer_larger_than_the_model_is_an_error_naming_the_file(tokenizer, tmp_path):
    tokenizer.save(tmp_path / "tokenizer.json")
    assert Tokenizer.load(tmp_path / "tokenizer.json", tokenizer.vocab_size).vocab_size == tokenizer.vocab_size
    with pytest.raises(ValueError, match=rf"{tmp_path / 'tokenizer.json'}: the tokenizer has {tokenizer.vocab_size}"):
        Tokenizer.load(tmp_path / "tokenizer.json", tokenizer.vocab_size - 1)


# <phrase> (data.phrase_tag): a tokenizer trained with it, and one without ------------------------------


@pytest.fixture(scope="module")
def tagged():
    return Tokenizer.train(CORPUS, vocab_size=400, phrase_tag=True)


def five_special_tokenizer(tmp_path) -> Tokenizer:
    """A tokenizer as aiayn trained them before <phrase>: the same BPE with the first five
    specials only, saved and loaded again."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, min_frequency=2, special_tokens=["<pad>", "<s>", "</s>", "<unk>", "<mask>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    hf.train_from_iterator((t.strip() for t in CORPUS), trainer)
    hf.save(str(tmp_path / "old.json"))
    return Tokenizer.load(tmp_path / "old.json")


def test_phrase_tag_is_special_token_5_and_decode_skips_it(tagged):
    tokenizer = tagged
    assert tokenizer.phrase_id == 5 == len(SPECIAL_TOKENS)
    assert tokenizer.hf.id_to_token(5) == "<phrase>" and tokenizer.num_special == 6
    ids = tokenizer.encode("Es war purer Zufall.")
    assert tokenizer.decode([tokenizer.phrase_id, *ids]) == "Es war purer Zufall."
    assert tokenizer.decode([*ids[:2], tokenizer.phrase_id, *ids[2:]]) == tokenizer.decode(ids)
    assert tokenizer.pieces([tokenizer.phrase_id]) == ["<phrase>"]


def test_a_literal_phrase_tag_in_a_text_is_text(tagged):
    """A source sentence that says "<phrase>" must not carry the tag that marks dictionary pairs."""
    tokenizer = tagged
    ids = tokenizer.encode("ein <phrase> hier")
    assert tokenizer.phrase_id not in ids and all(i >= tokenizer.num_special for i in ids)
    assert tokenizer.decode(ids) == "ein <phrase> hier"


def test_a_tokenizer_with_the_five_old_specials_loads_and_id_5_is_text(tmp_path, tokenizer):
    old = five_special_tokenizer(tmp_path)
    assert old.phrase_id is None and old.num_special == 5
    assert [old.pad_id, old.bos_id, old.eos_id, old.unk_id, old.mask_id] == [0, 1, 2, 3, 4]
    assert old.hf.token_to_id("<phrase>") is None
    text_5 = old.hf.decode([5])  # what BPE put at id 5: a byte of text
    assert text_5 and old.hf.id_to_token(5) not in SPECIAL_TOKENS
    assert old.decode([5]) == text_5.lstrip(" ")
    ids = old.encode("Es war purer Zufall.")
    assert old.decode([*ids, 5]) == old.hf.decode([*ids, 5]).lstrip(" ")  # not skipped as a control token
    for text in CORPUS[:5]:
        assert old.decode(old.encode(text)) == text


def test_phrase_tag_at_another_id_is_an_error(tmp_path, tokenizer):
    """<phrase> present but not at id 5 (added after training) is refused, naming the token."""
    from tokenizers import Tokenizer as HFTokenizer

    old = five_special_tokenizer(tmp_path)
    hf = HFTokenizer.from_str(old.hf.to_str())
    hf.add_special_tokens(["<phrase>"])
    assert hf.token_to_id("<phrase>") == old.vocab_size
    hf.save(str(tmp_path / "late.json"))
    with pytest.raises(ValueError, match="<phrase> must have id 5"):
        Tokenizer.load(tmp_path / "late.json")


def test_merge_parents_spell_each_merged_token(tokenizer):
    """Every token the BPE merged (all but the specials and the 256 bytes) has two parts whose
    strings concatenate to its own, each part a shorter token, the pairs those of the tokenizer's
    merge list; bytes and specials have none."""
    parents = tokenizer.merge_parents()
    assert len(parents) == tokenizer.vocab_size - len(SPECIAL_TOKENS) - 256
    for merged, (left, right) in parents.items():
        string = tokenizer.hf.id_to_token(merged)
        assert tokenizer.hf.id_to_token(left) + tokenizer.hf.id_to_token(right) == string
        assert len(tokenizer.hf.id_to_token(left)) < len(string) and len(tokenizer.hf.id_to_token(right)) < len(string)
    assert not set(range(len(SPECIAL_TOKENS))) & parents.keys()
    merges = {tuple(m) for m in json.loads(tokenizer.hf.to_str())["model"]["merges"]}
    assert {(tokenizer.hf.id_to_token(a), tokenizer.hf.id_to_token(b)) for a, b in parents.values()} == merges
