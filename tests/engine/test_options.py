"""The engine's choices: one frozen object, mapped from the environment by the CLI only."""

import dataclasses
import warnings

import pytest
import torch

from aiayn.engine import EngineOptions


def test_defaults_and_frozen():
    options = EngineOptions()
    assert (options.kernels, options.gemm) == (True, "auto")
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.kernels = False
    with pytest.raises(ValueError, match="gemm must be one of auto, onednn, mkl, got 'fast'"):
        EngineOptions(gemm="fast")


def test_from_environ():
    assert EngineOptions.from_environ({}) == EngineOptions()
    env = {"AIAYN_CPU_KERNELS": "0", "AIAYN_CPU_GEMM": " MKL "}
    assert EngineOptions.from_environ(env) == EngineOptions(kernels=False, gemm="mkl")
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


def test_auto_packs_only_large_weights(monkeypatch):
    """``auto`` packs for oneDNN from ``ONEDNN_MIN_WEIGHT`` elements up, on AVX-512 only;
    ``onednn`` packs every weight, ``mkl`` none."""
    from aiayn.engine.options import ONEDNN_MIN_WEIGHT

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    onednn = torch.backends.mkldnn.is_available()
    auto = EngineOptions()
    assert ONEDNN_MIN_WEIGHT == 512 * 512  # measured: docs/benchmarks.md
    assert auto.onednn_for(512, 512) is onednn
    assert auto.onednn_for(511, 512) is False
    assert auto.onednn_for(128, 8000) is onednn
    assert auto.onednn_for(128, 512) is False
    assert EngineOptions(gemm="onednn").onednn_for(128, 128) is onednn
    assert EngineOptions(gemm="mkl").onednn_for(512, 8000) is False
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert auto.onednn_for(512, 8000) is False


def test_prepare_packs_by_shape(monkeypatch):
    """A prepared model's layers follow ``onednn_for``: the 16x40 output projection of a tiny
    model is packed only when oneDNN is asked for; its products stay MKL's under ``auto``."""
    from aiayn import ModelConfig, Transformer, engine

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    model = Transformer(ModelConfig(vocab_size=40, d_model=16, d_ff=32, h=2, N=1))
    auto = engine.prepare(model)
    assert auto.engine_projection.packed is None
    assert all(m.packed is None and not m.transpose_steps for m in auto.modules() if type(m).__name__ == "PackedLinear")
    forced = engine.prepare(model, options=EngineOptions(gemm="onednn"))
    layers = [m for m in forced.modules() if type(m).__name__ == "PackedLinear"]
    assert layers and all((m.packed is not None) is torch.backends.mkldnn.is_available() for m in layers)


def test_transposed_products_on_cpus_without_avx512_or_under_mkl(monkeypatch):
    """MKL's transposed decoding products: ``auto`` takes them without AVX-512 (where they were
    measured faster), ``mkl`` always, ``onednn`` never."""
    for capability, expected in (("AVX512", False), ("AVX2", True), ("DEFAULT", True)):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        assert EngineOptions().transposed is expected
        assert EngineOptions(gemm="mkl").transposed is True
        assert EngineOptions(gemm="onednn").transposed is False
