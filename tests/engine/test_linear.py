"""The engine's products (oneDNN on packed weights; MKL's transposed product for a few rows)
equal ``F.linear``; the packed copy is made once, at ``PackedLinear``'s construction."""

import pytest
import torch
import torch.nn.functional as F

from aiayn.engine.linear import SMALL_ROWS, PackedLinear

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.fixture(params=[False, pytest.param(True, marks=needs_onednn)], ids=["mkl", "onednn"])
def onednn(request):
    """Each test runs with oneDNN's packed products off and on, whatever this CPU's default."""
    return request.param


def _layer(d_in: int, d_out: int, bias: bool, onednn: bool, seed: int = 0) -> tuple[torch.nn.Linear, PackedLinear]:
    torch.manual_seed(seed)
    linear = torch.nn.Linear(d_in, d_out, bias=bias)
    if bias:
        torch.nn.init.normal_(linear.bias)  # a zero bias would hide a dropped one
    return linear, PackedLinear.of(linear, onednn)


@pytest.mark.parametrize("shape", [(1, 16), (3, 1, 16), (SMALL_ROWS, 16), (SMALL_ROWS + 1, 16), (2, 5, 16), (0, 16)])
@pytest.mark.parametrize("bias", [True, False])
def test_forward_equals_f_linear(shape, bias, onednn):
    linear, packed = _layer(16, 24, bias, onednn)
    x = torch.randn(*shape)
    with torch.no_grad():
        y = packed(x)
        assert y.shape == (*shape[:-1], 24) and y.is_contiguous()
        torch.testing.assert_close(y, F.linear(x, linear.weight, linear.bias), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, SMALL_ROWS, SMALL_ROWS + 1])
@pytest.mark.parametrize("relu", [False, True])
def test_step_product_equals_f_linear(rows, relu, onednn):
    """The flat step's product: MKL's transposed view for a few rows (without oneDNN), and
    max(0, ·) inside oneDNN's product (§3.3)."""
    linear, packed = _layer(16, 24, True, onednn, seed=1)
    x = torch.randn(rows, 16)
    with torch.no_grad():
        y = packed.step(x, relu=relu)
        expected = F.linear(x, linear.weight, linear.bias)
        if relu:
            assert (expected < 0).any()
            expected = expected.relu()
        if not onednn and 1 < rows <= SMALL_ROWS:  # MKL's decoding path: the transposed view
            assert y.stride(-1) == rows
        torch.testing.assert_close(y, expected, rtol=1e-6, atol=1e-5)


def test_untransposed_step_product_is_row_major():
    """``transpose_steps=False`` (``auto`` on AVX-512): MKL's x Wᵀ, a contiguous result, same values."""
    linear = torch.nn.Linear(16, 24)
    packed = PackedLinear(linear.weight, linear.bias, onednn=False, transpose_steps=False)
    x = torch.randn(8, 16)
    with torch.no_grad():
        y = packed.step(x)
        assert y.is_contiguous()
        torch.testing.assert_close(y, F.linear(x, linear.weight, linear.bias), rtol=1e-6, atol=1e-5)


def test_views_of_a_fused_weight(onednn):
    """The query rows of a fused in-projection (a view at an offset) serve as a layer's weight."""
    torch.manual_seed(2)
    in_proj, bias = torch.randn(3 * 16, 16), torch.randn(3 * 16)
    x = torch.randn(16, 7).t()  # (7, 16), not contiguous
    with torch.no_grad():
        for rows in (slice(0, 16), slice(16, 48)):
            layer = PackedLinear(in_proj[rows], bias[rows], onednn)
            expected = F.linear(x, in_proj[rows], bias[rows])
            torch.testing.assert_close(layer(x), expected, rtol=1e-6, atol=1e-5)
            torch.testing.assert_close(layer.step(x.contiguous()), expected, rtol=1e-6, atol=1e-5)


@needs_onednn
def test_the_packed_copy_is_made_once():
    linear, packed = _layer(16, 24, True, True, seed=3)
    first = packed.packed
    assert first is not None
    with torch.no_grad():
        packed(torch.randn(4, 16))
        packed.step(torch.randn(2, 16))
    assert packed.packed is first
    assert packed.weight is linear.weight and packed.bias is linear.bias  # shared, not copied


def test_autograd_autocast_and_other_dtypes_take_f_linear(onednn):
    """With autograd on, under autocast and for float64, ``F.linear``'s values, dtype and gradients."""
    linear, packed = _layer(8, 6, True, onednn, seed=4)
    x = torch.randn(4, 8, requires_grad=True)
    y = packed(x)
    y.sum().backward()
    torch.testing.assert_close(x.grad, linear.weight.sum(0).expand(4, 8))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert packed(torch.randn(4, 8)).dtype == torch.bfloat16
    x64 = torch.randn(4, 8, dtype=torch.float64)
    layer64 = PackedLinear(linear.weight.detach().double(), linear.bias.detach().double(), onednn)
    with torch.no_grad():
        assert layer64.packed is None
        assert torch.equal(layer64(x64), F.linear(x64, layer64.weight, layer64.bias))


def test_compiled_traces_f_linear(onednn):
    """Under torch.compile the compiler chooses the kernels."""
    linear, packed = _layer(16, 24, True, onednn, seed=5)
    compiled = torch.compile(packed, backend="eager", fullgraph=True)
    x = torch.randn(3, 16)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), F.linear(x, linear.weight, linear.bias))
