"""The learning-rate schedule of §5.3."""

from __future__ import annotations

import torch

__all__ = ["paper_lr", "inverse_sqrt_schedule", "cooldown_factor"]


def paper_lr(step: int, d_model: int, warmup: int = 4000, scale: float = 1.0) -> float:
    """lrate = scale · d_model^-0.5 · min(step^-0.5, step · warmup^-1.5)  (§5.3, eq. 3).

    Rises linearly for the first ``warmup`` steps, then decays with the inverse square root of
    the step number. ``step`` counts from 1; step 0 gives 0.
    """
    if step <= 0:
        return 0.0
    return scale * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def inverse_sqrt_schedule(
    optimizer: torch.optim.Optimizer, d_model: int, warmup: int = 4000, scale: float = 1.0
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` applying ``paper_lr``; set the optimizer's ``lr`` to 1.0. The scheduler's
    step count (starting at 0) is the number of optimizer steps taken, so step k uses
    ``paper_lr(k + 1)``."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: paper_lr(i + 1, d_model, warmup, scale))


def cooldown_factor(progress: float, cooldown: float) -> float:
    """The factor on eq. 3's rate that anneals it linearly to 0 over the last ``cooldown`` of a
    run's budget (not in the paper: inverse square root with a cooldown, Zhai et al., 2022,
    "Scaling Vision Transformers"; Hägele et al., 2024). ``progress`` is the fraction of the
    budget spent, from 0 to 1: 1 until ``1 - cooldown``, then ``(1 - progress) / cooldown``.
    ``cooldown`` 0 leaves eq. 3 as it is."""
    if cooldown <= 0:
        return 1.0
    return min(1.0, max(0.0, (1.0 - progress) / cooldown))
