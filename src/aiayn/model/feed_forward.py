"""Position-wise feed-forward networks (§3.3).

Legend: B batch, L sequence length.

What differs from the paper: GELU and SiLU (swish, Marian's) are options beside ReLU, and dropout after the activation
(``activation_dropout``, default 0 as in the paper) is available.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from .dropout import Dropout

__all__ = ["PositionwiseFeedForward", "ACTIVATION"]

ACTIVATION = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}  # by ModelConfig.activation


class PositionwiseFeedForward(nn.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2  (§3.3, eq. 2), applied to each position alike.

    Inner size d_ff (2048 in the base model); ``activation="gelu"`` or ``"silu"`` replaces max(0, ·).
    Shape: ``(B, L, d_model) -> (B, L, d_model)``.
    """

    def __init__(self, d_model: int, d_ff: int, activation: str = "relu", activation_dropout: float = 0.0) -> None:
        super().__init__()
        self.linear1 = nn.Linear(d_model, d_ff)  # W1, b1
        self.linear2 = nn.Linear(d_ff, d_model)  # W2, b2
        self.activation = ACTIVATION[activation]
        self.dropout = Dropout(activation_dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = self.activation(self.linear1(x))  # (B, L, d_ff)
        return self.linear2(self.dropout(h))  # (B, L, d_model)
