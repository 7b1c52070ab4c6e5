"""The three models: parameter counts, tied embeddings, initialisation, attention maps,
padding invariance, causality and bidirectionality."""

import math

import pytest
import torch
from torch import nn

from aiayn import DecoderOnly, EncoderOnly, ModelConfig, Transformer
from aiayn.model.attention import MultiHeadAttention
from helpers import randomize_

V = 32


def build(cls, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return cls(ModelConfig.tiny(V, **overrides)).eval()


def ids(B: int, L: int, seed: int) -> torch.Tensor:
    """Random non-padding ids."""
    return torch.randint(3, V, (B, L), generator=torch.Generator().manual_seed(seed))


def pad(tokens: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    tokens = tokens.clone()
    for b, length in enumerate(lengths):
        tokens[b, length:] = 0
    return tokens


# Parameter counts ------------------------------------------------------------------------------


def transformer_parameters(V: int, d_model: int, d_ff: int, N: int) -> int:
    """Parameters of the paper's Transformer with one shared embedding / projection matrix."""
    attention = 4 * d_model * d_model + 4 * d_model  # W^Q, W^K, W^V, W^O and their biases
    feed_forward = 2 * d_model * d_ff + d_ff + d_model  # W1, b1, W2, b2
    norm = 2 * d_model  # LayerNorm gain and bias
    encoder_layer = attention + feed_forward + 2 * norm
    decoder_layer = 2 * attention + feed_forward + 3 * norm
    return V * d_model + N * encoder_layer + N * decoder_layer


@pytest.mark.parametrize(
    "preset,d_model,d_ff,expected",
    [("base", 512, 2048, 63_082_496), ("big", 1024, 4096, 214_245_376)],
)
def test_parameter_counts_with_vocab_37000(preset, d_model, d_ff, expected):
    assert transformer_parameters(37000, d_model, d_ff, 6) == expected
    with torch.device("meta"):  # no memory, no init cost: only the shapes matter
        model = Transformer(getattr(ModelConfig, preset)(37000))
    assert model.num_parameters() == expected


def test_untied_parameter_counts():
    d = 32
    tied = transformer_parameters(V, d, 64, 2)
    assert build(Transformer).num_parameters() == tied
    assert build(Transformer, share_embeddings=False).num_parameters() == tied + V * d
    assert build(Transformer, tie_output=False).num_parameters() == tied + V * d
    assert build(Transformer, share_embeddings=False, tie_output=False).num_parameters() == tied + 2 * V * d
    assert build(Transformer, share_embeddings=False, tgt_vocab_size=40).num_parameters() == tied + 40 * d
    assert build(Transformer, final_norm=True).num_parameters() == tied + 2 * 2 * d


# Tied embeddings (§3.4) ------------------------------------------------------------------------


def decoder_output(model: nn.Module, run) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``run()`` and capture the decoder stack's output (the input of the projection)."""
    captured = []
    handle = model.decoder.register_forward_hook(lambda module, args, out: captured.append(out[0]))
    try:
        logits = run()
    finally:
        handle.remove()
    return logits, captured[0]


def test_transformer_ties_one_matrix_three_ways():
    model = build(Transformer)
    assert model.src_embedding.weight is model.tgt_embedding.weight
    assert model.output_projection is None
    src, tgt = ids(2, 5, 0), ids(2, 4, 1)
    with torch.no_grad():
        logits, hidden = decoder_output(model, lambda: model(src, tgt))
    torch.testing.assert_close(logits, hidden @ model.src_embedding.weight.T, atol=1e-5, rtol=0)
    # one Parameter: a gradient step through the projection moves the embedding of both stacks
    assert sum(p is model.src_embedding.weight for p in model.parameters()) == 1


@pytest.mark.parametrize(
    "share,tie,tgt_vocab", [(False, True, V), (True, False, V), (False, False, V), (False, True, 40)]
)
def test_transformer_untied_matrices_are_separate(share, tie, tgt_vocab):
    model = build(Transformer, share_embeddings=share, tie_output=tie, tgt_vocab_size=tgt_vocab)
    src, tgt = ids(2, 5, 0), ids(2, 4, 1)
    with torch.no_grad():
        logits, hidden = decoder_output(model, lambda: model(src, tgt))
    assert logits.shape == (2, 4, tgt_vocab)
    if share:
        assert model.src_embedding.weight is model.tgt_embedding.weight
    else:
        assert model.src_embedding.weight.data_ptr() != model.tgt_embedding.weight.data_ptr()
    projection = model.tgt_embedding.weight if tie else model.output_projection.weight
    if not tie:
        assert projection.data_ptr() != model.tgt_embedding.weight.data_ptr()
    torch.testing.assert_close(logits, hidden @ projection.T, atol=1e-5, rtol=0)


@pytest.mark.parametrize("tie", [True, False])
def test_decoder_only_projection(tie):
    model = build(DecoderOnly, tie_output=tie)
    tokens = ids(2, 6, 0)
    with torch.no_grad():
        logits, hidden = decoder_output(model, lambda: model(tokens))
    projection = model.embedding.weight if tie else model.output_projection.weight
    assert (model.output_projection is None) == tie
    torch.testing.assert_close(logits, hidden @ projection.T, atol=1e-5, rtol=0)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_encoder_only_masked_lm_head(tie, activation):
    model = build(EncoderOnly, tie_output=tie, activation=activation)
    with torch.no_grad():
        model.mlm_head.bias.normal_()
        model.mlm_head.norm.weight.normal_()
    tokens = ids(2, 6, 0)
    head = model.mlm_head
    with torch.no_grad():
        memory = model.encode(tokens).memory
        x = memory @ head.dense.weight.T + head.dense.bias
        x = 0.5 * x * (1 + torch.erf(x / math.sqrt(2))) if activation == "gelu" else x.clamp(min=0)
        x = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-5)
        x = x * head.norm.weight + head.norm.bias
        projection = model.embedding.weight if tie else head.projection.weight
        expected = x @ projection.T + head.bias
        torch.testing.assert_close(model(tokens), expected, atol=1e-5, rtol=0)
    assert (head.projection is None) == tie


# Initialisation --------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [Transformer, DecoderOnly, EncoderOnly])
def test_xavier_uniform_projections_and_zero_biases(cls):
    d_model, h, d_ff = 128, 4, 256
    torch.manual_seed(0)
    model = cls(ModelConfig(vocab_size=64, N=1, d_model=d_model, h=h, d_ff=d_ff, tie_output=False, final_norm=True))

    def check_xavier(weight: torch.Tensor, what: str) -> None:
        fan_out, fan_in = weight.shape
        bound = math.sqrt(6 / (fan_in + fan_out))
        assert weight.abs().max() <= bound, what
        # Var(U(-a, a)) = a² / 3 = 2 / (fan_in + fan_out); >= 16k samples: within a few percent
        assert abs(weight.var().item() / (bound**2 / 3) - 1) < 0.06, what

    attention = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    assert attention
    for mha in attention:
        hd = h * mha.d_k
        W = mha.in_proj.weight
        # each of W^Q, W^K, W^V on its own (fan_out = h d_k), not the fused block as a whole
        for name, block in zip("QKV", (W[:hd], W[hd : 2 * hd], W[2 * hd :]), strict=True):
            check_xavier(block, f"W^{name}")
        check_xavier(mha.out_proj.weight, "W^O")
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    for linear in linears:
        if linear.bias is not None:
            assert torch.all(linear.bias == 0)
    for module in model.modules():
        if hasattr(module, "linear1"):  # the feed-forward network
            check_xavier(module.linear1.weight, "W1")
            check_xavier(module.linear2.weight, "W2")
        if isinstance(module, nn.LayerNorm):
            assert torch.all(module.weight == 1) and torch.all(module.bias == 0)


# Attention maps --------------------------------------------------------------------------------


def test_transformer_returns_every_layers_attention():
    model = randomize_(build(Transformer, N=2, N_dec=3))
    B, S, T, H = 3, 7, 5, 4
    src = pad(ids(B, S, 0), [7, 4, 2])
    tgt = pad(ids(B, T, 1), [5, 3, 2])
    with torch.no_grad():
        logits, att = model(src, tgt, return_attention=True)
        torch.testing.assert_close(logits, model(src, tgt), atol=1e-5, rtol=0)  # explicit path = fast path
    assert len(att.encoder) == 2 and len(att.decoder_self) == 3 and len(att.decoder_cross) == 3
    src_pad, tgt_pad = src == 0, tgt == 0
    upper = torch.ones(T, T, dtype=torch.bool).triu(1)
    for w in att.encoder:
        assert w.shape == (B, H, S, S)
        torch.testing.assert_close(w.sum(-1), torch.ones(B, H, S))
        assert torch.all(w.masked_select(src_pad[:, None, None, :].expand_as(w)) == 0)
    for w in att.decoder_self:
        assert w.shape == (B, H, T, T)
        torch.testing.assert_close(w.sum(-1), torch.ones(B, H, T))
        assert torch.all(w[..., upper] == 0)
        assert torch.all(w.masked_select(tgt_pad[:, None, None, :].expand_as(w)) == 0)
        assert torch.all(w[..., 0, 0] == 1)  # the first position sees only itself
    for w in att.decoder_cross:
        assert w.shape == (B, H, T, S)
        torch.testing.assert_close(w.sum(-1), torch.ones(B, H, T))
        assert torch.all(w.masked_select(src_pad[:, None, None, :].expand_as(w)) == 0)
        assert torch.all(w.masked_select(~src_pad[:, None, None, :].expand_as(w)) > 0)


def test_decoder_only_and_encoder_only_return_attention():
    tokens = pad(ids(2, 6, 0), [6, 4])
    upper = torch.ones(6, 6, dtype=torch.bool).triu(1)
    with torch.no_grad():
        _, att = build(DecoderOnly)(tokens, return_attention=True)
    assert att.encoder is None and att.decoder_cross is None and len(att.decoder_self) == 2
    for w in att.decoder_self:
        assert w.shape == (2, 4, 6, 6)
        assert torch.all(w[..., upper] == 0)
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 6))
    with torch.no_grad():
        _, att = build(EncoderOnly)(tokens, return_attention=True)
    assert att.decoder_self is None and len(att.encoder) == 2
    for w in att.encoder:
        assert w.shape == (2, 4, 6, 6)
        assert torch.all(w[1, :, :, 4:] == 0)
        assert torch.all(w[0] > 0)  # bidirectional: every unpadded pair attends


# Padding, causality, bidirectionality ----------------------------------------------------------


@pytest.mark.parametrize("overrides", [{}, {"norm_first": True}, {"attention_window": 2}])
def test_transformer_logits_ignore_appended_padding(overrides):
    model = randomize_(build(Transformer, **overrides))
    src = pad(ids(3, 6, 0), [6, 4, 2])
    tgt = pad(ids(3, 5, 1), [5, 3, 1])
    zeros = torch.zeros(3, 4, dtype=torch.long)
    with torch.no_grad():
        logits = model(src, tgt)
        more_src = model(torch.cat([src, zeros], 1), tgt)
        more_tgt = model(src, torch.cat([tgt, zeros], 1))
        more_both = model(torch.cat([src, zeros], 1), torch.cat([tgt, zeros[:, :2]], 1))
    real = tgt != 0
    for other in (more_src, more_tgt, more_both):
        torch.testing.assert_close(other[:, :5][real], logits[real], atol=1e-5, rtol=0)
    # the comparison is not vacuous: a different source changes the logits
    with torch.no_grad():
        assert not torch.allclose(model(ids(3, 6, 5), tgt)[real], logits[real], atol=1e-3)


def test_encoder_only_ignores_appended_padding():
    model = randomize_(build(EncoderOnly))
    tokens = pad(ids(2, 5, 0), [5, 3])
    with torch.no_grad():
        logits = model(tokens)
        longer = model(torch.cat([tokens, torch.zeros(2, 3, dtype=torch.long)], 1))
    real = tokens != 0
    torch.testing.assert_close(longer[:, :5][real], logits[real], atol=1e-5, rtol=0)


@pytest.mark.parametrize("overrides", [{}, {"norm_first": True, "positional": "learned"}])
def test_decoder_only_is_causal(overrides):
    model = build(DecoderOnly, **overrides)
    tokens = ids(1, 10, 0)
    with torch.no_grad():
        logits = model(tokens)
        for t in range(10):
            changed = tokens.clone()
            changed[0, t] = 3 + (tokens[0, t] - 3 + 11) % (V - 3)
            other = model(changed)
            torch.testing.assert_close(other[:, :t], logits[:, :t], atol=1e-6, rtol=0)
            assert (other[0, t:] - logits[0, t:]).abs().amax(-1).min() > 1e-4  # every later position moves


def test_transformer_decoder_is_causal_in_the_target():
    model = build(Transformer)
    src, tgt = ids(1, 6, 0), ids(1, 8, 1)
    with torch.no_grad():
        logits = model(src, tgt)
        changed = tgt.clone()
        changed[0, 5] = 3 + (tgt[0, 5] - 3 + 1) % (V - 3)
        other = model(src, changed)
    torch.testing.assert_close(other[:, :5], logits[:, :5], atol=1e-6, rtol=0)
    assert not torch.allclose(other[:, 5:], logits[:, 5:], atol=1e-4)


def test_encoder_only_shape_and_bidirectionality():
    model = build(EncoderOnly)
    tokens = ids(2, 7, 0)
    with torch.no_grad():
        enc = model.encode(tokens)
        logits = model(tokens)
        changed = tokens.clone()
        changed[:, -1] = 3 + (tokens[:, -1] - 3 + 1) % (V - 3)
        other = model(changed)
    assert enc.memory.shape == (2, 7, 32) and enc.mask.shape == (2, 1, 1, 7)
    assert logits.shape == (2, 7, V)
    # the last token reaches every position, the first one included
    assert (other - logits).abs().amax(-1).min() > 1e-4


def test_dropout_is_active_in_training_only():
    model = build(Transformer, P_drop=0.3)
    src, tgt = ids(2, 5, 0), ids(2, 4, 1)
    with torch.no_grad():
        model.train()
        assert not torch.allclose(model(src, tgt), model(src, tgt))
        model.eval()
        assert torch.equal(model(src, tgt), model(src, tgt))


def test_gelu_model_differs_from_relu_model():
    relu, gelu = build(Transformer), build(Transformer, activation="gelu")
    assert all(torch.equal(a, b) for a, b in zip(relu.parameters(), gelu.parameters(), strict=True))
    src, tgt = ids(2, 5, 0), ids(2, 4, 1)
    with torch.no_grad():
        assert not torch.allclose(relu(src, tgt), gelu(src, tgt), atol=1e-4)
    assert torch.nn.functional.gelu is gelu.encoder.layers[0].feed_forward.activation


def test_select_computes_logits_only_at_selected_positions():
    torch.manual_seed(0)
    model = randomize_(Transformer(ModelConfig.tiny(40)).eval())
    src = torch.randint(3, 40, (3, 6))
    tgt = torch.randint(3, 40, (3, 5))
    tgt[1, 3:] = 0
    select = tgt != 0
    full = model(src, tgt)
    picked = model(src, tgt, select=select)
    assert picked.shape == (int(select.sum()), 40)
    torch.testing.assert_close(picked, full[select], atol=1e-6, rtol=0)


@pytest.mark.parametrize("tie", [True, False])
def test_output_bias_is_added_to_every_logit(tie):
    """``output_bias`` (Marian's final_logits_bias): the same model's logits plus the bias."""
    model = randomize_(build(Transformer, output_bias=True, tie_output=tie, share_embeddings=tie), seed=3)
    src, tgt = ids(2, 5, 1), ids(2, 4, 2)
    with torch.no_grad():
        biased = model(src, tgt)
        bias = model.output_bias.clone()
        model.output_bias.zero_()
        torch.testing.assert_close(biased, model(src, tgt) + bias)
    assert bias.abs().min() > 0


def test_output_bias_of_a_decoder_only_model_is_added_to_every_logit_and_an_encoder_only_model_refuses_it():
    """``DecoderOnly`` honours ``output_bias`` as ``Transformer`` does (also on its KV cache);
    ``EncoderOnly``'s masked-LM head has its own bias, so the option is an error, not ignored."""
    model = randomize_(build(DecoderOnly, output_bias=True), seed=5)
    tokens = ids(2, 6, 3)
    with torch.no_grad():
        biased = model(tokens)
        cache = model.init_cache()
        stepped = torch.cat([model.decode(tokens[:, t : t + 1], cache=cache).logits for t in range(6)], dim=1)
        torch.testing.assert_close(stepped, biased, atol=1e-5, rtol=1e-5)
        bias = model.output_bias.clone()
        model.output_bias.zero_()
        torch.testing.assert_close(biased, model(tokens) + bias)
    assert bias.abs().min() > 0
    with pytest.raises(ValueError, match="output_bias is for models that decode"):
        build(EncoderOnly, output_bias=True)


def test_a_start_token_that_is_the_pad_id_is_attended():
    """With ``bos_id == pad_id`` (Marian's) the decoder attends to the start token: the logits equal
    a model starting from another id with the same embedding."""
    marian = randomize_(build(Transformer, bos_id=0, share_embeddings=False, tie_output=False), seed=4)
    other = build(Transformer, bos_id=1, share_embeddings=False, tie_output=False)
    other.load_state_dict(marian.state_dict())
    with torch.no_grad():
        other.tgt_embedding.weight[1] = marian.tgt_embedding.weight[0]
    src, tgt = ids(2, 5, 1), ids(2, 4, 2)
    with torch.no_grad():
        ours = marian(src, torch.cat([torch.zeros(2, 1, dtype=torch.long), tgt], 1))
        theirs = other(src, torch.cat([torch.ones(2, 1, dtype=torch.long), tgt], 1))
    torch.testing.assert_close(ours, theirs)
