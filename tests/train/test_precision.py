"""Training precision (``train.amp``): the choice and its reasons, the trainer's probe leaving no
trace, a bfloat16 step against float32, an autocast context reused step after step, the
copy task learned under bfloat16 where the CPU runs it natively, and the CPU's bfloat16 products
on rows padded to a multiple of ``ROWS``."""

import collections
import contextlib
import time

import pytest
import torch
from tests.test_interop import randomize_norms_and_biases
from torch.utils._python_dispatch import TorchDispatchMode

from aiayn.model import ModelConfig, Transformer
from aiayn.tasks import CopyTask, copy_task_accuracy, train_copy_task
from aiayn.train import precision as precision_module
from aiayn.train.objectives import Translation
from aiayn.train.precision import MIN_GAIN, ROWS, Precision, choose_precision, native_bf16, time_passes
from aiayn.train.trainer import _probe

CPU = torch.device("cpu")


def cpu_features(monkeypatch, amx: bool, avx512_bf16: bool) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)


def no_probe() -> tuple[float, float]:
    raise AssertionError("the probe must not run here")


# The choice -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("amx", "avx512_bf16", "expected"), [(True, True, "AMX"), (False, True, "AVX512_BF16"), (False, False, None)]
)
def test_native_bf16_names_what_the_cpu_has(monkeypatch, amx, avx512_bf16, expected):
    cpu_features(monkeypatch, amx, avx512_bf16)
    assert native_bf16(CPU) == expected
    assert native_bf16(torch.device("meta")) is None  # neither a CPU nor CUDA


@pytest.mark.parametrize("probe", [no_probe, lambda: (1.0, 0.01)])  # even a probe that would say "100x faster"
def test_auto_never_picks_bf16_without_native_bf16_and_does_not_probe(monkeypatch, probe):
    cpu_features(monkeypatch, amx=False, avx512_bf16=False)
    calls = []
    chosen = choose_precision("auto", CPU, lambda: calls.append(1) or probe())
    assert chosen.name == "fp32" and not chosen.bf16
    assert "no native bfloat16" in chosen.reason
    assert calls == []


@pytest.mark.parametrize("native", [True, False])
def test_amp_false_is_fp32_and_true_is_bf16_without_probing(monkeypatch, native):
    cpu_features(monkeypatch, amx=native, avx512_bf16=False)
    off = choose_precision(False, CPU, no_probe)
    assert (off.name, off.reason) == ("fp32", "train.amp false")
    on = choose_precision(True, CPU, no_probe)
    assert on.name == "bf16" and on.bf16 and on.reason.startswith("train.amp true")
    # forced onto an emulating CPU, the reason says so (it runs ~100x slower there)
    assert ("no native bfloat16" in on.reason) == (not native)


@pytest.mark.parametrize(
    ("fp32", "bf16", "expected", "gain"),
    [(1.0, 0.5, "bf16", "2.00x"), (1.0, 0.95, "fp32", "1.05x"), (1.0, 1 / MIN_GAIN, "bf16", f"{MIN_GAIN:.2f}x")],
)
def test_auto_on_native_cpu_follows_the_probe(monkeypatch, fp32, bf16, expected, gain):
    cpu_features(monkeypatch, amx=True, avx512_bf16=True)
    calls = []
    chosen = choose_precision("auto", CPU, lambda: calls.append(1) or (fp32, bf16))
    assert calls == [1]
    assert chosen.name == expected
    # the reason names the hardware, the measured gain, both timings and the threshold
    assert chosen.reason.startswith("AMX: ")
    assert gain in chosen.reason and f"{fp32:.2f} s against {bf16:.2f} s" in chosen.reason
    assert f">= {MIN_GAIN:g}x" in chosen.reason


def test_auto_on_native_cpu_needs_a_probe(monkeypatch):
    cpu_features(monkeypatch, amx=False, avx512_bf16=True)
    with pytest.raises(ValueError, match="needs a probe"):
        choose_precision("auto", CPU)


@pytest.mark.parametrize(("supported", "expected"), [(True, "bf16"), (False, "fp32")])
def test_auto_on_cuda_follows_bf16_support_without_probing(monkeypatch, supported, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: supported)
    chosen = choose_precision("auto", torch.device("cuda"), no_probe)
    assert chosen.name == expected
    assert chosen.reason == ("CUDA with bfloat16" if supported else "this GPU has no bfloat16")


def test_autocast_runs_products_in_bf16_only_for_bf16():
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    with Precision("bf16", "test").autocast(CPU):
        assert (a @ b).dtype == torch.bfloat16
    with Precision("fp32", "test").autocast(CPU):
        assert (a @ b).dtype == torch.float32
        assert not torch.is_autocast_enabled("cpu")


def test_time_passes_warms_up_then_times_each_batch_once_in_each_precision(monkeypatch):
    """On a fake clock that each pass advances by a given time: one untimed warm-up of each on
    batch 0, then batches 1 .. count - 1, float32 and bfloat16 alternating, each batch once per
    precision, and the totals (the warm-up left out)."""
    clock = [0.0]
    monkeypatch.setattr(precision_module.time, "perf_counter", lambda: clock[0])
    durations = {False: iter([100.0, 1.0, 9.0, 2.0]), True: iter([100.0, 0.5, 0.25, 7.0])}  # warm-ups first
    calls = []

    def passes(bf16: bool, i: int) -> None:
        calls.append((bf16, i))
        clock[0] += next(durations[bf16])

    assert time_passes(passes, 4) == (12.0, 7.75)
    assert calls == [(False, 0), (True, 0)] + [(bf16, i) for i in (1, 2, 3) for bf16 in (False, True)]


# The trainer's probe ---------------------------------------------------------------------------


def tiny_translation(seed: int = 0, P_drop: float = 0.1) -> Transformer:
    """A tiny Transformer (with dropout, so that a forward pass draws random numbers) whose
    biases and LayerNorm parameters are random, not torch's 0 and 1."""
    torch.manual_seed(seed)
    model = Transformer(ModelConfig.tiny(40, P_drop=P_drop))
    randomize_norms_and_biases(model)
    return model


def examples(seed: int = 1, lengths=(7, 3, 9, 5, 8, 2)) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(6, 40, (n,), generator=g).tolist(), torch.randint(6, 40, (n + 1,), generator=g).tolist())
        for n in lengths
    ]


def test_probe_leaves_no_trace():
    """RNG state, gradients, weights and the training mode are as before; the timings are real."""
    model = tiny_translation().train()
    objective = Translation()
    batches = [objective.collate(examples(seed), model.config, 0) for seed in (1, 2)]
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    # the RNG check below can fail: a training forward pass draws dropout masks from it
    rng = torch.get_rng_state()
    objective.loss(model, batches[0], 0.1)
    assert not torch.equal(torch.get_rng_state(), rng)
    model.zero_grad(set_to_none=True)

    rng = torch.get_rng_state()
    fp32, bf16 = _probe(model, objective, batches, CPU)
    assert fp32 > 0 and bf16 > 0
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    assert model.training
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, weights[name]), name
        assert tensor.dtype == weights[name].dtype, name


def test_probe_runs_both_precisions_on_the_batches_given(monkeypatch):
    """Its passes are the training step's forward and backward, in float32 and under autocast."""
    model = tiny_translation(P_drop=0.0)
    objective = Translation()
    batches = [objective.collate(examples(), model.config, 0) for _ in range(3)]  # three distinct tensors
    seen = []
    loss = objective.loss

    def recording(m, batch, eps_ls, amp=None):
        out = loss(m, batch, eps_ls, amp)
        with amp:
            seen.append((torch.is_autocast_enabled("cpu"), batch.src.data_ptr(), torch.is_grad_enabled()))
        return out

    monkeypatch.setattr(objective, "loss", recording)
    _probe(model, objective, batches, CPU)
    assert [s[0] for s in seen] == [False, True] * 3  # a warm-up and each of the other batches once, both
    assert [s[1] for s in seen] == [b.src.data_ptr() for b in batches for _ in range(2)] and all(s[2] for s in seen)


# bfloat16 against float32 ----------------------------------------------------------------------


def step_gradients(model: Transformer, batch, bf16: bool) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of one training step (the trainer's: ``Translation.loss`` then backward),
    the same dropout masks in both runs (seeded)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    loss, _ = Translation().loss(model, batch, 0.1, Precision("bf16" if bf16 else "fp32", "test").autocast(CPU))
    loss.backward()
    grads = {name: p.grad.double().clone() for name, p in model.named_parameters()}
    # parameters and their gradients stay float32 (autocast casts copies)
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    return loss.item(), grads


def test_one_bf16_step_is_within_bf16_error_of_float32():
    """One training step (dropout 0.1, random biases and norms) under bfloat16 autocast against
    float32. bfloat16 keeps 8 significant bits (relative rounding 2^-9 = 0.2%); through 2 + 2
    layers forward and back it builds up to, measured with this seed (AMX): loss 4e-4 relative,
    all gradients together 3.7%, the worst single tensor 10.4% (an encoder layer's, deepest in
    the backward pass), each tensor's gradient direction within cosine 0.9947 (without dropout,
    seeds 0-4: 1-4%, 3-12%, >= 0.993). The bounds leave room for another CPU's rounding. With
    F.dropout's mask in bfloat16 instead of the 16-bit one (the float32 path's) it was 67%,
    103% and cosine 0.45; a lost bias or affine would be off by as much."""
    model = tiny_translation().train()
    batch = Translation().collate(examples(), model.config, 0)
    fp32_loss, fp32 = step_gradients(model, batch, bf16=False)
    again_loss, again = step_gradients(model, batch, bf16=False)
    assert again_loss == fp32_loss and all(torch.equal(again[n], fp32[n]) for n in fp32)  # masks repeat
    bf16_loss, bf16 = step_gradients(model, batch, bf16=True)

    every = torch.cat([g.flatten() for g in bf16.values()])
    truth = torch.cat([g.flatten() for g in fp32.values()])
    overall = ((every - truth).norm() / truth.norm()).item()
    worst = max(((bf16[n] - fp32[n]).norm() / fp32[n].norm()).item() for n in fp32)
    cosine = min(torch.nn.functional.cosine_similarity(bf16[n].flatten(), fp32[n].flatten(), 0).item() for n in fp32)
    loss_error = abs(bf16_loss - fp32_loss) / fp32_loss
    print(f"bf16 step: loss {loss_error:.1e}, gradients {overall:.2%}, worst {worst:.2%}, min cosine {cosine:.4f}")
    assert loss_error < 3e-3
    assert 1e-4 < overall < 0.08  # above zero: the step did run in bfloat16
    assert worst < 0.2
    assert cosine > 0.98


def test_reused_autocast_context_sees_each_steps_weights():
    """The trainer enters one autocast object around each forward pass. Autocast keeps its
    bfloat16 copies of the weights until it is left: a context held around the whole loop would
    run every later step on the first step's weights. Two Adam steps, then the loss under the
    reused context equals the loss under a fresh one, and differs from the first step's."""
    model = tiny_translation(P_drop=0.0).train()
    objective = Translation()
    batch = objective.collate(examples(), model.config, 0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    amp = Precision("bf16", "test").autocast(CPU)
    losses = []
    for _ in range(3):
        loss, _ = objective.loss(model, batch, 0.1, amp)
        losses.append(loss.item())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    fresh, _ = objective.loss(model, batch, 0.1, Precision("bf16", "test").autocast(CPU))
    reused, _ = objective.loss(model, batch, 0.1, amp)
    assert reused.item() == fresh.item()
    assert losses[2] < losses[1] < losses[0]


@pytest.mark.skipif(
    native_bf16(CPU) is None, reason="this CPU has no native bfloat16 (AMX or AVX512_BF16): bf16 is emulated there"
)
def test_bf16_trains_the_copy_task_to_full_exact_match():
    """The float32 copy task test's seed (test_tasks.py) with 1,000 steps instead of 700, the
    forward pass in the trainer's bfloat16 context (``Precision.autocast``: autocast with its own
    kernel for every linear layer; at these shapes no row needs padding) and the loss reading
    bfloat16 logits, as the trainer's: 100% exact match (greedy decoding of the float32 weights).
    Under plain autocast, at 700 steps a Zen 4 (AVX512_BF16, no AMX) reached 99.80% (one of 512
    wrong), the Xeon with AMX 100%; 1,000 steps reached 100% on the Zen 4 (about 36 s there), as
    they do in this context."""
    task = CopyTask(steps=1000)
    products: collections.Counter[torch.dtype] = collections.Counter()  # each linear layer's output dtype

    def record(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        if isinstance(module, torch.nn.Linear):
            products[output.dtype] += 1

    hook = torch.nn.modules.module.register_module_forward_hook(record)
    try:
        start = time.perf_counter()
        model, losses = train_copy_task(task, amp=True)
        seconds = time.perf_counter() - start
    finally:
        hook.remove()
    # the training ran its products in bfloat16: with ``amp`` ignored this test would fail here
    assert set(products) == {torch.bfloat16} and products[torch.bfloat16] >= task.steps
    accuracy = copy_task_accuracy(model, task, n=512)
    print(f"bf16 copy task: {task.steps} steps in {seconds:.1f} s, exact match {accuracy:.2%}")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert losses[-1] < losses[0] / 4
    assert accuracy == 1.0


def test_cuda_bf16_leaves_out_cudnn_attention_and_is_reusable():
    """On CUDA the bf16 context autocasts and keeps SDPA off cuDNN's kernel (a plan per new shape:
    precision.py), restoring torch's choice on exit, at every step it is entered."""
    import warnings

    context = Precision("bf16", "test").autocast(torch.device("cuda"))
    before = torch.backends.cuda.cudnn_sdp_enabled()
    for _ in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a CPU-only torch warns that CUDA autocast is off
            with context:
                assert not torch.backends.cuda.cudnn_sdp_enabled()
                assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
                if torch.cuda.is_available():
                    assert torch.is_autocast_enabled("cuda")
        assert torch.backends.cuda.cudnn_sdp_enabled() == before
    assert isinstance(Precision("fp32", "test").autocast(torch.device("cuda")), contextlib.nullcontext)


# bfloat16 products on padded rows (CPU) ---------------------------------------------------------


class BF16ProductRows(TorchDispatchMode):
    """The row counts of the bfloat16 matrix products (``aten.mm``, and ``aten.addmm``'s first
    matrix) that run while it is entered: below autocast, so what oneDNN is asked to multiply."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            a = args[1] if func is torch.ops.aten.addmm.default else args[0]
            if a.dtype == torch.bfloat16:
                self.rows.append(a.shape[0])
        return func(*args, **(kwargs or {}))


def forward_product_rows(model: Transformer, batch, context=None) -> list[int]:
    """The bf16 products' row counts of a forward pass (the loss) under ``context`` (default: a
    fresh ``Precision("bf16").autocast``)."""
    with BF16ProductRows() as seen:
        Translation().loss(model, batch, 0.1, Precision("bf16", "test").autocast(CPU) if context is None else context)
    return seen.rows


def test_cpu_bf16_pads_every_linear_products_rows_to_a_multiple_of_ROWS(monkeypatch):
    """Six pairs in a batch of 10 source and 11 target positions: under plain autocast the
    encoder's products have 60 rows, the decoder's 66 and the output projection's 46 (the
    target's tokens, pads left out); under the CPU's bf16 context each product of the forward
    pass has its rows rounded up to a multiple of ``ROWS``. ``AIAYN_BF16_ROWS=0`` turns it off."""
    model = tiny_translation().train()
    batch = Translation().collate(examples(), model.config, 0)
    padded = forward_product_rows(model, batch)
    monkeypatch.setenv("AIAYN_BF16_ROWS", "0")
    assert isinstance(Precision("bf16", "test").autocast(CPU), torch.autocast)
    plain = forward_product_rows(model, batch)
    assert sorted(set(plain)) == [46, 6 * 10, 6 * 11]
    assert len(padded) == len(plain) > 10
    assert ROWS == 64 and padded == [{46: 64, 60: 64, 66: 128}[m] for m in plain]


def test_cpu_bf16_padding_changes_no_loss_or_gradient(monkeypatch):
    """The padded rows are sliced off before anything reads them: one training step (random
    weights, biases and norms, dropout with the same masks) gives plain autocast's loss and
    gradients, and only float32 parameters and gradients."""
    model = tiny_translation().train()
    batch = Translation().collate(examples(), model.config, 0)
    padded_loss, padded = step_gradients(model, batch, bf16=True)
    monkeypatch.setenv("AIAYN_BF16_ROWS", "0")
    plain_loss, plain = step_gradients(model, batch, bf16=True)
    _, fp32 = step_gradients(model, batch, bf16=False)
    worst = max(((padded[n] - plain[n]).norm() / plain[n].norm()).item() for n in plain)
    print(f"padded against plain autocast: loss {padded_loss} / {plain_loss}, worst gradient {worst:.1e}")
    assert padded_loss == pytest.approx(plain_loss, rel=1e-5)  # equal on a Zen 4; room for a kernel's rounding
    assert worst < 1e-3  # the padding in front of the rows instead read 1.33; bf16 against fp32 ~4e-2
    assert any(not torch.equal(plain[n], fp32[n]) for n in plain)  # the step ran in bfloat16


def test_cpu_bf16_context_is_reusable_and_leaves_autocast_as_it_was():
    """Entered at every step, and gone on leaving: plain autocast afterwards multiplies the rows
    as they are."""
    model = tiny_translation().train()
    batch = Translation().collate(examples(), model.config, 0)
    context = Precision("bf16", "test").autocast(CPU)
    for _ in range(2):
        assert sorted(set(forward_product_rows(model, batch, context))) == [64, 128]
    assert sorted(set(forward_product_rows(model, batch, torch.autocast("cpu", dtype=torch.bfloat16)))) == [46, 60, 66]
    assert not torch.is_autocast_enabled("cpu")


def test_cpu_bf16_context_cleans_up_after_an_error_and_refuses_to_nest():
    """An error in the step leaves neither autocast nor the padding behind; a second context
    entered inside the first (the kernel is the process's) is refused, and the first stays whole."""
    model = tiny_translation().train()
    batch = Translation().collate(examples(), model.config, 0)
    context = Precision("bf16", "test").autocast(CPU)
    with pytest.raises(ValueError, match="in the step"), context:
        raise ValueError("in the step")
    assert not torch.is_autocast_enabled("cpu")
    assert sorted(set(forward_product_rows(model, batch, torch.autocast("cpu", dtype=torch.bfloat16)))) == [46, 60, 66]
    with context:
        with pytest.raises(RuntimeError, match="already entered"), Precision("bf16", "test").autocast(CPU):
            pass
        assert sorted(set(forward_product_rows(model, batch, contextlib.nullcontext()))) == [64, 128]
    assert not torch.is_autocast_enabled("cpu")
