"""Joint source-target BPE (§5.1: "byte-pair encoding ... shared source-target vocabulary").

A thin wrapper over a Hugging Face ``tokenizers`` byte-level BPE: any text, umlauts, ß and
characters never seen in training included, round-trips exactly (surrounding whitespace is
stripped). Saved as ``tokenizer.json`` beside the model.

Special tokens have fixed ids, matching ``ModelConfig``'s defaults:
``<pad>`` 0, ``<s>`` (BOS) 1, ``</s>`` (EOS) 2, ``<unk>`` 3, ``<mask>`` 4; a tokenizer trained with
``phrase_tag`` (for ``data.phrase_tag``) also has ``<phrase>`` 5, the tag of dictionary pairs' sources.

The literal text ``<mask>`` encodes as the mask token (for ``aiayn fill-mask``), as the masked
LM saw a masked word in training: the whitespace before it is dropped, because the masked token
carries its own leading space (``Ġhouse``; RoBERTa's mask token strips left likewise), and the
text after it gets no prefix space. "a <mask> house." reads ``Ġa <mask> Ġhouse .`` and "a
<mask>." ``Ġa <mask> .``, not ``Ġa Ġ <mask> Ġhouse .`` and ``Ġa Ġ <mask> Ġ .``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

__all__ = [
    "Tokenizer", "SPECIAL_TOKENS", "PHRASE_TOKEN", "TOKENIZER_NAME",
    "load_tokenizer", "save_tokenizer", "tokenizer_contents", "tokenizer_files",
]  # fmt: skip

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<mask>"]
PHRASE_TOKEN = "<phrase>"  # id 5 where present
TOKENIZER_NAME = "tokenizer.json"
MASK_TOKEN = "<mask>"
_SPACE_BEFORE_MASK = re.compile(r"\s+(?=<mask>)")


def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-character table, in which byte-level BPE writes its tokens:
    printable Latin-1 bytes stand for themselves, the others are shifted to U+0100 and up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}


_BYTE_DECODER = _byte_decoder()


class Tokenizer:
    """Joint BPE for source and target text, with aiayn's special-token ids."""

    pad_id, bos_id, eos_id, unk_id, mask_id = range(5)

    def __init__(self, hf: HFTokenizer) -> None:
        for i, token in enumerate(SPECIAL_TOKENS):
            if hf.token_to_id(token) != i:
                raise ValueError(f"tokenizer: special token {token} must have id {i}")
        tag = hf.token_to_id(PHRASE_TOKEN)
        if tag not in (None, len(SPECIAL_TOKENS)):
            raise ValueError(f"tokenizer: special token {PHRASE_TOKEN} must have id {len(SPECIAL_TOKENS)}")
        self.num_special = len(SPECIAL_TOKENS) + (tag is not None)  # ids below are control tokens, never text
        # literal "<s>", "</s>", "<pad>", "<unk>" in a text are text (bytes), not control tokens;
        # "<mask>" is split out by hand where wanted (``_encode_masked``)
        hf.encode_special_tokens = True
        self.hf = hf
        self._continuation: HFTokenizer | None = None  # the same BPE without the prefix space

    @classmethod
    def train(
        cls, texts: Iterable[str], vocab_size: int, min_frequency: int = 2, phrase_tag: bool = False
    ) -> Tokenizer:
        """Learn a byte-level BPE of ``vocab_size`` entries (specials included) from ``texts``;
        with ``phrase_tag``, ``<phrase>`` is a special token too (id 5)."""
        hf = HFTokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=SPECIAL_TOKENS + [PHRASE_TOKEN] * phrase_tag,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        hf.train_from_iterator((t.strip() for t in texts), trainer)
        return cls(hf)

    @property
    def phrase_id(self) -> int | None:
        """The id of ``<phrase>``, the tag of dictionary pairs' sources (None unless trained with it)."""
        return len(SPECIAL_TOKENS) if self.num_special > len(SPECIAL_TOKENS) else None

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size()

    def merge_parents(self) -> dict[int, tuple[int, int]]:
        """Per merged token, the ids of the two tokens its BPE merge joined (``Ġd`` + ``er`` ->
        ``Ġder``): the merge tree that ``train.bpe_dropout`` undoes. Bytes and specials have none."""
        merges = json.loads(self.hf.to_str())["model"]["merges"]
        parents: dict[int, tuple[int, int]] = {}
        for merge in merges:
            left, right = merge.split(" ", 1) if isinstance(merge, str) else merge  # tokenizers < 0.20: "a b"
            ids = self.hf.token_to_id(left), self.hf.token_to_id(right), self.hf.token_to_id(left + right)
            if None in ids:
                raise ValueError(f"tokenizer: the merge {left!r} + {right!r} names a token not in the vocabulary")
            parents.setdefault(ids[2], (ids[0], ids[1]))  # a token two merges make: the first
        return parents

    def encode(self, text: str, target: bool = False) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS); ``target``: a target-side text (one joint BPE:
        the same ids)."""
        text = text.strip()
        if MASK_TOKEN in text:
            return self._encode_masked(text)[0]
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str], target: bool = False) -> list[list[int]]:
        texts = [t.strip() for t in texts]
        encodings = self.hf.encode_batch(texts, add_special_tokens=False)
        return [self._encode_masked(t)[0] if MASK_TOKEN in t else e.ids for t, e in zip(texts, encodings, strict=True)]

    def _encode_masked(self, text: str) -> tuple[list[int], list[str]]:
        """Ids and token strings of stripped ``text`` holding a literal ``<mask>``: the pieces
        around the masks are encoded apart, the first as any text, the others as continuations
        (no prefix space), the whitespace before each mask dropped (see the module docstring)."""
        if self._continuation is None:
            self._continuation = HFTokenizer.from_str(self.hf.to_str())
            self._continuation.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            self._continuation.encode_special_tokens = True
        ids: list[int] = []
        tokens: list[str] = []
        for i, piece in enumerate(_SPACE_BEFORE_MASK.sub("", text).split(MASK_TOKEN)):
            if i:
                ids.append(self.mask_id)
                tokens.append(MASK_TOKEN)
            if piece:
                encoding = (self._continuation if i else self.hf).encode(piece, add_special_tokens=False)
                ids += encoding.ids
                tokens += encoding.tokens
        return ids, tokens

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, stopping at the first EOS and skipping the other special tokens."""
        ids = list(ids)
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        text = self.hf.decode([i for i in ids if i >= self.num_special], skip_special_tokens=True)
        return text[1:] if text.startswith(" ") else text  # the prefix space the pre-tokenizer added

    def decode_batch(self, batch: Sequence[Sequence[int]]) -> list[str]:
        return [self.decode(ids) for ids in batch]

    def tokens(self, text: str) -> list[str]:
        """The subword strings of ``text`` (for display, e.g. attention maps)."""
        text = text.strip()
        if MASK_TOKEN in text:
            return self._encode_masked(text)[1]
        return self.hf.encode(text, add_special_tokens=False).tokens

    def pieces(self, ids: Sequence[int], target: bool = False) -> list[str]:
        """One display string per id (e.g. attention-map labels): special tokens as written,
        the space that starts a word as ``▁``, a byte that is only part of a character as ``\\xNN``.
        ``target``: the ids are the target side's (one joint vocabulary here: no difference)."""
        pieces = []
        for i in ids:
            token = self.hf.id_to_token(i)
            if token is None:
                raise ValueError(f"tokenizer: no token has id {i} (vocabulary size {self.vocab_size})")
            if i >= self.num_special and all(c in _BYTE_DECODER for c in token):
                token = bytes(_BYTE_DECODER[c] for c in token).decode("utf-8", errors="backslashreplace")
                token = token.replace(" ", "▁")
            pieces.append(token)
        return pieces

    def save(self, path: str | Path) -> None:
        from ..model.pretrained import atomic_write

        atomic_write(path, lambda tmp: self.hf.save(tmp))

    @classmethod
    def load(cls, path: str | Path, model_vocab_size: int | None = None) -> Tokenizer:
        """Read ``tokenizer.json``; with ``model_vocab_size``, a tokenizer with more tokens than
        the model has embeddings is an error (naming the file), not an index error later."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such file (a model directory needs {TOKENIZER_NAME})")
        try:
            tokenizer = cls(HFTokenizer.from_file(str(path)))
        except Exception as e:  # tokenizers raises plain Exceptions for bad files
            raise ValueError(f"{path}: not a valid tokenizer file: {e}") from None
        if model_vocab_size is not None and tokenizer.vocab_size > model_vocab_size:
            raise ValueError(
                f"{path}: the tokenizer has {tokenizer.vocab_size} tokens but the model only {model_vocab_size}"
            )
        return tokenizer


def load_tokenizer(
    directory: str | Path, model_vocab_size: int | None = None, model_tgt_vocab_size: int | None = None
) -> Any:
    """The tokenizer of a model directory: aiayn's BPE (``tokenizer.json``) or, in a model
    converted from Marian (``aiayn convert marian``), its SentencePiece files
    (``data.sentencepiece.SentencePieceTokenizer``). Errors name the file at fault."""
    from .sentencepiece import SentencePieceTokenizer

    if SentencePieceTokenizer.is_in(directory):
        return SentencePieceTokenizer.load(directory, model_vocab_size, model_tgt_vocab_size)
    return Tokenizer.load(Path(directory) / TOKENIZER_NAME, model_vocab_size)


def save_tokenizer(tokenizer: Any, directory: str | Path) -> None:
    """Write ``tokenizer``'s files into the model directory ``directory`` (``load_tokenizer`` reads
    them), removing another kind's that would be read instead."""
    from .sentencepiece import SOURCE_SPM

    if isinstance(tokenizer, Tokenizer):
        (Path(directory) / SOURCE_SPM).unlink(missing_ok=True)  # load_tokenizer prefers SentencePiece's
        tokenizer.save(Path(directory) / TOKENIZER_NAME)
    else:
        tokenizer.save(directory)


def tokenizer_files(directory: str | Path) -> tuple[str, ...]:
    """The names of the tokenizer files that the model directory ``directory`` needs (a
    converted Marian model's ``target_vocab.json`` where it has one: separate vocabularies)."""
    from .sentencepiece import SOURCE_SPM, TARGET_SPM, TARGET_VOCAB_NAME, VOCAB_NAME, SentencePieceTokenizer

    if not SentencePieceTokenizer.is_in(directory):
        return (TOKENIZER_NAME,)
    separate = (Path(directory) / TARGET_VOCAB_NAME).is_file()
    return (SOURCE_SPM, TARGET_SPM, VOCAB_NAME, *((TARGET_VOCAB_NAME,) if separate else ()))


def tokenizer_contents(directory: str | Path) -> dict[str, bytes]:
    """The bytes of each of the model directory's tokenizer files (``tokenizer_files``): equal for
    two directories iff they read and write the same ids. An unreadable file is an error naming it."""
    contents = {}
    for name in tokenizer_files(directory):
        try:
            contents[name] = (Path(directory) / name).read_bytes()
        except OSError as e:
            raise ValueError(f"{Path(directory) / name}: cannot read the tokenizer file ({e.strerror or e})") from None
    return contents
