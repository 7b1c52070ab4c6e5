"""Training checkpoints: a model directory plus everything needed for an exact resume.

Layout of ``RUN/checkpoints/step_00001000/``:
- ``config.json``, ``model.safetensors``, ``tokenizer.json``: what ``from_pretrained`` loads;
- ``optimizer.safetensors``: Adam's moments and step counts (tensors) and, in its metadata, the
  parameter groups as JSON;
- ``rng.safetensors``: the torch RNG states (dropout);
- ``trainer_state.json``: step, epoch, position in the epoch's batches, elapsed time, the run
  config.

A checkpoint is written into a temporary directory (``.step_00001000.tmp``), flushed to disk and
renamed into place, so a ``step_*`` directory with ``trainer_state.json`` is complete. One is
removed (rotation, or the same step saved again) by renaming it out of the ``step_*`` names
first, so a kill during the deletion never leaves a half-deleted one that looks complete; the
next save clears what such a kill leaves. ``latest`` names the newest checkpoint for people and
scripts; it is rewritten after the rename, so a kill between the two leaves it one behind, and
``latest_checkpoint`` goes by the directories instead. A checkpoint damaged afterwards (a file
deleted, or cut short by a copy) is found by ``checkpoint_problem``; ``resumable_checkpoint``
then falls back to the one before and says so. Nothing is unpickled on load: JSON and
safetensors only, so a pickle in place of a file is refused as not what its name says.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from ..data.tokenizer import Tokenizer, save_tokenizer, tokenizer_files
from ..model.pretrained import CONFIG_NAME, WEIGHTS_NAME, atomic_write

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "checkpoint_problem",
    "resumable_checkpoint",
]

STATE_NAME = "trainer_state.json"
OPTIMIZER_NAME = "optimizer.safetensors"
RNG_NAME = "rng.safetensors"
FILES = (CONFIG_NAME, WEIGHTS_NAME, OPTIMIZER_NAME, RNG_NAME, STATE_NAME)  # and the tokenizer's (tokenizer_files)


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], str]:
    state = optimizer.state_dict()
    tensors = {}
    for index, values in state["state"].items():
        for name, value in values.items():
            tensors[f"{index}.{name}"] = value if torch.is_tensor(value) else torch.tensor(value)
    return {k: v.detach().cpu().contiguous() for k, v in tensors.items()}, json.dumps(state["param_groups"])


def _load_optimizer(optimizer: torch.optim.Optimizer, path: Path) -> None:
    with safetensors.safe_open(str(path), framework="pt") as f:
        groups = json.loads(f.metadata()["param_groups"])
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            index, name = key.split(".", 1)
            state.setdefault(int(index), {})[name] = f.get_tensor(key)
    for group in groups:
        group["betas"] = tuple(group["betas"])
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and (p / STATE_NAME).is_file())


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run, or None. Not the ``latest`` file: a kill right
    after a checkpoint's rename leaves that naming the one before."""
    checkpoints = list_checkpoints(run_dir)
    return checkpoints[-1] if checkpoints else None


def checkpoint_problem(path: str | Path) -> str | None:
    """What makes checkpoint ``path`` unusable, naming the file: one missing, or one that is not
    whole JSON or a whole safetensors file (cut short, or something else under that name, such
    as a pickle); None if every file is there and whole. Reads the safetensors headers, which
    say how long the data is, not the data."""
    path = Path(path)
    for name in (*FILES, *tokenizer_files(path)):
        file = path / name
        if not file.is_file():
            return f"{file}: missing"
        if name.endswith(".spm"):  # a SentencePiece model (a converted Marian model's): read when loaded
            continue
        if name.endswith(".json"):
            try:
                json.loads(file.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                return f"{file}: not valid JSON ({e})"
            continue
        try:
            with safetensors.safe_open(str(file), framework="pt"):
                pass
        except safetensors.SafetensorError as e:
            return f"{file}: not a whole safetensors file ({e})"
    return None


def resumable_checkpoint(run_dir: str | Path, log: Callable[[str], None]) -> Path | None:
    """The newest checkpoint of a run whose files are all there and whole, or None if the run has
    no checkpoint. Each newer one found broken is passed over with a line to ``log`` naming the
    file at fault; if all are broken, a ValueError listing them."""
    checkpoints = list_checkpoints(run_dir)
    problems = []
    for path in reversed(checkpoints):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        log(f"checkpoint {path.name} is broken, trying the one before: {problem}")
        problems.append(problem)
    if problems:
        raise ValueError(f"{run_dir}: no checkpoint is whole, so none to resume from: " + "; ".join(problems))
    return None


def _retire(path: Path) -> Path:
    """Rename a checkpoint out of the ``step_*`` names before deleting it, so that a kill during
    the deletion cannot leave a partial directory that ``list_checkpoints`` takes for one."""
    trash = path.with_name(f".{path.name}.old")
    os.replace(path, trash)
    return trash


def save_checkpoint(
    run_dir: str | Path,
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    keep: int = 5,
) -> Path:
    """Write checkpoint ``step_{state['step']}`` atomically; keep the newest ``keep``."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    name = f"step_{state['step']:08d}"
    for leftover in root.glob(".step_*"):  # a save or a removal that a kill cut short
        shutil.rmtree(leftover, ignore_errors=True)
    for leftover in root.glob(".latest.*.tmp"):  # atomic_write's, cut short likewise
        leftover.unlink(missing_ok=True)
    final, tmp = root / name, root / f".{name}.tmp"
    model.save_pretrained(tmp)
    save_tokenizer(tokenizer, tmp)
    tensors, groups = _optimizer_tensors(optimizer)
    safetensors.torch.save_file(tensors, str(tmp / OPTIMIZER_NAME), metadata={"param_groups": groups})
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    safetensors.torch.save_file(rng, str(tmp / RNG_NAME))
    (tmp / STATE_NAME).write_text(json.dumps(state, indent=2) + "\n")
    for f in tmp.iterdir():  # on disk before the rename makes the checkpoint visible
        with open(f, "rb") as handle:
            os.fsync(handle.fileno())
    # the same step saved again (the end of training, just after a checkpoint) replaces it
    retired = [_retire(final)] if final.exists() else []
    os.replace(tmp, final)
    atomic_write(root / "latest", lambda path: Path(path).write_text(name + "\n"))
    retired += [_retire(old) for old in list_checkpoints(run_dir)[:-keep]]
    for path in retired:
        shutil.rmtree(path)
    return final


def load_checkpoint(
    path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> dict[str, Any]:
    """Restore model weights, optimizer state and RNG states in place; return the trainer state."""
    path = Path(path)
    state_file = path / STATE_NAME
    if not state_file.is_file():
        raise FileNotFoundError(f"{state_file}: no such file; {path} is not a complete checkpoint")
    problem = checkpoint_problem(path)
    if problem is not None:
        raise ValueError(f"{path} is not a usable checkpoint: {problem}")
    state = json.loads(state_file.read_text())
    loaded = type(model).from_pretrained(path, device=next(model.parameters()).device)
    model.load_state_dict(loaded.state_dict())
    if optimizer is not None:
        _load_optimizer(optimizer, path / OPTIMIZER_NAME)
    rng = safetensors.torch.load_file(str(path / RNG_NAME))
    torch.set_rng_state(rng["torch"])
    cuda = [rng[k] for k in sorted(rng) if k.startswith("cuda.")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    return state
