"""ScaleNorm and FixNorm (Nguyen & Salazar 2019; Nguyen & Chiang 2018) against their formulas,
computed here in float64 by hand: the layer's output and both gradients, the encoder-decoder
built with ScaleNorm in every place a LayerNorm stood, the embeddings at unit length, and the
converters that cannot express them refusing."""

import math

import pytest
import torch
from torch import nn

from aiayn.model import ModelConfig, Transformer
from aiayn.model.embedding import TokenEmbedding
from aiayn.model.layers import ScaleNorm
from helpers import random_model


def scale_norm_by_hand(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return g * x / x.norm(dim=-1, keepdim=True)


def test_scale_norm_equals_the_formula_and_its_gradients():
    """y = g · x / ‖x‖, ‖y‖ = g; both gradients against autograd through the formula, in float64."""
    torch.manual_seed(0)
    norm = ScaleNorm(6).double()
    assert norm.g.item() == pytest.approx(math.sqrt(6))  # initialised to √d_model
    with torch.no_grad():
        norm.g.fill_(1.7)
    x = torch.randn(3, 4, 6, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(3, 4, 6, dtype=torch.float64)
    y = norm(x)
    x2 = x.detach().clone().requires_grad_()
    g2 = torch.tensor(1.7, dtype=torch.float64, requires_grad=True)
    expected = scale_norm_by_hand(x2, g2)
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(y.norm(dim=-1), torch.full((3, 4), 1.7, dtype=torch.float64))
    (y * dy).sum().backward()
    (expected * dy).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(norm.g.grad, g2.grad, rtol=1e-10, atol=1e-12)


def test_scale_norm_of_a_zero_vector_is_zero_not_nan():
    norm = ScaleNorm(4)
    x = torch.zeros(2, 4, requires_grad=True)
    y = norm(x)
    y.sum().backward()
    assert torch.equal(y, torch.zeros(2, 4)) and torch.isfinite(x.grad).all()


def test_the_model_has_scale_norm_wherever_a_layer_norm_stood():
    layer = Transformer(ModelConfig.tiny(vocab_size=20, norm_first=True))
    scale = Transformer(ModelConfig.tiny(vocab_size=20, norm_first=True, norm="scale"))
    count = sum(isinstance(m, nn.LayerNorm) for m in layer.modules())
    assert count == 2 * 2 + 2 * 3 + 2  # encoder layers 2 each, decoder layers 3, two final norms
    assert sum(isinstance(m, ScaleNorm) for m in scale.modules()) == count
    assert not any(isinstance(m, nn.LayerNorm) for m in scale.modules())
    # one scalar per norm instead of 2 d_model
    assert layer.num_parameters() - scale.num_parameters() == count * (2 * 32 - 1)


def test_fix_norm_embeds_and_projects_with_unit_length_rows():
    torch.manual_seed(0)
    emb = TokenEmbedding(11, 8, fix_norm=True)
    with torch.no_grad():
        emb.weight.mul_(torch.rand(11, 1) * 5)  # rows of different lengths
    weight = emb.weight.detach().double()
    unit = weight / weight.norm(dim=-1, keepdim=True)
    tokens = torch.tensor([[1, 4, 10], [0, 0, 3]])
    torch.testing.assert_close(emb(tokens).double(), unit[tokens] * math.sqrt(8), rtol=1e-6, atol=1e-6)
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(emb.project(x).double(), x.double() @ unit.T, rtol=1e-5, atol=1e-5)
    # a row's length does not change what it does, and gets no gradient along itself
    emb(tokens).sum().backward()
    radial = (emb.weight.grad * emb.weight.detach()).sum(-1)
    torch.testing.assert_close(radial, torch.zeros(11), rtol=0, atol=1e-5)
    plain = TokenEmbedding(11, 8)
    with torch.no_grad():
        plain.weight.copy_(emb.weight)
    assert not torch.allclose(plain(tokens), emb(tokens))


def test_a_fix_norm_model_scores_with_cosines_times_the_last_norms_length():
    """With ScaleNorm last, ‖h‖ = g, so every logit is g · cos(h, e_w): bounded by |g|."""
    model = random_model(vocab_size=23, norm_first=True, norm="scale", fix_norm=True)
    src = torch.randint(3, 23, (2, 5))
    tgt = torch.randint(3, 23, (2, 4))
    with torch.no_grad():
        logits = model(src, tgt)
    assert logits.abs().max() <= model.decoder.norm.g.abs() + 1e-5
    assert logits.abs().max() > 0.5 * model.decoder.norm.g.abs()


def test_config_validates_and_round_trips(tmp_path):
    with pytest.raises(ValueError, match="norm must be one of 'layer', 'scale', got 'rms'"):
        ModelConfig.tiny(norm="rms")
    with pytest.raises(ValueError, match="fix_norm must be true or false"):
        ModelConfig.tiny(fix_norm="yes")
    model = random_model(vocab_size=17, norm="scale", fix_norm=True)
    model.save_pretrained(tmp_path)
    loaded = Transformer.from_pretrained(tmp_path).eval()
    assert loaded.config.norm == "scale" and loaded.config.fix_norm
    src, tgt = torch.randint(3, 17, (2, 5)), torch.randint(3, 17, (2, 4))
    with torch.no_grad():
        assert torch.equal(model(src, tgt), loaded(src, tgt))


def test_converters_refuse_what_they_cannot_express():
    from aiayn.interop import load_torch_transformer, to_marian_state

    with pytest.raises(ValueError, match=r"norm='scale'.*fix_norm=True"):
        to_marian_state(random_model(vocab_size=17, norm="scale", fix_norm=True))
    torch_model = nn.Transformer(32, 4, 2, 2, 64, batch_first=True)
    with pytest.raises(ValueError, match="LayerNorms only"):
        load_torch_transformer(Transformer(ModelConfig.tiny(vocab_size=17, norm="scale")), torch_model)
