"""Attention (§3.2) against independent truths: the formula written out by hand,
torch.nn.MultiheadAttention with the same weights, and a per-head loop."""

import math

import pytest
import torch
from torch import nn

from aiayn import EncoderOnly, ModelConfig, Transformer
from aiayn.model.attention import MultiHeadAttention, scaled_dot_product_attention
from aiayn.model.masks import causal_mask, padding_mask

B, H, T, S, D_K, D_V = 2, 3, 5, 6, 4, 7


def qkv(seed: int = 0, requires_grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D_K, generator=g)
    k = torch.randn(B, H, S, D_K, generator=g)
    v = torch.randn(B, H, S, D_V, generator=g)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def by_hand(q, k, v, mask=None):
    """softmax(Q Kᵀ / √d_k) V, one query row at a time, with masked keys left out of the softmax."""
    out = torch.zeros((*q.shape[:-1], v.size(-1)), dtype=torch.float64)
    q, k, v = q.double(), k.double(), v.double()
    for b in range(q.size(0)):
        for h in range(q.size(1)):
            for i in range(q.size(2)):
                allowed = [j for j in range(k.size(2)) if mask is None or bool(mask[b, 0, i, j])]
                if not allowed:
                    continue
                scores = torch.tensor([float(q[b, h, i] @ k[b, h, j]) / math.sqrt(q.size(-1)) for j in allowed])
                weights = torch.exp(scores - scores.max())
                weights = weights / weights.sum()
                out[b, h, i] = sum(w * v[b, h, j] for w, j in zip(weights, allowed, strict=True))
    return out.float()


def random_mask(seed: int = 1, fully_masked_row: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, 1, T, S, generator=g) > 0.4
    mask[..., 0] = True  # at least one key per row
    if fully_masked_row:
        mask[1, 0, 2] = False
    return mask


MASKS = {
    "none": lambda: None,
    "padding": lambda: padding_mask(torch.tensor([[1] * S, [1] * 3 + [0] * (S - 3)]), 0).expand(B, 1, T, S),
    "causal": lambda: causal_mask(T, S, offset=S - T).expand(B, 1, T, S),
    "random": random_mask,
}


@pytest.mark.parametrize("mask_name", list(MASKS))
def test_fast_and_explicit_paths_equal_the_formula(mask_name):
    q, k, v = qkv()
    mask = MASKS[mask_name]()
    fast, no_weights = scaled_dot_product_attention(q, k, v, mask, need_weights=False)
    explicit, weights = scaled_dot_product_attention(q, k, v, mask, need_weights=True)
    assert no_weights is None
    assert weights.shape == (B, H, T, S)
    assert fast.shape == explicit.shape == (B, H, T, D_V)
    torch.testing.assert_close(fast, explicit, atol=1e-6, rtol=0)
    expected = by_hand(q, k, v, None if mask is None else mask.expand(B, 1, T, S))
    torch.testing.assert_close(fast, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(explicit, expected, atol=1e-5, rtol=0)


def test_fast_path_takes_strided_head_vectors():
    """Queries, keys and values whose head vectors are strided (a decoding step's projections
    come transposed from the engine's products) give the formula's result without weights (the path that
    makes them contiguous for the fused kernel; which kernel runs is measured in bench/, not here)."""
    q, k, v = qkv()
    mask = MASKS["padding"]()
    # the same values, laid out feature-major: stride 1 along the rows, not along the head vector
    strided = [t.permute(3, 0, 1, 2).contiguous().permute(1, 2, 3, 0) for t in (q, k, v)]
    assert all(t.stride(-1) != 1 for t in strided)
    with torch.no_grad():
        fast, _ = scaled_dot_product_attention(*strided, mask)
    torch.testing.assert_close(fast, by_hand(q, k, v, mask), atol=1e-5, rtol=0)


@pytest.mark.parametrize("mask_name", list(MASKS))
def test_fast_and_explicit_paths_have_equal_gradients(mask_name):
    mask = MASKS[mask_name]()
    upstream = torch.randn(B, H, T, D_V, generator=torch.Generator().manual_seed(7))
    grads = []
    for need_weights in (False, True):
        q, k, v = qkv(requires_grad=True)
        out, _ = scaled_dot_product_attention(q, k, v, mask, need_weights=need_weights)
        (out * upstream).sum().backward()
        grads.append([q.grad, k.grad, v.grad])
    for fast, explicit in zip(*grads, strict=True):
        torch.testing.assert_close(fast, explicit, atol=1e-6, rtol=0)


def test_weights_rows_sum_to_one_and_are_zero_where_masked():
    q, k, v = qkv()
    mask = random_mask()
    _, weights = scaled_dot_product_attention(q, k, v, mask, need_weights=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(B, H, T))
    assert torch.all(weights.masked_select(~mask.expand_as(weights)) == 0)
    assert torch.all(weights.masked_select(mask.expand_as(weights)) > 0)


@pytest.mark.parametrize("need_weights", [False, True])
def test_fully_masked_row_gives_zeros_and_finite_gradients(need_weights):
    q, k, v = qkv(requires_grad=True)
    mask = random_mask(fully_masked_row=True)
    out, weights = scaled_dot_product_attention(q, k, v, mask, need_weights=need_weights)
    assert torch.all(out[1, :, 2] == 0)
    assert torch.isfinite(out).all()
    if need_weights:
        assert torch.all(weights[1, :, 2] == 0)
        torch.testing.assert_close(weights[0].sum(-1), torch.ones(H, T))
    out.square().sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    # the masked row contributes nothing, so its query gets no gradient
    assert torch.all(q.grad[1, :, 2] == 0)
    # the other rows are still the formula
    expected = by_hand(q.detach(), k.detach(), v.detach(), mask)
    torch.testing.assert_close(out.detach(), expected, atol=1e-5, rtol=0)


# Multi-head attention --------------------------------------------------------------------------


def torch_mha(ours: MultiHeadAttention, d_model: int, h: int) -> nn.MultiheadAttention:
    theirs = nn.MultiheadAttention(d_model, h, batch_first=True)
    with torch.no_grad():
        theirs.in_proj_weight.copy_(ours.in_proj.weight)
        theirs.in_proj_bias.copy_(ours.in_proj.bias)
        theirs.out_proj.weight.copy_(ours.out_proj.weight)
        theirs.out_proj.bias.copy_(ours.out_proj.bias)
    return theirs


def seeded_mha(d_model=16, h=4, d_k=None, d_v=None, cross=False, seed=0) -> MultiHeadAttention:
    torch.manual_seed(seed)
    mha = MultiHeadAttention(d_model, h, d_k or d_model // h, d_v or d_model // h, cross=cross)
    with torch.no_grad():  # nonzero biases, so that a bias mix-up shows
        mha.in_proj.bias.normal_()
        mha.out_proj.bias.normal_()
    return mha.eval()


@pytest.mark.parametrize("with_padding", [False, True])
def test_self_attention_equals_torch_multihead_attention(with_padding):
    ours = seeded_mha()
    theirs = torch_mha(ours, 16, 4)
    x = torch.randn(3, 6, 16)
    valid = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    mask = valid[:, None, None, :] if with_padding else None
    out, weights = ours(x, mask=mask, need_weights=True)
    expected, expected_weights = theirs(
        x, x, x, key_padding_mask=~valid if with_padding else None, average_attn_weights=False
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(weights, expected_weights, atol=1e-6, rtol=0)
    fast, _ = ours(x, mask=mask)
    torch.testing.assert_close(fast, expected, atol=1e-5, rtol=0)


def test_self_attention_with_causal_mask_equals_torch():
    ours = seeded_mha(seed=3)
    theirs = torch_mha(ours, 16, 4)
    x = torch.randn(2, 5, 16)
    out, _ = ours(x, mask=causal_mask(5))
    expected, _ = theirs(x, x, x, attn_mask=~causal_mask(5)[0, 0])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("with_padding", [False, True])
def test_cross_attention_equals_torch_multihead_attention(with_padding):
    ours = seeded_mha(cross=True, seed=1)
    theirs = torch_mha(ours, 16, 4)
    x, memory = torch.randn(2, 4, 16), torch.randn(2, 7, 16)
    valid = torch.tensor([[1] * 7, [1, 1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    mask = valid[:, None, None, :] if with_padding else None
    out, weights = ours(x, memory, mask=mask, need_weights=True)
    expected, expected_weights = theirs(
        x, memory, memory, key_padding_mask=~valid if with_padding else None, average_attn_weights=False
    )
    assert out.shape == (2, 4, 16) and weights.shape == (2, 4, 4, 7)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(weights, expected_weights, atol=1e-6, rtol=0)


def per_head_loop(mha: MultiHeadAttention, x, memory, mask=None):
    """Concat(head_1..head_h) W^O with head_i = Attention(x W_i^Q, m W_i^K, m W_i^V), one head at a time.

    in_proj.weight stacks [W^Q; W^K; W^V]; head i owns rows i*d_k:(i+1)*d_k of each block.
    """
    h, d_k, d_v = mha.h, mha.d_k, mha.d_v
    W, b = mha.in_proj.weight, mha.in_proj.bias
    W_Q, W_K, W_V = W[: h * d_k], W[h * d_k : 2 * h * d_k], W[2 * h * d_k :]
    b_Q, b_K, b_V = b[: h * d_k], b[h * d_k : 2 * h * d_k], b[2 * h * d_k :]
    heads = []
    for i in range(h):
        qs, vs = slice(i * d_k, (i + 1) * d_k), slice(i * d_v, (i + 1) * d_v)
        q = x @ W_Q[qs].T + b_Q[qs]  # (B, T, d_k)
        k = memory @ W_K[qs].T + b_K[qs]  # (B, S, d_k)
        v = memory @ W_V[vs].T + b_V[vs]  # (B, S, d_v)
        scores = q @ k.transpose(1, 2) / math.sqrt(d_k)
        if mask is not None:
            scores = scores.masked_fill(~mask[:, 0], float("-inf"))
        heads.append(scores.softmax(-1) @ v)
    return torch.cat(heads, dim=-1) @ mha.out_proj.weight.T + mha.out_proj.bias


@pytest.mark.parametrize("d_model,h,d_k,d_v", [(16, 4, 4, 4), (12, 3, 5, 7), (8, 2, 16, 3)])
@pytest.mark.parametrize("cross", [False, True])
def test_heads_equal_a_per_head_loop(d_model, h, d_k, d_v, cross):
    mha = seeded_mha(d_model, h, d_k, d_v, cross=cross, seed=2)
    assert mha.in_proj.weight.shape == (h * (2 * d_k + d_v), d_model)
    assert mha.out_proj.weight.shape == (d_model, h * d_v)
    x = torch.randn(2, 5, d_model)
    memory = torch.randn(2, 3, d_model) if cross else x
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)[:, None, None, :] if cross else causal_mask(5)
    mask = mask.expand(2, 1, 5, memory.size(1))
    expected = per_head_loop(mha, x, memory, mask)
    for need_weights in (False, True):
        out, weights = mha(x, memory if cross else None, mask=mask, need_weights=need_weights)
        assert out.shape == (2, 5, d_model)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
        if need_weights:
            assert weights.shape == (2, h, 5, memory.size(1))


# Restricted self-attention (§4, Table 1) -------------------------------------------------------


@pytest.mark.parametrize("N,r", [(1, 2), (2, 1), (2, 3)])
def test_window_limits_the_receptive_field_to_N_times_r(N, r):
    torch.manual_seed(0)
    model = EncoderOnly(ModelConfig.tiny(N=N, attention_window=r)).eval()
    L, i = 24, 12
    tokens = torch.randint(3, 32, (1, L))
    reach = N * r
    # row j < L of the batch has token j replaced by another non-special token; row L is the original
    batch = tokens.repeat(L + 1, 1)
    batch[torch.arange(L), torch.arange(L)] = 3 + (tokens[0] - 3 + 7) % 29
    memory = model.encode(batch).memory[:, i]  # (L + 1, d_model)
    diffs = (memory[:L] - memory[L]).abs().amax(-1)
    for j in range(L):
        if abs(i - j) > reach:
            assert diffs[j] == 0, f"position {i} depends on token {j}, farther than N*r={reach}"
        else:
            assert diffs[j] > 1e-4, f"position {i} ignores token {j}, within N*r={reach}"


def test_window_applies_to_the_transformer_encoder_too():
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(N=2, attention_window=1)).eval()
    src = torch.randint(3, 32, (1, 12))
    far = src.clone()
    far[0, 0] = 3 + (src[0, 0] - 3 + 5) % 29
    near = src.clone()
    near[0, 4] = 3 + (src[0, 4] - 3 + 5) % 29
    base = model.encode(src).memory[0, 6]
    assert torch.equal(model.encode(far).memory[0, 6], base)
    assert not torch.allclose(model.encode(near).memory[0, 6], base)


# bfloat16 on the CPU (autocast training): computed in float32, rounded back once -------------------

BF16_MASKS = {**MASKS, "fully masked row": lambda: random_mask(fully_masked_row=True)}


@pytest.mark.parametrize("mask_name", list(BF16_MASKS))
def test_bf16_on_the_cpu_is_float32_attention_of_the_rounded_inputs(mask_name):
    """Forward: exactly the float32 result on the same (bfloat16) inputs, rounded to bfloat16, so
    within bfloat16's rounding (2^-8 relative) of the formula in float64. Backward: the float32
    gradients (of the bfloat16 upstream gradient) rounded to bfloat16. A fully masked row gives
    zeros and a zero query gradient, and nothing is NaN."""
    mask = BF16_MASKS[mask_name]()
    q, k, v = (t.bfloat16().requires_grad_() for t in qkv())
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))  # the same values, exactly
    upstream = torch.randn(B, H, T, D_V, generator=torch.Generator().manual_seed(7)).bfloat16()

    out, weights = scaled_dot_product_attention(q, k, v, mask)
    assert out.dtype == torch.bfloat16 and weights is None and torch.isfinite(out).all()
    ref, _ = scaled_dot_product_attention(q32, k32, v32, mask)
    assert torch.equal(out, ref.bfloat16())
    truth = by_hand(q32.detach(), k32.detach(), v32.detach(), None if mask is None else mask.expand(B, 1, T, S))
    torch.testing.assert_close(out.float(), truth, rtol=2**-8, atol=1e-5)

    (out.float() * upstream.float()).sum().backward()
    (ref * upstream.float()).sum().backward()
    for ours, theirs in zip((q.grad, k.grad, v.grad), (q32.grad, k32.grad, v32.grad), strict=True):
        assert ours.dtype == torch.bfloat16 and torch.isfinite(ours).all()
        torch.testing.assert_close(ours.float(), theirs, rtol=2**-8, atol=1e-6)
    if mask_name == "fully masked row":
        assert torch.all(out[1, :, 2] == 0) and torch.all(q.grad[1, :, 2] == 0)


def test_bf16_attention_under_autocast_keeps_the_bf16_path():
    """In training, autocast's products hand attention bfloat16 queries; the result is the same
    as without autocast (autocast is off inside), and still bfloat16 for the next product."""
    q, k, v = (t.bfloat16() for t in qkv())
    mask = random_mask()
    plain, _ = scaled_dot_product_attention(q, k, v, mask)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast, _ = scaled_dot_product_attention(q, k, v, mask)
    assert autocast.dtype == torch.bfloat16 and torch.equal(autocast, plain)
