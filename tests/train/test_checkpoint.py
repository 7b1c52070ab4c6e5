"""Checkpoints under a kill at the worst moment: the process dying inside ``save_checkpoint`` is
emulated by an exception raised from the call it would have died in. Whatever is then on disk,
``latest_checkpoint`` is the newest complete checkpoint and every listed checkpoint loads."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from aiayn.data.tokenizer import Tokenizer
from aiayn.model import ModelConfig, Transformer
from aiayn.train import checkpoint
from aiayn.train.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint


class Killed(BaseException):
    """Stands in for SIGKILL: the save stops where it is raised (no ``except Exception`` catches it)."""


@pytest.fixture(scope="module")
def parts():
    tokenizer = Tokenizer.train(["das haus ist klein", "der hund ist groß"] * 5, 300)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=tokenizer.vocab_size, N=1, d_model=16, d_ff=32, h=2))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.tensor([[5, 6, 2]]), torch.tensor([[1, 7]])).sum().backward()
    optimizer.step()  # Adam state to save
    return model, tokenizer, optimizer


def save(run: Path, parts, step: int, keep: int = 5) -> Path:
    model, tokenizer, optimizer = parts
    return save_checkpoint(run, model, tokenizer, optimizer, {"step": step, "epoch": 0, "index": step}, keep)


def loads(path: Path, parts) -> int:
    model, _, optimizer = parts
    return load_checkpoint(path, model, optimizer)["step"]


def test_a_kill_between_the_rename_and_latest_resumes_from_the_new_checkpoint(tmp_path, parts, monkeypatch):
    """The resume-after-kill flake: the test kills the run as soon as ``step_00000004`` appears,
    which can be before ``latest`` (written after the rename, with an fsync) names it."""
    save(tmp_path, parts, 2)

    def die(path, write):  # in the middle of it: its temporary file is written, not yet renamed
        (Path(path).parent / f".{Path(path).name}.x8k2.tmp").write_text("step_00000004\n")
        raise Killed

    monkeypatch.setattr(checkpoint, "atomic_write", die)
    with pytest.raises(Killed):
        save(tmp_path, parts, 4)
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_00000002\n"  # one behind
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_00000004"
    assert loads(latest_checkpoint(tmp_path), parts) == 4
    monkeypatch.undo()
    save(tmp_path, parts, 6)  # the next save clears what the kill left
    expected = ["latest", "step_00000002", "step_00000004", "step_00000006"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == expected


@pytest.mark.parametrize("removal", ["same step saved again", "rotation"])
def test_a_kill_while_removing_a_checkpoint_leaves_no_broken_one(tmp_path, parts, monkeypatch, removal):
    save(tmp_path, parts, 2)
    save(tmp_path, parts, 4)
    real_rmtree = shutil.rmtree

    def dies_halfway(path, *args, **kwargs):
        weights = Path(path) / "model.safetensors"
        if weights.exists():  # a checkpoint: the kill comes after its weights are gone
            weights.unlink()
            raise Killed
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", dies_halfway)
    with pytest.raises(Killed):
        save(tmp_path, parts, 4) if removal == "same step saved again" else save(tmp_path, parts, 6, keep=2)
    monkeypatch.undo()
    assert list_checkpoints(tmp_path)
    for path in list_checkpoints(tmp_path):
        assert loads(path, parts) == json.loads((path / "trainer_state.json").read_text())["step"]
    assert loads(latest_checkpoint(tmp_path), parts) == (4 if removal == "same step saved again" else 6)
    save(tmp_path, parts, 8)  # the next save clears what the kill left
    checkpoints = [p.name for p in list_checkpoints(tmp_path)]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", *checkpoints]
