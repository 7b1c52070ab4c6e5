"""Checkpoint averaging (§6.1: "we used a single model obtained by averaging the last 5
checkpoints ... for the big models, we averaged the last 20 checkpoints")."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import safetensors
import safetensors.torch
import torch

from .model import WEIGHTS_NAME, load_pretrained

__all__ = ["average_checkpoints"]


@torch.no_grad()
def average_checkpoints(paths: Sequence[str | Path]):
    """The model whose parameters are the mean of the checkpoints' (in float64, then cast back).

    A matrix shared by several modules (the tied embedding) is stored once in each file and so
    averaged once. Averaging k copies of one checkpoint gives that checkpoint exactly.
    """
    if not paths:
        raise ValueError("no checkpoints to average")
    model = load_pretrained(paths[0])  # checks the first directory: its config, its weights against it
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


def _load_weights(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of one checkpoint's weights file; errors name the file."""
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no such file (a checkpoint directory needs {WEIGHTS_NAME})")
    try:
        return safetensors.torch.load_file(str(file))
    except safetensors.SafetensorError as e:
        raise ValueError(f"{file}: not a readable safetensors file: {e}") from None
