"""Decoding: translating with greedy and beam search (§6.1); sampling from a decoder-only
language model and filling masks with an encoder-only one (last section, not in the paper).

Legend: B batch (sentences), K beam size, S source length, L output length, V vocabulary.

Both searches run on the KV cache: the encoder-decoder keys and values are computed once per
source, the self-attention keys and values grow one step at a time, and beam search gathers the
cache rows by parent beam every step. A model from ``aiayn.engine.prepare`` runs on the engine
(its cache and flat step, ``engine.step.Decoding``); any other on its own modules and
``model/cache.py``. ``use_cache=False`` recomputes the whole prefix each step instead (the
reference the cache is tested and benchmarked against).

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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .engine import is_prepared
from .engine.step import Decoding
from .model import DecoderOnly, EncoderOnly, ModelConfig, Transformer

__all__ = [
    "Hypothesis", "beam_search", "fill_mask", "filter_logits", "generate_ids", "greedy_decode", "length_penalty",
    "sample", "sample_next", "translate_ids",
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


def _limits(model: Transformer, src: Tensor, max_len_a: int, max_len: int | None) -> Tensor:
    """Per-sentence output limits ``(B,)``: source length (non-pad tokens) + max_len_a, capped by
    ``max_len`` and by the positions a learned positional embedding has."""
    limit = (src != model.config.pad_id).sum(-1) + max_len_a  # (B,)
    if max_len is not None:
        limit = limit.clamp(max=max_len)
    if model.config.positional == "learned":
        limit = limit.clamp(max=model.config.max_len - 1)  # BOS takes position 0
    return limit.clamp(min=1)


def _constrain(logp: Tensor, length: int, at_limit: Tensor, min_len: int, config: ModelConfig) -> Tensor:
    """Apply the shared rules to next-token log-probabilities (or logits) ``(R, V)`` for output
    position ``length`` (1-based): no padding nor ``config.suppress_ids``, no EOS before
    ``min_len``, only EOS at the limit."""
    pad_id, eos_id = config.pad_id, config.eos_id
    logp[:, pad_id] = -torch.inf
    if config.suppress_ids:  # a list index builds an index tensor: only where there is something to ban
        logp[:, list(config.suppress_ids)] = -torch.inf
    if length < min_len:
        logp[:, eos_id] = -torch.inf
    if at_limit.any():
        eos = logp[at_limit, eos_id].clone()
        logp[at_limit] = -torch.inf
        logp[at_limit, eos_id] = eos
    return logp


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

    def argmax(self, logits: Tensor) -> Tensor:
        return logits.argmax(dim=-1)


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


def _decoding(model: Transformer, src: Tensor, beam: int, steps: int, use_cache: bool) -> _Plain | Decoding:
    """The decoder state of a search over ``src``, ``beam`` rows per sentence, at most ``steps`` steps."""
    if not use_cache:
        return _Recompute(model, src, beam)
    if is_prepared(model):
        return Decoding(model, src, beam, steps)
    return _Plain(model, src, beam)


@torch.no_grad()
def greedy_decode(
    model: Transformer,
    src: Tensor,
    max_len: int | None = None,
    max_len_a: int = 50,
    min_len: int = 0,
    use_cache: bool = True,
    no_repeat_ngram_size: int = 0,
) -> Tensor:
    """Pick the most likely token at every step until every sentence has produced EOS.

    Args:
        model: an encoder-decoder ``Transformer`` (put it in eval mode first).
        src: ``(B, S)`` source token ids, padded with ``config.pad_id``.
        max_len, max_len_a, min_len: the output limits (module docstring); by default each
            sentence may produce its source length + 50 tokens.
        use_cache: run on the KV cache (default) or recompute the prefix each step.
        no_repeat_ngram_size: n > 0 forbids repeating an n-gram of the output (module docstring).

    Returns:
        ``(B, L)`` output ids without BOS, each ending in EOS; positions after EOS hold ``pad_id``.
    """
    if no_repeat_ngram_size < 0:
        raise ValueError(f"no_repeat_ngram_size must be >= 0, got {no_repeat_ngram_size}")
    config = model.config
    B = src.size(0)
    limit = _limits(model, src, max_len_a, max_len)  # (B,)
    active = torch.arange(B, device=src.device)  # the sentences still decoding
    state = _decoding(model, src, 1, int(limit.max()), use_cache)
    prefixes = torch.full((B, 1), config.bos_id, dtype=torch.long, device=src.device)
    out = torch.full((B, int(limit.max())), config.pad_id, dtype=torch.long, device=src.device)
    finished = None  # (R,) rows that have produced EOS but are still decoded (no compaction yet)
    for t in range(out.size(1)):
        logits = state(prefixes[:, -1]).float()  # (R, V); the argmax needs no softmax
        logits = _constrain(logits, t + 1, limit[active] <= t + 1, min_len, config)
        logits = _ban_repeated_ngrams(logits, prefixes, no_repeat_ngram_size, config.eos_id)
        token = state.argmax(logits)  # (R,)
        ended = token == config.eos_id  # (R,)
        if finished is not None:  # rows already ended stay until the next compaction; ignore them
            ended |= finished
            token = token.masked_fill(finished, config.pad_id)
        out[active, t] = token
        prefixes = torch.cat([prefixes, token[:, None]], dim=1)
        n_ended = int(ended.sum())
        if n_ended == ended.numel():
            break
        if n_ended and n_ended * COMPACT_FRACTION >= ended.numel():
            keep = (~ended).nonzero().squeeze(1)
            active, prefixes = active[keep], prefixes[keep]
            state.reorder(keep, sentences_changed=True)
            finished = None
        else:
            finished = ended if n_ended else None
    return out[:, : t + 1]  # limits are >= 1: the loop ran


@torch.no_grad()
def beam_search(
    model: Transformer,
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
    """Beam search with length penalty (§6.1: beam size 4, α = 0.6), batched over sentences.

    Each step extends the K live beams of every sentence by every token, keeps the 2K best
    candidates by log P, finalizes the EOS candidates ranked among the first K (scored
    log P / lp(|Y|)) and continues with the K best non-EOS ones; a sentence stops once it has K
    finished hypotheses or reaches its length limit (EOS is forced there), and leaves the batch.
    The KV cache is gathered by parent beam every step.

    Args:
        model: an encoder-decoder ``Transformer`` in eval mode.
        src: ``(B, S)`` source ids padded with ``config.pad_id``.
        beam: K; ``beam=1`` gives the greedy output.
        alpha: the length penalty's α (0: plain log-probability).
        nbest: how many hypotheses to return per sentence (<= beam), best first.
        max_len, max_len_a, min_len, use_cache, no_repeat_ngram_size: as for ``greedy_decode``.

    Returns:
        for every sentence, its ``nbest`` best ``Hypothesis`` objects, best first.
    """
    if beam < 1 or not 1 <= nbest <= beam:
        raise ValueError(f"need beam >= 1 and 1 <= nbest <= beam, got beam={beam}, nbest={nbest}")
    if no_repeat_ngram_size < 0:
        raise ValueError(f"no_repeat_ngram_size must be >= 0, got {no_repeat_ngram_size}")
    config = model.config
    B, K, device = src.size(0), beam, src.device
    limit = _limits(model, src, max_len_a, max_len)  # (B,)
    active = torch.arange(B, device=device)  # sentence of each group of K rows
    state = _decoding(model, src, K, int(limit.max()), use_cache)
    prefixes = torch.full((B * K, 1), config.bos_id, dtype=torch.long, device=device)  # (R, t), R = n K
    scores = torch.full((B, K), -torch.inf, device=device)  # log P of each live beam
    scores[:, 0] = 0.0  # at first every beam is the same empty prefix: expand only one
    finished: list[list[Hypothesis]] = [[] for _ in range(B)]
    for t in range(1, int(limit.max()) + 1):
        n = active.numel()
        at_limit = (limit[active] <= t).repeat_interleave(K)  # (R,)
        logp = _constrain(F.log_softmax(state(prefixes[:, -1]).float(), dim=-1), t, at_limit, min_len, config)  # (R, V)
        logp = _ban_repeated_ngrams(logp, prefixes, no_repeat_ngram_size, config.eos_id)
        V = logp.size(-1)
        candidates = (scores.view(n * K, 1) + logp).view(n, K * V)  # (n, K V)
        top, index = candidates.topk(min(2 * K, K * V), dim=1)  # (n, 2K), best first
        parent, token = index // V, index % V  # (n, 2K)
        is_eos = token == config.eos_id
        # finalize EOS candidates ranked among the first K, best first
        eos_rank = (is_eos[:, :K] & top[:, :K].isfinite()).nonzero().tolist()
        if eos_rank:
            rows = torch.tensor([i * K + int(parent[i, r]) for i, r in eos_rank], device=device)
            ended = prefixes[rows, 1:].tolist()
            for (i, r), tokens in zip(eos_rank, ended, strict=True):
                b = int(active[i])
                if len(finished[b]) < K:
                    log_prob = float(top[i, r])
                    finished[b].append(Hypothesis(tokens, log_prob / length_penalty(t, alpha), log_prob))
        # continue with the K best non-EOS candidates (there are at least K among 2K)
        keep_rank = torch.sort(is_eos.int(), dim=1, stable=True).indices[:, :K]  # (n, K)
        scores = top.gather(1, keep_rank)  # (n, K)
        parent, token = parent.gather(1, keep_rank), token.gather(1, keep_rank)  # (n, K)
        done = torch.tensor([len(finished[b]) >= K for b in active.tolist()], device=device) | (limit[active] <= t)
        if done.all():
            break
        going = (~done).nonzero().squeeze(1)  # (n',)
        rows = (going[:, None] * K + parent[going]).view(-1)  # (n' K,) parent rows
        prefixes = torch.cat([prefixes[rows], token[going].view(-1, 1)], dim=1)
        state.reorder(rows, sentences_changed=bool(done.any()))
        active, scores = active[going], scores[going]
    results = []
    for hyps in finished:
        hyps.sort(key=lambda h: h.score, reverse=True)
        results.append(hyps[:nbest])
    return results


def _refills(model: Transformer) -> bool:
    """Whether ``translate_ids`` refills its batches (``_greedy_refilled``, ``_beam_refilled``): a
    prepared model (``aiayn.engine``) with ``EngineOptions.refill``, without an attention window."""
    return is_prepared(model) and model.engine.refill and model.config.attention_window is None


@torch.no_grad()
def _greedy_refilled(
    model: Transformer,
    sources: Sequence[Sequence[int]],
    batches: Sequence[Sequence[int]],
    max_len_a: int,
    budget: int,
    no_repeat_ngram_size: int = 0,
):
    """Greedy search (as ``greedy_decode``) over many batches, taking in the next batch's
    sentences as soon as half of the rows decoding have ended, if their sources fit
    (``_fits``). Yields ``(index, tokens)`` (EOS cut off) as sentences end.

    Not in the paper. Batch by batch, a batch runs until its last sentence ends, at most its
    source length + 50 steps, and its last steps decode a few rows at the cost of a full step's
    fixed work (~3 ms for run M's model: on the Ding test split, 169 of 262 greedy steps had 15
    rows or fewer). Here new sentences join the cache (``EngineCache.add_rows``) at position 0 while
    the others go on, so steps stay full. With float weights each sentence's output is what
    ``greedy_decode`` gives it alone (tested on the CPU, where masked keys add exact zeros; a
    GPU's attention kernels may round differently). int8 (dynamic quantization, activations
    scaled by the whole batch's range) changes with its batch either way.
    """
    config = model.config
    device = next(model.parameters()).device
    pending = list(batches)
    state: Decoding | None = None
    sentence = torch.zeros(0, dtype=torch.long, device=device)  # (R,) index into sources
    limit = torch.zeros(0, dtype=torch.long, device=device)  # (R,) output limit
    steps = torch.zeros(0, dtype=torch.long, device=device)  # (R,) tokens produced
    last = torch.zeros(0, dtype=torch.long, device=device)  # (R,) the next step's input
    ended = torch.zeros(0, dtype=torch.bool, device=device)  # (R,) rows that have produced EOS
    out = torch.zeros(0, 0, dtype=torch.long, device=device)  # (R, W) the tokens produced so far
    joined = 0  # rows of the last batch taken in
    n_ended = 0  # rows of the cache that have ended (counted at the end of each step)
    while True:
        if (
            pending
            and 2 * (sentence.numel() - n_ended) <= joined
            and _fits(state, sentence.numel(), pending[0], sources, budget)
        ):
            batch = pending.pop(0)
            state, new_limit = _take_in(model, sources, batch, state, 1, max_len_a)
            B = len(batch)
            sentence = torch.cat([sentence, torch.tensor(batch, device=device)])
            limit, steps = torch.cat([limit, new_limit]), torch.cat([steps, steps.new_zeros(B)])
            last = torch.cat([last, last.new_full((B,), config.bos_id)])
            ended = torch.cat([ended, ended.new_zeros(B)])
            out = _with_rows(out, B, int(limit.max()), config.pad_id)
            joined = B
        logits = state(last).float()  # (R, V)
        logits = _constrain(logits, 1, steps + 1 >= limit, 0, config)  # no min_len
        if no_repeat_ngram_size:
            history = _histories(out, steps, config.bos_id)  # (R, 1 + t')
            logits = _ban_repeated_ngrams(logits, history, no_repeat_ngram_size, config.eos_id)
        token = state.argmax(logits)  # (R,)
        going = (~ended).nonzero().squeeze(1)  # rows that have not ended: their token counts
        out[going, steps[going]] = token[going]
        ended = ended | (token == config.eos_id)
        steps = steps + (~ended).long()
        last = token
        if state.cache.positions is not None:  # ended rows wait at position 0 until they leave
            state.cache.positions.masked_fill_(ended, 0)
        n_ended = int(ended.sum())
        if n_ended and n_ended * COMPACT_FRACTION >= ended.numel():
            done = ended.nonzero().squeeze(1)
            for i, ids in zip(sentence[done].tolist(), out[done].tolist(), strict=True):
                yield i, ids[: ids.index(config.eos_id)]
            keep = (~ended).nonzero().squeeze(1)
            if keep.numel() == 0:
                if not pending:
                    return
                state, joined = None, 0
            else:
                state.reorder(keep)
                state.cache.drop_leading()
            sentence, limit, steps, last, ended, out = (t[keep] for t in (sentence, limit, steps, last, ended, out))
            n_ended = 0


def _fits(
    state: Decoding | None, sentences: int, batch: Sequence[int], sources: Sequence[Sequence[int]], budget: int
) -> bool:
    """Whether ``batch`` may join a cache of ``sentences`` sentences: the source positions the
    encoder-decoder K/V then hold, padded to the longest source, stay within twice a batch's
    ``budget`` (a long sentence joining many short ones waits until they have ended)."""
    if state is None:
        return True
    longest = max(len(sources[i]) for i in batch) + 1  # EOS included
    return (sentences + len(batch)) * max(state.cache.cross_attn[0].length, longest) <= 2 * budget


def _take_in(
    model: Transformer,
    sources: Sequence[Sequence[int]],
    batch: Sequence[int],
    state: Decoding | None,
    K: int,
    max_len_a: int,
) -> tuple[Decoding, Tensor]:
    """Encode the sentences ``batch`` (indices into ``sources``) and add K rows each (beams) to
    ``state``, or start one; return it and their output limits ``(len(batch),)``."""
    config = model.config
    src = _source_tensor([sources[i] for i in batch], config.pad_id, config.eos_id, next(model.parameters()).device)
    limit = _limits(model, src, max_len_a, None)
    if state is None:
        return Decoding(model, src, K, int(limit.max())), limit
    state.add(src)
    return state, limit


def _with_rows(out: Tensor, rows: int, width: int, pad_id: int) -> Tensor:
    """``out`` ``(R, W)`` with ``rows`` more rows and at least ``width`` columns, all new entries ``pad_id``."""
    out = F.pad(out, (0, max(width - out.size(1), 0)), value=pad_id)
    return torch.cat([out, out.new_full((rows, out.size(1)), pad_id)])


@torch.no_grad()
def _beam_refilled(
    model: Transformer,
    sources: Sequence[Sequence[int]],
    batches: Sequence[Sequence[int]],
    beam: int,
    alpha: float,
    nbest: int,
    max_len_a: int,
    budget: int,
    no_repeat_ngram_size: int = 0,
):
    """Beam search (as ``beam_search``) over many batches, taking in the next batch's sentences
    as soon as half of the sentences decoding have ended, if their sources fit (``_fits``; see
    ``_greedy_refilled``). Yields ``(index, hypotheses)``, the ``nbest`` best first, as
    sentences end; with float weights each sentence's are those ``beam_search`` gives it alone
    (tested on the CPU)."""
    config = model.config
    device = next(model.parameters()).device
    K = beam
    pending = list(batches)
    state: Decoding | None = None
    active = torch.zeros(0, dtype=torch.long, device=device)  # (n,) index into sources of each sentence
    limit = torch.zeros(0, dtype=torch.long, device=device)  # (n,) output limit
    steps = torch.zeros(0, dtype=torch.long, device=device)  # (n,) tokens produced by each beam so far
    scores = torch.zeros(0, K, device=device)  # (n, K) log P of each live beam
    last = torch.zeros(0, dtype=torch.long, device=device)  # (n K,) the next step's input
    out = torch.zeros(0, 0, dtype=torch.long, device=device)  # (n K, W) each beam's tokens so far
    finished: dict[int, list[Hypothesis]] = {}
    joined = 0  # sentences of the last batch taken in
    while True:
        if pending and 2 * active.numel() <= joined and _fits(state, active.numel(), pending[0], sources, budget):
            batch = pending.pop(0)
            state, new_limit = _take_in(model, sources, batch, state, K, max_len_a)
            n2 = len(batch)
            active = torch.cat([active, torch.tensor(batch, device=device)])
            limit, steps = torch.cat([limit, new_limit]), torch.cat([steps, steps.new_zeros(n2)])
            fresh = scores.new_full((n2, K), -torch.inf)
            fresh[:, 0] = 0.0  # every beam is the same empty prefix: expand only one
            scores, last = torch.cat([scores, fresh]), torch.cat([last, last.new_full((n2 * K,), config.bos_id)])
            out = _with_rows(out, n2 * K, int(limit.max()), config.pad_id)
            finished.update((i, []) for i in batch)
            joined = n2
        n, t = active.numel(), steps + 1  # t: each sentence's output length after this step
        logits = state(last)  # (n K, V)
        logp = _constrain(F.log_softmax(logits.float(), dim=-1), 1, (limit <= t).repeat_interleave(K), 0, config)
        if no_repeat_ngram_size:
            history = _histories(out, steps.repeat_interleave(K), config.bos_id)  # (n K, 1 + t')
            logp = _ban_repeated_ngrams(logp, history, no_repeat_ngram_size, config.eos_id)
        V = logp.size(-1)
        candidates = (scores.view(n * K, 1) + logp).view(n, K * V)
        top, index = candidates.topk(min(2 * K, K * V), dim=1)  # (n, 2K), best first
        parent, token = index // V, index % V
        is_eos = token == config.eos_id
        eos_rank = (is_eos[:, :K] & top[:, :K].isfinite()).nonzero().tolist()
        if eos_rank:
            rows = torch.tensor([i * K + int(parent[i, r]) for i, r in eos_rank], device=device)
            for (i, r), tokens in zip(eos_rank, out[rows].tolist(), strict=True):
                hyps = finished[int(active[i])]
                if len(hyps) < K:
                    length, log_prob = int(t[i]), float(top[i, r])
                    hyps.append(Hypothesis(tokens[: length - 1], log_prob / length_penalty(length, alpha), log_prob))
        keep_rank = torch.sort(is_eos.int(), dim=1, stable=True).indices[:, :K]  # (n, K)
        scores = top.gather(1, keep_rank)
        parent, token = parent.gather(1, keep_rank), token.gather(1, keep_rank)
        done = torch.tensor([len(finished[b]) >= K for b in active.tolist()], device=device) | (limit <= t)
        for b in active[done].tolist():
            hyps = sorted(finished.pop(b), key=lambda h: h.score, reverse=True)
            yield b, hyps[:nbest]
        going = (~done).nonzero().squeeze(1)  # (n',)
        if going.numel() == 0:
            if not pending:
                return
            state, joined = None, 0
        rows = (going[:, None] * K + parent[going]).view(-1)  # (n' K,) parent rows
        out = out[rows]
        out[torch.arange(rows.numel(), device=device), steps[going].repeat_interleave(K)] = token[going].view(-1)
        last = token[going].view(-1)
        active, limit, steps, scores = active[going], limit[going], t[going], scores[going]
        if state is not None:
            state.reorder(rows, sentences_changed=bool(done.any()))
            state.cache.drop_leading()


def _source_tensor(sources: Sequence[Sequence[int]], pad_id: int, eos_id: int, device: torch.device) -> Tensor:
    """Sources (ids without EOS) as a padded ``(B, S)`` batch, EOS appended (as in training)."""
    longest = max(len(s) for s in sources) + 1
    src = torch.full((len(sources), longest), pad_id, dtype=torch.long)
    for row, ids in enumerate(sources):
        src[row, : len(ids) + 1] = torch.tensor([*ids, eos_id])
    return src.to(device)


MAX_LEN_A = 1024  # translate_ids' largest max_len_a, unless the model's max_len is larger


@torch.no_grad()
def translate_ids(
    model: Transformer,
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
    beam); a sentence longer than that gets a batch of its own. With a prepared model
    (``aiayn.engine``), once half of a batch's sentences have ended, the next batch's join the
    decoding (``EngineOptions.refill``; not with an attention window, which goes batch by batch),
    as long as the sentences decoding together hold at most twice
    ``max_tokens`` source positions, padded to the longest; with float weights the results are
    those of decoding each sentence alone either way.
    ``progress``: True shows a progress bar; a tqdm bar of the caller's is advanced instead
    (by the sentences that end) and left open. ``no_repeat_ngram_size``: as for
    ``greedy_decode``.
    """
    from .data.batching import TokenBatcher

    if beam < 1 or not 1 <= nbest <= beam:
        raise ValueError(f"need beam >= 1 and 1 <= nbest <= beam, got beam={beam}, nbest={nbest}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if no_repeat_ngram_size < 0:
        raise ValueError(f"no_repeat_ngram_size must be >= 0, got {no_repeat_ngram_size}")
    config = model.config
    longest = max(config.max_len, MAX_LEN_A)
    if not 0 <= max_len_a <= longest:  # the caches are reserved for the longest output
        raise ValueError(f"max_len_a must be between 0 and {longest} (or the model's max_len), got {max_len_a}")
    if not sources:
        return []
    device = next(model.parameters()).device
    lengths = [(len(s) + 1, 0) for s in sources]  # source positions, EOS included
    budget = max(max_tokens // beam, 1)  # source positions a batch may hold
    # a sentence longer than a batch gets a batch of its own; the others keep to the budget
    batches = TokenBatcher(lengths, budget, shuffle=False, long_alone=True).batches
    results: list = [None] * len(sources)
    bar = None if isinstance(progress, bool) else progress
    if progress is True:
        from .progress import progress_bar

        bar = progress_bar(total=len(sources), desc="translate", unit="sent")
    if _refills(model):
        n = no_repeat_ngram_size
        if beam == 1 and nbest == 1:
            finished = _greedy_refilled(model, sources, batches, max_len_a, budget, n)
        else:
            finished = _beam_refilled(model, sources, batches, beam, alpha, nbest, max_len_a, budget, n)
        for i, result in finished:
            results[i] = result if beam == 1 or nbest > 1 else result[0].tokens
            if bar is not None:
                bar.update(1)
    else:
        for batch in batches:
            src = _source_tensor([sources[i] for i in batch], config.pad_id, config.eos_id, device)
            if beam == 1 and nbest == 1:
                out = greedy_decode(model, src, max_len_a=max_len_a, no_repeat_ngram_size=no_repeat_ngram_size).tolist()
                for row, i in enumerate(batch):
                    ids = out[row]
                    results[i] = ids[: ids.index(config.eos_id)] if config.eos_id in ids else ids
            else:
                hyps = beam_search(
                    model, src, beam, alpha, nbest, max_len_a=max_len_a, no_repeat_ngram_size=no_repeat_ngram_size
                )
                for row, i in enumerate(batch):
                    results[i] = hyps[row] if nbest > 1 else hyps[row][0].tokens
            if bar is not None:
                bar.update(len(batch))
    if progress is True:
        bar.close()
    return results


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
    cache = model.init_cache()
    logits = model.decode(prompt, cache=cache).logits[:, -1]  # (B, V)
    finished = torch.zeros(B, dtype=torch.bool, device=prompt.device)
    out = []
    for step in range(max_new_tokens):
        logits[:, config.pad_id] = float("-inf")
        if config.suppress_ids:
            logits[:, list(config.suppress_ids)] = float("-inf")
        token = sample_next(logits, temperature, top_k, top_p, generator).masked_fill(finished, config.pad_id)  # (B,)
        out.append(token)
        finished |= token == config.eos_id
        if finished.all() or step == max_new_tokens - 1:
            break
        logits = model.decode(token[:, None], cache=cache).logits[:, -1]  # (B, V)
    return torch.stack(out, dim=1)


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
