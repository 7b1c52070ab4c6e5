"""Training: the paper's recipe (§5)."""

from .schedule import inverse_sqrt_schedule, paper_lr

__all__ = ["inverse_sqrt_schedule", "paper_lr"]
