"""Checkpoint averaging (§6.1: "we used a single model obtained by averaging the last 5
checkpoints ... for the big models, we averaged the last 20 checkpoints")."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import safetensors
import safetensors.torch
import torch

from .model import WEIGHTS_NAME, ModelConfig, load_pretrained
from .model.pretrained import CONFIG_NAME

__all__ = ["average_checkpoints"]


@torch.no_grad()
def average_checkpoints(paths: Sequence[str | Path]):
    """The model whose parameters are the mean of the checkpoints' (in float64, then cast back).

    A matrix shared by several modules (the tied embedding) is stored once in each file and so
    averaged once. Averaging k copies of one checkpoint gives that checkpoint exactly. Every
    checkpoint must hold the first one's architecture and config, dropout rates aside (an error
    names the first ``config.json`` that differs, and the fields); the result has the first's.
    """
    if not paths:
        raise ValueError("no checkpoints to average")
    model = load_pretrained(paths[0])  # checks the first directory: its config, its weights against it
    _check_configs(paths)
    first = Path(paths[0]) / WEIGHTS_NAME
    total: dict[str, torch.Tensor] = {}
    for index, path in enumerate(paths):
        file = Path(path) / WEIGHTS_NAME
        weights = _load_weights(file)
        if index and set(weights) != set(total):
            raise ValueError(f"{file}: holds other tensors than {first}")
        for name, tensor in weights.items():
            if index and tensor.shape != total[name].shape:
                raise ValueError(
                    f"{file}: {name} has shape {tuple(tensor.shape)}, but {tuple(total[name].shape)} in {first}"
                )
            total[name] = total.get(name, 0) + tensor.double()
    for name, tensor in total.items():
        target = model.get_parameter(name) if name in dict(model.named_parameters()) else model.get_buffer(name)
        target.copy_((tensor / len(paths)).to(target.dtype))
    return model


_DROPOUT = ("P_drop", "attention_dropout", "activation_dropout")


def _check_configs(paths: Sequence[str | Path]) -> None:
    """Raise if a checkpoint's architecture or model config differs from the first one's
    (dropout rates aside: they do not change the function the weights compute at inference)."""

    def model_of(file: Path) -> dict:
        config, metadata = ModelConfig.load(file)
        fields = {k: v for k, v in config.to_dict().items() if k not in _DROPOUT}
        return {"architecture": metadata.get("architecture"), **fields}

    first = Path(paths[0]) / CONFIG_NAME
    expected = model_of(first)
    for path in paths[1:]:
        file = Path(path) / CONFIG_NAME
        other = model_of(file)
        differ = [f"{k} {other[k]!r} (not {expected[k]!r})" for k in expected if other[k] != expected[k]]
        if differ:
            raise ValueError(f"{file}: another model than {first}: " + ", ".join(differ))


def _load_weights(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of one checkpoint's weights file; errors name the file."""
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no such file (a checkpoint directory needs {WEIGHTS_NAME})")
    try:
        return safetensors.torch.load_file(str(file))
    except safetensors.SafetensorError as e:
        raise ValueError(f"{file}: not a readable safetensors file: {e}") from None
