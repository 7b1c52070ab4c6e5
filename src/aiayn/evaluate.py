"""Scoring translations the way papers do: sacreBLEU's BLEU and chrF, with their signatures."""

from __future__ import annotations

from dataclasses import dataclass

import sacrebleu

__all__ = ["Scores", "score_translations"]


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
