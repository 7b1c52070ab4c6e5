"""The CPU kernels (engine/kernels.py): decoding attention against the formula written out by
hand and against torch's fused kernel, and end to end: decoding gives the same tokens with it
and without it; the training loss against its float64 formula and torch's operations. Where no
C++ compiler is installed the kernels cannot be built and these tests skip (as with
AIAYN_CPU_KERNELS=0, which the CLI maps to ``EngineOptions(kernels=False)``); where one is (CI),
a failed build fails them."""

import inspect
import math
import os
import shutil
import time
import warnings
from pathlib import Path

import pytest
import torch

from aiayn import ModelConfig, Transformer, engine
from aiayn.decode import beam_search, greedy_decode
from aiayn.engine import EngineOptions
from aiayn.engine import kernels as cpu_kernels
from aiayn.engine.step import Decoding
from aiayn.model.attention import scaled_dot_product_attention
from helpers import randomize_

pytestmark = [
    pytest.mark.skipif(
        shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler to build the kernel"
    ),
]


def by_hand(q, k, v, mask):
    """softmax(Q Kᵀ / √d_k) V in float64, query by query; masked keys are left out of the softmax
    and a query with no key left gives zeros."""
    B, H, T, _ = q.shape
    S = k.size(2)
    mask = torch.ones(B, 1, T, S, dtype=torch.bool) if mask is None else mask.expand(B, 1, T, S)
    out = torch.zeros(B, H, T, v.size(-1), dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                allowed = mask[b, 0, t].nonzero().flatten()
                if allowed.numel() == 0:
                    continue
                scores = k[b, h, allowed].double() @ q[b, h, t].double() / math.sqrt(q.size(-1))
                weights = torch.softmax(scores, dim=0)
                out[b, h, t] = weights @ v[b, h, allowed].double()
    return out


def layouts(B, H, T, S, D_k, D_v, seed, layout="heads"):
    """q strided as a decoding step's projection leaves it (feature-major rows); k and v as views
    of reserved cache buffers ``(B, H, capacity, D)``, as the engine's cache keeps them
    (``layout="heads"``), or of position-major ones ``(B, capacity, H, D)`` (``"positions"``: any
    strides with the last one 1 serve)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(H * D_k, B * T, generator=g).t().reshape(B, T, H, D_k).transpose(1, 2)  # (B, H, T, D_k)
    capacity = S + 3
    if layout == "heads":
        k = torch.randn(B, H, capacity, D_k, generator=g)[:, :, :S]  # (B, H, S, D_k)
        v = torch.randn(B, H, capacity, D_v, generator=g)[:, :, :S]  # (B, H, S, D_v)
    else:
        k = torch.randn(B, capacity, H, D_k, generator=g)[:, :S].transpose(1, 2)  # (B, H, S, D_k)
        v = torch.randn(B, capacity, H, D_v, generator=g)[:, :S].transpose(1, 2)  # (B, H, S, D_v)
    return q, k, v


def masks(B, T, S, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, S + 1, (B,), generator=g)
    padding = (torch.arange(S) < lengths[:, None]).view(B, 1, 1, S)
    padding[-1] = False  # a row with nothing to attend to: zeros
    causal = torch.ones(T, S, dtype=torch.bool).tril(S - T).view(1, 1, T, S)
    both = padding & causal  # (B, 1, T, S)
    strided = torch.rand(B, 1, S, T, generator=g).transpose(2, 3) > 0.3  # non-contiguous (B, 1, T, S)
    return {"none": None, "padding": padding, "causal": causal, "padding & causal": both, "strided": strided}


SHAPES = [  # B, H, T, S, D_k, D_v
    (3, 8, 1, 17, 64, 64),  # a greedy step at the base head size
    (2, 4, 4, 9, 16, 8),  # 4 beams folded into one row's queries (EngineCache.expand)
    (2, 3, 5, 1, 7, 5),  # head sizes that are no multiple of 8, one key
    (1, 2, cpu_kernels.MAX_QUERIES, cpu_kernels.MAX_SCORES // cpu_kernels.MAX_QUERIES, 12, 20),
    (5, 2, 1, 300, 8, 8),  # one query: any number of keys
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mask_name", ["none", "padding", "causal", "padding & causal", "strided"])
@pytest.mark.parametrize("layout", ["heads", "positions"])
def test_kernel_equals_the_formula(shape, mask_name, layout):
    B, H, T, S, D_k, D_v = shape
    q, k, v = layouts(B, H, T, S, D_k, D_v, seed=sum(shape), layout=layout)
    mask = masks(B, T, S, seed=len(mask_name))[mask_name]
    assert cpu_kernels.eligible(q, k, v, mask)
    out = cpu_kernels.decode_attention(q, k, v, mask)
    assert out.shape == (B, H, T, D_v)
    assert out.transpose(1, 2).is_contiguous()  # (B, T, H, D_v): merging the heads copies nothing
    torch.testing.assert_close(out.double(), by_hand(q, k, v, mask), atol=2e-6, rtol=1e-5)
    if mask_name == "padding":
        assert torch.all(out[-1] == 0)


def test_the_kernel_matches_torchs_fused_attention():
    q, k, v = layouts(4, 8, 1, 21, 64, 64, seed=0)
    mask = masks(4, 1, 21, seed=0)["padding"]
    ours = cpu_kernels.decode_attention(q, k, v, mask)
    torchs, _ = scaled_dot_product_attention(q.contiguous(), k.contiguous(), v.contiguous(), mask)
    torch.testing.assert_close(ours, torchs, atol=2e-6, rtol=1e-5)


def test_what_the_kernel_leaves_to_torch():
    q, k, v = layouts(2, 4, 1, 6, 8, 8, seed=1)
    assert cpu_kernels.eligible(q, k, v, None)
    long_q = torch.randn(2, 4, cpu_kernels.MAX_QUERIES + 1, 8)
    per_head_mask = torch.ones(2, 4, 1, 6, dtype=torch.bool)
    cases = {
        "float64": (q.double(), k.double(), v.double(), None),
        "more queries than MAX_QUERIES": (long_q, k, v, None),
        "more scores than MAX_SCORES": (long_q[:, :, :4], *(torch.randn(2, 4, 33, 8) for _ in "kv"), None),
        "keys broadcast over rows": (q, k[:1], v[:1], None),
        "strided head vectors": (q, k.transpose(-1, -2).contiguous().transpose(-1, -2), v, None),
        "a mask per head": (q, k, v, per_head_mask),
        "a float mask": (q, k, v, per_head_mask[:, :1].float()),
    }
    for name, args in cases.items():
        assert not cpu_kernels.eligible(*args), name
    with torch.enable_grad():  # training: autograd needs torch's kernels
        assert not cpu_kernels.eligible(q.requires_grad_(), k, v, None)


def test_rows_split_over_threads_and_nan_scores_stay_nan():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # at::parallel_for gives each thread its own rows
    try:
        q, k, v = layouts(7, 3, 2, 11, 16, 16, seed=3)
        mask = masks(7, 2, 11, seed=3)["padding & causal"]
        torch.testing.assert_close(
            cpu_kernels.decode_attention(q, k, v, mask).double(), by_hand(q, k, v, mask), atol=2e-6, rtol=1e-5
        )
    finally:
        torch.set_num_threads(threads)
    q[1, 0, 0, 0] = float("nan")  # one query's scores: NaN, as in the formula; the others unharmed
    out = cpu_kernels.decode_attention(q, k, v)
    assert torch.isnan(out[1, 0, 0]).all()
    assert not torch.isnan(out[1, 1:]).any() and not torch.isnan(out[0]).any()


def test_the_build_is_tried_once_across_threads_and_again_after_an_interrupt(monkeypatch):
    import threading
    import time

    from torch.utils import cpp_extension

    real, calls = cpp_extension.load, []

    def slow(*args, **kwargs):
        calls.append(1)
        time.sleep(0.3)
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setattr(cpp_extension, "load", slow)
    results = []
    workers = [threading.Thread(target=lambda: results.append(cpu_kernels.available())) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert results == [True] * 3 and calls == [1]

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setattr(cpp_extension, "load", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cpu_kernels.available()
    monkeypatch.setattr(cpp_extension, "load", real)
    assert cpu_kernels.available()  # not recorded as failed: built (loaded) on the next call


def test_a_failed_build_warns_once_and_falls_back(monkeypatch):
    from torch.utils import cpp_extension

    def fail(*args, **kwargs):
        raise RuntimeError("Error building extension 'aiayn_cpu_kernels': c++: not found")

    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setattr(cpp_extension, "load", fail)
    with pytest.warns(RuntimeWarning, match="could not be built .*c\\+\\+: not found.*torch's kernels"):
        assert not cpu_kernels.available()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not cpu_kernels.available()  # tried once: no second build, no second warning


@pytest.fixture(scope="module")
def model_and_sources():
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=40, d_model=32, d_ff=64, h=4, N=2, P_drop=0.0, max_len=64, pad_id=0, bos_id=1, eos_id=2
    )
    model = randomize_(Transformer(config).eval(), 0)  # every parameter random: default init would hide a dropped bias
    g = torch.Generator().manual_seed(1)
    src = torch.randint(3, 40, (5, 9), generator=g)
    src[1, 6:] = 0  # padded sources: the encoder-decoder mask matters
    src[3, 4:] = 0
    return model, src


@pytest.mark.parametrize("search", ["greedy", "beam 1", "beam 4", "int8 beam 3"])
def test_decoding_with_the_kernel_equals_decoding_without_it(model_and_sources, search, monkeypatch):
    model, src = model_and_sources
    quantize = "int8" if search.startswith("int8") else None
    beam = int(search.split()[-1]) if "beam" in search else 0

    def run(options):
        model_ = engine.prepare(model, quantize=quantize, options=options)
        with torch.no_grad():
            if beam:
                return beam_search(model_, src, beam=beam, max_len=20, nbest=beam)
            return greedy_decode(model_, src, max_len=20)

    calls = []
    real = cpu_kernels.decode_attention
    monkeypatch.setattr(cpu_kernels, "decode_attention", lambda *a: calls.append(1) or real(*a))
    ours = run(EngineOptions())
    assert calls, "the kernel did not run"
    n = len(calls)
    torchs = run(EngineOptions(kernels=False))
    assert len(calls) == n  # off: torch's kernels ran
    if beam:
        for a, b in zip(ours, torchs, strict=True):
            assert [h.tokens for h in a] == [h.tokens for h in b]
            assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-5)
    else:
        assert torch.equal(ours, torchs)


def test_a_cached_build_is_recognized_so_that_only_a_real_build_is_announced(monkeypatch, caplog, tmp_path):
    from torch.utils import cpp_extension

    assert cpu_kernels.available()
    name = cpu_kernels.build_name()
    assert cpu_kernels._built(cpp_extension, name)
    with monkeypatch.context() as m:  # torch creates the directory it looks in: not in the user's cache
        m.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
        assert not cpu_kernels._built(cpp_extension, name)
        m.setattr(torch, "__version__", "0.0.1")  # another torch: another build, announced
        assert not cpu_kernels._built(cpp_extension, cpu_kernels.build_name())
    monkeypatch.setattr(cpu_kernels, "_state", {})
    with caplog.at_level("INFO", logger="aiayn"):
        assert cpu_kernels.available()  # loads the cached build again
    assert "building" not in caplog.text


def test_each_checkout_and_torch_installation_builds_in_a_directory_of_its_own(monkeypatch, tmp_path):
    """torch's extension cache is shared by all of a user's checkouts and venvs, and ninja's build
    file names the source file and torch's headers by path: under one build name a clone and a
    copy of it (or two venvs) rebuilt each other's kernels, silently, each time the other ran."""
    name = cpu_kernels.build_name()
    assert name == cpu_kernels.build_name()  # stable: a second process finds the same build
    assert name.startswith(f"aiayn_cpu_kernels_{torch.backends.cpu.get_cpu_capability().lower()}_")
    copy = tmp_path / "clone" / "csrc" / cpu_kernels.SOURCE.name  # the same source in another checkout
    copy.parent.mkdir(parents=True)
    copy.write_bytes(cpu_kernels.SOURCE.read_bytes())
    monkeypatch.setattr(cpu_kernels, "SOURCE", copy)
    other_checkout = cpu_kernels.build_name()
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "venv" / "torch" / "__init__.py"))  # torch elsewhere
    other_venv = cpu_kernels.build_name()
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    other_torch = cpu_kernels.build_name()
    assert len({name, other_checkout, other_venv, other_torch}) == 4


def _fake_build(directory: Path, source: Path, days_unused: float = 31) -> Path:
    """A build directory with the ninja file torch's builder writes for ``source`` (by torch's own
    writer where it has the one we know), last loaded ``days_unused`` days ago."""
    from torch.utils import cpp_extension

    directory.mkdir(parents=True)
    ninja_file = directory / "build.ninja"
    writer = getattr(cpp_extension, "_write_ninja_file_to_build_library", None)
    if writer is not None:
        known = dict(
            path=str(ninja_file), name=directory.name, sources=[str(source)], extra_cflags=[], extra_cuda_cflags=[],
            extra_sycl_cflags=[], extra_ldflags=[], extra_include_paths=[], with_cuda=False, with_sycl=False,
            is_standalone=False,
        )  # fmt: skip
        parameters = inspect.signature(writer).parameters
        writer(**{k: v for k, v in known.items() if k in parameters})
    else:  # its format as of torch 2.13: a space escaped as "$ "
        escaped = str(source).replace(" ", "$ ")
        ninja_file.write_text(
            f"build cpu_kernels.o: compile {escaped}\n\nbuild {directory.name}.so: link cpu_kernels.o\n"
        )
    (directory / f"{directory.name}.so").write_bytes(b"\0" * 64)
    last_load = time.time() - days_unused * 86400
    os.utime(directory, (last_load, last_load))
    return directory


def test_the_build_runs_the_pip_packages_ninja_whatever_ninja_comes_first_on_path(monkeypatch, tmp_path):
    """A system ninja first on PATH (outside the venv) and the pip package's (inside it) hash the
    build's commands differently: each took the other's build for stale. The build always runs the
    package's, and the PATH is as it was afterwards."""
    pytest.importorskip("ninja")
    ran = tmp_path / "ran"
    other = tmp_path / "ninja"
    other.write_text(f"#!/bin/sh\ntouch {ran}\nexit 1\n")
    other.chmod(0o755)
    path = os.pathsep.join([str(tmp_path), os.environ.get("PATH", "")])
    monkeypatch.setenv("PATH", path)
    monkeypatch.setattr(cpu_kernels, "_state", {})
    assert cpu_kernels.available()  # the cached build, checked and loaded by the package's ninja
    assert not ran.exists()
    assert os.environ["PATH"] == path


def test_without_a_binary_of_the_packages_own_the_build_keeps_the_path(monkeypatch, tmp_path):
    """The package sets BIN_DIR to "" when it has no ninja binary: then the PATH stays as it is
    (an empty entry would put the working directory on it)."""
    ninja = pytest.importorskip("ninja")
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # the fake build below: not in the user's cache
    seen = []
    monkeypatch.setattr(ninja, "BIN_DIR", "")
    monkeypatch.setattr(cpp_extension, "load", lambda *args, **kwargs: seen.append(os.environ["PATH"]))
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setenv("PATH", "/usr/bin")
    assert cpu_kernels.available()
    assert seen == ["/usr/bin"]


def test_the_first_layers_decision_serves_every_layer(monkeypatch):
    """The step decides once (first layer) whether the kernel serves self- and cross-attention."""
    calls = []
    real = cpu_kernels.eligible
    monkeypatch.setattr(cpu_kernels, "eligible", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(0)
    model = engine.prepare(Transformer(ModelConfig.tiny(40, N=3)).eval())
    state = Decoding(model, torch.randint(3, 40, (2, 5)), beam=1, steps=3)
    for _ in range(3):
        state(torch.full((2,), model.config.bos_id))
    assert calls == [1, 1]


def smoothed_by_hand(logits, target, eps):
    """Per row the label-smoothed loss, the NLL and the gradient p - q, in float64 (§5.4):
    q = (1 - eps) onehot(y) + eps / V."""
    z = logits.double()
    log_p = torch.log_softmax(z, dim=-1)
    V = z.size(-1)
    q = torch.full_like(z, eps / V)
    q[torch.arange(z.size(0)), target] += 1 - eps
    return -(q * log_p).sum(-1), -log_p[torch.arange(z.size(0)), target], log_p.exp() - q


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_loss_kernel_equals_the_formula(dtype, eps):
    g = torch.Generator().manual_seed(int(eps * 10) + (dtype == torch.bfloat16))
    N, V = 53, 1_003  # rows over several threads' chunks; a vocabulary no multiple of 8
    logits = (torch.randn(N, V, generator=g) * torch.rand(N, 1, generator=g) * 12).to(dtype)
    logits[0, 5] = 40.0  # a confident row
    target = torch.randint(0, V, (N,), generator=g)
    target[:2] = torch.tensor([0, V - 1])
    assert cpu_kernels.loss_eligible(logits)
    loss, nll, grad = cpu_kernels.label_smoothed_ce(logits, target, eps, True)
    want_loss, want_nll, want_grad = smoothed_by_hand(logits, target, eps)  # of the logits as given
    assert loss.dtype == nll.dtype == torch.float32 and grad.dtype == dtype and grad.shape == (N, V)
    torch.testing.assert_close(loss.double(), want_loss, rtol=2e-6, atol=2e-5)
    torch.testing.assert_close(nll.double(), want_nll, rtol=2e-6, atol=2e-5)
    # the gradient is computed in float32 (a few float32 ulps) and rounded once to the logits'
    # dtype: within one bfloat16 step of the exact value rounded
    tolerance = dict(rtol=2e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-9)
    torch.testing.assert_close(grad.double(), want_grad.to(dtype).double(), **tolerance)
    no_grad = cpu_kernels.label_smoothed_ce(logits, target, eps, False)
    assert no_grad[2].numel() == 0
    torch.testing.assert_close(no_grad[0], loss, rtol=0, atol=0)


def test_loss_kernel_keeps_nan_and_checks_the_targets():
    logits = torch.randn(4, 10)
    logits[2, 3] = float("nan")
    for eps in (0.0, 0.1):
        loss, nll, grad = cpu_kernels.label_smoothed_ce(logits, torch.tensor([1, 2, 3, 4]), eps, True)
        assert torch.isnan(loss[2]) and torch.isnan(nll[2]) and torch.isnan(grad[2]).all()  # a diverged model shows
        assert torch.isfinite(loss[[0, 1, 3]]).all() and torch.isfinite(grad[[0, 1, 3]]).all()
    for bad in (10, -1):
        with pytest.raises(RuntimeError, match=f"target {bad} at row 1 is out of bounds for 10 classes"):
            cpu_kernels.label_smoothed_ce(logits, torch.tensor([0, bad, 0, 0]), 0.1, True)
    with pytest.raises(RuntimeError, match="target must be int64"):
        cpu_kernels.label_smoothed_ce(logits, torch.tensor([0, 1, 0, 0], dtype=torch.int32), 0.1, True)


def test_what_the_loss_kernel_leaves_to_torch(monkeypatch):
    logits = torch.randn(3, 5)
    assert cpu_kernels.loss_eligible(logits) and cpu_kernels.loss_eligible(logits.bfloat16())
    assert not cpu_kernels.loss_eligible(logits.double())
    assert not cpu_kernels.loss_eligible(logits.half())
    assert not cpu_kernels.loss_eligible(torch.empty(3, 5, device="meta"))
    monkeypatch.setenv("AIAYN_CPU_KERNELS", "0")
    assert not cpu_kernels.loss_eligible(logits)
    # turned off, the trainer's early build (loss_kernel_on) builds nothing either
    monkeypatch.setattr(cpu_kernels, "available", lambda: pytest.fail("built with AIAYN_CPU_KERNELS=0"))
    assert not cpu_kernels.loss_kernel_on()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_training_loss_is_the_same_with_and_without_the_kernel(dtype, monkeypatch):
    """label_smoothed_loss through the kernel and through torch's operations: the loss, the NLL
    and the gradient the backward pass hands on (scaled by the incoming gradient)."""
    from aiayn.train.loss import label_smoothed_loss

    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(70, 301, generator=g) * 4).to(dtype)
    target = torch.randint(0, 301, (70,), generator=g)
    results, calls = {}, []
    kernel = cpu_kernels.label_smoothed_ce
    monkeypatch.setattr(cpu_kernels, "label_smoothed_ce", lambda *args: calls.append(args[3]) or kernel(*args))
    for switch in ("1", "0"):
        monkeypatch.setenv("AIAYN_CPU_KERNELS", switch)
        leaf = logits.clone().requires_grad_()
        loss, nll = label_smoothed_loss(leaf * 1.0, target, 0.1)  # a non-leaf input, as in a model
        (loss / 7).backward()
        with torch.no_grad():
            eval_loss, _ = label_smoothed_loss(logits, target, 0.1)
        results[switch] = loss, nll, leaf.grad, eval_loss
    assert calls == [True, False]  # the kernel ran with the switch on: training, then evaluation
    (loss_k, nll_k, grad_k, eval_k), (loss_t, nll_t, grad_t, eval_t) = results["1"], results["0"]
    assert grad_k.dtype == grad_t.dtype == dtype
    torch.testing.assert_close(loss_k, loss_t, rtol=1e-6, atol=0)
    torch.testing.assert_close(nll_k, nll_t, rtol=1e-6, atol=0)
    torch.testing.assert_close(eval_k, loss_k, rtol=0, atol=0)  # evaluation (no gradient): the same loss
    torch.testing.assert_close(eval_t, loss_t, rtol=0, atol=0)
    # bfloat16: the kernel rounds p - q, then its product with 1/7 (torch's path rounds once)
    tolerance = dict(rtol=2e-6, atol=1e-8) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-9)
    torch.testing.assert_close(grad_k, grad_t, **tolerance)
