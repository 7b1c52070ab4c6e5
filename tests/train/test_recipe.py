"""The recipe of §5: the learning-rate formula and label-smoothed cross-entropy."""

import math

import pytest
import torch
import torch.nn.functional as F

from aiayn.train.loss import label_smoothed_loss
from aiayn.train.schedule import inverse_sqrt_schedule, paper_lr


def test_paper_lr_matches_equation_3_by_hand():
    d_model, warmup = 512, 4000
    # warmup phase: linear in step
    assert paper_lr(1, d_model, warmup) == pytest.approx(512**-0.5 * 1 * 4000**-1.5)
    assert paper_lr(2000, d_model, warmup) == pytest.approx(512**-0.5 * 2000 * 4000**-1.5)
    # the peak is at step = warmup, where both branches meet
    peak = 512**-0.5 * 4000**-0.5
    assert paper_lr(4000, d_model, warmup) == pytest.approx(peak)
    assert max(paper_lr(s, d_model, warmup) for s in range(1, 20000, 7)) <= peak * (1 + 1e-12)
    # decay: inverse square root of the step
    assert paper_lr(16000, d_model, warmup) == pytest.approx(peak / 2)
    assert paper_lr(100, d_model, warmup, scale=2.0) == pytest.approx(2 * paper_lr(100, d_model, warmup))
    assert paper_lr(0, d_model, warmup) == 0.0


def test_lambda_schedule_follows_paper_lr():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.Adam([p], lr=1.0)
    schedule = inverse_sqrt_schedule(opt, d_model=64, warmup=10)
    seen = []
    for _ in range(30):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        schedule.step()
    assert seen == pytest.approx([paper_lr(k, 64, 10) for k in range(1, 31)])


@pytest.mark.parametrize("eps_ls", [0.0, 0.1, 0.3])
def test_label_smoothed_loss_equals_torch_cross_entropy(eps_ls):
    torch.manual_seed(0)
    logits, target = torch.randn(50, 17), torch.randint(0, 17, (50,))
    loss, nll = label_smoothed_loss(logits, target, eps_ls)
    expected = F.cross_entropy(logits, target, label_smoothing=eps_ls, reduction="sum")
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(nll, F.cross_entropy(logits, target, reduction="sum"))


@pytest.mark.parametrize("eps_ls", [0.0, 0.1, 0.3])
def test_label_smoothed_loss_gradient_equals_torch_autograd(eps_ls):
    # the fused gradient p - q against autograd through torch's own label-smoothed cross-entropy
    torch.manual_seed(1)
    logits = torch.randn(40, 23, dtype=torch.float64)
    target = torch.randint(0, 23, (40,))
    ours = logits.clone().requires_grad_()
    theirs = logits.clone().requires_grad_()
    loss, _ = label_smoothed_loss(ours * 2.0, target, eps_ls)  # a non-leaf input, as in a model
    (loss / 7).backward()
    (F.cross_entropy(theirs * 2.0, target, label_smoothing=eps_ls, reduction="sum") / 7).backward()
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-12, atol=1e-14)


def test_label_smoothed_loss_half_precision_logits_and_misuse():
    torch.manual_seed(2)
    logits = torch.randn(8, 11).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, 11, (8,))
    loss, nll = label_smoothed_loss(logits, target, 0.1)
    assert loss.dtype == nll.dtype == torch.float32 and not nll.requires_grad
    torch.testing.assert_close(loss, F.cross_entropy(logits.float(), target, label_smoothing=0.1, reduction="sum"))
    loss.backward(retain_graph=True)
    assert logits.grad.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="backward can run once"):
        loss.backward()
    with pytest.raises(ValueError, match=r"expected logits \(N, V\) and target \(N,\)"):
        label_smoothed_loss(torch.zeros(2, 3, 4), torch.zeros(2, dtype=torch.long))


def test_label_smoothed_loss_hand_computed():
    # two classes, uniform logits: every term is log 2 whatever eps
    loss, nll = label_smoothed_loss(torch.zeros(3, 2), torch.tensor([0, 1, 0]), 0.1)
    assert loss.item() == pytest.approx(3 * math.log(2))
    assert nll.item() == pytest.approx(3 * math.log(2))
    # a confident correct prediction still pays for smoothing
    logits = torch.tensor([[10.0, 0.0]])
    loss, nll = label_smoothed_loss(logits, torch.tensor([0]), 0.1)
    logp = torch.log_softmax(logits, -1)[0]
    assert loss.item() == pytest.approx(-(0.95 * logp[0] + 0.05 * logp[1]).item())
