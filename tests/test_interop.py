"""Our stacks equal torch.nn.Transformer / torch.nn.TransformerEncoder with the same weights."""

import warnings

import pytest
import torch
from torch import nn

from aiayn import EncoderOnly, ModelConfig, Transformer
from aiayn.interop import load_torch_transformer
from aiayn.model.masks import causal_mask

d_model, h, d_ff, N, N_dec = 32, 4, 64, 2, 3
B, S, T = 3, 7, 5
SRC_LENGTHS, TGT_LENGTHS = [7, 4, 2], [5, 3, 1]  # padding in every row but one, no row fully padded
ATOL = 1e-5


@pytest.fixture(autouse=True)
def quiet_torch():
    # torch warns that nested tensors are off with norm_first=True; not our concern here
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


def valid(lengths: list[int], L: int) -> torch.Tensor:
    """(B, L) True at real positions."""
    return torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]


def randomize_norms_and_biases(module: nn.Module) -> None:
    """torch starts LayerNorms at (1, 0) and attention biases at 0; random values show a mix-up of them."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.2)
            elif "norm" in name:
                p.normal_(1.0, 0.2)


def pair(norm_first: bool, activation: str = "relu", seed: int = 0) -> tuple[Transformer, nn.Transformer]:
    torch.manual_seed(seed)
    theirs = nn.Transformer(
        d_model, h, N, N_dec, d_ff, dropout=0.0, activation=activation, batch_first=True, norm_first=norm_first
    )
    randomize_norms_and_biases(theirs)
    config = ModelConfig.tiny(
        N=N, N_dec=N_dec, d_model=d_model, h=h, d_ff=d_ff, activation=activation,
        norm_first=norm_first, final_norm=True, P_drop=0.0,
    )  # fmt: skip
    ours = Transformer(config)
    load_torch_transformer(ours, theirs)
    return ours, theirs


def inputs(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, S, d_model, generator=g), torch.randn(B, T, d_model, generator=g)


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_stacks_equal_torch_transformer(norm_first, mode, activation):
    ours, theirs = pair(norm_first, activation)
    ours.train(mode == "train")
    theirs.train(mode == "train")
    x, y = inputs()
    src_valid, tgt_valid = valid(SRC_LENGTHS, S), valid(TGT_LENGTHS, T)
    src_mask = src_valid[:, None, None, :]  # (B, 1, 1, S), True = may attend
    tgt_mask = causal_mask(T) & tgt_valid[:, None, None, :]  # (B, 1, T, T)
    torch_causal = ~torch.ones(T, T, dtype=torch.bool).tril()  # torch: True = masked out

    with torch.no_grad():
        memory, _ = ours.encoder(x, src_mask)
        expected_memory = theirs.encoder(x, src_key_padding_mask=~src_valid)
        # torch's eval fast path may zero the padded rows: compare the real positions
        torch.testing.assert_close(memory[src_valid], expected_memory[src_valid], atol=ATOL, rtol=0)

        out, _, _ = ours.decoder(y, memory, self_mask=tgt_mask, memory_mask=src_mask)
        expected = theirs.decoder(
            y, memory, tgt_mask=torch_causal, tgt_key_padding_mask=~tgt_valid, memory_key_padding_mask=~src_valid
        )
        torch.testing.assert_close(out[tgt_valid], expected[tgt_valid], atol=ATOL, rtol=0)

        full = theirs(
            x, y, tgt_mask=torch_causal, src_key_padding_mask=~src_valid,
            tgt_key_padding_mask=~tgt_valid, memory_key_padding_mask=~src_valid,
        )  # fmt: skip
        torch.testing.assert_close(out[tgt_valid], full[tgt_valid], atol=ATOL, rtol=0)


def test_parity_is_not_vacuous():
    """A different torch module (other weights) gives different outputs: the comparison can fail."""
    ours, _ = pair(False, seed=0)
    _, other = pair(False, seed=1)
    x, _ = inputs()
    with torch.no_grad():
        assert not torch.allclose(ours.encoder(x)[0], other.encoder(x), atol=1e-2)


@pytest.mark.parametrize("with_final_norm", [True, False])
@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_only_equals_torch_transformer_encoder(with_final_norm, norm_first):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model, h, d_ff, dropout=0.0, batch_first=True, norm_first=norm_first)
    norm = nn.LayerNorm(d_model) if with_final_norm else None
    theirs = nn.TransformerEncoder(layer, N, norm=norm, enable_nested_tensor=False)
    randomize_norms_and_biases(theirs)
    config = ModelConfig.tiny(N=N, d_model=d_model, h=h, d_ff=d_ff, norm_first=norm_first, final_norm=with_final_norm)
    ours = EncoderOnly(config).eval()
    load_torch_transformer(ours, theirs)
    theirs.eval()
    x, _ = inputs()
    src_valid = valid(SRC_LENGTHS, S)
    with torch.no_grad():
        out, _ = ours.encoder(x, src_valid[:, None, None, :])
        expected = theirs(x, src_key_padding_mask=~src_valid)
    torch.testing.assert_close(out[src_valid], expected[src_valid], atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "change",
    [
        {"N": 3},
        {"N_dec": 2},
        {"norm_first": True},
        {"final_norm": False},
        {"activation": "gelu"},
        {"d_ff": 32},
        {"layer_norm_eps": 1e-6},
    ],
)
def test_mismatched_config_raises(change):
    theirs = nn.Transformer(d_model, h, N, N_dec, d_ff, dropout=0.0, batch_first=True)
    config = ModelConfig.tiny(N=N, N_dec=N_dec, d_model=d_model, h=h, d_ff=d_ff, final_norm=True)
    with pytest.raises(ValueError):
        load_torch_transformer(Transformer(config.replace(**change)), theirs)


def test_encoder_only_mismatch_raises():
    layer = nn.TransformerEncoderLayer(d_model, h, d_ff, dropout=0.0, batch_first=True)
    theirs = nn.TransformerEncoder(layer, N, norm=None, enable_nested_tensor=False)
    config = ModelConfig.tiny(N=N, d_model=d_model, h=h, d_ff=d_ff, final_norm=False)
    load_torch_transformer(EncoderOnly(config), theirs)  # matches
    for change in ({"N": 3}, {"final_norm": True}, {"norm_first": True, "final_norm": False}):
        with pytest.raises(ValueError):
            load_torch_transformer(EncoderOnly(config.replace(**change)), theirs)


def test_seq_first_torch_module_is_refused():
    theirs = nn.Transformer(d_model, h, N, N_dec, d_ff, dropout=0.0, batch_first=False)
    config = ModelConfig.tiny(N=N, N_dec=N_dec, d_model=d_model, h=h, d_ff=d_ff, final_norm=True)
    with pytest.raises(ValueError, match="batch_first"):
        load_torch_transformer(Transformer(config), theirs)
