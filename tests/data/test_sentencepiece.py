"""Marian SentencePiece: encode and decode equal transformers' MarianTokenizer on a SentencePiece
model trained here, round trips, save/load, separate target vocabularies, errors naming the file."""

import json
import re
import sys

import pytest

sentencepiece = pytest.importorskip("sentencepiece")
transformers = pytest.importorskip("transformers")

from aiayn.data.sentencepiece import (  # noqa: E402
    TARGET_SPM,
    TARGET_VOCAB_NAME,
    VOCAB_NAME,
    SentencePieceTokenizer,
)
from marian_helpers import ENGLISH, GERMAN, lines, marian, marian_vocab, train_spm, write  # noqa: E402

SENTENCES = [
    "Die Straße ist groß.",
    "Äpfel, Öl und Übermut: schön!",
    "Größe 42 und süß?",
    "the weather is nice today (7) times",
    "Zahlen 1234, Satzzeichen?!",
    "Das Haus , die Straße .",  # spaces before punctuation stay (no clean-up in either)
    "  surrounding   spaces and  inner  ones  ",
    "ein unbekanntes Zeichen ✓ mitten drin",
    "€ and ✓ never seen",
    ">>de<< Das Haus ist schön.",
    ">>en<<the house is nice",
    ">>xx<< an unknown code",
    ">>de<<",
    "",
]


@pytest.fixture(scope="module")
def spms() -> tuple[bytes, bytes]:
    """A German-like and an English-like SentencePiece model."""
    return train_spm(lines(f"{GERMAN} {ENGLISH}", 0)), train_spm(lines(ENGLISH, 1))


@pytest.fixture(scope="module")
def shared(spms, tmp_path_factory):
    """Ours and MarianTokenizer on the same files: one spm for both sides, one vocabulary."""
    directory = write(tmp_path_factory.mktemp("shared"), spms[0], spms[0], marian_vocab(spms[0]))
    return SentencePieceTokenizer.load(directory), marian(directory), directory


def test_special_ids_come_from_the_vocabulary(shared):
    ours, _, _ = shared
    assert (ours.eos_id, ours.unk_id) == (0, 1)
    assert ours.pad_id == ours.bos_id == ours.vocab_size - 1 == ours.target_vocab_size - 1
    assert ours.mask_id is None and ours.phrase_id is None


@pytest.mark.parametrize("text", SENTENCES)
def test_encode_equals_marian(shared, text):
    ours, hf, _ = shared
    expected = hf(text).input_ids
    assert expected[-1] == ours.eos_id
    assert ours.encode(text) == expected[:-1]
    assert ours.tokens(text) == hf.convert_ids_to_tokens(expected[:-1])


def test_language_code_and_unseen_characters(shared):
    ours, _, _ = shared
    assert ours.encode(">>de<< Haus")[0] == ours.vocab[">>de<<"]
    assert ours.encode(">>xx<< Haus")[0] == ours.unk_id  # a code not in the vocabulary
    assert ours.unk_id in ours.encode("ein ✓")
    assert ours.encode_batch(SENTENCES) == [ours.encode(s) for s in SENTENCES]
    assert ours.eos_id not in ours.encode("a </s> b")  # text, as in Tokenizer (MarianTokenizer: the EOS token)


@pytest.mark.parametrize("text", SENTENCES)
def test_decode_equals_marian(shared, text):
    ours, hf, _ = shared
    ids = ours.encode(text)
    assert ours.decode([*ids, ours.eos_id, *ids]) == hf.decode(ids, skip_special_tokens=True)
    assert ours.decode([ours.pad_id, *ids, ours.pad_id]) == hf.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("text", [s for s in SENTENCES if not any(c in s for c in ("✓", "€", "  ", ">>"))])
def test_round_trip(shared, text):
    ours, _, _ = shared
    assert ours.decode(ours.encode(text)) == text.strip()
    assert ours.decode_batch([ours.encode(text)] * 2) == [text.strip()] * 2


def test_save_load_round_trip(shared, tmp_path):
    ours, _, directory = shared
    assert not SentencePieceTokenizer.is_in(tmp_path)
    ours.save(tmp_path / "copy")
    assert SentencePieceTokenizer.is_in(tmp_path / "copy") and SentencePieceTokenizer.is_in(directory)
    loaded = SentencePieceTokenizer.load(tmp_path / "copy", model_vocab_size=ours.vocab_size)
    assert loaded.encode_batch(SENTENCES) == ours.encode_batch(SENTENCES)
    assert not (tmp_path / "copy" / TARGET_VOCAB_NAME).exists()


def test_separate_target_vocabulary(spms, tmp_path):
    target, source = spms  # the target vocabulary the larger, to check its size below
    vocab, target_vocab = marian_vocab(source), marian_vocab(target)
    write(tmp_path / "m", source, target, vocab, target_vocab)
    ours, hf = SentencePieceTokenizer.load(tmp_path / "m"), marian(tmp_path / "m", separate=True)
    assert (ours.vocab_size, ours.target_vocab_size) == (len(vocab), len(target_vocab))
    assert len(vocab) < len(target_vocab)
    for text in ["the house is nice today.", "the weather, not the oil!"]:
        assert ours.encode(text) == hf(text).input_ids[:-1]
        target_ids = hf(text_target=text).input_ids[:-1]  # the ids of target_vocab.json
        assert target_ids != ours.encode(text)
        assert ours.encode(text, target=True) == ours.encode_batch([text], target=True)[0] == target_ids
        assert ours.decode(target_ids) == hf.decode(target_ids, skip_special_tokens=True) == text
        assert ours.pieces(target_ids, target=True) == hf.convert_ids_to_tokens(target_ids)
    ours.save(tmp_path / "copy")
    assert json.loads((tmp_path / "copy" / TARGET_VOCAB_NAME).read_text()) == target_vocab
    # each vocabulary against its side of the model: a larger target vocabulary is no error
    SentencePieceTokenizer.load(tmp_path / "m", model_vocab_size=len(vocab), model_tgt_vocab_size=len(target_vocab))
    with pytest.raises(
        ValueError,
        match=re.escape(f"{tmp_path / 'm' / TARGET_VOCAB_NAME}: the tokenizer has {len(target_vocab)} tokens"),
    ):
        SentencePieceTokenizer.load(tmp_path / "m", len(vocab), model_tgt_vocab_size=len(target_vocab) - 1)


def test_target_text_goes_through_the_target_model(spms, tmp_path):
    """Marian's targets (fine-tuning, the perplexity of references) are split by target.spm."""
    german, english = spms
    vocab = marian_vocab(german) | {p: i for i, p in enumerate(marian_vocab(english), start=1000) if p != "<pad>"}
    vocab["<pad>"] = max(vocab.values()) + 1
    write(tmp_path / "m", german, english, vocab)
    ours, hf = SentencePieceTokenizer.load(tmp_path / "m"), marian(tmp_path / "m")
    for text in ["the house is nice today.", "Die Straße ist groß."]:
        assert ours.encode(text) == hf(text).input_ids[:-1]
        assert ours.encode(text, target=True) == hf(text_target=text).input_ids[:-1]
    assert ours.encode("Die Straße ist groß.", target=True) != ours.encode("Die Straße ist groß.")


def test_pieces(shared):
    ours, _, _ = shared
    assert ours.pieces([ours.eos_id, ours.unk_id, ours.pad_id]) == ["</s>", "<unk>", "<pad>"]
    with pytest.raises(ValueError, match=rf"no token has id {ours.vocab_size} \(vocabulary size {ours.vocab_size}\)"):
        ours.pieces([3, ours.vocab_size])
    with pytest.raises(ValueError, match="no token has id"):
        ours.decode([ours.vocab_size + 5])


def test_missing_file_names_it(shared, tmp_path):
    ours, _, _ = shared
    ours.save(tmp_path)
    (tmp_path / VOCAB_NAME).unlink()
    with pytest.raises(FileNotFoundError, match=f"^{re.escape(str(tmp_path / VOCAB_NAME))}: no such file"):
        SentencePieceTokenizer.load(tmp_path)
    (tmp_path / VOCAB_NAME).write_text("{not json")
    with pytest.raises(ValueError, match=f"^{re.escape(str(tmp_path / VOCAB_NAME))}: not a JSON file"):
        SentencePieceTokenizer.load(tmp_path)
    (tmp_path / VOCAB_NAME).write_text(json.dumps(ours.vocab))
    (tmp_path / TARGET_SPM).write_bytes(b"not a model")
    with pytest.raises(ValueError, match=f"^{re.escape(str(tmp_path / TARGET_SPM))}: not a SentencePiece model"):
        SentencePieceTokenizer.load(tmp_path)


def test_vocab_without_pad_names_the_token(shared, spms, tmp_path):
    ours, _, _ = shared
    vocab = {k: v for k, v in ours.vocab.items() if k != "<pad>"}
    with pytest.raises(ValueError, match="<pad>"):
        SentencePieceTokenizer(spms[0], spms[0], vocab)
    write(tmp_path, spms[0], spms[0], vocab)
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / VOCAB_NAME}: no special token <pad>")):
        SentencePieceTokenizer.load(tmp_path)


def test_model_vocab_size_too_small_names_the_file(shared):
    ours, _, directory = shared
    SentencePieceTokenizer.load(directory, model_vocab_size=ours.vocab_size)
    with pytest.raises(
        ValueError, match=re.escape(f"{directory / VOCAB_NAME}: the tokenizer has {ours.vocab_size} tokens")
    ):
        SentencePieceTokenizer.load(directory, model_vocab_size=ours.vocab_size - 1)


def test_without_sentencepiece_says_what_to_install(shared, spms, monkeypatch):
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # import fails
    with pytest.raises(ImportError, match="pip install sentencepiece"):
        SentencePieceTokenizer(spms[0], spms[0], shared[0].vocab)
