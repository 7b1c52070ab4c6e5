"""The inference paths of ``linear`` (MKL's transposed product for a few rows, oneDNN on packed
weights) equal ``F.linear``; the packed copies follow their weights."""

import gc
import warnings

import pytest
import torch
import torch.nn.functional as F

from aiayn.model import linear as linear_module
from aiayn.model.linear import SMALL_ROWS, Linear, inference_path, linear, packed, packed_linear

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.fixture(params=[False, pytest.param(True, marks=needs_onednn)], ids=["mkl", "onednn"])
def packed_on(request, monkeypatch):
    """Each test runs with oneDNN's packed products off and on, whatever this CPU's default."""
    monkeypatch.setattr(linear_module, "PACKED", request.param)
    return request.param


@pytest.mark.parametrize("shape", [(1, 16), (3, 1, 16), (SMALL_ROWS, 16), (SMALL_ROWS + 1, 16), (2, 5, 16), (0, 16)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_equals_f_linear_without_grad(shape, bias, packed_on):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g)
    weight, b = torch.randn(24, 16, generator=g), torch.randn(24, generator=g) if bias else None
    with torch.no_grad():
        path = inference_path(x, weight)
        y = linear(x, weight, b)
    rows = y.numel() // 24
    assert path == (
        "linear" if rows == 0 else "packed" if packed_on else "transposed" if rows <= SMALL_ROWS else "linear"
    )
    assert y.shape == (*shape[:-1], 24)
    if path == "transposed" and rows > 1:  # MKL's decoding path: its result is the transposed view
        assert y.stride(-1) == rows
    else:
        assert y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, weight, b), rtol=1e-6, atol=1e-5)


@needs_onednn
def test_packed_product_takes_views_strides_and_relu():
    """The query rows of a fused in-projection (a view of the weight), a transposed input, a
    batch of sequences and the fused ReLU of §3.3 give ``F.linear``'s values."""
    g = torch.Generator().manual_seed(2)
    in_proj, bias = torch.randn(3 * 16, 16, generator=g), torch.randn(3 * 16, generator=g)
    q_weight, q_bias = in_proj[:16], bias[:16]  # (16, 16) view, as MultiHeadAttention.project_q takes it
    kv_weight = in_proj[16:]  # (32, 16) view at an offset
    x = torch.randn(16, 7, generator=g).t()  # (7, 16), not contiguous
    seq = torch.randn(2, 5, 16, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(
            packed_linear(x, q_weight, q_bias), F.linear(x, q_weight, q_bias), rtol=1e-6, atol=1e-5
        )
        torch.testing.assert_close(packed_linear(seq, kv_weight), F.linear(seq, kv_weight), rtol=1e-6, atol=1e-5)
        relu = packed_linear(x, in_proj, bias, relu=True)
        torch.testing.assert_close(relu, F.relu(F.linear(x, in_proj, bias)), rtol=1e-6, atol=1e-5)
        assert relu.min() == 0 and (F.linear(x, in_proj, bias) < 0).any()


@needs_onednn
def test_packed_copy_is_made_once_and_follows_the_weight():
    """One packed copy per weight (and per view of it) while the weight is unchanged; an
    optimizer step, ``load_state_dict`` or a new ``.data`` make a new one, so results follow."""
    torch.manual_seed(3)
    layer = Linear(16, 24)
    x = torch.randn(4, 16)
    with torch.no_grad():
        first = packed(layer.weight)
        assert packed(layer.weight) is first  # kept
        assert packed(layer.weight[:8]) is packed(layer.weight[:8])  # a view: kept under its weight
        assert packed(layer.weight[:8]) is not first
    layer(torch.randn(4, 16)).sum().backward()
    torch.optim.SGD(layer.parameters(), lr=0.5).step()  # an in-place update
    with torch.no_grad():
        assert packed(layer.weight) is not first
        torch.testing.assert_close(packed_linear(x, layer.weight, layer.bias), F.linear(x, layer.weight, layer.bias))
        layer.load_state_dict({"weight": torch.ones(24, 16), "bias": torch.zeros(24)})
        torch.testing.assert_close(packed_linear(x, layer.weight, layer.bias), x.sum(-1, keepdim=True).expand(4, 24))
        layer.weight.data = torch.full((24, 16), 2.0)  # a new storage, version counter aside
        torch.testing.assert_close(packed_linear(x, layer.weight), 2 * x.sum(-1, keepdim=True).expand(4, 24))


@needs_onednn
def test_a_new_storage_at_the_old_address_is_not_taken_for_the_old_weight():
    """A dtype round trip gives the weight new storage with the same version count; the
    allocator may hand it the old storage's address (it did, one round in four, before the
    packed copy held on to its storage)."""
    torch.manual_seed(6)
    layer, x = Linear(512, 512), torch.randn(4, 512)
    with torch.no_grad():
        for _ in range(8):
            linear(x, layer.weight, layer.bias)  # packed (when oneDNN's products are on)
            layer.double()
            layer.weight.data = -layer.weight.data  # new values
            layer.float()
            torch.testing.assert_close(
                packed_linear(x, layer.weight, layer.bias), F.linear(x, layer.weight, layer.bias)
            )


@needs_onednn
def test_packed_copies_go_with_their_weights():
    before = len(linear_module._packs)
    weights = [torch.randn(8, 4) for _ in range(3)]
    with torch.no_grad():
        for w in weights:
            packed(w)
    assert len(linear_module._packs) == before + 3
    del weights, w
    gc.collect()
    assert len(linear_module._packs) == before


def test_weights_made_under_inference_mode(packed_on):
    """Weights without a version counter (made under ``torch.inference_mode``) are never packed
    and kept: ``linear`` takes MKL's product, and a packed copy asked for is made anew."""
    torch.manual_seed(5)
    with torch.inference_mode():
        layer = Linear(16, 24)
    x = torch.randn(4, 16)
    with torch.no_grad():
        assert inference_path(x, layer.weight) == "transposed"
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-6, atol=1e-5)
    if packed_on:
        before = len(linear_module._packs)
        with torch.inference_mode():
            y = packed_linear(x, layer.weight, layer.bias)
            layer.weight.mul_(2)  # an in-place change no version counter sees
            y2 = packed_linear(x, layer.weight, layer.bias)
        torch.testing.assert_close(y2 - layer.bias, 2 * (y - layer.bias), rtol=1e-5, atol=1e-5)
        assert len(linear_module._packs) == before


def test_compiled_linear_traces_f_linear(packed_on):
    """Under torch.compile the compiler chooses the kernels: ``linear`` traces as ``F.linear``,
    in one graph (the packed copies' bookkeeping is not traced)."""
    torch.manual_seed(4)
    layer, x = Linear(16, 24), torch.randn(3, 16)
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), F.linear(x, layer.weight, layer.bias))


def test_the_choice_of_product(monkeypatch):
    """``AIAYN_CPU_GEMM`` decides; unset (or ``auto``), oneDNN where torch runs AVX-512 kernels."""
    for capability, expected in (("AVX512", torch.backends.mkldnn.is_available()), ("AVX2", False), ("DEFAULT", False)):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        monkeypatch.delenv("AIAYN_CPU_GEMM", raising=False)
        assert linear_module._packed_default() is expected
        monkeypatch.setenv("AIAYN_CPU_GEMM", "auto")
        assert linear_module._packed_default() is expected
        monkeypatch.setenv("AIAYN_CPU_GEMM", "mkl")
        assert linear_module._packed_default() is False
        monkeypatch.setenv("AIAYN_CPU_GEMM", "oneDNN")
        assert linear_module._packed_default() is torch.backends.mkldnn.is_available()
        monkeypatch.setenv("AIAYN_CPU_GEMM", "fast")
        with pytest.warns(UserWarning, match="AIAYN_CPU_GEMM='fast' is not one of auto, onednn, mkl"):
            assert linear_module._packed_default() is expected
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        monkeypatch.setenv("AIAYN_CPU_GEMM", "mkl")
        linear_module._packed_default()


def test_linear_keeps_dtype_and_gradients(packed_on):
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
