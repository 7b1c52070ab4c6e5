"""What a training step computes, task by task (``train.task``); the loop around it
(``trainer.train``: batches, Adam, checkpoints, validation) is the same for all three.

- ``translation`` (§5): the encoder-decoder ``Transformer`` reads the source and the shifted
  target and is scored with label-smoothed cross-entropy at every target token.
- ``lm``: a ``DecoderOnly`` causal language model reads ``<s> x_1 .. x_n`` and predicts
  ``x_1 .. x_n </s>``, token t + 1 from tokens 1 .. t: the decoder of Figure 1 without the
  encoder (§3.2.3's masking is what makes it a language model).
- ``mlm``: an ``EncoderOnly`` masked language model reads ``x_1 .. x_n </s>`` corrupted by
  ``mask_tokens`` and predicts the original token at the chosen positions only.

What differs from the paper, and why: the paper trains only the translation model; the two
language models (GPT: Radford et al., 2018; BERT: Devlin et al., 2019) reuse its layers, its
tokenizer, its batching and its training recipe, so that the three Transformer types of the
paper's successors can be compared on the same corpus.

Legend: B sequences in a batch, L sequence length, N scored positions, V vocabulary size.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from ..data.batching import Batch, TextBatch, collate, collate_text
from ..data.tokenizer import SPECIAL_TOKENS, Tokenizer
from ..model import DecoderOnly, EncoderOnly, ModelConfig, Transformer
from .config import DataConfig, TrainConfig
from .data import load_split, load_texts
from .loss import label_smoothed_loss

__all__ = [
    "Objective", "Translation", "CausalLM", "MaskedLM", "objective_for", "mask_tokens", "drop_words", "split_merges",
]  # fmt: skip

Log = Callable[[str], None]


class Objective:
    """One task's data, batches and loss. ``unit`` names an example in log lines."""

    task: str
    unit: str
    model_class: type[nn.Module]

    def __init__(self, word_dropout: float = 0.0, bpe_dropout: float = 0.0) -> None:
        self.word_dropout, self.bpe_dropout = word_dropout, bpe_dropout
        self.merge_parents: dict[int, tuple[int, int]] = {}  # for bpe_dropout: Tokenizer.merge_parents()

    def split_examples(self, examples: list[Any], max_len: int, rng: random.Random) -> list[Any]:
        """Training examples under BPE-dropout (``split_merges``), every sequence of them (both
        sides of a pair), each at most ``max_len - 1`` tokens long as ``encode`` keeps them. The
        trainer remakes each epoch's examples so (``batching.RemadeBatcher``)."""
        if not self.merge_parents:
            raise ValueError("train.bpe_dropout: set the objective's merge_parents (Tokenizer.merge_parents()) first")
        return [self._split(x, max_len, rng) for x in examples]

    def _split(self, example: Any, max_len: int, rng: random.Random) -> Any:
        return split_merges(example, self.bpe_dropout, self.merge_parents, rng, max_len - 1)

    def load(self, data: DataConfig, split: str, log: Log, seed: int, required: bool) -> list[Any]:
        """The raw examples (strings) of a split."""
        raise NotImplementedError

    def texts(self, raw: list[Any]) -> Iterator[str]:
        """Every string of the raw examples (what the tokenizer learns from)."""
        raise NotImplementedError

    def encode(self, tokenizer: Tokenizer, raw: list[Any], max_len: int) -> tuple[list[Any], int]:
        """Token-id examples, and how many were skipped as empty or as long as ``max_len`` or longer."""
        raise NotImplementedError

    def lengths(self, examples: list[Any]) -> list[tuple[int, int]]:
        """Per example, the (source, target) positions it fills, for ``TokenBatcher``."""
        raise NotImplementedError

    def collate(self, examples: list[Any], config: ModelConfig, seed: int, train: bool = False) -> Batch | TextBatch:
        """A padded batch; ``seed`` fixes any randomness in it (the masked LM's choice of tokens;
        with ``train``, word dropout)."""
        raise NotImplementedError

    def loss(
        self,
        model: nn.Module,
        batch: Any,
        eps_ls: float,
        amp: contextlib.AbstractContextManager | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Summed label-smoothed loss and summed NLL over the batch's ``num_tokens`` scored
        positions, the logits computed at those positions only."""
        raise NotImplementedError


class Translation(Objective):
    """§5: source -> target, label-smoothed cross-entropy at every target token."""

    task, unit, model_class = "translation", "pairs", Transformer

    def load(self, data: DataConfig, split: str, log: Log, seed: int, required: bool) -> list[tuple[str, str]]:
        return load_split(data, split, log, seed=seed, required=required)

    def texts(self, raw: list[tuple[str, str]]) -> Iterator[str]:
        return (text for pair in raw for text in pair)

    def encode(
        self, tokenizer: Tokenizer, raw: list[tuple[str, str]], max_len: int
    ) -> tuple[list[tuple[list[int], list[int]]], int]:
        kept = [example for example in self.encode_each(tokenizer, raw, max_len) if example is not None]
        return kept, len(raw) - len(kept)

    def encode_each(
        self, tokenizer: Tokenizer, raw: list[tuple[str, str]], max_len: int
    ) -> list[tuple[list[int], list[int]] | None]:
        """Per raw pair its example, or None where ``encode`` skips it (empty or too long)."""
        src = tokenizer.encode_batch([s for s, _ in raw])
        tgt = tokenizer.encode_batch([t for _, t in raw], target=True)  # Marian's: the target SentencePiece
        return [
            (s, t) if 0 < len(s) < max_len and 0 < len(t) < max_len else None for s, t in zip(src, tgt, strict=True)
        ]

    def lengths(self, examples: list[tuple[list[int], list[int]]]) -> list[tuple[int, int]]:
        return [(len(s) + 1, len(t) + 1) for s, t in examples]

    def _split(self, example: tuple[list[int], list[int]], max_len: int, rng: random.Random) -> Any:
        return super()._split(example[0], max_len, rng), super()._split(example[1], max_len, rng)  # both sides

    def collate(
        self, examples: list[tuple[list[int], list[int]]], config: ModelConfig, seed: int, train: bool = False
    ) -> Batch:
        batch = collate(examples, config.pad_id, config.bos_id, config.eos_id)
        if train and self.word_dropout:
            generator = torch.Generator().manual_seed(seed)
            keep = config.suppress_ids  # a tag (data.phrase_tag) is not a word
            src = drop_words(batch.src, self.word_dropout, generator, keep=keep)  # (B, S)
            tgt_in = drop_words(batch.tgt_in, self.word_dropout, generator, keep=keep)  # (B, T); tgt_out as is
            batch = Batch(src, tgt_in, batch.tgt_out, batch.pad_id)
        return batch

    def loss(
        self, model: nn.Module, batch: Batch, eps_ls: float, amp: contextlib.AbstractContextManager | None = None
    ) -> tuple[Tensor, Tensor]:
        select = batch.tgt_out != batch.pad_id  # (B, T)
        with amp or contextlib.nullcontext():
            logits = model(batch.src, batch.tgt_in, select=select)  # (N, V)
        return label_smoothed_loss(logits, batch.tgt_out[select], eps_ls)


class _Monolingual(Objective):
    """Text, one example a line (``data.format: text``), each a sequence of token ids."""

    unit = "texts"

    def load(self, data: DataConfig, split: str, log: Log, seed: int, required: bool) -> list[str]:
        return load_texts(data, split, log, required=required)

    def texts(self, raw: list[str]) -> Iterator[str]:
        return iter(raw)

    def encode(self, tokenizer: Tokenizer, raw: list[str], max_len: int) -> tuple[list[list[int]], int]:
        kept = [ids for ids in tokenizer.encode_batch(raw) if 0 < len(ids) < max_len]
        return kept, len(raw) - len(kept)

    def lengths(self, examples: list[list[int]]) -> list[tuple[int, int]]:
        return [(len(x) + 1, len(x) + 1) for x in examples]  # one side: BOS or EOS added

    def loss(
        self, model: nn.Module, batch: TextBatch, eps_ls: float, amp: contextlib.AbstractContextManager | None = None
    ) -> tuple[Tensor, Tensor]:
        select = batch.targets != batch.pad_id  # (B, L)
        with amp or contextlib.nullcontext():
            logits = model(batch.inputs, select=select)  # (N, V)
        return label_smoothed_loss(logits, batch.targets[select], eps_ls)


class CausalLM(_Monolingual):
    """Next-token prediction: inputs ``<s> x_1 .. x_n``, targets ``x_1 .. x_n </s>``."""

    task, model_class = "lm", DecoderOnly

    def collate(self, examples: list[list[int]], config: ModelConfig, seed: int, train: bool = False) -> TextBatch:
        inputs = collate_text([[config.bos_id, *x] for x in examples], config.pad_id)  # (B, L)
        targets = collate_text([[*x, config.eos_id] for x in examples], config.pad_id)  # (B, L)
        if train and self.word_dropout:
            generator = torch.Generator().manual_seed(seed)
            inputs = drop_words(inputs, self.word_dropout, generator, keep=config.suppress_ids)  # (B, L)
        return TextBatch(inputs, targets, config.pad_id)


class MaskedLM(_Monolingual):
    """Masked-token prediction: inputs ``x_1 .. x_n </s>`` corrupted by ``mask_tokens``, targets
    the original tokens at the chosen positions (padding elsewhere: no loss there)."""

    task, model_class = "mlm", EncoderOnly

    def __init__(self, mask_prob: float = 0.15) -> None:
        super().__init__()
        self.mask_prob = mask_prob

    def collate(self, examples: list[list[int]], config: ModelConfig, seed: int, train: bool = False) -> TextBatch:
        tokens = collate_text([[*x, config.eos_id] for x in examples], config.pad_id)  # (B, L)
        maskable = tokens >= len(SPECIAL_TOKENS)  # words, not padding, EOS or other specials
        generator = torch.Generator().manual_seed(seed)
        inputs, chosen = mask_tokens(tokens, maskable, config.vocab_size, generator, self.mask_prob)
        return TextBatch(inputs, tokens.masked_fill(~chosen, config.pad_id), config.pad_id)


def mask_tokens(
    tokens: Tensor,
    maskable: Tensor,
    vocab_size: int,
    generator: torch.Generator,
    mask_prob: float = 0.15,
    mask_id: int = Tokenizer.mask_id,
    first_random: int = len(SPECIAL_TOKENS),
) -> tuple[Tensor, Tensor]:
    """BERT's masked-LM corruption (Devlin et al., 2019, §3.1): each maskable position is chosen
    with probability ``mask_prob``; a chosen token is replaced by ``mask_id`` with probability
    0.8, by a uniformly random token of ``first_random .. vocab_size - 1`` with probability 0.1,
    and kept with probability 0.1 (so the model cannot learn that an unmasked token is never the
    answer). A sequence with maskable tokens but none chosen gets one chosen at random: it then
    teaches something, and a batch always has a target (short sentences are so masked slightly
    more than ``mask_prob``).

    (A corruption of the input, not an attention mask: attention masks live in ``model/masks.py``.)

    Shape: tokens ``(B, L)``, maskable ``(B, L)`` boolean -> corrupted inputs ``(B, L)`` and
    ``chosen`` ``(B, L)`` boolean, the positions to predict.
    """
    chosen = (torch.rand(tokens.shape, generator=generator) < mask_prob) & maskable  # (B, L)
    fallback = torch.rand(tokens.shape, generator=generator).masked_fill(~maskable, -1.0).argmax(dim=1)  # (B,)
    none = maskable.any(dim=1) & ~chosen.any(dim=1)  # (B,)
    chosen[none, fallback[none]] = True
    action = torch.rand(tokens.shape, generator=generator)  # (B, L): < 0.8 mask, < 0.9 random, else keep
    random_tokens = torch.randint(first_random, vocab_size, tokens.shape, generator=generator)  # (B, L)
    inputs = torch.where(chosen & (action < 0.8), mask_id, tokens)
    inputs = torch.where(chosen & (action >= 0.8) & (action < 0.9), random_tokens, inputs)
    return inputs, chosen


def drop_words(
    tokens: Tensor,
    p: float,
    generator: torch.Generator,
    unk_id: int = Tokenizer.unk_id,
    first_word: int = len(SPECIAL_TOKENS),
    keep: tuple[int, ...] = (),
) -> Tensor:
    """Word dropout (Gal & Ghahramani, 2016; for low-resource NMT, Sennrich & Zhang, 2019): each
    token of a word (an id >= ``first_word``, not in ``keep``: not padding, BOS, EOS or a tag) is
    replaced by ``unk_id`` with probability ``p``, independently. Sennrich & Zhang zero the word's embedding
    instead; ``<unk>``, whose embedding is learned, does the same without touching the model.

    Shape: tokens ``(B, L)`` -> ``(B, L)``.
    """
    words = (tokens >= first_word) & ~torch.isin(tokens, torch.tensor(keep, dtype=tokens.dtype))  # (B, L)
    dropped = (torch.rand(tokens.shape, generator=generator) < p) & words  # (B, L)
    return tokens.masked_fill(dropped, unk_id)


def split_merges(
    ids: list[int], p: float, parents: dict[int, tuple[int, int]], rng: random.Random, max_len: int | None = None
) -> list[int]:
    """BPE-dropout (Provilkov et al., 2020, "BPE-Dropout: Simple and Effective Subword
    Regularization"; not in the paper), on each token's own merge tree: a token is split with
    probability ``p`` into the two tokens its merge joined (``parents``: merged id -> the two ids,
    from ``Tokenizer.merge_parents``), each part again with probability ``p``, and so on down to
    bytes; a merge at depth d of the tree is so undone with probability p^(d+1). Provilkov et al.
    skip each merge with probability ``p`` while segmenting, which also lets other merges take
    its place; this approximation costs no second tokenization and is seeded: ``rng`` (the
    trainer seeds it by the epoch) makes it repeatable, so a resumed run draws the same splits. At p 0.1
    it adds 0.116 tokens per merged token on Ding, the exact method (``tokenizers``' unseeded BPE
    ``dropout``) 0.125; at 0.3, 0.40 against 0.55.

    The text is unchanged (the parts spell the token) and ``p = 0`` changes nothing. With
    ``max_len``, splitting stops once the sequence holds ``max_len`` tokens (a longer input is
    left as it is).
    """
    room = math.inf if max_len is None else max_len - len(ids)  # splits left: each adds a token
    out: list[int] = []
    stack: list[int] = []
    for token in ids:
        stack.append(token)
        while stack:
            t = stack.pop()
            pair = parents.get(t)
            if pair is not None and room > 0 and rng.random() < p:
                stack += (pair[1], pair[0])  # the left part next
                room -= 1
            else:
                out.append(t)
    return out


def objective_for(train: TrainConfig) -> Objective:
    """The objective of ``train.task``."""
    if train.task == "lm":
        return CausalLM(train.word_dropout, train.bpe_dropout)
    if train.task == "mlm":
        return MaskedLM(train.mask_prob)
    return Translation(train.word_dropout, train.bpe_dropout)
