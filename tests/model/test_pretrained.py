"""save_pretrained / from_pretrained / load_pretrained: config.json + model.safetensors."""

import json
import re

import pytest
import torch
from safetensors import safe_open

import aiayn
from aiayn import DecoderOnly, EncoderOnly, ModelConfig, Transformer
from aiayn.model import CONFIG_NAME, WEIGHTS_NAME

V = 32
CASES = {
    "transformer-tied": (Transformer, {}),
    "transformer-untied": (Transformer, {"share_embeddings": False, "tie_output": False, "tgt_vocab_size": 40}),
    "transformer-shared-untied-output": (Transformer, {"tie_output": False}),
    "decoder-only-tied": (DecoderOnly, {"positional": "learned"}),
    "decoder-only-untied": (DecoderOnly, {"tie_output": False, "norm_first": True}),
    "encoder-only-tied": (EncoderOnly, {"activation": "gelu"}),
    "encoder-only-untied": (EncoderOnly, {"tie_output": False, "attention_window": 2}),
}


def trained_looking(cls, overrides: dict):
    """A model whose weights no fresh initialisation could reproduce."""
    torch.manual_seed(0)
    model = cls(ModelConfig.tiny(V, **overrides)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def run(model, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, V, (2, 6), generator=g)
    tokens[1, 4:] = 0
    with torch.no_grad():
        if isinstance(model, Transformer):
            return model(tokens, torch.randint(3, V, (2, 5), generator=g))
        return model(tokens)


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_gives_identical_outputs(case, tmp_path):
    cls, overrides = CASES[case]
    model = trained_looking(cls, overrides)
    directory = model.save_pretrained(tmp_path / "nested" / "model", step=7)
    assert (directory / CONFIG_NAME).is_file() and (directory / WEIGHTS_NAME).is_file()

    loaded = cls.from_pretrained(directory)
    assert type(loaded) is cls
    assert loaded.config == model.config
    assert torch.equal(run(loaded.eval()), run(model))
    expected_state = model.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, expected_state[name]), name
    # tying survives the round trip
    if cls is Transformer:
        assert (loaded.src_embedding.weight is loaded.tgt_embedding.weight) == model.config.share_embeddings
    projection = loaded.mlm_head.projection if cls is EncoderOnly else loaded.output_projection
    assert (projection is None) == model.config.tie_output

    same = aiayn.load_pretrained(directory)
    assert type(same) is cls
    assert torch.equal(run(same.eval()), run(model))


@pytest.mark.parametrize("case", list(CASES))
def test_weights_file_is_safetensors_with_shared_matrix_stored_once(case, tmp_path):
    cls, overrides = CASES[case]
    model = trained_looking(cls, overrides)
    model.save_pretrained(tmp_path)
    state = model.state_dict()
    with safe_open(str(tmp_path / WEIGHTS_NAME), framework="pt") as f:
        keys = set(f.keys())
        stored = {k: f.get_tensor(k) for k in keys}
    assert keys <= set(state)
    assert not any(k.endswith(".pe") for k in keys)  # the sinusoid table is a function of the config
    for k, tensor in stored.items():
        assert torch.equal(tensor, state[k]), k
    # every parameter once, each shared matrix once: as many tensors and numbers as num_parameters
    assert len(keys) == len(list(model.parameters()))
    assert sum(t.numel() for t in stored.values()) == model.num_parameters()
    if cls is Transformer:
        aliases = keys & {"src_embedding.weight", "tgt_embedding.weight"}
        assert len(aliases) == (1 if model.config.share_embeddings else 2)


def test_config_json_records_architecture_and_metadata(tmp_path):
    model = trained_looking(DecoderOnly, {})
    model.save_pretrained(tmp_path, step=3, note="hello")
    data = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert data["architecture"] == "DecoderOnly" and data["step"] == 3 and data["note"] == "hello"
    config, metadata = ModelConfig.load(tmp_path / CONFIG_NAME)
    assert config == model.config
    assert metadata == {"architecture": "DecoderOnly", "step": 3, "note": "hello"}


def test_save_overwrites_a_previous_checkpoint(tmp_path):
    first, second = trained_looking(EncoderOnly, {}), trained_looking(EncoderOnly, {})
    with torch.no_grad():
        second.embedding.weight.add_(1.0)
    first.save_pretrained(tmp_path)
    second.save_pretrained(tmp_path)
    assert torch.equal(run(EncoderOnly.from_pretrained(tmp_path).eval()), run(second))
    assert sorted(p.name for p in tmp_path.iterdir()) == [CONFIG_NAME, WEIGHTS_NAME]  # no temporary files left


@pytest.mark.parametrize("cls", [Transformer, DecoderOnly, EncoderOnly])
def test_load_pretrained_dispatches_on_the_architecture(cls, tmp_path):
    cls(ModelConfig.tiny(V)).save_pretrained(tmp_path)
    assert type(aiayn.load_pretrained(tmp_path)) is cls


def test_loading_as_the_wrong_architecture_raises(tmp_path):
    Transformer(ModelConfig.tiny(V)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="Transformer"):
        DecoderOnly.from_pretrained(tmp_path)
    with pytest.raises(ValueError):
        EncoderOnly.from_pretrained(tmp_path)


def in_message(path) -> str:
    return re.escape(str(path))


@pytest.fixture
def saved(tmp_path):
    Transformer(ModelConfig.tiny(V)).save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("load", [Transformer.from_pretrained, aiayn.load_pretrained])
def test_missing_weights_file_names_it(saved, load):
    (saved / WEIGHTS_NAME).unlink()
    with pytest.raises(FileNotFoundError, match=in_message(saved / WEIGHTS_NAME)):
        load(saved)


@pytest.mark.parametrize("garbage", [b"not a safetensors file at all" * 4, b"abc", b""])
@pytest.mark.parametrize("load", [Transformer.from_pretrained, aiayn.load_pretrained])
def test_corrupt_weights_file_names_it(saved, load, garbage):
    (saved / WEIGHTS_NAME).write_bytes(garbage)
    with pytest.raises(ValueError, match=in_message(saved / WEIGHTS_NAME)):
        load(saved)


@pytest.mark.parametrize("load", [Transformer.from_pretrained, aiayn.load_pretrained])
def test_missing_config_names_it(saved, load):
    (saved / CONFIG_NAME).unlink()
    with pytest.raises(FileNotFoundError, match=in_message(saved / CONFIG_NAME)):
        load(saved)


@pytest.mark.parametrize(
    "text",
    [
        "{ not json",
        "[]",
        '{"architecture": "Transformer", "vocab_size": 32, "d_model": 30, "h": 4}',  # invalid value
        '{"architecture": "Transformer", "vocab_size": 32, "dropout_rate": 0.1}',  # unknown field
        '{"architecture": "Transformer"}',  # no vocab_size
    ],
)
@pytest.mark.parametrize("load", [Transformer.from_pretrained, aiayn.load_pretrained])
def test_invalid_config_names_it(saved, load, text):
    (saved / CONFIG_NAME).write_text(text)
    with pytest.raises(ValueError, match=in_message(saved / CONFIG_NAME)):
        load(saved)


def test_unknown_architecture_names_the_config(saved):
    data = json.loads((saved / CONFIG_NAME).read_text())
    (saved / CONFIG_NAME).write_text(json.dumps({**data, "architecture": "Mamba"}))
    with pytest.raises(ValueError, match=in_message(saved / CONFIG_NAME)):
        aiayn.load_pretrained(saved)


def test_weights_that_do_not_match_the_config_name_both_files(saved):
    data = json.loads((saved / CONFIG_NAME).read_text())
    (saved / CONFIG_NAME).write_text(json.dumps({**data, "d_ff": 128}))
    with pytest.raises(ValueError, match=in_message(saved / WEIGHTS_NAME)):
        Transformer.from_pretrained(saved)


@pytest.mark.parametrize("load", [Transformer.from_pretrained, aiayn.load_pretrained])
def test_missing_directory_or_a_file_for_one(saved, load, tmp_path):
    with pytest.raises(FileNotFoundError, match=in_message(tmp_path / "nowhere") + ": not a model directory"):
        load(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=in_message(saved / WEIGHTS_NAME) + ": not a model directory$"):
        load(saved / WEIGHTS_NAME)  # (once named its config inside a file: "Not a directory")
