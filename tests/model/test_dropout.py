"""Dropout (§5.4) with the 16-bit CPU mask: its distribution, scale and gradient against the
Bernoulli formula, checked statistically (5σ bounds) on a million elements."""

import math

import pytest
import torch

from aiayn.model.dropout import Dropout, dropout, dropout_mask, scaled_dropout_mask


def bound(q: float, n: int) -> float:
    return 5 * math.sqrt(q * (1 - q) / n)


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5, 0.9])
def test_the_mask_keeps_each_element_with_probability_1_minus_p(p):
    torch.manual_seed(0)
    n = 1_000_000
    mask = dropout_mask((1000, 1000), p)
    assert mask.dtype == torch.bool and mask.shape == (1000, 1000)
    q = 1 - p
    assert abs(mask.float().mean().item() - q) < bound(q, n)
    # every element on its own: rows, columns and each 16-bit quarter of the 64-bit draws
    flat = mask.flatten()
    quarters = [flat[k::4] for k in range(4)]
    for part in (*quarters, mask[:, 0], mask[0, :]):
        assert abs(part.float().mean().item() - q) < bound(q, part.numel())
    # the quarters of one draw are independent: P(both kept) = q² for every pair
    for i, j in ((0, 1), (1, 2), (2, 3), (0, 3), (0, 2)):
        both = (quarters[i] & quarters[j]).float().mean().item()
        assert abs(both - q * q) < bound(q * q, n // 4)
    # neighbours in a row: P(kept, kept) = q² as well
    pairs = (mask[:, :-1] & mask[:, 1:]).float().mean().item()
    assert abs(pairs - q * q) < bound(q * q, n)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_the_scaled_mask_is_the_boolean_mask_times_the_rounded_scale(p):
    torch.manual_seed(4)
    mask = dropout_mask((300, 301), p)
    torch.manual_seed(4)
    scaled = scaled_dropout_mask((300, 301), p)
    assert scaled.dtype == torch.float32
    q = 1 - round(p * 65536) / 65536
    assert torch.equal(scaled, mask.float() / q)


def test_odd_sizes_and_empty_tensors():
    torch.manual_seed(0)
    assert dropout_mask((3, 5, 7), 0.5).shape == (3, 5, 7)
    assert scaled_dropout_mask((1, 3), 0.5).shape == (1, 3)
    assert dropout_mask((0, 4), 0.5).shape == (0, 4)
    assert dropout(torch.ones(0, 4), 0.5).shape == (0, 4)


def test_kept_elements_are_scaled_so_the_expectation_is_x():
    torch.manual_seed(1)
    p = 0.1
    x = torch.rand(1000, 1000) + 0.5
    y = dropout(x, p)
    kept = y != 0
    q = 1 - round(p * 65536) / 65536  # the rounded probability the scale uses
    assert abs(q - (1 - p)) <= 1 / 65536
    torch.testing.assert_close(y[kept], x[kept] / q, rtol=1e-6, atol=0)
    ratio = (y / x).mean().item()  # E[y / x] = 1, Var[y / x] = (1 - q) / q per element
    assert abs(ratio - 1) < 5 * math.sqrt((1 - q) / q / x.numel())


def test_the_gradient_is_the_same_mask_and_scale():
    torch.manual_seed(2)
    p = 0.3
    x = torch.randn(64, 48, requires_grad=True)
    y = dropout(x, p)
    g = torch.randn_like(y)
    y.backward(g)
    q = 1 - round(p * 65536) / 65536
    kept = y != 0  # x is never exactly 0 here
    torch.testing.assert_close(x.grad, torch.where(kept, g / q, torch.zeros(())), rtol=1e-6, atol=0)


def test_identity_in_eval_mode_and_at_p_0_zero_at_p_1():
    x = torch.randn(8, 16)
    module = Dropout(0.5).eval()
    assert module(x) is x
    assert dropout(x, 0.0) is x
    assert torch.equal(dropout(x, 1.0), torch.zeros_like(x))
    with pytest.raises(ValueError, match="dropout probability"):
        Dropout(1.5)


def test_seeded_masks_repeat():
    x = torch.randn(32, 32)
    torch.manual_seed(3)
    a = Dropout(0.1).train()(x)
    torch.manual_seed(3)
    b = Dropout(0.1).train()(x)
    assert torch.equal(a, b)
    assert not torch.equal(a, Dropout(0.1).train()(x))


def test_other_dtypes_use_torch_dropout_with_its_exact_scale():
    torch.manual_seed(5)
    x = torch.ones(1000, 1000, dtype=torch.float64)
    y = dropout(x, 0.1)
    assert y.dtype == torch.float64
    assert set(y.unique().tolist()) == {0.0, 1 / 0.9}  # exactly 1 / (1 - p), not a rounded scale


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_bf16_takes_the_16_bit_mask_and_rounds_once(p):
    """A bfloat16 x (autocast's products in training): the float32 path's mask for the same seed,
    x times the float32 scale 1 / (1 - p') rounded once to bfloat16; p of the elements dropped."""
    torch.manual_seed(6)
    x = (torch.rand(1000, 1000) + 0.5).bfloat16()
    torch.manual_seed(7)
    y = dropout(x, p)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    torch.manual_seed(7)
    assert torch.equal(y, dropout(x.float(), p).bfloat16())  # the same mask, one rounding
    q = 1 - round(p * 65536) / 65536
    kept = y != 0  # x is never 0 here
    torch.testing.assert_close(y[kept].float(), x[kept].float() / q, rtol=2**-8, atol=0)  # within bf16 rounding
    dropped = 1 - kept.float().mean().item()
    assert abs(dropped - p) < bound(p, x.numel())


def test_bf16_gradient_is_the_same_mask_and_scale():
    torch.manual_seed(2)
    p = 0.3
    x = torch.randn(256, 192).bfloat16().requires_grad_()
    y = dropout(x, p)
    g = torch.randn(256, 192).bfloat16()
    y.backward(g)
    assert x.grad.dtype == torch.bfloat16
    q = 1 - round(p * 65536) / 65536
    kept = y != 0  # x is never exactly 0 here
    assert 0.6 < kept.float().mean().item() < 0.8
    expected = torch.where(kept, g.float() / q, torch.zeros(()))
    torch.testing.assert_close(x.grad.float(), expected, rtol=2**-8, atol=0)
    assert torch.all(x.grad[~kept] == 0)


needs_dynamo = pytest.mark.skipif(not torch._dynamo.is_dynamo_supported(), reason="torch.compile unsupported here")


@needs_dynamo
def test_under_torch_compile_dropout_keeps_its_distribution_and_gradient():
    """train.compile: the compiler draws the mask itself (F.dropout); still p of the elements
    dropped, the rest scaled by 1 / (1 - p), and the gradient the same mask and scale."""
    torch._dynamo.reset()
    p = 0.3
    step = torch.compile(lambda x: dropout(x, p), backend="aot_eager", fullgraph=True)
    torch.manual_seed(8)
    x = torch.ones(1000, 1000, requires_grad=True)
    y = step(x)
    y.sum().backward()
    kept = y != 0
    assert abs(1 - kept.float().mean().item() - p) < bound(p, x.numel())
    torch.testing.assert_close(y[kept], torch.full_like(y[kept], 1 / (1 - p)))
    torch.testing.assert_close(x.grad, y.detach())  # d(sum y)/dx = mask · scale = y for x = 1


@needs_dynamo
def test_a_compiled_model_trains_with_dropout():
    """The trainer's train.compile: torch.compile(model, dynamic=True) on token batches of two
    shapes, forward and backward in training mode (the 16-bit mask, viewed from 64-bit draws,
    broke AOTAutograd's aliasing here). With P_drop 0 it equals the model run eagerly."""
    from tests.helpers import random_model

    torch._dynamo.reset()
    for P_drop in (0.1, 0.0):
        model = random_model(3, P_drop=P_drop).train()
        compiled = torch.compile(model, backend="aot_eager", dynamic=True)
        for T in (7, 11):
            src, tgt = torch.randint(3, 32, (4, T)), torch.randint(3, 32, (4, T - 2))
            loss = compiled(src, tgt).logsumexp(-1).mean()
            loss.backward()
            grads = [q.grad.clone() for q in model.parameters()]
            assert all(g.isfinite().all() for g in grads)
            model.zero_grad()
            if P_drop == 0.0:
                eager = model(src, tgt).logsumexp(-1).mean()
                eager.backward()
                torch.testing.assert_close(loss, eager, rtol=1e-5, atol=1e-5)
                for g, q in zip(grads, model.parameters(), strict=True):
                    torch.testing.assert_close(g, q.grad, rtol=1e-4, atol=1e-5)
                model.zero_grad()
