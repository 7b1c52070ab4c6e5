"""Joint BPE: special-token ids, exact round trips (umlauts, ß, unseen characters), save/load."""

import pytest

from aiayn.data.tokenizer import SPECIAL_TOKENS, Tokenizer
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
