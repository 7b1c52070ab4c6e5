"""Position-wise feed-forward network (§3.3, eq. 2) against the formula written out."""

import math

import torch

from aiayn.model.feed_forward import PositionwiseFeedForward


def seeded_ffn(activation: str) -> PositionwiseFeedForward:
    torch.manual_seed(0)
    ffn = PositionwiseFeedForward(d_model=6, d_ff=10, activation=activation)
    with torch.no_grad():
        ffn.linear1.bias.normal_()  # so that some pre-activations are negative, some positive
        ffn.linear2.bias.normal_()
    return ffn


def test_relu_ffn_equals_max_0_xW1_b1_W2_b2():
    ffn = seeded_ffn("relu")
    x = torch.randn(2, 5, 6)
    W1, b1 = ffn.linear1.weight.T, ffn.linear1.bias  # (d_model, d_ff)
    W2, b2 = ffn.linear2.weight.T, ffn.linear2.bias  # (d_ff, d_model)
    hidden = x @ W1 + b1
    assert (hidden < 0).any() and (hidden > 0).any()
    expected = torch.maximum(torch.zeros(()), hidden) @ W2 + b2
    torch.testing.assert_close(ffn(x), expected, atol=1e-6, rtol=0)


def test_relu_ffn_gradients_equal_the_formula():
    """Every gradient of eq. 2, also with a full backward hook on linear1."""
    ffn = seeded_ffn("relu")
    seen = []
    ffn.linear1.register_full_backward_hook(lambda module, grad_in, grad_out: seen.append(grad_out[0].shape))
    x = torch.randn(2, 5, 6, requires_grad=True)
    ffn(x).square().sum().backward()
    assert seen == [torch.Size([2, 5, 10])]
    params = [ffn.linear1.weight, ffn.linear1.bias, ffn.linear2.weight, ffn.linear2.bias]
    W1, b1, W2, b2 = (p.detach().clone().requires_grad_() for p in params)
    x2 = x.detach().clone().requires_grad_()
    (torch.maximum(torch.zeros(()), x2 @ W1.T + b1) @ W2.T + b2).square().sum().backward()
    for ours, theirs in zip([x, *params], [x2, W1, b1, W2, b2], strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-5, rtol=1e-5)


def test_relu_ffn_without_autograd_equals_the_formula():
    """Inference (autograd off) gives eq. 2 too."""
    ffn = seeded_ffn("relu")
    x = torch.randn(3, 4, 6)
    with torch.no_grad():
        hidden = x @ ffn.linear1.weight.T + ffn.linear1.bias
        assert (hidden < 0).any() and (hidden > 0).any()
        expected = torch.maximum(torch.zeros(()), hidden) @ ffn.linear2.weight.T + ffn.linear2.bias
        torch.testing.assert_close(ffn(x), expected, atol=1e-6, rtol=0)


def test_ffn_acts_on_each_position_alone():
    ffn = seeded_ffn("relu")
    x = torch.randn(1, 4, 6)
    whole = ffn(x)
    for t in range(4):
        torch.testing.assert_close(ffn(x[:, t : t + 1]), whole[:, t : t + 1], atol=1e-6, rtol=0)


def test_gelu_ffn_uses_the_erf_gelu():
    ffn = seeded_ffn("gelu")
    x = torch.randn(3, 4, 6)
    hidden = x @ ffn.linear1.weight.T + ffn.linear1.bias
    gelu = hidden.clone()
    for idx in range(hidden.numel()):
        v = hidden.view(-1)[idx].item()
        gelu.view(-1)[idx] = 0.5 * v * (1 + math.erf(v / math.sqrt(2)))
    expected = gelu @ ffn.linear2.weight.T + ffn.linear2.bias
    torch.testing.assert_close(ffn(x), expected, atol=1e-6, rtol=0)
    # and not the ReLU network with the same weights
    relu = torch.relu(hidden) @ ffn.linear2.weight.T + ffn.linear2.bias
    assert not torch.allclose(ffn(x), relu, atol=1e-3)


def test_silu_ffn_equals_the_formula():
    """Marian's swish: x · σ(x) in place of max(0, ·)."""
    torch.manual_seed(0)
    ffn = PositionwiseFeedForward(8, 16, activation="silu")
    x = torch.randn(2, 3, 8)
    h = x @ ffn.linear1.weight.T + ffn.linear1.bias
    expected = (h * torch.sigmoid(h)) @ ffn.linear2.weight.T + ffn.linear2.bias
    torch.testing.assert_close(ffn(x), expected)
