"""The decoding path of ``linear`` (the transposed product for a few rows) equals ``F.linear``."""

import pytest
import torch
import torch.nn.functional as F

from aiayn.model.linear import SMALL_ROWS, Linear, linear


@pytest.mark.parametrize("shape", [(1, 16), (3, 1, 16), (SMALL_ROWS, 16), (SMALL_ROWS + 1, 16), (2, 5, 16), (0, 16)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_equals_f_linear_without_grad(shape, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g)
    weight, b = torch.randn(24, 16, generator=g), torch.randn(24, generator=g) if bias else None
    with torch.no_grad():
        y = linear(x, weight, b)
    assert y.shape == (*shape[:-1], 24)
    rows = y.numel() // 24
    if 1 < rows <= SMALL_ROWS:  # the decoding path ran: its result is the transposed view
        assert y.stride(-1) == rows
    else:
        assert y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, weight, b), rtol=1e-6, atol=1e-5)


def test_linear_keeps_dtype_and_gradients():
    g = torch.Generator().manual_seed(1)
    x64, w64 = torch.randn(4, 8, generator=g, dtype=torch.float64), torch.randn(6, 8, generator=g, dtype=torch.float64)
    with torch.no_grad():
        assert linear(x64, w64).dtype == torch.float64  # F.linear's path
        assert torch.equal(linear(x64, w64), F.linear(x64, w64))
    x = torch.randn(4, 8, generator=g)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # autocast: F.linear's path and dtype
        assert linear(x, w64.float(), torch.ones(6)).dtype == torch.bfloat16
    layer = Linear(8, 6)
    x = torch.randn(4, 8, generator=g, requires_grad=True)
    y = layer(x)
    assert y.is_contiguous()  # with autograd on, F.linear's path: gradients as usual
    y.sum().backward()
    torch.testing.assert_close(x.grad, layer.weight.sum(0).expand(4, 8))
    torch.testing.assert_close(layer.weight.grad, x.detach().sum(0).expand(6, 8))


def test_linear_module_is_an_nn_linear_with_the_same_state_dict():
    torch.manual_seed(0)
    ours, theirs = Linear(8, 6), torch.nn.Linear(8, 6)
    theirs.load_state_dict(ours.state_dict())
    assert isinstance(ours, torch.nn.Linear)
    x = torch.randn(5, 8)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-6, atol=1e-6)
