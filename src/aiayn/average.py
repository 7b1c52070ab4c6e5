"""Checkpoint averaging (§6.1: "we used a single model obtained by averaging the last 5
checkpoints ... for the big models, we averaged the last 20 checkpoints")."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

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
    model = load_pretrained(paths[0])
    total: dict[str, torch.Tensor] = {}
    for path in paths:
        weights = safetensors.torch.load_file(str(Path(path) / WEIGHTS_NAME))
        if total and set(weights) != set(total):
            raise ValueError(f"{Path(path) / WEIGHTS_NAME}: holds other tensors than {Path(paths[0]) / WEIGHTS_NAME}")
        for name, tensor in weights.items():
            total[name] = total.get(name, 0) + tensor.double()
    for name, tensor in total.items():
        target = model.get_parameter(name) if name in dict(model.named_parameters()) else model.get_buffer(name)
        target.copy_((tensor / len(paths)).to(target.dtype))
    return model
