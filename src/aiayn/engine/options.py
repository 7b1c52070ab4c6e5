"""The engine's choices, made once in one visible place (not in the paper).

``EngineOptions`` is a frozen object passed to ``prepare``; nothing in the engine's decoding reads
the environment or a module global at call time. (The training loss, which has no prepared model
to carry options, reads ``AIAYN_CPU_KERNELS`` at each call: ``kernels.loss_eligible``.) The CLI
maps the environment variables a user may set into it (``from_environ``):

| field | variable | what it turns on |
|---|---|---|
| ``kernels`` | ``AIAYN_CPU_KERNELS=0`` turns off | the C++ attention kernel (``kernels.py``; and the loss kernel) |
| ``gemm`` | ``AIAYN_CPU_GEMM=auto|onednn|mkl`` | how float32 CPU products run (``linear.py``) |
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = ["EngineOptions", "GEMMS", "ONEDNN_MIN_WEIGHT"]

GEMMS = ("auto", "onednn", "mkl")

# ``auto`` packs a weight for oneDNN from this many elements (d_in * d_out) up. oneDNN's call
# costs ~10-20 us more than MKL's: on the 2-core Xeon with AMX it lost (0.58-0.93x MKL's
# product) on d_model 128's 128x128, 128x384 and 128x512 weights at 8-128 rows, and won (1.03-1.48x)
# on every weight from 512x512 (2^18) up, 128x8000 included (docs/benchmarks.md)
ONEDNN_MIN_WEIGHT = 2**18


@dataclass(frozen=True)
class EngineOptions:
    """How a prepared model runs. The defaults are the fastest measured (docs/benchmarks.md)."""

    kernels: bool = True  # C++ attention for decoding steps (CPU, float32)
    gemm: str = "auto"  # float32 CPU products: oneDNN on packed weights, MKL, or auto (onednn_for)

    def __post_init__(self) -> None:
        if self.gemm not in GEMMS:
            raise ValueError(f"EngineOptions.gemm must be one of {', '.join(GEMMS)}, got {self.gemm!r}")

    @property
    def onednn(self) -> bool:
        """Whether any float32 CPU product may run on packed oneDNN weights: ``gemm="onednn"``,
        or ``"auto"`` where torch runs AVX-512 kernels (on AVX2 it was level with MKL)."""
        if not torch.backends.mkldnn.is_available():
            return False
        if self.gemm == "auto":
            return torch.backends.cpu.get_cpu_capability() == "AVX512"
        return self.gemm == "onednn"

    @property
    def transposed(self) -> bool:
        """Whether MKL's products at a decoding step come transposed (W xᵀ for at most
        ``linear.SMALL_ROWS`` rows): under ``"mkl"``, and under ``"auto"`` on a CPU without
        AVX-512 (a Zen 3: 1.15x greedy end to end; the Xeon with AMX: 0.96-0.98x)."""
        if self.gemm == "auto":
            return torch.backends.cpu.get_cpu_capability() != "AVX512"
        return self.gemm == "mkl"

    def onednn_for(self, d_in: int, d_out: int) -> bool:
        """Whether a ``(d_out, d_in)`` weight is packed for oneDNN: under ``"onednn"`` wherever
        oneDNN is available; under ``"auto"`` where ``onednn`` holds and the weight has at least
        ``ONEDNN_MIN_WEIGHT`` elements."""
        if self.gemm == "auto":
            return self.onednn and d_in * d_out >= ONEDNN_MIN_WEIGHT
        return self.onednn

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
        )
