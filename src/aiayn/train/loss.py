"""Label-smoothed cross-entropy (§5.4: "we employed label smoothing of value ε_ls = 0.1").

The loss and its gradient are computed together. With the smoothed target distribution
q = (1 - ε_ls) · onehot(y) + ε_ls / V and p = softmax(z), the loss of one position is

    loss = -Σ_v q_v log p_v = (1 - ε_ls) · NLL + ε_ls · mean_v(-log p_v)

and its gradient with respect to the logits z is simply p - q. The forward pass writes
log p into one new (N, V) buffer, reads the loss off it, and turns the same buffer into
p - q in place; the backward pass scales it by the incoming gradient. The autograd chain of
log_softmax, gather and mean allocates five (N, V) tensors and makes about twice as many
passes over them; at the base shape (8,000 words, 2,000 target tokens) that was 9% of a CPU
training step (torch.profiler), much of it first-touch page faults on freshly allocated memory.

On the CPU a C++ kernel (``aiayn.engine.kernels.label_smoothed_ce``) does the same per row while
the row is in cache, and reads bfloat16 logits (autocast) without a float32 copy of them; tests
keep the two paths equal. ``AIAYN_CPU_KERNELS=0`` leaves torch's operations.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..engine import kernels

__all__ = ["label_smoothed_loss"]


class _LabelSmoothedCrossEntropy(torch.autograd.Function):
    """Summed label-smoothed cross-entropy whose gradient p - q is made in the forward pass."""

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, eps_ls: float) -> tuple[Tensor, Tensor]:
        want_grad = ctx.needs_input_grad[0]
        if kernels.loss_eligible(logits):
            rows, nll, buf = kernels.label_smoothed_ce(logits, target, eps_ls, want_grad)  # buf: p - q
            loss = rows.sum()
        else:
            wide = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
            buf = torch.log_softmax(wide, dim=-1)  # (N, V) log p, a new buffer
            nll = -buf.gather(-1, target[:, None]).squeeze(-1)  # (N,)
            smooth = -buf.mean(dim=-1)  # (N,)
            loss = ((1 - eps_ls) * nll + eps_ls * smooth).sum()
            if want_grad:
                buf.exp_().sub_(eps_ls / buf.shape[-1])  # p - ε_ls / V
                buf.scatter_add_(-1, target[:, None], buf.new_full((target.numel(), 1), -(1 - eps_ls)))  # p - q
        ctx.grad_buffer, ctx.logits_dtype = (buf if want_grad else None), logits.dtype
        nll_sum = nll.sum()
        ctx.mark_non_differentiable(nll_sum)
        return loss, nll_sum

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss: Tensor, _grad_nll: Tensor) -> tuple[Tensor | None, None, None]:
        if ctx.grad_buffer is None:
            raise RuntimeError("label_smoothed_loss: backward can run once per forward (its buffer is reused)")
        grad, ctx.grad_buffer = ctx.grad_buffer.mul_(grad_loss), None  # d loss / d z = (p - q) · grad
        return grad.to(ctx.logits_dtype), None, None


def label_smoothed_loss(logits: Tensor, target: Tensor, eps_ls: float = 0.1) -> tuple[Tensor, Tensor]:
    """Summed label-smoothed cross-entropy and summed negative log-likelihood.

    The smoothed target puts 1 - ε_ls on the reference token and spreads ε_ls uniformly over the
    vocabulary: loss = (1 - ε_ls) · NLL + ε_ls · mean_v(-log p_v). Padding must already be
    removed (compute logits only at real target positions). The loss may be backpropagated once;
    the NLL is detached. Both are computed in float32 for half-precision logits.

    Shape: logits ``(N, V)``, target ``(N,)`` -> two scalars (sums over the N positions).
    """
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(f"expected logits (N, V) and target (N,), got {tuple(logits.shape)} and {tuple(target.shape)}")
    return _LabelSmoothedCrossEntropy.apply(logits, target, eps_ls)
