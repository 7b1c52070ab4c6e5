"""Scoring translations the way papers do: sacreBLEU's BLEU and chrF, with their signatures;
and the perplexity of reference translations under a model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import sacrebleu
import torch
import torch.nn.functional as F

from .model import Transformer

__all__ = ["Scores", "mean_nll", "score_translations"]


@dataclass(frozen=True)
class Scores:
    bleu: float
    chrf: float
    bleu_signature: str
    chrf_signature: str
    bleu_text: str  # e.g. "BLEU = 21.3 55.1/27.0/15.2/9.1 (BP = 1.000 ...)"

    def __str__(self) -> str:
        return f"BLEU {self.bleu:.2f}  chrF {self.chrf:.2f}\n  {self.bleu_signature}\n  {self.chrf_signature}"


def score_translations(hypotheses: list[str], references: list[str]) -> Scores:
    """Corpus BLEU and chrF of ``hypotheses`` against one reference each (sacreBLEU defaults:
    13a tokenization, mixed case)."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
    b = bleu.corpus_score(hypotheses, [references])
    c = chrf.corpus_score(hypotheses, [references])
    return Scores(b.score, c.score, str(bleu.get_signature()), str(chrf.get_signature()), str(b))


@torch.no_grad()
def mean_nll(model: Transformer, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], max_tokens: int = 4096) -> float:
    """Mean negative log-likelihood per target token (EOS included, no label smoothing) of
    token-id pairs under teacher forcing; ``exp`` of it is the perplexity."""
    from .data.batching import TokenBatcher, collate

    config = model.config
    device = next(model.parameters()).device
    training = model.training
    model.eval()
    examples = [(list(s), list(t)) for s, t in pairs]
    batcher = TokenBatcher([(len(s) + 1, len(t) + 1) for s, t in examples], max_tokens, shuffle=False)
    nll, tokens = 0.0, 0
    for indices in batcher.epoch(0):
        batch = collate([examples[i] for i in indices], config.pad_id, config.bos_id, config.eos_id).to(device)
        select = batch.tgt_out != config.pad_id  # (B, T)
        logits = model(batch.src, batch.tgt_in, select=select)  # (N, V)
        nll += float(F.cross_entropy(logits.float(), batch.tgt_out[select], reduction="sum"))
        tokens += int(select.sum())
    model.train(training)
    return nll / max(tokens, 1)
