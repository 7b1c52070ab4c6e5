"""Decoding: translating with greedy and beam search (§6.1); sampling from a decoder-only
language model and filling masks with an encoder-only one (last section, not in the paper).

Legend: B batch (sentences), K beam size, S source length, L output length, V vocabulary.

One search loop (``_search``, as fairseq's ``SequenceGenerator`` with its ``search`` strategies
and logits processors) runs behind ``greedy_decode``, ``beam_search``, ``translate_ids`` (and so
``Translator``, ``aiayn translate`` and the trainer's dev BLEU) and ``sample``. A step: the
decoder's next-token logits for every row, a strategy's scores (``_Greedy``, ``_Sample``:
logits; ``_Beam``: log-probabilities), the rules of ``_rules`` (no padding nor suppressed
tokens, ``min_len``, EOS at the limit, no repeated n-gram), then the strategy's choice of tokens
and of the rows that go on. Batches run one after another, or, in ``translate_continuous``
(``aiayn serve``), new sentences join the rows decoding as others end.

The loop runs on the KV cache: the encoder-decoder keys and values are computed once per
source, the self-attention keys and values grow one step at a time, and beam search gathers the
cache rows by parent beam every step. A model from ``aiayn.engine.prepare`` runs on the engine
(its cache and flat step, ``engine.step.Decoding``); any other on its own modules and
``model/cache.py``. ``use_cache=False`` recomputes the whole prefix each step instead (the
reference the cache is tested and benchmarked against). An ``Ensemble`` of models decodes each
member on its own state and scores the mean of their next-token probabilities.

Conventions shared by greedy and beam search (as in fairseq):
- the padding token is never produced;
- sentence b may produce at most ``limit_b = (its source length) + max_len_a`` tokens, EOS
  included (§6.1: "maximum output length to input length + 50"), capped by ``max_len``; at
  the limit EOS is forced (scored with its real probability);
- ``min_len`` forbids EOS before that many tokens (benchmarks use it to force equal lengths);
- ``no_repeat_ngram_size`` n > 0 (not in the paper; fairseq's ``--no-repeat-ngram-size``)
  forbids any token that would make an n-gram occur twice in the output; EOS stays allowed
  (fairseq's n = 1 bans it too), and the rule yields where it would leave no token at all.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .engine import is_prepared
from .engine.step import Decoding
from .model import DecoderOnly, EncoderOnly, ModelConfig, Transformer

__all__ = [
    "Ensemble", "Hypothesis", "beam_search", "fill_mask", "filter_logits", "generate_ids", "greedy_decode",
    "length_penalty", "sample", "sample_next", "translate_continuous", "translate_ids",
]  # fmt: skip


def length_penalty(length: int | Tensor, alpha: float = 0.6) -> float | Tensor:
    """lp(Y) = ((5 + |Y|) / 6)^α, the length penalty of GNMT (Wu et al., 2016) that §6.1 uses
    with α = 0.6; a hypothesis scores log P(Y|X) / lp(Y). |Y| counts the output tokens, EOS
    included."""
    return ((5 + length) / 6) ** alpha


@dataclass
class Hypothesis:
    """One finished output: ``tokens`` without BOS and EOS, ``score`` = log P / lp(|Y|),
    ``log_prob`` = log P(Y|X) (summed over the tokens, EOS included)."""

    tokens: list[int]
    score: float
    log_prob: float


# Greedy search drops the rows of finished sentences from the batch (gathering every layer's
# cache) once at least 1 / COMPACT_FRACTION of its rows have ended; until then they are decoded
# along and ignored. On the Ding test split (run M's model) compacting at every sentence's end
# took 88 gathers, 0.19 s of ~2.1 s; at a quarter, 49 gathers (0.09 s) for 5% more rows decoded
# (docs/benchmarks.md).
COMPACT_FRACTION = 4


def _limits(model: Transformer, src: Tensor, max_len_a: int = 50, max_len: int | None = None) -> Tensor:
    """Per-sentence output limits ``(B,)``: source length (non-pad tokens) + max_len_a, capped by
    ``max_len`` and by the positions a learned positional embedding has."""
    limit = (src != model.config.pad_id).sum(-1) + max_len_a  # (B,)
    if max_len is not None:
        limit = limit.clamp(max=max_len)
    if model.config.positional == "learned":
        limit = limit.clamp(max=model.config.max_len - 1)  # BOS takes position 0
    return limit.clamp(min=1)


def _ban_repeated_ngrams(logp: Tensor, prefixes: Tensor, n: int, eos_id: int) -> Tensor:
    """In place: -inf for every token that would repeat an n-gram of the output so far.

    ``prefixes`` ``(R, 1 + t)`` (BOS, then t output tokens; BOS is not part of the history),
    ``logp`` ``(R, V)``; rows of fewer tokens are right-aligned after -1s (``_histories``). With
    n = 1 no output token may come twice; with n >= 2 the token that followed each earlier
    occurrence of the last n - 1 tokens is banned. A live prefix holds no EOS, so EOS is never
    banned (fairseq's n = 1 also bans its start symbol, EOS). Where the rule would leave a row
    no token at all (``min_len`` forbidding EOS), it yields for that row at that step.
    """
    tokens = prefixes[:, 1:]  # (R, t)
    t = tokens.size(1)
    if n < 1 or t < n:  # no earlier n-gram to repeat yet
        return logp
    if n == 1:
        rows = torch.arange(tokens.size(0), device=tokens.device)[:, None].expand_as(tokens).reshape(-1)
        banned = tokens.reshape(-1)
    else:
        windows = tokens.unfold(1, n - 1, 1)  # (R, t - n + 2, n - 1): every run of n - 1 tokens
        match = (windows[:, :-1] == windows[:, -1:]).all(-1)  # (R, t - n + 1): earlier runs equal to the last
        rows, starts = match.nonzero(as_tuple=True)
        banned = tokens[rows, starts + n - 1]  # the token that followed each such run
    # a -1 (no token yet) is never banned; a run of -1s matches only in a row with no token at all
    real = banned >= 0
    rows, banned = rows[real], banned[real]
    before = logp[rows, banned]
    logp[rows, banned] = -torch.inf
    # a live row's EOS is never banned: only a row whose EOS was already ruled out can be left
    # with nothing (checking every row's V scores took ~1.5 ms a step, as long as the rest of the rule)
    maybe = (logp[:, eos_id] == -torch.inf).nonzero().squeeze(1)  # (R',)
    if maybe.numel():
        stuck = torch.zeros(logp.size(0), dtype=torch.bool, device=logp.device)  # (R,)
        stuck[maybe] = ~logp[maybe].isfinite().any(dim=-1)
        undo = stuck[rows]
        logp[rows[undo], banned[undo]] = before[undo]
    return logp


def _histories(out: Tensor, lengths: Tensor, bos_id: int) -> Tensor:
    """Each row's first ``lengths[r]`` tokens of ``out`` as prefixes for ``_ban_repeated_ngrams``:
    BOS, then the tokens right-aligned after -1s. Shape: ``out`` ``(R, W)``, ``lengths``
    ``(R,)`` -> ``(R, 1 + max(lengths))``."""
    L = int(lengths.max()) if lengths.numel() else 0
    index = torch.arange(L, device=out.device) + (lengths[:, None] - L)  # (R, L): position in out, < 0 before
    tokens = out.gather(1, index.clamp(min=0)).masked_fill(index < 0, -1)  # (R, L)
    return torch.cat([tokens.new_full((tokens.size(0), 1), bos_id), tokens], dim=1)


class _Plain:
    """Incremental decoding by the model's own modules on its KV cache (``model/cache.py``):
    ``state(tokens)`` takes each row's last token ``(R,)`` and returns next-token logits ``(R, V)``;
    ``reorder(rows)`` gathers rows (beam parents, or the rows still decoding)."""

    def __init__(self, model: Transformer, src: Tensor, beam: int) -> None:
        enc = model.encode(src)
        self.model, self.cache = model, model.init_cache(enc.memory, enc.mask)
        if beam > 1:
            self.cache.reorder(torch.arange(src.size(0), device=src.device).repeat_interleave(beam))

    def __call__(self, tokens: Tensor) -> Tensor:
        return self.model.decode(tokens[:, None], cache=self.cache).logits[:, -1]  # (R, V)

    def reorder(self, rows: Tensor, sentences_changed: bool = True) -> None:
        self.cache.reorder(rows)

    def freeze(self, rows: Tensor) -> None:  # rows all start together here: their positions are shared
        pass


class _Recompute(_Plain):
    """As ``_Plain``, but recomputing each row's whole prefix at every step, without a cache (the
    reference the caches are tested against)."""

    def __init__(self, model: Transformer, src: Tensor, beam: int) -> None:
        self.model = model
        enc = model.encode(src)
        rows = torch.arange(src.size(0), device=src.device).repeat_interleave(beam)
        self.memory, self.memory_mask = enc.memory[rows], enc.mask[rows]
        self.prefixes = src.new_empty(rows.numel(), 0)  # (R, t)

    def __call__(self, tokens: Tensor) -> Tensor:
        self.prefixes = torch.cat([self.prefixes, tokens[:, None]], dim=1)
        select = torch.zeros_like(self.prefixes, dtype=torch.bool)
        select[:, -1] = True
        return self.model.decode(self.prefixes, self.memory, self.memory_mask, select=select).logits  # (R, V)

    def reorder(self, rows: Tensor, sentences_changed: bool = True) -> None:
        self.memory, self.memory_mask, self.prefixes = self.memory[rows], self.memory_mask[rows], self.prefixes[rows]


class _Prompted(_Plain):
    """A decoder-only language model continuing prompts ``(B, T)`` on its KV cache: the first
    step reads the whole prompt in one pass, then each new token comes alone."""

    def __init__(self, model: DecoderOnly, prompt: Tensor) -> None:
        self.model, self.cache, self.prompt = model, model.init_cache(), prompt

    def __call__(self, tokens: Tensor) -> Tensor:
        if self.prompt is not None:  # the first step: the prompt, BOS first, instead of the BOS fed
            tokens, self.prompt = self.prompt, None
            return self.model.decode(tokens, cache=self.cache).logits[:, -1]  # (B, V)
        return self.model.decode(tokens[:, None], cache=self.cache).logits[:, -1]


class Ensemble(nn.Module):
    """Several encoder-decoder models of one vocabulary read as one (not in the paper; the
    ensembles of fairseq's ``--path a.pt:b.pt``, Marian's ``--models``): the next-token
    distribution is the mean of the members' probabilities, p(y | x, y<t) = 1/M Σ_m p_m(y | x, y<t).

    Searches, ``translate_ids`` and ``Translator`` take it in place of a ``Transformer``; each
    member decodes on its own cache (on the engine where it was prepared). ``forward`` returns
    log p, normalised log-probabilities standing in for logits, so that the loss and perplexity
    of ``evaluate_loss`` are the ensemble's. The members must share the tokenizer; their
    vocabulary sizes, special ids and device must agree (checked here), their shapes may differ.
    A token any member suppresses (``suppress_ids``) the ensemble never produces. In
    ``translate_continuous`` sentences join a running search as for one model where every
    member is prepared (``aiayn.engine.prepare``).
    """

    def __init__(self, models: Sequence[Transformer], names: Sequence[Any] | None = None) -> None:
        """``names``: what errors call the members (their directories); by default "member i"."""
        super().__init__()
        names = [f"member {i}" for i in range(len(models))] if names is None else [str(n) for n in names]
        if not models:
            raise ValueError("an ensemble needs at least one model")
        for i, model in enumerate(models):
            if not isinstance(model, Transformer):
                raise TypeError(f"ensemble {names[i]} is a {type(model).__name__}, not an encoder-decoder Transformer")
        first = models[0].config
        same = ("vocab_size", "tgt_vocab_size", "pad_id", "bos_id", "eos_id")
        devices = {next(m.parameters()).device for m in models}
        for i, model in enumerate(models[1:], 1):
            differ = [f"{k} {getattr(model.config, k)} != {getattr(first, k)}" for k in same
                      if getattr(model.config, k) != getattr(first, k)]  # fmt: skip
            if differ:
                raise ValueError(f"ensemble {names[i]} does not match {names[0]}: {', '.join(differ)}")
        if len(devices) > 1:
            raise ValueError(f"the members of an ensemble must be on one device, got {sorted(map(str, devices))}")
        self.members = nn.ModuleList(models)
        self.train(all(m.training for m in models))  # eval members make an eval ensemble (evaluate_loss restores it)
        # outputs must fit every member's learned positions (``_limits``); sinusoidal ones extend
        learned = [m.config.max_len for m in models if m.config.positional == "learned"]
        suppress = tuple(sorted({i for m in models for i in m.config.suppress_ids}))
        positional = "learned" if learned else first.positional
        self.config = first.replace(
            positional=positional, max_len=min(learned, default=first.max_len), suppress_ids=suppress
        )

    def forward(self, src: Tensor, tgt: Tensor, select: Tensor | None = None) -> Tensor:
        """Teacher-forced log p of the mean distribution: src ``(B, S)``, tgt ``(B, T)`` ->
        ``(B, T, V)``, or ``(N, V)`` at the positions where ``select`` is True."""
        return _mean_of_probabilities([m(src, tgt, select=select) for m in self.members])


def _mean_of_probabilities(logits: list[Tensor]) -> Tensor:
    """log(1/M Σ_m softmax(logits_m)), in float32, from M tensors of logits ``(..., V)``."""
    logp = torch.stack([F.log_softmax(x.float(), dim=-1) for x in logits])  # (M, ..., V)
    return torch.logsumexp(logp, dim=0) - math.log(len(logits))


class _EnsembleState:
    """The decoder states of an ``Ensemble``'s members, stepped together: the mean of their
    next-token probabilities (as log p), their caches reordered and frozen alike, and sentences
    joining all of them (``add``) where every member is on the engine."""

    def __init__(self, states: list[_Plain | Decoding]) -> None:
        self.states = states

    def add(self, src: Tensor) -> None:
        for state in self.states:
            state.add(src)

    def __call__(self, tokens: Tensor) -> Tensor:
        return _mean_of_probabilities([state(tokens) for state in self.states])  # (R, V)

    def reorder(self, rows: Tensor, sentences_changed: bool = True) -> None:
        for state in self.states:
            state.reorder(rows, sentences_changed)

    def freeze(self, rows: Tensor) -> None:
        for state in self.states:
            state.freeze(rows)


def _joinable(state: _Plain | Decoding | _EnsembleState) -> bool:
    """Whether sentences may join a running search on ``state`` (``Decoding.add``): on the engine
    without an attention window; an ensemble's where every member's may."""
    if isinstance(state, _EnsembleState):
        return all(_joinable(s) for s in state.states)
    return isinstance(state, Decoding) and state.model.config.attention_window is None


def _decoding(
    model: Transformer | Ensemble, src: Tensor, beam: int, steps: int, use_cache: bool
) -> _Plain | Decoding | _EnsembleState:
    """The decoder state of a search over ``src``, ``beam`` rows per sentence, at most ``steps`` steps."""
    if isinstance(model, Ensemble):
        return _EnsembleState([_decoding(m, src, beam, steps, use_cache) for m in model.members])
    if isinstance(model, DecoderOnly):
        return _Prompted(model, src)
    if not use_cache:
        return _Recompute(model, src, beam)
    if is_prepared(model):
        return Decoding(model, src, beam, steps)
    return _Plain(model, src, beam)


# The rules every search applies to next-token scores (logits processors) ----------------------


@dataclass
class _Step:
    """What the rules see at a step: each row's output position being chosen ``length`` (1-based,
    EOS included) and limit ``limit``, both ``(R,)``, and its tokens so far ``history()``."""

    length: Tensor
    limit: Tensor
    history: Callable[[], Tensor]  # (R, 1 + t): BOS, then the tokens right-aligned after -1s


def _rules(
    config: ModelConfig, min_len: int = 0, no_repeat_ngram_size: int = 0, eos_at_the_limit: bool = True
) -> list[Callable[[Tensor, _Step], Tensor]]:
    """The shared conventions (module docstring), in the order they apply, as functions
    ``(scores (R, V), step) -> scores`` that change the scores in place. Sampling from a language
    model stops at its limit without forcing EOS (``eos_at_the_limit=False``)."""
    pad_id, eos_id = config.pad_id, config.eos_id
    banned = [pad_id, *config.suppress_ids]  # padding, and config.suppress_ids (a tag is never produced)

    def suppress(scores: Tensor, step: _Step) -> Tensor:
        scores[:, banned if len(banned) > 1 else pad_id] = -torch.inf
        return scores

    def min_length(scores: Tensor, step: _Step) -> Tensor:
        scores[step.length < min_len, eos_id] = -torch.inf
        return scores

    def eos_at_limit(scores: Tensor, step: _Step) -> Tensor:
        at_limit = step.limit <= step.length  # (R,)
        if at_limit.any():
            eos = scores[at_limit, eos_id].clone()
            scores[at_limit] = -torch.inf
            scores[at_limit, eos_id] = eos
        return scores

    def no_repeat_ngram(scores: Tensor, step: _Step) -> Tensor:
        return _ban_repeated_ngrams(scores, step.history(), no_repeat_ngram_size, eos_id)

    rules = [suppress, *([min_length] if min_len > 0 else []), *([eos_at_limit] if eos_at_the_limit else [])]
    return rules + ([no_repeat_ngram] if no_repeat_ngram_size > 0 else [])


# Search strategies: what each step keeps of the scores ----------------------------------------


class _Greedy:
    """Greedy search: each sentence's one row takes the most likely token; the sentence ends with
    EOS or at its limit. Ended rows stay in the batch (decoded along, ignored) until
    1 / ``COMPACT_FRACTION`` of them have ended, then leave together: gathering the cache is not free."""

    K = 1

    def join(self, sentences: Tensor) -> None:
        pass

    def scores(self, logits: Tensor) -> Tensor:
        return logits  # the argmax needs no softmax

    def pick(self, scores: Tensor) -> Tensor:
        return scores.argmax(dim=-1)  # (R,)

    def step(self, scores: Tensor, rows: _Rows) -> tuple[Tensor, Tensor | None, Tensor | None, list]:
        """-> (next tokens of the rows kept, their parent rows and the sentences kept, or None and
        None for all in place, results ``(sentence index, tokens)`` of the sentences that ended)."""
        token = self.pick(scores)  # (R,)
        eos = token == rows.eos_id
        ended = (eos | (rows.steps + 1 >= rows.limit)) & ~rows.done  # (n,) with K = 1: rows are sentences
        results = []
        if ended.any():
            index = ended.nonzero().squeeze(1)
            for i, r, ids in zip(index.tolist(), rows.sentence[index].tolist(), rows.out[index].tolist(), strict=True):
                last = [] if eos[i] else [int(token[i])]  # at the limit without EOS (sampling): the last token counts
                results.append((r, ids[: int(rows.steps[i])] + last))
        done = rows.done | ended
        n_done = rows.n_done + len(results)
        if n_done and n_done * COMPACT_FRACTION >= done.numel():
            keep = (~done).nonzero().squeeze(1)
            rows.n_done = 0  # the ended rows leave
            return token[keep], keep, keep, results
        rows.done, rows.n_done = done, n_done
        return token, None, None, results


class _Sample(_Greedy):
    """Sampling (not in the paper): each row draws its next token from softmax(logits / T) after
    top-k and nucleus filtering (``sample_next``); temperature 0 is greedy."""

    def __init__(self, temperature: float, top_k: int | None, top_p: float | None, generator) -> None:
        self.temperature, self.top_k, self.top_p, self.generator = temperature, top_k, top_p, generator

    def pick(self, scores: Tensor) -> Tensor:
        return sample_next(scores, self.temperature, self.top_k, self.top_p, self.generator)  # (R,)


class _Beam:
    """Beam search with length penalty (§6.1): each step extends the K live beams of every sentence
    by every token, keeps the 2K best candidates by log P, finalizes the EOS candidates ranked
    among the first K (scored log P / lp(|Y|)) and continues with the K best non-EOS ones; a
    sentence ends once it has K finished hypotheses or reaches its length limit."""

    def __init__(self, K: int, alpha: float, nbest: int) -> None:
        self.K, self.alpha, self.nbest = K, alpha, nbest
        self.log_p: Tensor | None = None  # (n, K): log P of each live beam
        self.finished: dict[int, list[Hypothesis]] = {}

    def join(self, sentences: Tensor) -> None:
        fresh = torch.full((sentences.numel(), self.K), -torch.inf, device=sentences.device)
        fresh[:, 0] = 0.0  # at first every beam is the same empty prefix: expand only one
        self.log_p = fresh if self.log_p is None else torch.cat([self.log_p, fresh])
        self.finished.update((i, []) for i in sentences.tolist())

    def scores(self, logits: Tensor) -> Tensor:
        return F.log_softmax(logits, dim=-1)

    def step(self, scores: Tensor, rows: _Rows) -> tuple[Tensor, Tensor | None, Tensor, list]:
        K, n, V = self.K, rows.sentence.numel(), scores.size(-1)
        length = rows.steps + 1  # (n,) each sentence's output length after this step, EOS included
        candidates = (self.log_p.view(n * K, 1) + scores).view(n, K * V)
        top, index = candidates.topk(min(2 * K, K * V), dim=1)  # (n, 2K), best first
        parent, token = index // V, index % V
        is_eos = token == rows.eos_id
        eos_rank = (is_eos[:, :K] & top[:, :K].isfinite()).nonzero().tolist()  # EOS among the first K, best first
        if eos_rank:
            ended = torch.tensor([i * K + int(parent[i, r]) for i, r in eos_rank], device=scores.device)
            for (i, r), tokens in zip(eos_rank, rows.out[ended].tolist(), strict=True):
                hyps = self.finished[int(rows.sentence[i])]
                if len(hyps) < K:
                    t, log_p = int(length[i]), float(top[i, r])
                    hyps.append(Hypothesis(tokens[: t - 1], log_p / length_penalty(t, self.alpha), log_p))
        keep_rank = torch.sort(is_eos.int(), dim=1, stable=True).indices[:, :K]  # the K best non-EOS (n, K)
        self.log_p = top.gather(1, keep_rank)
        parent, token = parent.gather(1, keep_rank), token.gather(1, keep_rank)
        full = torch.tensor([len(self.finished[b]) >= K for b in rows.sentence.tolist()], device=scores.device)
        done = full | (rows.limit <= length)
        results = []
        for b in rows.sentence[done].tolist():
            hyps = sorted(self.finished.pop(b), key=lambda h: h.score, reverse=True)
            results.append((b, hyps[: self.nbest]))
        going = (~done).nonzero().squeeze(1)  # (n',)
        self.log_p = self.log_p[going]
        parents = (going[:, None] * K + parent[going]).view(-1)  # (n' K,) each new row's parent row
        return token[going].view(-1), parents, going, results


# The search loop (§6.1) -----------------------------------------------------------------------


@dataclass
class _Rows:
    """The sentences decoding together (n) and their K rows each (R = n K)."""

    sentence: Tensor  # (n,) index of each sentence among the inputs
    limit: Tensor  # (n,) output limit, EOS included
    steps: Tensor  # (n,) tokens produced so far (EOS excluded)
    done: Tensor  # (n,) ended, still in the batch (greedy's lazy compaction)
    last: Tensor  # (R,) each row's latest token, the next step's input
    out: Tensor  # (R, W) each row's tokens so far
    eos_id: int
    n_done: int = 0  # how many of ``done`` are True

    def select(self, keep: Tensor, parents: Tensor) -> None:
        self.sentence, self.limit, self.steps = self.sentence[keep], self.limit[keep], self.steps[keep]
        self.done, self.out = self.done[keep], self.out[parents]

    @classmethod
    def start(cls, sentences: Tensor, limit: Tensor, K: int, config: ModelConfig) -> _Rows:
        """The rows of ``sentences`` ``(n,)`` with output limits ``limit`` ``(n,)``, K each, at BOS."""
        n = sentences.numel()
        out = sentences.new_full((n * K, int(limit.max())), config.pad_id)
        last = sentences.new_full((n * K,), config.bos_id)
        return cls(sentences, limit, limit.new_zeros(n), limit.new_zeros(n, dtype=torch.bool), last, out, config.eos_id)

    def join(self, sentences: Tensor, limit: Tensor, K: int, config: ModelConfig) -> None:
        """``sentences`` ``(n',)`` join after the rows decoding, K rows each, at BOS."""
        new = _Rows.start(sentences, limit, K, config)
        self.sentence, self.limit = torch.cat([self.sentence, sentences]), torch.cat([self.limit, limit])
        self.steps, self.done = torch.cat([self.steps, new.steps]), torch.cat([self.done, new.done])
        self.last = torch.cat([self.last, new.last])
        width = max(self.out.size(1), new.out.size(1))
        self.out = torch.cat([F.pad(self.out, (0, width - self.out.size(1)), value=config.pad_id),
                              F.pad(new.out, (0, width - new.out.size(1)), value=config.pad_id)])  # fmt: skip


# What a search takes in next: given how many sentences are decoding (0: none), a batch of
# ``(sentence indices (B,), padded sources (B, S))`` to join them, or None for none now.
Feed = Callable[[int], "tuple[Tensor, Tensor] | None"]


def _in_turn(batches: Iterable[tuple[Tensor, Tensor]]) -> Feed:
    """The feed of batch-by-batch decoding: the next batch once the last one has ended."""
    pending = iter(batches)
    return lambda live: next(pending, None) if live == 0 else None


@torch.no_grad()
def _search(
    model: Transformer,
    batches: Iterable[tuple[Tensor, Tensor]] | None,
    strategy: _Greedy | _Beam,
    rules: list,
    limits: Callable[[Tensor], Tensor],
    use_cache: bool = True,
    feed: Feed | None = None,
) -> Iterator[tuple[int, Any]]:
    """Run ``strategy`` over ``batches`` of ``(sentence indices (B,), padded sources (B, S))``
    (for a decoder-only model: prompts), each with output limits ``limits(src)`` ``(B,)``,
    yielding ``(index, result)`` as sentences end: greedy's or sampling's tokens (EOS cut off),
    or beam's hypotheses.

    One step: the decoder's next-token logits for every row (``_decoding``: the engine's state for
    a prepared model, the model's own cache otherwise), the strategy's scores (logits, or
    log-probabilities), the ``rules``, then the strategy's choice of tokens and of the rows that go
    on; the cache follows the rows (``reorder``). Batch after batch: a batch runs until its last
    sentence ends. With float weights each sentence's result is what it gets decoded alone
    (tested on the CPU); int8 activations are scaled by the whole batch's range.

    ``feed`` instead of ``batches`` (``translate_continuous``): asked before every step, it may
    bring sentences to join those decoding, at their own position 0 (``Decoding.add``: on the
    engine, or an ensemble of such models, without an attention window; elsewhere only once the
    batch has ended). The search ends when nothing decodes and the feed brings nothing.
    """
    config, K = model.config, strategy.K
    feed = _in_turn(batches) if feed is None else feed
    state = rows = None
    while True:
        if state is None:
            batch = feed(0)
            if batch is None:
                return
            sentences, src = batch
            limit = limits(src)
            state = _decoding(model, src, K, int(limit.max()), use_cache)
            joinable = _joinable(state)
            rows = _Rows.start(sentences, limit, K, config)
            strategy.join(sentences)
        elif joinable:
            batch = feed(rows.sentence.numel() - rows.n_done)
            if batch is not None:
                sentences, src = batch
                limit = limits(src)
                state.add(src)
                rows.join(sentences, limit, K, config)
                strategy.join(sentences)
        logits = state(rows.last).float()  # (R, V)
        steps = rows.steps.repeat_interleave(K) if K > 1 else rows.steps  # (R,)
        limit = rows.limit.repeat_interleave(K) if K > 1 else rows.limit
        out = rows.out
        step = _Step(steps + 1, limit, lambda: _histories(out, steps, config.bos_id))  # noqa: B023
        scores = strategy.scores(logits)
        for rule in rules:
            scores = rule(scores, step)
        token, parents, keep, results = strategy.step(scores, rows)
        yield from results
        if parents is not None:
            if parents.numel() == 0:  # every sentence decoding has ended
                state = rows = None
                continue
            state.reorder(parents, sentences_changed=keep.numel() < rows.sentence.numel())
            rows.select(keep, parents)
        # an ended row (greedy, until it leaves) writes after its last token, where nothing reads
        rows.out.scatter_(1, (rows.steps.repeat_interleave(K) if K > 1 else rows.steps)[:, None], token[:, None])
        rows.last = token
        if rows.n_done:  # greedy's ended rows, still in the batch
            rows.steps = rows.steps + (~rows.done).long()
            state.freeze(rows.done)
        else:
            rows.steps = rows.steps + 1


@torch.no_grad()
def greedy_decode(
    model: Transformer | Ensemble,
    src: Tensor,
    max_len: int | None = None,
    max_len_a: int = 50,
    min_len: int = 0,
    use_cache: bool = True,
    no_repeat_ngram_size: int = 0,
) -> Tensor:
    """Pick the most likely token at every step until every sentence has produced EOS.

    Args:
        model: an encoder-decoder ``Transformer`` in eval mode, or one prepared by
            ``aiayn.engine.prepare`` (the same outputs, faster), or an ``Ensemble`` of them.
        src: ``(B, S)`` source token ids, padded with ``config.pad_id``.
        max_len, max_len_a, min_len: the output limits (module docstring); by default each
            sentence may produce its source length + 50 tokens.
        use_cache: run on the KV cache (default) or recompute the prefix each step.
        no_repeat_ngram_size: n > 0 forbids repeating an n-gram of the output (module docstring).

    Returns:
        ``(B, L)`` output ids without BOS, each ending in EOS; positions after EOS hold ``pad_id``.
    """
    _check(1, 1, no_repeat_ngram_size)
    config = model.config
    rules = _rules(config, min_len, no_repeat_ngram_size)
    sentences = torch.arange(src.size(0), device=src.device)
    limits = functools.partial(_limits, model, max_len_a=max_len_a, max_len=max_len)
    found = dict(_search(model, [(sentences, src)], _Greedy(), rules, limits, use_cache))
    width = max(len(found[b]) for b in range(src.size(0))) + 1
    out = torch.full((src.size(0), width), config.pad_id, dtype=torch.long, device=src.device)
    for b in range(src.size(0)):
        out[b, : len(found[b]) + 1] = torch.tensor([*found[b], config.eos_id])
    return out


@torch.no_grad()
def beam_search(
    model: Transformer | Ensemble,
    src: Tensor,
    beam: int = 4,
    alpha: float = 0.6,
    nbest: int = 1,
    max_len: int | None = None,
    max_len_a: int = 50,
    min_len: int = 0,
    use_cache: bool = True,
    no_repeat_ngram_size: int = 0,
) -> list[list[Hypothesis]]:
    """Beam search with length penalty (§6.1: beam size 4, α = 0.6), batched over sentences
    (``_Beam``); the KV cache is gathered by parent beam every step, and a sentence leaves the
    batch once it has K finished hypotheses or reaches its length limit (EOS is forced there).

    Args:
        model: an encoder-decoder ``Transformer`` in eval mode, or one prepared by
            ``aiayn.engine.prepare``, or an ``Ensemble`` of them.
        src: ``(B, S)`` source ids padded with ``config.pad_id``.
        beam: K; ``beam=1`` gives the greedy output.
        alpha: the length penalty's α (0: plain log-probability).
        nbest: how many hypotheses to return per sentence (<= beam), best first.
        max_len, max_len_a, min_len, use_cache, no_repeat_ngram_size: as for ``greedy_decode``.

    Returns:
        for every sentence, its ``nbest`` best ``Hypothesis`` objects, best first.
    """
    _check(beam, nbest, no_repeat_ngram_size)
    rules = _rules(model.config, min_len, no_repeat_ngram_size)
    sentences = torch.arange(src.size(0), device=src.device)
    limits = functools.partial(_limits, model, max_len_a=max_len_a, max_len=max_len)
    found = dict(_search(model, [(sentences, src)], _Beam(beam, alpha, nbest), rules, limits, use_cache))
    return [found[b] for b in range(src.size(0))]


def _check(beam: int, nbest: int, no_repeat_ngram_size: int) -> None:
    if beam < 1 or not 1 <= nbest <= beam:
        raise ValueError(f"need beam >= 1 and 1 <= nbest <= beam, got beam={beam}, nbest={nbest}")
    if no_repeat_ngram_size < 0:
        raise ValueError(f"no_repeat_ngram_size must be >= 0, got {no_repeat_ngram_size}")


def _source_tensor(sources: Sequence[Sequence[int]], config: ModelConfig, device: torch.device) -> Tensor:
    """Sources (ids without EOS) as a padded ``(B, S)`` batch, EOS appended (as in training)."""
    pad_id, eos_id = config.pad_id, config.eos_id
    longest = max(len(s) for s in sources) + 1
    src = torch.full((len(sources), longest), pad_id, dtype=torch.long)
    for row, ids in enumerate(sources):
        src[row, : len(ids) + 1] = torch.tensor([*ids, eos_id])
    return src.to(device)


MAX_LEN_A = 1024  # translate_ids' largest max_len_a, unless the model's max_len is larger


def _check_max_len_a(config: ModelConfig, max_len_a: int) -> None:
    longest = max(config.max_len, MAX_LEN_A)
    if not 0 <= max_len_a <= longest:  # the caches are reserved for the longest output
        raise ValueError(f"max_len_a must be between 0 and {longest} (or the model's max_len), got {max_len_a}")


@torch.no_grad()
def translate_ids(
    model: Transformer | Ensemble,
    sources: Sequence[Sequence[int]],
    max_tokens: int = 4096,
    max_len_a: int = 50,
    beam: int = 1,
    alpha: float = 0.6,
    nbest: int = 1,
    progress: bool | Any = False,
    no_repeat_ngram_size: int = 0,
) -> list[list[int]] | list[list[Hypothesis]]:
    """Translate many sources (token ids without EOS), batched by length; results in input order.

    ``beam=1`` decodes greedily and returns token lists (EOS cut off); ``beam > 1`` runs beam
    search and returns token lists too, unless ``nbest > 1``, which returns each source's
    ``nbest`` hypotheses. A batch holds at most ``max_tokens`` source positions (times the
    beam); a sentence longer than that gets a batch of its own. With float weights the results
    are those of decoding each sentence alone.
    ``progress``: True shows a progress bar; a tqdm bar of the caller's is advanced instead
    (by the sentences that end) and left open. ``no_repeat_ngram_size``: as for
    ``greedy_decode``.
    """
    from .data.batching import TokenBatcher

    _check(beam, nbest, no_repeat_ngram_size)
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    config = model.config
    _check_max_len_a(config, max_len_a)
    if not sources:
        return []
    device = next(model.parameters()).device
    lengths = [(len(s) + 1, 0) for s in sources]  # source positions, EOS included
    budget = max(max_tokens // beam, 1)  # source positions a batch may hold
    # a sentence longer than a batch gets a batch of its own; the others keep to the budget
    batches = [
        (torch.tensor(batch, device=device), _source_tensor([sources[i] for i in batch], config, device))
        for batch in TokenBatcher(lengths, budget, shuffle=False, long_alone=True).batches
    ]
    greedy = beam == 1 and nbest == 1
    strategy = _Greedy() if greedy else _Beam(beam, alpha, nbest)
    rules = _rules(config, 0, no_repeat_ngram_size)
    results: list = [None] * len(sources)
    bar = None if isinstance(progress, bool) else progress
    if progress is True:
        from .progress import progress_bar

        bar = progress_bar(total=len(sources), desc="translate", unit="sent")
    limits = functools.partial(_limits, model, max_len_a=max_len_a, max_len=None)
    for i, result in _search(model, batches, strategy, rules, limits):
        results[i] = result if greedy or nbest > 1 else result[0].tokens
        if bar is not None:
            bar.update(1)
    if progress is True:
        bar.close()
    return results


def translate_continuous(
    model: Transformer | Ensemble,
    feed: Callable[[int], tuple[Sequence[int], Sequence[Sequence[int]]] | None],
    max_len_a: int = 50,
    beam: int = 1,
    alpha: float = 0.6,
    nbest: int = 1,
    no_repeat_ngram_size: int = 0,
) -> Iterator[tuple[int, list[int] | list[Hypothesis]]]:
    """Continuous batching (not in the paper; the iteration-level scheduling of Orca, Yu et al.,
    2022): sentences join a running search as others end, instead of waiting for its last one.

    Before every step (on the engine; elsewhere once nothing decodes) ``feed(live)`` is told how
    many sentences are decoding (0: none) and returns
    ``(keys, sources)`` to join them (sources: token ids without EOS; keys: ints naming them,
    none equal to a key still decoding) or None. Yields ``(key, result)`` as each sentence ends,
    the result as ``translate_ids``'s; ends when nothing decodes and the feed brings nothing.
    Joining rows start at position 0 beside the others (``Decoding.add``), on a model from
    ``aiayn.engine.prepare`` without an attention window, or an ``Ensemble`` of such models;
    any other model takes a feed's sentences only once the batch has ended. With float weights
    each result is what the sentence gets decoded alone. Bad arguments raise here, before the
    first step.
    """
    _check(beam, nbest, no_repeat_ngram_size)
    _check_max_len_a(model.config, max_len_a)
    return _continuous(model, feed, max_len_a, beam, alpha, nbest, no_repeat_ngram_size)


@torch.no_grad()
def _continuous(model, feed, max_len_a, beam, alpha, nbest, no_repeat_ngram_size) -> Iterator:
    config = model.config
    device = next(model.parameters()).device
    greedy = beam == 1 and nbest == 1
    strategy = _Greedy() if greedy else _Beam(beam, alpha, nbest)
    decoding: set[int] = set()  # keys fed and not yet ended

    def batches(live: int) -> tuple[Tensor, Tensor] | None:
        taken = feed(live)
        if taken is None:
            return None
        keys, sources = taken
        if len(keys) != len(sources):
            raise ValueError(f"the feed gave {len(keys)} keys for {len(sources)} sources")
        if not len(keys):
            return None
        keys = [int(k) for k in keys]
        if len(set(keys)) < len(keys) or not decoding.isdisjoint(keys):
            raise ValueError(f"the feed gave a key twice, or one still decoding: {keys}")
        decoding.update(keys)
        return torch.tensor(keys, device=device), _source_tensor(sources, config, device)

    limits = functools.partial(_limits, model, max_len_a=max_len_a, max_len=None)
    for key, result in _search(model, None, strategy, _rules(config, 0, no_repeat_ngram_size), limits, feed=batches):
        decoding.discard(key)
        yield key, (result if greedy or nbest > 1 else result[0].tokens)


# Sampling from a decoder-only language model; filling masks with an encoder-only one ---------
#
# Not in the paper. Legend for this section: B samples, T prompt length (BOS included), L new
# tokens, V vocabulary, M masks.


def filter_logits(logits: Tensor, top_k: int | None = None, top_p: float | None = None) -> Tensor:
    """Top-k and nucleus (top-p) filtering: the logits of every token outside the ``top_k`` most
    likely (Fan et al., 2018), and outside the nucleus, the smallest set of most likely tokens
    whose probability reaches ``top_p`` (Holtzman et al., 2020), become -inf. Top-k is applied
    first, so the nucleus is taken of the renormalised top k. ``None`` (or ``top_k`` 0,
    ``top_p`` 1) turns a filter off; the most likely token always stays.

    Shape: ``(B, V) -> (B, V)``.
    """
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k and top_k < logits.size(-1):
        # exactly k, even with ties at the k-th value
        keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, logits.topk(top_k, dim=-1).indices, True)
        logits = logits.masked_fill(~keep, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
        probs = sorted_logits.softmax(dim=-1)  # (B, V)
        before = probs.cumsum(dim=-1) - probs  # (B, V): the mass of the more likely tokens
        drop = (before >= top_p).scatter(-1, order, before >= top_p)  # back to vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(
    logits: Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Draw a token per row from softmax(logits / temperature), after ``filter_logits``.
    Temperature 0 takes the most likely token (greedy), the limit of temperature -> 0.

    Shape: ``(B, V) -> (B,)``.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = filter_logits(logits.float() / temperature, top_k, top_p)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def sample(
    model: DecoderOnly,
    prompt: Tensor,
    max_new_tokens: int = 50,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Continue prompts one token at a time on the KV cache: the prompt is read in one pass,
    then each new token alone, attending to the cached keys and values.

    Args:
        model: a ``DecoderOnly`` causal language model (put it in eval mode first).
        prompt: ``(B, T)`` token ids starting with BOS, no padding (prompts of one length).
        max_new_tokens: the most new tokens, EOS included; also at most ``config.max_len``
            positions in all.
        temperature, top_k, top_p: as ``sample_next``; temperature 0 is greedy.
        generator: seeds the draws (on the model's device), for reproducible samples.

    Returns:
        ``(B, L)`` new token ids, each row ending in EOS unless it hit the limit; positions
        after EOS hold ``pad_id``. Padding is never drawn.
    """
    config = model.config
    max_new_tokens = min(max_new_tokens, config.max_len - prompt.size(1))
    B = prompt.size(0)
    if max_new_tokens <= 0:
        return prompt.new_empty(B, 0)
    rows = torch.arange(B, device=prompt.device)
    strategy = _Sample(temperature, top_k, top_p, generator)
    rules = _rules(config, eos_at_the_limit=False)
    found = dict(_search(model, [(rows, prompt)], strategy, rules, lambda src: torch.full_like(rows, max_new_tokens)))
    ended = [found[b] + ([config.eos_id] if len(found[b]) < max_new_tokens else []) for b in range(B)]
    out = torch.full((B, max(map(len, ended))), config.pad_id, dtype=torch.long, device=prompt.device)
    for b, tokens in enumerate(ended):
        out[b, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    return out


@torch.no_grad()
def generate_ids(
    model: DecoderOnly,
    prompt: Sequence[int],
    num_samples: int = 1,
    max_new_tokens: int = 50,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
) -> list[list[int]]:
    """``num_samples`` continuations of one prompt (token ids without BOS, possibly none), cut at
    EOS (exclusive). A ``seed`` makes them reproducible."""
    config = model.config
    device = next(model.parameters()).device
    generator = None if seed is None else torch.Generator(device=device).manual_seed(seed)
    tokens = torch.tensor([[config.bos_id, *prompt]] * num_samples, dtype=torch.long, device=device)  # (B, T)
    out = sample(model, tokens, max_new_tokens, temperature, top_k, top_p, generator).tolist()
    return [row[: row.index(config.eos_id)] if config.eos_id in row else row for row in out]


@torch.no_grad()
def fill_mask(model: EncoderOnly, ids: Sequence[int], mask_id: int, top_k: int = 5) -> list[list[tuple[int, float]]]:
    """The ``top_k`` most likely tokens at each ``mask_id`` of ``ids`` (a text's tokens without
    EOS; EOS is appended, as in training), with their probabilities, most likely first. One
    pass: every mask is predicted from the text around it, several masks not jointly.

    Shape: ``ids`` of length L with M masks -> M lists of ``top_k`` (token id, probability).
    """
    config = model.config
    device = next(model.parameters()).device
    tokens = torch.tensor([[*ids, config.eos_id]], dtype=torch.long, device=device)  # (1, L + 1)
    select = tokens == mask_id  # (1, L + 1)
    if not select.any():
        raise ValueError("fill_mask: the text has no mask token")
    probs = model(tokens, select=select).float().softmax(dim=-1)  # (M, V)
    top = probs.topk(min(top_k, probs.size(-1)), dim=-1)
    return [
        list(zip(indices, values, strict=True))
        for indices, values in zip(top.indices.tolist(), top.values.tolist(), strict=True)
    ]
