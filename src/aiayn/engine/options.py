"""The engine's choices, made once in one visible place (not in the paper).

``EngineOptions`` is a frozen object passed to ``prepare``; nothing in the engine reads the
environment or a module global at call time. The CLI maps the environment variables a user
may set into it (``from_environ``):

| field | variable | what it turns on |
|---|---|---|
| ``kernels`` | ``AIAYN_CPU_KERNELS=0`` turns off | the C++ attention and argmax kernels (``kernels.py``) |
| ``gemm`` | ``AIAYN_CPU_GEMM=auto|onednn|mkl`` | how float32 CPU products run (``linear.py``) |
| ``refill`` | ``AIAYN_REFILL=0`` turns off | new sentences take ended ones' places (``decode.translate_ids``) |
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = ["EngineOptions", "GEMMS"]

GEMMS = ("auto", "onednn", "mkl")


@dataclass(frozen=True)
class EngineOptions:
    """How a prepared model runs. The defaults are the fastest measured (docs/benchmarks.md)."""

    kernels: bool = True  # C++ attention for decoding steps and greedy's argmax (CPU, float32)
    gemm: str = "auto"  # float32 CPU products: oneDNN on packed weights, MKL, or auto (oneDNN on AVX-512)
    refill: bool = True  # translate_ids refills its batches as sentences end

    def __post_init__(self) -> None:
        if self.gemm not in GEMMS:
            raise ValueError(f"EngineOptions.gemm must be one of {', '.join(GEMMS)}, got {self.gemm!r}")

    @property
    def onednn(self) -> bool:
        """Whether float32 CPU products run on packed oneDNN weights: ``gemm="onednn"``, or
        ``"auto"`` where torch runs AVX-512 kernels (on AVX2 it was level with MKL)."""
        if not torch.backends.mkldnn.is_available():
            return False
        if self.gemm == "auto":
            return torch.backends.cpu.get_cpu_capability() == "AVX512"
        return self.gemm == "onednn"

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> EngineOptions:
        """The options the ``AIAYN_*`` variables ask for (module docstring); unset ones keep
        their defaults, and an unknown ``AIAYN_CPU_GEMM`` warns and stays ``auto``."""
        env = os.environ if environ is None else environ
        gemm = env.get("AIAYN_CPU_GEMM", "auto").strip().lower()
        if gemm not in GEMMS:
            warnings.warn(f"AIAYN_CPU_GEMM={gemm!r} is not one of {', '.join(GEMMS)}: using auto", stacklevel=2)
            gemm = "auto"
        return cls(
            kernels=env.get("AIAYN_CPU_KERNELS", "1") != "0",
            gemm=gemm,
            refill=env.get("AIAYN_REFILL", "1") != "0",
        )
