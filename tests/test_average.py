"""Checkpoint averaging (§6.1) against the arithmetic mean computed here, tensor by tensor."""

from pathlib import Path

import pytest
import safetensors.torch
import torch

from aiayn.average import average_checkpoints
from aiayn.model import ModelConfig, Transformer
from aiayn.train.checkpoint import list_checkpoints
from aiayn.train.config import RunConfig
from aiayn.train.trainer import train


def _save(tmp_path: Path, seed: int, **config) -> Path:
    torch.manual_seed(seed)
    model = Transformer(ModelConfig.tiny(vocab_size=20, **config))
    return model.save_pretrained(tmp_path / f"m{seed}")


def test_average_is_the_mean_and_a_tied_matrix_is_averaged_once(tmp_path):
    paths = [_save(tmp_path, seed) for seed in (0, 1, 2)]
    models = [Transformer.from_pretrained(p) for p in paths]
    averaged = average_checkpoints(paths)
    # still tied: one matrix serves both embeddings and the output projection
    assert averaged.tgt_embedding.weight is averaged.src_embedding.weight
    for name, tensor in averaged.state_dict().items():
        expected = sum(dict(m.state_dict())[name].double() for m in models) / 3
        assert torch.allclose(tensor.double(), expected, atol=1e-7), name
    # averaged once: not the sum of the two names' contributions
    shared = sum(m.src_embedding.weight.double() for m in models) / 3
    assert torch.allclose(averaged.src_embedding.weight.double(), shared, atol=1e-7)


def test_averaging_copies_of_one_checkpoint_gives_it_exactly(tmp_path):
    path = _save(tmp_path, 0, share_embeddings=False, tie_output=False)
    averaged = average_checkpoints([path] * 5)
    original = safetensors.torch.load_file(str(path / "model.safetensors"))
    assert all(torch.equal(averaged.state_dict()[k], v) for k, v in original.items())


def test_a_broken_or_different_later_checkpoint_is_an_error_naming_it(tmp_path):
    first, second = _save(tmp_path, 0), _save(tmp_path, 1)
    wider = _save(tmp_path, 2, d_model=24, d_ff=48)  # the same tensor names, other shapes
    with pytest.raises(ValueError, match=rf"{wider / 'config.json'}: another model than .* d_model 24 \(not 32\)"):
        average_checkpoints([first, wider])
    (wider / "config.json").write_bytes((first / "config.json").read_bytes())  # a config that does not tell
    with pytest.raises(ValueError, match=rf"{wider / 'model.safetensors'}: .* has shape .* in {first}"):
        average_checkpoints([first, wider])
    (second / "model.safetensors").write_bytes((first / "model.safetensors").read_bytes()[:200])  # cut short
    with pytest.raises(ValueError, match=rf"{second / 'model.safetensors'}: not a readable safetensors file"):
        average_checkpoints([first, second])
    (second / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=rf"{second / 'model.safetensors'}: no such file"):
        average_checkpoints([first, second])


def test_trainer_averages_the_last_n_checkpoints(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    words = ["haus", "katze", "hund", "rot", "klein"]
    for split, n in (("train", 120), ("dev", 10)):
        de = [" ".join(words[(i + j) % 5] for j in range(1 + i % 4)) for i in range(n)]
        (data / f"{split}.de").write_text("".join(x + "\n" for x in de))
        (data / f"{split}.en").write_text("".join(x.upper() + "\n" for x in de))
    run = RunConfig.from_dict(
        {
            "data": {"dir": str(data), "max_len": 32},
            "model": {"N": 1, "d_model": 32, "d_ff": 64, "h": 2, "P_drop": 0.1},
            "train": {"vocab_size": 300, "max_tokens": 160, "warmup": 5, "max_steps": 9, "checkpoint_every": 3,
                      "checkpoint_minutes": None, "keep_checkpoints": 5, "average_last": 3, "seed": 3},
        }
    )  # fmt: skip
    result = train(run, tmp_path / "run", progress=False, log=lambda _: None)
    last3 = list_checkpoints(tmp_path / "run")[-3:]
    assert [p.name for p in last3] == ["step_00000003", "step_00000006", "step_00000009"]
    final = safetensors.torch.load_file(str(result.model_dir / "model.safetensors"))
    weights = [safetensors.torch.load_file(str(p / "model.safetensors")) for p in last3]
    for name, tensor in final.items():
        expected = sum(w[name].double() for w in weights) / 3
        assert torch.allclose(tensor.double(), expected, atol=1e-6), name
    name = "decoder.layers.0.feed_forward.linear1.weight"
    assert not torch.equal(final[name], weights[-1][name])  # not simply the last checkpoint


def test_checkpoints_of_another_config_are_an_error_even_when_every_shape_matches(tmp_path):
    first = _save(tmp_path, 0)  # tiny: h 4, ReLU
    heads = _save(tmp_path, 1, h=2)  # the same tensors and shapes: only the heads' split differs
    with pytest.raises(ValueError, match=rf"{heads / 'config.json'}: another model than {first / 'config.json'}: h 2"):
        average_checkpoints([first, heads])
    gelu = _save(tmp_path, 2, activation="gelu")
    with pytest.raises(ValueError, match="activation 'gelu'"):
        average_checkpoints([first, gelu])
    dropout = _save(tmp_path, 3, P_drop=0.3)  # dropout does not change the function at inference
    assert average_checkpoints([first, dropout]).config.P_drop == ModelConfig.tiny(vocab_size=20).P_drop


def test_average_command_refuses_checkpoints_with_other_tokenizers(tmp_path, capsys):
    from aiayn.cli import main
    from aiayn.data.tokenizer import TOKENIZER_NAME, Tokenizer

    first, second = _save(tmp_path, 0), _save(tmp_path, 1)
    Tokenizer.train(["ein Haus", "das Haus"] * 5, vocab_size=270).save(first / TOKENIZER_NAME)
    Tokenizer.train(["ein Haus", "das Haus"] * 5, vocab_size=270).save(second / TOKENIZER_NAME)
    assert main(["average", str(first), str(second), "--out", str(tmp_path / "same")]) == 0
    assert (tmp_path / "same" / TOKENIZER_NAME).read_text() == (first / TOKENIZER_NAME).read_text()
    Tokenizer.train(["eine Katze", "die Katze"] * 5, vocab_size=270).save(second / TOKENIZER_NAME)
    assert main(["average", str(first), str(second), "--out", str(tmp_path / "mixed")]) == 1
    err = capsys.readouterr().err
    assert f"{second / TOKENIZER_NAME}: another tokenizer than {first / TOKENIZER_NAME}" in err
    assert not (tmp_path / "mixed").exists()
