"""Shared by the Marian tests (``tests/data/test_sentencepiece.py``, ``tests/test_marian.py``):
SentencePiece models and Marian-style vocabularies trained here, and transformers' own
``MarianTokenizer`` on them, the independent truth. Import only after
``pytest.importorskip("sentencepiece")`` and ``("transformers")``."""

import io
import json
import random
import warnings

import sentencepiece
import transformers

from aiayn.data.sentencepiece import SOURCE_SPM, TARGET_SPM, TARGET_VOCAB_NAME, VOCAB_NAME

GERMAN = "der die das Straße Größe Äpfel Öl Übermut schön süß groß Haus Zufall war ist und nicht heute"
ENGLISH = "the house is nice today weather coincidence was and not big sweet apples oil street size"
PUNCTUATION = [".", ",", "!", "?", ":", "1234", "42", "(7)"]
CODES = [">>de<<", ">>en<<"]  # language codes of multilingual OPUS-MT models, in their vocab.json


def lines(words: str, seed: int) -> list[str]:
    """300 random sentences of ``words`` (space-separated) and punctuation."""
    rng = random.Random(seed)
    vocabulary = words.split() + PUNCTUATION
    return [" ".join(rng.choice(vocabulary) for _ in range(rng.randint(3, 12))).capitalize() for _ in range(300)]


def train_spm(texts: list[str]) -> bytes:
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_writer=model,
        vocab_size=200,
        model_type="unigram",
        character_coverage=1.0,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    return model.getvalue()


def marian_vocab(*spms: bytes) -> dict[str, int]:
    """A vocab.json as OPUS-MT's read: ``</s>`` 0, ``<unk>`` 1, the language codes, the pieces
    of every model in ``spms`` (a bilingual model's source and target, joined), ``<pad>`` last (no
    spm control pieces: Marian's ids are not SentencePiece's)."""
    pieces: dict[str, None] = {}
    for spm in spms:
        processor = sentencepiece.SentencePieceProcessor()
        processor.LoadFromSerializedProto(spm)
        for i in range(processor.get_piece_size()):
            if not (processor.is_control(i) or processor.is_unknown(i)):
                pieces[processor.id_to_piece(i)] = None
    tokens = ["</s>", "<unk>", *CODES, *pieces, "<pad>"]
    return {token: i for i, token in enumerate(tokens)}


def write(directory, source: bytes, target: bytes, vocab: dict, target_vocab: dict | None = None):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / SOURCE_SPM).write_bytes(source)
    (directory / TARGET_SPM).write_bytes(target)
    (directory / VOCAB_NAME).write_text(json.dumps(vocab))
    if target_vocab is not None:
        (directory / TARGET_VOCAB_NAME).write_text(json.dumps(target_vocab))
    return directory


def marian(directory, separate: bool = False):
    files = {"source_spm": SOURCE_SPM, "target_spm": TARGET_SPM, "vocab": VOCAB_NAME}
    if separate:
        files["target_vocab_file"] = TARGET_VOCAB_NAME
    with warnings.catch_warnings():  # "Recommended: pip install sacremoses" (which _tokenize never calls)
        warnings.simplefilter("ignore")
        return transformers.MarianTokenizer(
            **{k: str(directory / v) for k, v in files.items()}, separate_vocabs=separate
        )
