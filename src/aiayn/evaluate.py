"""Scoring models and translations: per-token loss and perplexity under teacher forcing, and
sacreBLEU's BLEU and chrF with their signatures, the way papers report them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sacrebleu
import torch

from .data.batching import TokenBatcher
from .model import DecoderOnly, EncoderOnly, Transformer

if TYPE_CHECKING:
    from .train.objectives import Objective

__all__ = ["Scores", "evaluate_loss", "score_translations"]


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
    if not hypotheses:
        raise ValueError("no sentences to score")
    bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
    b = bleu.corpus_score(hypotheses, [references])
    c = chrf.corpus_score(hypotheses, [references])
    return Scores(b.score, c.score, str(bleu.get_signature()), str(chrf.get_signature()), str(b))


@torch.no_grad()
def evaluate_loss(
    model: Transformer | DecoderOnly | EncoderOnly,
    examples: list[Any],
    max_tokens: int,
    device: torch.device,
    objective: Objective | None = None,
) -> tuple[float, float]:
    """Label-smoothing-free per-token NLL and perplexity of ``examples`` under ``objective``
    (default: translation). For the masked LM these are of the masked positions, chosen the
    same way at every evaluation (seeded by the batch), so that evaluations compare. An example
    longer than ``max_tokens`` is evaluated in a batch of its own."""
    if objective is None:
        from .train.objectives import Translation  # the task's definition (batches, loss), not the loop

        objective = Translation()
    training = model.training
    model.eval()
    batcher = TokenBatcher(objective.lengths(examples), max_tokens, shuffle=False, long_alone=True)
    nll_sum, tokens = 0.0, 0
    for i, indices in enumerate(batcher.epoch(0)):
        batch = objective.collate([examples[j] for j in indices], model.config, seed=i).to(device)
        _, nll = objective.loss(model, batch, 0.0)
        nll_sum += nll.item()
        tokens += batch.num_tokens
    model.train(training)
    nll = nll_sum / max(tokens, 1)
    return nll, math.exp(min(nll, 50))
