"""Embeddings and positional encodings (§3.4, §3.5) against the paper's formulas."""

import math

import pytest
import torch

from aiayn.model.embedding import (
    LearnedPositionalEmbedding,
    SinusoidalPositionalEncoding,
    TokenEmbedding,
    sinusoidal_encoding,
)


@pytest.mark.parametrize("L,d", [(1, 2), (7, 4), (12, 10), (5, 7)])
def test_sinusoidal_encoding_equals_the_formula(L, d):
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)), element by element."""
    pe = sinusoidal_encoding(L, d)
    assert pe.shape == (L, d) and pe.dtype == torch.float32
    for pos in range(L):
        for col in range(d):
            two_i = col - col % 2
            angle = pos / 10000 ** (two_i / d)
            expected = math.sin(angle) if col % 2 == 0 else math.cos(angle)
            assert abs(pe[pos, col].item() - expected) < 1e-6, (pos, col)


def test_sinusoidal_values_are_bounded():
    pe = sinusoidal_encoding(2000, 64)
    assert pe.abs().max() <= 1.0
    # position 0 is (0, 1, 0, 1, ...)
    assert torch.equal(pe[0, 0::2], torch.zeros(32)) and torch.equal(pe[0, 1::2], torch.ones(32))


def rotation(k: int, d: int) -> torch.Tensor:
    """T_k: block-diagonal [[cos kω_i, sin kω_i], [-sin kω_i, cos kω_i]], ω_i = 1 / 10000^(2i/d)."""
    T = torch.zeros(d, d, dtype=torch.float64)
    for i in range(d // 2):
        w = 1 / 10000 ** (2 * i / d)
        c, s = math.cos(k * w), math.sin(k * w)
        T[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] = torch.tensor([[c, s], [-s, c]], dtype=torch.float64)
    return T


@pytest.mark.parametrize("k", [1, 2, 5, 17, 40])
def test_pe_at_pos_plus_k_is_a_linear_function_of_pe_at_pos(k):
    """§3.5: "for any fixed offset k, PE_{pos+k} can be represented as a linear function of PE_pos"."""
    d, L = 8, 200
    pe = sinusoidal_encoding(L + k, d).double()
    now, later = pe[:L], pe[k : L + k]  # (L, d)
    T = rotation(k, d)
    torch.testing.assert_close(now @ T.T, later, atol=1e-5, rtol=0)
    # the same matrix, found from the data alone by least squares: later = now @ X, T_k = Xᵀ
    X = torch.linalg.lstsq(now, later).solution
    torch.testing.assert_close(now @ X, later, atol=1e-5, rtol=0)
    torch.testing.assert_close(X.T, T, atol=1e-4, rtol=0)


def test_sinusoidal_module_adds_the_table_and_extends_past_max_len():
    module = SinusoidalPositionalEncoding(d_model=6, max_len=4)
    x = torch.randn(2, 3, 6)
    torch.testing.assert_close(module(x), x + sinusoidal_encoding(3, 6), atol=0, rtol=0)
    # offset 2 with 9 positions reaches position 10, past max_len=4
    long = torch.randn(2, 9, 6)
    torch.testing.assert_close(module(long, offset=2), long + sinusoidal_encoding(11, 6)[2:], atol=1e-6, rtol=0)
    # and the short case still agrees after the table has grown
    torch.testing.assert_close(module(x, offset=1), x + sinusoidal_encoding(4, 6)[1:], atol=1e-6, rtol=0)
    assert len(list(module.parameters())) == 0
    assert "pe" not in module.state_dict()


def test_learned_positional_embedding_adds_rows_and_refuses_past_max_len():
    torch.manual_seed(0)
    module = LearnedPositionalEmbedding(d_model=4, max_len=5)
    x = torch.randn(1, 3, 4)
    torch.testing.assert_close(module(x, offset=2), x + module.weight[2:5], atol=0, rtol=0)
    with pytest.raises(ValueError, match="max_len=5"):
        module(x, offset=3)
    with pytest.raises(ValueError):
        module(torch.randn(1, 6, 4))


def test_token_embedding_is_scaled_by_sqrt_d_model():
    torch.manual_seed(0)
    emb = TokenEmbedding(vocab_size=11, d_model=16)
    tokens = torch.tensor([[3, 0, 10], [5, 5, 1]])
    out = emb(tokens)
    assert out.shape == (2, 3, 16)
    for b in range(2):
        for t in range(3):
            torch.testing.assert_close(out[b, t], emb.weight[tokens[b, t]] * 4.0, atol=1e-6, rtol=0)
    # the same matrix is the pre-softmax projection: logits = x Eᵀ
    x = torch.randn(2, 16)
    torch.testing.assert_close(emb.project(x), x @ emb.weight.T, atol=1e-5, rtol=0)


@pytest.mark.parametrize("d_model", [16, 64, 256])
def test_token_embedding_init_std_is_inverse_sqrt_d_model(d_model):
    torch.manual_seed(0)
    emb = TokenEmbedding(vocab_size=100_000 // d_model * 4, d_model=d_model)
    std = emb.weight.std().item()
    # ~400k samples: the std estimate is good to about 0.1%
    assert abs(std / d_model**-0.5 - 1) < 0.02
    assert abs(emb.weight.mean().item()) < 0.01 * d_model**-0.5
    # so embedded tokens have unit variance after the √d_model scaling
    assert abs(emb(torch.arange(emb.weight.size(0))).std().item() - 1) < 0.02
