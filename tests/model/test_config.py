"""ModelConfig: Table 3 presets, derived defaults, validation, immutability, serialization."""

import dataclasses
import json
import re

import pytest

from aiayn import ModelConfig


def test_base_preset_is_table_3_base():
    c = ModelConfig.base(37000)
    assert (c.N, c.N_dec, c.d_model, c.d_ff, c.h, c.d_k, c.d_v, c.P_drop) == (6, 6, 512, 2048, 8, 64, 64, 0.1)
    assert c.vocab_size == c.tgt_vocab_size == 37000
    # the paper's model: post-norm, no final norm, ReLU, sinusoids, shared embeddings (§3.1, §3.3-3.5)
    assert not c.norm_first and not c.final_norm
    assert c.activation == "relu" and c.positional == "sinusoidal"
    assert c.share_embeddings and c.tie_output
    assert c.attention_dropout == 0.0 and c.activation_dropout == 0.0


def test_big_preset_is_table_3_big():
    c = ModelConfig.big(37000)
    assert (c.N, c.N_dec, c.d_model, c.d_ff, c.h, c.d_k, c.d_v, c.P_drop) == (6, 6, 1024, 4096, 16, 64, 64, 0.3)


def test_presets_accept_overrides():
    c = ModelConfig.base(100, P_drop=0.2, max_len=64)
    assert c.P_drop == 0.2 and c.max_len == 64 and c.d_model == 512


def test_tiny_preset():
    c = ModelConfig.tiny()
    assert (c.vocab_size, c.N, c.d_model, c.d_ff, c.h, c.d_k, c.P_drop) == (32, 2, 32, 64, 4, 8, 0.0)


def test_derived_defaults():
    c = ModelConfig(vocab_size=50, N=3, d_model=48, h=6, norm_first=True)
    assert c.d_k == c.d_v == 8  # d_model / h
    assert c.N_dec == 3  # N for both stacks
    assert c.final_norm is True  # pre-norm needs a final LayerNorm
    assert c.tgt_vocab_size == 50
    # explicit values win
    c = ModelConfig(vocab_size=50, N=3, N_dec=1, d_model=30, h=4, d_k=5, d_v=9, norm_first=True, final_norm=False)
    assert (c.N_dec, c.d_k, c.d_v, c.final_norm) == (1, 5, 9, False)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"d_model": 30, "h": 4},  # d_model not divisible by h, no d_k/d_v given
        {"P_drop": -0.1},
        {"P_drop": 1.0},
        {"attention_dropout": -0.5},
        {"activation_dropout": 1.5},
        {"activation": "swish"},
        {"positional": "rotary"},
        {"tgt_vocab_size": 40},  # share_embeddings=True needs one vocabulary
        {"pad_id": 32},  # vocab_size is 32
        {"pad_id": -1},
        {"bos_id": 100},
        {"eos_id": 32},
        {"share_embeddings": False, "tgt_vocab_size": 10, "pad_id": 12},  # outside the target vocabulary
        {"vocab_size": 0},
        {"N": 0},
        {"d_model": -32},
        {"h": 0},
        {"d_ff": 2.5},
        {"max_len": 0},
        {"N_dec": 0},
        {"d_k": -1},
        {"attention_window": 0},
        {"layer_norm_eps": 0.0},
    ],
)
def test_validation_rejects_bad_values(kwargs):
    args = {"vocab_size": 32, **kwargs}
    with pytest.raises(ValueError, match="ModelConfig"):
        ModelConfig(**args)


def test_separate_target_vocabulary_needs_unshared_embeddings():
    c = ModelConfig(vocab_size=32, tgt_vocab_size=40, share_embeddings=False)
    assert c.tgt_vocab_size == 40


def test_config_is_frozen():
    c = ModelConfig.tiny()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.d_model = 64  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.h = 2  # type: ignore[misc]


def test_replace_makes_a_new_validated_config():
    c = ModelConfig.tiny()
    d = c.replace(P_drop=0.3)
    assert d.P_drop == 0.3 and c.P_drop == 0.0
    with pytest.raises(ValueError):
        c.replace(P_drop=2.0)


@pytest.mark.parametrize(
    "change",
    [
        {"vocab_size": 100},  # tgt_vocab_size was derived from vocab_size
        {"norm_first": True},  # final_norm was derived from norm_first
        {"N": 3},  # N_dec was derived from N
        {"d_model": 64},  # d_k, d_v were derived from d_model / h
    ],
)
def test_replace_rederives_defaults(change):
    """A changed field must carry its derived defaults along: replace(x=...) equals building with x=...
    (vocab_size=100 would raise if tgt_vocab_size stayed 32; norm_first=True must bring final_norm)."""
    fresh = {"vocab_size": 32, **change}
    assert ModelConfig.tiny(32).replace(**change) == ModelConfig.tiny(**fresh)


def test_replace_keeps_explicit_values():
    c = ModelConfig.tiny(32, d_k=16, d_v=4, N_dec=1, final_norm=True, share_embeddings=False, tgt_vocab_size=40)
    c2 = c.replace(d_model=64, N=3, vocab_size=50)
    assert (c2.d_k, c2.d_v, c2.N_dec, c2.final_norm, c2.tgt_vocab_size) == (16, 4, 1, True, 40)


def test_table3_row_a_varies_heads_with_d_k_equal_d_model_over_h():
    c = ModelConfig.base(100).replace(h=16)
    assert (c.d_k, c.d_v) == (32, 32)
    assert ModelConfig.base(100, h=1).d_k == 512


def test_dict_round_trip_and_unknown_fields():
    c = ModelConfig.tiny(50, norm_first=True, attention_window=4, positional="learned")
    assert ModelConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match="dropout_rate"):
        ModelConfig.from_dict({**c.to_dict(), "dropout_rate": 0.1})


def test_save_and_load_keep_metadata_apart(tmp_path):
    c = ModelConfig.base(1000, share_embeddings=False, tgt_vocab_size=900)
    path = tmp_path / "config.json"
    c.save(path, architecture="Transformer", step=12)
    loaded, metadata = ModelConfig.load(path)
    assert loaded == c
    assert metadata == {"architecture": "Transformer", "step": 12}


def test_load_errors_name_the_file(tmp_path):
    path = tmp_path / "config.json"
    with pytest.raises(FileNotFoundError, match=re.escape(str(path))):
        ModelConfig.load(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match=re.escape(str(path))):
        ModelConfig.load(path)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match=re.escape(str(path))):
        ModelConfig.load(path)
    path.write_text('{"vocab_size": 32, "d_model": 30, "h": 4}')
    with pytest.raises(ValueError, match=re.escape(str(path))):
        ModelConfig.load(path)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"suppress_ids": (2,)},  # EOS: the search could never end
        {"suppress_ids": (5, 32)},  # vocab_size is 32
        {"suppress_ids": (-1,)},
        {"suppress_ids": ("5",)},
        {"suppress_ids": (5.0,)},
        {"share_embeddings": False, "tgt_vocab_size": 10, "suppress_ids": (12,)},  # a source id only
    ],
)
def test_suppress_ids_must_be_target_ids_other_than_eos(kwargs):
    with pytest.raises(ValueError, match="suppress_ids"):
        ModelConfig(**{"vocab_size": 32, **kwargs})


def test_suppress_ids_round_trip_as_a_tuple(tmp_path):
    assert ModelConfig.tiny(32).suppress_ids == ()
    c = ModelConfig.tiny(32, suppress_ids=[5, 7])  # a list, as JSON and YAML give it
    assert c.suppress_ids == (5, 7)
    path = tmp_path / "config.json"
    c.save(path)
    assert json.loads(path.read_text())["suppress_ids"] == [5, 7]
    loaded, _ = ModelConfig.load(path)
    assert loaded.suppress_ids == (5, 7) and loaded == c and hash(loaded) == hash(c)
    assert ModelConfig.from_dict(c.to_dict()) == c
