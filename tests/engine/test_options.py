"""The engine's choices: one frozen object, mapped from the environment by the CLI only."""

import dataclasses
import warnings

import pytest
import torch

from aiayn.engine import EngineOptions


def test_defaults_and_frozen():
    options = EngineOptions()
    assert (options.kernels, options.gemm, options.refill) == (True, "auto", True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.kernels = False
    with pytest.raises(ValueError, match="gemm must be one of auto, onednn, mkl, got 'fast'"):
        EngineOptions(gemm="fast")


def test_from_environ():
    assert EngineOptions.from_environ({}) == EngineOptions()
    env = {"AIAYN_CPU_KERNELS": "0", "AIAYN_CPU_GEMM": " MKL ", "AIAYN_REFILL": "0"}
    assert EngineOptions.from_environ(env) == EngineOptions(kernels=False, gemm="mkl", refill=False)
    with pytest.warns(UserWarning, match="AIAYN_CPU_GEMM='fast' is not one of auto, onednn, mkl: using auto"):
        assert EngineOptions.from_environ({"AIAYN_CPU_GEMM": "fast"}).gemm == "auto"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        EngineOptions.from_environ({"AIAYN_CPU_GEMM": "onednn"})


def test_the_choice_of_product(monkeypatch):
    """``auto``: oneDNN where torch runs AVX-512 kernels (and has oneDNN); ``mkl`` never."""
    for capability, expected in (("AVX512", torch.backends.mkldnn.is_available()), ("AVX2", False), ("DEFAULT", False)):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        assert EngineOptions().onednn is expected
        assert EngineOptions(gemm="mkl").onednn is False
        assert EngineOptions(gemm="onednn").onednn is torch.backends.mkldnn.is_available()
