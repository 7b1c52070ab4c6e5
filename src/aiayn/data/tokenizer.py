"""Joint source-target BPE (§5.1: "byte-pair encoding ... shared source-target vocabulary").

A thin wrapper over a Hugging Face ``tokenizers`` byte-level BPE: any text, umlauts, ß and
characters never seen in training included, round-trips exactly (surrounding whitespace is
stripped). Saved as ``tokenizer.json`` beside the model.

Special tokens have fixed ids, matching ``ModelConfig``'s defaults:
``<pad>`` 0, ``<s>`` (BOS) 1, ``</s>`` (EOS) 2, ``<unk>`` 3, ``<mask>`` 4.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

__all__ = ["Tokenizer", "SPECIAL_TOKENS", "TOKENIZER_NAME"]

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<mask>"]
TOKENIZER_NAME = "tokenizer.json"


class Tokenizer:
    """Joint BPE for source and target text, with aiayn's special-token ids."""

    pad_id, bos_id, eos_id, unk_id, mask_id = range(5)

    def __init__(self, hf: HFTokenizer) -> None:
        for i, token in enumerate(SPECIAL_TOKENS):
            if hf.token_to_id(token) != i:
                raise ValueError(f"tokenizer: special token {token} must have id {i}")
        self.hf = hf

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
        """Learn a byte-level BPE of ``vocab_size`` entries (specials included) from ``texts``."""
        hf = HFTokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        hf.train_from_iterator((t.strip() for t in texts), trainer)
        return cls(hf)

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS)."""
        return self.hf.encode(text.strip(), add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.hf.encode_batch([t.strip() for t in texts], add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, stopping at the first EOS and skipping the other special tokens."""
        ids = list(ids)
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        text = self.hf.decode([i for i in ids if i >= len(SPECIAL_TOKENS)], skip_special_tokens=True)
        return text[1:] if text.startswith(" ") else text  # the prefix space the pre-tokenizer added

    def decode_batch(self, batch: Sequence[Sequence[int]]) -> list[str]:
        return [self.decode(ids) for ids in batch]

    def tokens(self, text: str) -> list[str]:
        """The subword strings of ``text`` (for display, e.g. attention maps)."""
        return self.hf.encode(text.strip(), add_special_tokens=False).tokens

    def save(self, path: str | Path) -> None:
        from ..model.pretrained import atomic_write

        atomic_write(path, lambda tmp: self.hf.save(tmp))

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such file (a model directory needs {TOKENIZER_NAME})")
        try:
            return cls(HFTokenizer.from_file(str(path)))
        except Exception as e:  # tokenizers raises plain Exceptions for bad files
            raise ValueError(f"{path}: not a valid tokenizer file: {e}") from None
