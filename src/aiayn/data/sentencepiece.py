"""SentencePiece tokenization of the Marian / OPUS-MT models, so aiayn can translate with a
converted OPUS-MT checkpoint.

Reproduces Hugging Face's ``MarianTokenizer`` (``transformers.models.marian``): a source and a
target SentencePiece model, whose pieces are mapped to ids by ``vocab.json`` (Marian's own
vocabulary, not the SentencePiece ids), and ``target_vocab.json`` for the target side of models
with separate vocabularies. A leading language code ``>>xx<<`` is a token of its own.

Differs from aiayn's BPE ``Tokenizer``: the special ids come from the vocabulary (``</s>`` is
usually 0, ``<pad>`` the last id), and there is no BOS: Marian's decoder starts from ``<pad>``,
so ``bos_id`` is ``pad_id``. As in ``MarianTokenizer``, no Moses punctuation normalization is
applied. Unlike it, a literal ``</s>`` in a text is text, not the control token (as in
``Tokenizer``). ``sentencepiece`` is an optional dependency (the ``marian`` extra).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["SentencePieceTokenizer", "SOURCE_SPM", "TARGET_SPM", "VOCAB_NAME", "TARGET_VOCAB_NAME"]

SOURCE_SPM = "source.spm"
TARGET_SPM = "target.spm"
VOCAB_NAME = "vocab.json"
TARGET_VOCAB_NAME = "target_vocab.json"  # only where the vocabularies are separate


def _processor(model: bytes, name: str) -> Any:
    """A ``SentencePieceProcessor`` for the serialized model ``model`` (read from file ``name``)."""
    try:
        import sentencepiece
    except ImportError:
        raise ImportError(
            "Marian tokenization needs sentencepiece: pip install sentencepiece (or aiayn[marian])"
        ) from None
    processor = sentencepiece.SentencePieceProcessor()
    try:
        processor.LoadFromSerializedProto(model)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{name}: not a SentencePiece model: {e}") from None
    return processor


def _inverse(vocab: Any, name: str) -> dict[int, str]:
    """id -> piece of a piece -> id vocabulary, checked (it may come from any JSON file)."""
    if not vocab or not isinstance(vocab, dict) or not all(isinstance(i, int) and i >= 0 for i in vocab.values()):
        raise ValueError(f"{name}: not a vocabulary (a non-empty map of pieces to ids >= 0)")
    return {i: piece for piece, i in vocab.items()}


class SentencePieceTokenizer:
    """Marian's source/target SentencePiece with its ``vocab.json`` ids (``MarianTokenizer``)."""

    mask_id: int | None = None  # no masked-LM token
    phrase_id: int | None = None  # no dictionary-phrase tag

    def __init__(
        self, source_spm: bytes, target_spm: bytes, vocab: dict[str, int], target_vocab: dict[str, int] | None = None
    ) -> None:
        self._source_pieces = _inverse(vocab, VOCAB_NAME)
        self._target_pieces = self._source_pieces if target_vocab is None else _inverse(target_vocab, TARGET_VOCAB_NAME)
        for token in ("</s>", "<unk>", "<pad>"):
            if token not in vocab:
                raise ValueError(f"{VOCAB_NAME}: no special token {token}")
        self.eos_id, self.unk_id, self.pad_id = vocab["</s>"], vocab["<unk>"], vocab["<pad>"]
        self.bos_id = self.pad_id  # Marian's decoder_start_token_id
        self.vocab, self.target_vocab = vocab, target_vocab
        self.vocab_size = max(self._source_pieces) + 1  # source (and shared) vocabulary: the largest id + 1
        self.target_vocab_size = max(self._target_pieces) + 1
        self._source = _processor(source_spm, SOURCE_SPM)
        self._target = _processor(target_spm, TARGET_SPM)

    def encode(self, text: str, target: bool = False) -> list[int]:
        """Token ids of ``text`` (no EOS): ``MarianTokenizer(text).input_ids`` without its EOS, or
        with ``target`` ``MarianTokenizer(text_target=text)``'s (the target model and vocabulary)."""
        text = text.strip()
        code = []
        if text.startswith(">>") and (end := text.find("<<")) != -1:  # remove_language_code
            code, text = [text[: end + 2]], text[end + 2 :]
        spm, vocab = (self._target, self.target_vocab or self.vocab) if target else (self._source, self.vocab)
        unk = vocab.get("<unk>", self.unk_id)
        return [vocab.get(piece, unk) for piece in code + spm.encode(text, out_type=str)]

    def encode_batch(self, texts: Sequence[str], target: bool = False) -> list[list[int]]:
        return [self.encode(text, target) for text in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of target ``ids``, stopping at the first EOS and skipping ``<pad>`` and ``<unk>``
        (``MarianTokenizer.decode(ids, skip_special_tokens=True)``)."""
        ids = list(ids)
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        pieces = self.pieces([i for i in ids if i not in (self.pad_id, self.unk_id)], target=True)
        return self._target.decode_pieces(pieces).replace("▁", " ").strip()

    def decode_batch(self, batch: Sequence[Sequence[int]]) -> list[str]:
        return [self.decode(ids) for ids in batch]

    def tokens(self, text: str) -> list[str]:
        """The pieces of ``encode(text)`` (for display, e.g. attention maps)."""
        return self.pieces(self.encode(text))

    def pieces(self, ids: Sequence[int], target: bool = False) -> list[str]:
        """One display string per id, special tokens as written; from the target vocabulary with
        ``target`` (where it is separate), else the source one."""
        vocab = self._target_pieces if target else self._source_pieces
        missing = [i for i in ids if i not in vocab]
        if missing:
            size = self.target_vocab_size if target else self.vocab_size
            raise ValueError(f"tokenizer: no token has id {missing[0]} (vocabulary size {size})")
        return [vocab[i] for i in ids]

    @classmethod
    def is_in(cls, directory: str | Path) -> bool:
        """Whether ``directory`` holds a Marian tokenizer (``source.spm``)."""
        return (Path(directory) / SOURCE_SPM).is_file()

    def save(self, directory: str | Path) -> None:
        """Write ``source.spm``, ``target.spm``, ``vocab.json`` (and ``target_vocab.json``)."""
        from ..model.pretrained import atomic_write

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        files = {SOURCE_SPM: self._source.serialized_model_proto(), TARGET_SPM: self._target.serialized_model_proto()}
        files[VOCAB_NAME] = json.dumps(self.vocab, ensure_ascii=False, indent=2).encode()
        if self.target_vocab is not None:
            files[TARGET_VOCAB_NAME] = json.dumps(self.target_vocab, ensure_ascii=False, indent=2).encode()
        else:  # a stale one would make load() read the vocabularies as separate
            (directory / TARGET_VOCAB_NAME).unlink(missing_ok=True)
        for name, data in files.items():
            atomic_write(directory / name, lambda tmp, data=data: Path(tmp).write_bytes(data))

    @classmethod
    def load(
        cls, directory: str | Path, model_vocab_size: int | None = None, model_tgt_vocab_size: int | None = None
    ) -> SentencePieceTokenizer:
        """Read the files of ``directory``; with ``model_vocab_size`` (and ``model_tgt_vocab_size``
        for a separate target vocabulary; default the same), a vocabulary with more tokens than
        the model has embeddings is an error (naming the file), not an index error later."""
        directory = Path(directory)

        def read(name: str) -> bytes:
            path = directory / name
            if not path.is_file():
                needs = f"{SOURCE_SPM}, {TARGET_SPM} and {VOCAB_NAME}"
                raise FileNotFoundError(f"{path}: no such file (a Marian model directory needs {needs})")
            try:
                return path.read_bytes()
            except OSError as e:
                raise ValueError(f"{path}: cannot read: {e}") from None

        def read_json(name: str) -> Any:
            try:
                return json.loads(read(name))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{directory / name}: not a JSON file: {e}") from None

        separate = (directory / TARGET_VOCAB_NAME).exists()
        files = read(SOURCE_SPM), read(TARGET_SPM), read_json(VOCAB_NAME)
        try:
            tokenizer = cls(*files, read_json(TARGET_VOCAB_NAME) if separate else None)
        except ValueError as e:  # its message starts with the file's name: make it the file's path
            raise ValueError(f"{directory}/{e}") from None
        tgt_size = model_tgt_vocab_size or model_vocab_size
        checks = [(VOCAB_NAME, tokenizer.vocab_size, model_vocab_size)]
        checks += [(TARGET_VOCAB_NAME, tokenizer.target_vocab_size, tgt_size)] if separate else []
        for name, size, model_size in checks:
            if model_size is not None and size > model_size:
                raise ValueError(f"{directory / name}: the tokenizer has {size} tokens but the model only {model_size}")
        return tokenizer
