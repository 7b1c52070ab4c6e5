"""Label-smoothed cross-entropy (§5.4: "we employed label smoothing of value ε_ls = 0.1")."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

__all__ = ["label_smoothed_loss"]


def label_smoothed_loss(logits: Tensor, target: Tensor, eps_ls: float = 0.1) -> tuple[Tensor, Tensor]:
    """Summed label-smoothed cross-entropy and summed negative log-likelihood.

    The smoothed target puts 1 - ε_ls on the reference token and spreads ε_ls uniformly over the
    vocabulary: loss = (1 - ε_ls) · NLL + ε_ls · mean_v(-log p_v). Padding must already be
    removed (compute logits only at real target positions).

    Shape: logits ``(N, V)``, target ``(N,)`` -> two scalars (sums over the N positions).
    """
    log_probs = F.log_softmax(logits.float(), dim=-1)  # (N, V)
    nll = -log_probs.gather(-1, target[:, None]).squeeze(-1)  # (N,)
    smooth = -log_probs.mean(dim=-1)  # (N,)
    loss = (1 - eps_ls) * nll + eps_ls * smooth
    return loss.sum(), nll.detach().sum()
