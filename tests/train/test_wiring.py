"""The trainer's wiring, each part against an independent truth: the learning rate it logs is
eq. 3, Adam takes the configured betas and eps, the loss the configured eps_ls, dropout sits where
§5.4 puts it, train.max_time stops the run, damaged or pickled checkpoints are refused or passed
over, a resume with nothing to resume starts afresh, and a mistyped override says what is known.
Tiny seeded models, a few steps each, the corpus of test_trainer.py."""

import dataclasses
import json
import math
import os
import pickle
import re
import time
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import tests.train.test_checkpoint as checkpoint_tests
import torch
import torch.nn.functional as F
from tests.train.test_trainer import losses, write_config, write_corpus

from aiayn.cli import main
from aiayn.engine import kernels
from aiayn.model import ModelConfig, Transformer
from aiayn.model.attention import MultiHeadAttention
from aiayn.model.dropout import Dropout
from aiayn.model.embedding import sinusoidal_encoding
from aiayn.model.feed_forward import PositionwiseFeedForward
from aiayn.train import objectives
from aiayn.train.checkpoint import latest_checkpoint, load_checkpoint
from aiayn.train.config import DataConfig, RunConfig, TrainConfig
from aiayn.train.trainer import train

QUIET = {"progress": False, "log": lambda _: None}


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    return write_corpus(root)


def records(run: Path, kind: str = "train") -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def equation_3(step: int, d_model: int, warmup: int, scale: float) -> float:
    """lrate = scale · d_model^-0.5 · min(step^-0.5, step · warmup^-1.5), written out again."""
    return scale / math.sqrt(d_model) * min(1 / math.sqrt(step), step / warmup / math.sqrt(warmup))


# The learning rate ----------------------------------------------------------------------------


def test_logged_learning_rate_is_equation_3(tmp_path, corpus):
    scale, d_model, warmup = 0.7, 48, 5
    config = write_config(tmp_path, corpus, lr_scale=scale, warmup=warmup, max_steps=9, checkpoint_every=None,
                          eval_every=100, amp=False)  # fmt: skip
    train(RunConfig.from_yaml(config, {"model.d_model": d_model}), tmp_path / "run", **QUIET)
    logged = [(r["step"], r["lr"]) for r in records(tmp_path / "run")]
    assert [step for step, _ in logged] == list(range(1, 10))  # 5 steps of warmup, 4 of decay
    assert [lr for _, lr in logged] == pytest.approx([equation_3(s, d_model, warmup, scale) for s in range(1, 10)])


def cooldown(progress: float, fraction: float) -> float:
    """The cooldown written out: 1 until 1 - fraction of the budget, then linear down to 0."""
    return 1.0 if progress <= 1 - fraction else (1 - progress) / fraction


def test_cooldown_anneals_equation_3_to_zero_over_the_last_steps(tmp_path, corpus):
    scale, d_model, warmup, steps = 0.7, 48, 3, 10
    config = write_config(tmp_path, corpus, lr_scale=scale, warmup=warmup, max_steps=steps, cooldown=0.5,
                          checkpoint_every=None, eval_every=100, amp=False)  # fmt: skip
    train(RunConfig.from_yaml(config, {"model.d_model": d_model}), tmp_path / "run", **QUIET)
    logged = [r["lr"] for r in records(tmp_path / "run")]
    # step k starts with k - 1 of the 10 steps spent: steps 1-6 at eq. 3, then 4/5, 3/5, 2/5, 1/5 of it
    expected = [equation_3(k, d_model, warmup, scale) * cooldown((k - 1) / steps, 0.5) for k in range(1, 11)]
    assert logged == pytest.approx(expected)
    assert logged[6] == pytest.approx(0.8 * equation_3(7, d_model, warmup, scale))  # by hand


def test_cooldown_by_epochs(tmp_path, corpus):
    scale, warmup = 1.0, 4
    config = write_config(tmp_path, corpus, lr_scale=scale, warmup=warmup, max_steps=None, max_epochs=2,
                          cooldown=0.75, checkpoint_every=None, eval_every=1000, amp=False)  # fmt: skip
    train(RunConfig.from_yaml(config), tmp_path / "run", **QUIET)
    logged = records(tmp_path / "run")
    per_epoch = [sum(r["epoch"] == e for r in logged) for e in (0, 1)]
    assert per_epoch[0] == per_epoch[1] > 4  # the same batches each epoch, several of them
    n = per_epoch[0]
    spent = [(e + i / n) / 2 for e in (0, 1) for i in range(n)]  # epochs spent as each step starts
    expected = [equation_3(k, 32, warmup, scale) * cooldown(p, 0.75) for k, p in enumerate(spent, 1)]
    assert [r["lr"] for r in logged] == pytest.approx(expected)
    assert logged[-1]["lr"] < 0.2 * equation_3(2 * n, 32, warmup, scale)  # annealed near 0 at the end


def test_cooldown_by_time_follows_the_seconds_spent(tmp_path, corpus):
    max_time, warmup = 3.0, 4
    config = write_config(tmp_path, corpus, warmup=warmup, max_steps=None, max_time=max_time, cooldown=1.0,
                          checkpoint_every=None, eval_every=10_000, amp=False)  # fmt: skip
    train(RunConfig.from_yaml(config), tmp_path / "run", **QUIET)
    logged = records(tmp_path / "run")
    assert len(logged) > 5
    before = 0.0  # the seconds spent when step k started lie between step k - 1's end and step k's
    for k, r in enumerate(logged, 1):
        factor = r["lr"] / equation_3(k, 32, warmup, 1.0)
        assert 1 - r["elapsed"] / max_time - 1e-3 <= factor <= 1 - before / max_time + 1e-3, (k, factor)
        before = r["elapsed"]
    assert logged[-1]["lr"] / equation_3(len(logged), 32, warmup, 1.0) < 0.5  # cooled down, most of the way


def test_a_run_resumed_after_a_kill_keeps_the_cooldown(tmp_path, corpus, monkeypatch):
    """Killed during step 8 (checkpoints every 2 steps), resumed: every step's loss and rate are
    the uninterrupted run's, the cooled-down steps 8-12 included."""
    config = write_config(tmp_path, corpus, max_steps=12, cooldown=0.5, checkpoint_every=2, eval_every=100,
                          amp=False)  # fmt: skip
    run = RunConfig.from_yaml(config)
    train(run, tmp_path / "reference", **QUIET)
    real, calls = objectives.label_smoothed_loss, []

    def killed_in_step_8(logits, target, eps_ls):
        calls.append(torch.is_grad_enabled())
        if sum(calls) == 8:
            raise KeyboardInterrupt
        return real(logits, target, eps_ls)

    monkeypatch.setattr(objectives, "label_smoothed_loss", killed_in_step_8)
    with pytest.raises(KeyboardInterrupt):
        train(run, tmp_path / "parts", **QUIET)
    assert latest_checkpoint(tmp_path / "parts").name == "step_00000006"
    monkeypatch.setattr(objectives, "label_smoothed_loss", real)
    train(run, tmp_path / "parts", resume=True, **QUIET)

    def seen(run_dir: Path) -> list[tuple]:
        return [(r["step"], r["loss"], r["lr"]) for r in records(run_dir)]

    assert [step for step, *_ in seen(tmp_path / "parts")] == list(range(1, 13))
    assert seen(tmp_path / "parts") == seen(tmp_path / "reference")
    assert seen(tmp_path / "reference")[-1][2] < seen(tmp_path / "reference")[6][2] / 2  # cooled down


def test_cooldown_must_be_a_fraction():
    for bad in (-0.1, 1.5, True):
        with pytest.raises(ValueError, match=r"train.cooldown must be in \[0, 1\]"):
            TrainConfig(max_steps=1, cooldown=bad)


# Adam's betas and eps -------------------------------------------------------------------------


def test_adam_takes_the_configured_betas_and_eps(tmp_path, corpus):
    """What Adam did, read from the checkpoints after steps 1 and 2: its moments show the betas,
    and the step from the first to the second set of weights is Adam's update with that eps."""
    (beta1, beta2), eps, warmup = (0.8, 0.95), 1e-3, 20  # eps of the size of sqrt(v): it matters
    config = write_config(tmp_path, corpus, betas=[beta1, beta2], adam_eps=eps, warmup=warmup, max_steps=2,
                          checkpoint_every=1, eval_every=100, amp=False)  # fmt: skip
    train(RunConfig.from_yaml(config), tmp_path / "run", **QUIET)
    moments, weights = {}, {}
    for step in (1, 2):
        path = tmp_path / "run" / "checkpoints" / f"step_{step:08d}"
        with safetensors.safe_open(str(path / "optimizer.safetensors"), framework="pt") as f:
            (group,) = json.loads(f.metadata()["param_groups"])
            assert (group["betas"], group["eps"]) == ([beta1, beta2], eps)
            assert group["fused"], "Adam's fused kernel (on the CPU since torch 2.4)"
            moments[step] = {key: f.get_tensor(key).double() for key in f.keys()}  # noqa: SIM118
        weights[step] = [p.detach().double() for p in Transformer.from_pretrained(path).parameters()]

    m1 = torch.cat([moments[1][f"{i}.exp_avg"].flatten() for i in range(len(weights[1]))])
    v1 = torch.cat([moments[1][f"{i}.exp_avg_sq"].flatten() for i in range(len(weights[1]))])
    # after one step m = (1 - beta1) g and v = (1 - beta2) g^2, whatever g
    torch.testing.assert_close(m1**2 * (1 - beta2), v1 * (1 - beta1) ** 2, rtol=1e-4, atol=1e-16)

    lr = equation_3(2, 32, warmup, 1.0)  # d_model 32, lr_scale 1: write_config's

    def update(i: int, adam_eps: float) -> torch.Tensor:  # step 2 of Adam, bias-corrected
        m, v = moments[2][f"{i}.exp_avg"], moments[2][f"{i}.exp_avg_sq"]
        return -lr / (1 - beta1**2) * m / ((v / (1 - beta2**2)).sqrt() + adam_eps)

    for i, (before, after) in enumerate(zip(weights[1], weights[2], strict=True)):
        torch.testing.assert_close(after - before, update(i, eps), rtol=1e-3, atol=1e-6, msg=f"parameter {i}")
    # the check can tell: Adam's default eps would have stepped differently
    assert max((update(i, 1e-8) - update(i, eps)).abs().max().item() for i in range(len(weights[1]))) > 1e-4


def test_a_resumed_run_updates_with_this_machines_adam_kernel(tmp_path, corpus):
    """A checkpoint saved with the multi-tensor update (an older aiayn, or a torch without the fused
    CPU kernel) resumes with the fused one: the kernel is the machine's, not the saved run's."""
    config = write_config(tmp_path, corpus, max_steps=2, checkpoint_every=1, eval_every=100, amp=False)
    train(RunConfig.from_yaml(config), tmp_path / "run", **QUIET)
    saved = tmp_path / "run" / "checkpoints" / "step_00000002" / "optimizer.safetensors"
    with safetensors.safe_open(str(saved), framework="pt") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118
        groups = json.loads(f.metadata()["param_groups"])
    for group in groups:
        group.update(fused=None, foreach=True)
    safetensors.torch.save_file(tensors, str(saved), metadata={"param_groups": json.dumps(groups)})
    config = write_config(tmp_path, corpus, max_steps=3, checkpoint_every=1, eval_every=100, amp=False)
    train(RunConfig.from_yaml(config), tmp_path / "run", resume=True, **QUIET)
    resumed = tmp_path / "run" / "checkpoints" / "step_00000003" / "optimizer.safetensors"
    with safetensors.safe_open(str(resumed), framework="pt") as f:
        (group,) = json.loads(f.metadata()["param_groups"])
    assert group["fused"] and not group["foreach"]


# Label smoothing ------------------------------------------------------------------------------


def test_the_training_loss_gets_eps_ls(tmp_path, corpus, monkeypatch):
    calls = []
    real = objectives.label_smoothed_loss

    def spy(logits, target, eps_ls):
        loss, nll = real(logits, target, eps_ls)
        calls.append((eps_ls, torch.is_grad_enabled(), loss.item(), target.numel()))
        return loss, nll

    monkeypatch.setattr(objectives, "label_smoothed_loss", spy)
    config = write_config(tmp_path, corpus, eps_ls=0.25, max_steps=3, checkpoint_every=None, eval_every=100,
                          amp=False)  # fmt: skip
    train(RunConfig.from_yaml(config), tmp_path / "run", **QUIET)
    training = [c for c in calls if c[1]]  # one micro-batch a step; evaluation runs without autograd
    assert [eps_ls for eps_ls, *_ in training] == [0.25] * 3
    assert {eps_ls for eps_ls, grad, *_ in calls if not grad} == {0.0}  # the dev loss: no smoothing
    # and what is logged is that loss, per scored token
    logged = [r["loss"] for r in records(tmp_path / "run")]
    assert logged == pytest.approx([loss / tokens for *_, loss, tokens in training], rel=1e-6)


# Dropout (§5.4) -------------------------------------------------------------------------------


def randomized(config: ModelConfig, seed: int = 0) -> Transformer:
    """A Transformer with every weight, bias and LayerNorm parameter random."""
    torch.manual_seed(seed)
    model = Transformer(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return model


def fixed_dropout_masks(model: torch.nn.Module) -> dict[tuple[str, int], torch.Tensor]:
    """Make every active Dropout module multiply by a mask drawn here, recorded by (module name,
    call number), so that a hand-written forward can apply the same masks where §5.4 says."""
    masks: dict[tuple[str, int], torch.Tensor] = {}

    def hook(name: str):
        def replace(module, args, output):
            x = args[0]
            key = (name, sum(1 for n, _ in masks if n == name))
            g = torch.Generator().manual_seed(len(masks))
            masks[key] = (torch.rand(x.shape, generator=g) >= module.p).float() / (1 - module.p)
            return x * masks[key]

        return replace

    for name, module in model.named_modules():
        if isinstance(module, Dropout) and module.p > 0:
            module.register_forward_hook(hook(name))
    return masks


def by_hand(model: Transformer, src: torch.Tensor, tgt: torch.Tensor, masks) -> torch.Tensor:
    """Figure 1 with dropout on the sum of embeddings and positional encodings and on each
    sublayer's output before the residual add (§5.4), post-norm or pre-norm; the attention and
    feed-forward sublayers and the layer norms are the model's own."""
    c = model.config
    embedding = model.src_embedding.weight  # shared by source, target and output (§3.4)

    def embed(tokens: torch.Tensor, call: int) -> torch.Tensor:
        x = F.embedding(tokens, embedding) * math.sqrt(c.d_model) + sinusoidal_encoding(tokens.size(1), c.d_model)
        return x * masks[("dropout", call)]

    def sublayer(layer: str, name: str, x: torch.Tensor, f) -> torch.Tensor:
        norm, mask = model.get_submodule(f"{layer}.{name}_norm.norm"), masks[(f"{layer}.{name}_norm.dropout", 0)]
        return x + f(norm(x)) * mask if c.norm_first else norm(x + f(x) * mask)

    src_keep = (src != c.pad_id)[:, None, None, :]  # (B, 1, 1, S)
    causal = torch.ones(tgt.size(1), tgt.size(1), dtype=torch.bool).tril()  # (T, T)
    tgt_mask = (tgt != c.pad_id)[:, None, None, :] & causal  # (B, 1, T, T)
    x = embed(src, 0)
    for i, layer in enumerate(model.encoder.layers):
        x = sublayer(f"encoder.layers.{i}", "self_attn", x, lambda h, a=layer.self_attn: a(h, mask=src_keep)[0])
        x = sublayer(f"encoder.layers.{i}", "feed_forward", x, layer.feed_forward)
    memory = model.encoder.norm(x) if c.final_norm else x
    y = embed(tgt, 1)
    for i, layer in enumerate(model.decoder.layers):
        y = sublayer(f"decoder.layers.{i}", "self_attn", y, lambda h, a=layer.self_attn: a(h, mask=tgt_mask)[0])
        y = sublayer(f"decoder.layers.{i}", "cross_attn", y, lambda h, a=layer.cross_attn: a(h, memory, src_keep)[0])
        y = sublayer(f"decoder.layers.{i}", "feed_forward", y, layer.feed_forward)
    y = model.decoder.norm(y) if c.final_norm else y
    return y @ embedding.T  # (B, T, V)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
def test_dropout_sits_where_section_5_4_puts_it(norm_first):
    model = randomized(ModelConfig.tiny(vocab_size=23, P_drop=0.3, norm_first=norm_first)).train()
    masks = fixed_dropout_masks(model)
    src = torch.tensor([[5, 9, 4, 17, 2], [8, 3, 2, 0, 0]])
    tgt = torch.tensor([[1, 6, 11, 21], [1, 14, 0, 0]])
    logits = model(src, tgt)
    residual = [f"{stack}.layers.{i}.{name}_norm.dropout" for stack, names in
                (("encoder", ("self_attn", "feed_forward")), ("decoder", ("self_attn", "cross_attn", "feed_forward")))
                for i in range(2) for name in names]  # fmt: skip
    # P_drop acts on the two embedding sums and once in each residual connection, nowhere else
    assert sorted(masks) == sorted([("dropout", 0), ("dropout", 1)] + [(name, 0) for name in residual])
    torch.testing.assert_close(logits, by_hand(model, src, tgt, masks), rtol=1e-5, atol=1e-5)


def test_attention_dropout_drops_attention_weights_in_training_only():
    """Values all 1 and W^O the identity: each head's output is the sum of its attention weights
    over the keys, 1 without dropout, the same in each of the head's d_v outputs."""
    torch.manual_seed(0)
    attention = MultiHeadAttention(d_model=8, h=2, d_k=4, d_v=4, attention_dropout=0.5)
    with torch.no_grad():
        attention.in_proj.weight[16:].zero_()  # W^V = 0, b^V = 1
        attention.in_proj.bias[16:].fill_(1.0)
        attention.out_proj.weight.copy_(torch.eye(8))
        attention.out_proj.bias.zero_()
    x = torch.randn(3, 6, 8)
    for need_weights in (False, True):  # the fused path and the explicit one
        attention.train()
        sums = attention(x, need_weights=need_weights)[0].view(3, 6, 2, 4)  # (B, T, H, D_v)
        torch.testing.assert_close(sums, sums[..., :1].expand_as(sums))  # weights dropped, not outputs
        assert (sums - 1).abs().max() > 0.1  # dropout acted
        assert set(sums.unique().tolist()) - {0.0, 2.0}  # and on weights, not on whole rows
        attention.eval()
        torch.testing.assert_close(attention(x, need_weights=need_weights)[0], torch.ones(3, 6, 8))


def test_activation_dropout_follows_the_activation_in_training_only():
    torch.manual_seed(0)
    ffn = PositionwiseFeedForward(d_model=8, d_ff=32, activation_dropout=0.5)
    seen = []
    ffn.dropout.register_forward_hook(lambda module, args, output: seen.append((args[0], output)))
    x = torch.randn(2, 5, 8)
    hidden = F.relu(ffn.linear1(x))
    ffn.train()
    out = ffn(x)
    (before, after) = seen[-1]
    torch.testing.assert_close(before, hidden)  # max(0, x W1 + b1) goes in
    torch.testing.assert_close(out, ffn.linear2(after))  # what comes out goes into W2
    assert 0.3 < (after[hidden > 0] == 0).float().mean() < 0.7  # about half the units dropped
    ffn.eval()
    torch.testing.assert_close(ffn(x), ffn.linear2(hidden))


def test_the_model_wires_each_dropout_rate_to_its_place():
    config = ModelConfig.tiny(P_drop=0.1, attention_dropout=0.2, activation_dropout=0.3)
    model = Transformer(config)
    modules = list(model.named_modules())
    assert {m.dropout.p for name, m in modules if name.endswith("_norm")} | {model.dropout.p} == {0.1}
    assert {m.attention_dropout for _, m in modules if isinstance(m, MultiHeadAttention)} == {0.2}
    assert {m.dropout.p for _, m in modules if isinstance(m, PositionwiseFeedForward)} == {0.3}
    # in eval mode none of them acts: the same output as the model without dropout
    src, tgt = torch.tensor([[5, 9, 4, 2]]), torch.tensor([[1, 6, 11]])
    plain = Transformer(config.replace(P_drop=0.0, attention_dropout=0.0, activation_dropout=0.0)).eval()
    plain.load_state_dict(model.state_dict())
    torch.testing.assert_close(model.eval()(src, tgt), plain(src, tgt))
    assert not torch.allclose(model.train()(src, tgt), plain(src, tgt))


# train.max_time -------------------------------------------------------------------------------


def test_max_time_stops_the_run(tmp_path, corpus, monkeypatch):
    # a cap far beyond what any CPU steps in a second (a fast one made 400), still finite if max_time is ignored
    max_time, max_steps = 1.0, 50_000
    # the loss kernel's first build (~20 s on a CPU new to torch's cache), made to take 2 s: outside max_time
    built, available = [], kernels.available

    def slow_first_build() -> bool:
        if not built:
            time.sleep(2.0)
            built.append(True)
        return available()

    monkeypatch.setattr(kernels, "available", slow_first_build)
    config = write_config(tmp_path, corpus, max_time=max_time, max_steps=max_steps, checkpoint_every=None,
                          eval_every=10_000, amp=False)  # fmt: skip
    said: list[str] = []
    result = train(RunConfig.from_yaml(config), tmp_path / "run", progress=False, log=said.append)
    assert any(line.startswith(f"stopped at step {result.step} (max_time)") for line in said), said
    assert 2 <= result.step < max_steps
    elapsed = json.loads((latest_checkpoint(tmp_path / "run") / "trainer_state.json").read_text())["elapsed"]
    assert max_time <= elapsed < max_time + 1.5  # stopped at the first step boundary past it
    assert records(tmp_path / "run")[-2]["elapsed"] <= max_time  # and not one step earlier


# Damaged checkpoints --------------------------------------------------------------------------


def cut_short(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize(
    "name, damage",
    [("optimizer.safetensors", cut_short), ("model.safetensors", Path.unlink), ("trainer_state.json", cut_short)],
)
def test_resume_passes_over_a_damaged_checkpoint_and_says_so(tmp_path, corpus, name, damage):
    config = write_config(tmp_path, corpus, max_steps=6, checkpoint_every=2, eval_every=100, amp=False)
    train(RunConfig.from_yaml(config), tmp_path / "whole", **QUIET)
    train(RunConfig.from_yaml(config, {"train.max_steps": 4}), tmp_path / "run", **QUIET)
    damage(tmp_path / "run" / "checkpoints" / "step_00000004" / name)
    said: list[str] = []
    train(RunConfig.from_yaml(config), tmp_path / "run", resume=True, progress=False, log=said.append)
    broken = [line for line in said if "step_00000004 is broken" in line]
    assert len(broken) == 1 and f"step_00000004/{name}" in broken[0], said
    assert any(line.startswith("resumed from") and "step_00000002 (step 2" in line for line in said), said
    assert [r["step"] for r in records(tmp_path / "run")] == list(range(1, 7))
    assert losses(tmp_path / "run") == losses(tmp_path / "whole")  # steps 3 to 6 again, exactly


def test_resume_with_every_checkpoint_damaged_is_an_error_naming_the_files(tmp_path, corpus):
    config = write_config(tmp_path, corpus, max_steps=4, checkpoint_every=2, eval_every=100, amp=False)
    train(RunConfig.from_yaml(config), tmp_path / "run", **QUIET)
    checkpoints = tmp_path / "run" / "checkpoints"
    (checkpoints / "step_00000002" / "rng.safetensors").unlink()
    cut_short(checkpoints / "step_00000004" / "tokenizer.json")
    with pytest.raises(ValueError, match="no checkpoint is whole") as error:
        train(RunConfig.from_yaml(config), tmp_path / "run", resume=True, **QUIET)
    assert f"{checkpoints / 'step_00000002' / 'rng.safetensors'}: missing" in str(error.value)
    assert f"{checkpoints / 'step_00000004' / 'tokenizer.json'}: not valid JSON" in str(error.value)
    with pytest.raises(ValueError, match=re.escape(f"{checkpoints / 'step_00000004' / 'tokenizer.json'}: ")):
        load_checkpoint(checkpoints / "step_00000004", Transformer(ModelConfig.tiny(vocab_size=300)), None)


# No unpickling --------------------------------------------------------------------------------


class Payload:
    """Unpickling this makes a directory: proof that something was unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return os.mkdir, (str(self.path),)


parts = checkpoint_tests.parts  # the fixture: a tiny model, its tokenizer and an Adam with state

NAMES = ["model.safetensors", "optimizer.safetensors", "rng.safetensors", "config.json", "trainer_state.json",
         "tokenizer.json"]  # fmt: skip


@pytest.mark.parametrize("write", ["torch.save", "pickle.dump"])
@pytest.mark.parametrize("name", NAMES)
def test_a_pickle_in_a_checkpoint_is_refused_unopened(tmp_path, parts, name, write):
    model, _, optimizer = parts
    path = checkpoint_tests.save(tmp_path, parts, 1)
    flag = tmp_path / "unpickled"
    with (path / name).open("wb") as f:
        torch.save({"state": Payload(flag)}, f) if write == "torch.save" else pickle.dump(Payload(flag), f)
    with pytest.raises(ValueError, match=re.escape(f"{path / name}: not ")):
        load_checkpoint(path, model, optimizer)
    assert not flag.exists()
    # the payload is live: unpickling it as torch.load without weights_only would, it fires
    with (path / name).open("rb") as f:
        torch.load(f, weights_only=False) if write == "torch.save" else pickle.load(f)
    assert flag.is_dir()


# Resume with nothing to resume ----------------------------------------------------------------


def test_resume_before_the_first_checkpoint_starts_afresh(tmp_path, corpus):
    """A run killed before its first checkpoint leaves run.json, a tokenizer, some metrics lines and
    perhaps a checkpoint half written: ``--resume`` trains from scratch, as a fresh run would."""
    config = write_config(tmp_path, corpus, max_steps=3, checkpoint_every=None, eval_every=100, amp=False)
    train(RunConfig.from_yaml(config), tmp_path / "fresh", **QUIET)
    killed = tmp_path / "killed"
    (killed / "checkpoints" / ".step_00000002.tmp").mkdir(parents=True)
    (killed / "checkpoints" / ".step_00000002.tmp" / "model.safetensors").write_bytes(b"\0" * 10)
    (killed / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 9.5}\n{"kind": "tr')
    (killed / "tokenizer.json").write_text("{}")
    said: list[str] = []
    result = train(RunConfig.from_yaml(config), killed, resume=True, progress=False, log=said.append)
    assert f"{killed}: no checkpoint to resume from; starting afresh" in said
    assert result.step == 3
    assert [r["step"] for r in records(killed)] == [1, 2, 3]
    assert losses(killed) == losses(tmp_path / "fresh")


# Unknown fields -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "section, cls, typo, meant",
    [("model", ModelConfig, "d_modell", "d_model"), ("data", DataConfig, "max_lenn", "max_len"),
     ("train", TrainConfig, "warmpu", "warmup")],
)  # fmt: skip
def test_an_unknown_field_names_the_section_and_the_known_fields(tmp_path, corpus, section, cls, typo, meant):
    config = write_config(tmp_path, corpus)
    skip = {"vocab_size"} if cls is ModelConfig else set()  # the model's comes from the tokenizer
    known = [f.name for f in dataclasses.fields(cls) if f.name not in skip]
    expected = f"{config}: {section}: unknown field(s) {typo} (did you mean {meant}?); known fields: {', '.join(known)}"
    with pytest.raises(ValueError) as error:
        RunConfig.from_yaml(config, {f"{section}.{typo}": 256})
    assert str(error.value) == expected
    with pytest.raises(ValueError, match=r"unknown field\(s\) zzz; known fields"):  # nothing close: no guess
        RunConfig.from_yaml(config, {f"{section}.zzz": 1})


def test_cli_reports_an_unknown_override_without_a_traceback(tmp_path, corpus, capsys):
    config = write_config(tmp_path, corpus)
    out = tmp_path / "run"
    assert main(["train", "--config", str(config), "--out", str(out), "--model.d_modell", "256"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"aiayn train: error: {config}: model: unknown field(s) d_modell (did you mean d_model?)")
    assert "known fields: N, N_dec, d_model, d_ff, h," in err and "Traceback" not in err
    assert not out.exists()
