"""Saving and loading models: ``config.json`` + ``model.safetensors`` in a directory.

Loading never unpickles anything: the config is JSON and the weights are safetensors. A matrix
shared by several modules (the tied embedding) is stored once. Files are written atomically (a
temporary file, then a rename), so an interrupted save leaves the previous file intact.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import safetensors
import safetensors.torch
import torch

from .config import ModelConfig

__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "PretrainedMixin", "atomic_write"]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"

M = TypeVar("M", bound="PretrainedMixin")


def atomic_write(path: str | Path, write: Callable[[str], None]) -> None:
    """Call ``write(tmp_path)`` on a temporary file beside ``path``, then rename it to ``path``."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class PretrainedMixin:
    """``save_pretrained`` / ``from_pretrained`` for the aiayn models (which set ``self.config``)."""

    config: ModelConfig

    def num_parameters(self) -> int:
        """Trainable parameters, each shared matrix counted once."""
        return sum(p.numel() for p in self.parameters())  # type: ignore[attr-defined]

    def save_pretrained(self, directory: str | Path, **metadata: Any) -> Path:
        """Write ``config.json`` (the config, the architecture, and ``metadata``) and
        ``model.safetensors`` into ``directory``, creating it if needed."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        info = {"architecture": type(self).__name__, **metadata, **self.config.to_dict()}
        atomic_write(directory / WEIGHTS_NAME, lambda tmp: safetensors.torch.save_model(self, tmp))
        atomic_write(directory / CONFIG_NAME, lambda tmp: Path(tmp).write_text(json.dumps(info, indent=2) + "\n"))
        return directory

    @classmethod
    def from_pretrained(cls: type[M], directory: str | Path, device: str | torch.device = "cpu") -> M:
        """Rebuild a model saved by ``save_pretrained``. Errors name the file at fault."""
        directory = Path(directory)
        device = _available(device)
        if not directory.is_dir():
            raise FileNotFoundError(f"{directory}: not a model directory")
        config, metadata = ModelConfig.load(directory / CONFIG_NAME)
        architecture = metadata.get("architecture", cls.__name__)
        if architecture != cls.__name__:
            raise ValueError(
                f"{directory / CONFIG_NAME}: holds a {architecture}, not a {cls.__name__} "
                f"(use aiayn.load_pretrained to load any architecture)"
            )
        model = cls(config)  # type: ignore[call-arg]
        weights = directory / WEIGHTS_NAME
        if not weights.is_file():
            raise FileNotFoundError(f"{weights}: no such file (a model directory needs {WEIGHTS_NAME})")
        try:
            safetensors.torch.load_model(model, weights, strict=True, device=str(device))
        except safetensors.SafetensorError as e:
            raise ValueError(f"{weights}: not a readable safetensors file: {e}") from None
        except RuntimeError as e:  # missing, unexpected or differently shaped tensors: torch lists them all
            lines = str(e).splitlines()
            more = f"\n  ... and {len(lines) - 4} more lines" if len(lines) > 4 else ""
            raise ValueError(
                f"{weights}: does not match {directory / CONFIG_NAME}: " + "\n".join(lines[:4]) + more
            ) from None
        return model.to(device)  # type: ignore[attr-defined]


def _available(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device``, or a ValueError saying why this machine cannot use it."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"unknown device {str(device)!r}: {e}") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device {str(device)!r}: CUDA is not available here (torch {torch.__version__})")
        if device.index is not None and device.index >= count:
            raise ValueError(f"device {str(device)!r}: this machine has {count} CUDA device(s)")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {str(device)!r}: MPS is not available here")
    return device
