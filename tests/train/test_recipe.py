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
