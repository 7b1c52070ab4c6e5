"""The trainer end to end on a tiny synthetic corpus: outputs, checkpoints, exact resume after a
kill, and DistributedDataParallel (torchrun, gloo) equal to one process with the same global batch."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
import yaml

from aiayn.data.tokenizer import Tokenizer
from aiayn.model import Transformer
from aiayn.train.checkpoint import latest_checkpoint, list_checkpoints
from aiayn.train.config import RunConfig, parse_overrides
from aiayn.train.trainer import train

WORDS = {"haus": "house", "katze": "cat", "hund": "dog", "rot": "red", "klein": "small", "groß": "big", "und": "and"}


def write_split(root: Path, name: str, n: int, g: torch.Generator, max_words: int = 7) -> None:
    """``{name}.de`` / ``{name}.en``: n word-by-word 'translations' of 1 to max_words words."""
    german = list(WORDS)
    de, en = [], []
    for _ in range(n):
        length = int(torch.randint(1, max_words + 1, (1,), generator=g))
        words = [german[i] for i in torch.randint(0, len(german), (length,), generator=g)]
        de.append(" ".join(words))
        en.append(" ".join(WORDS[w] for w in words))
    (root / f"{name}.de").write_text("\n".join(de) + "\n")
    (root / f"{name}.en").write_text("\n".join(en) + "\n")


def write_corpus(root: Path, n_train: int = 400, n_dev: int = 40, seed: int = 0) -> Path:
    """Word-by-word 'translations' from a 7-word dictionary: learnable in a few dozen steps."""
    g = torch.Generator().manual_seed(seed)
    for split, n in (("train", n_train), ("dev", n_dev)):
        write_split(root, split, n, g)
    return root


def write_config(root: Path, data_dir: Path, **train) -> Path:
    config = {
        "data": {"format": "parallel", "dir": str(data_dir), "max_len": 32},
        "model": {"N": 1, "d_model": 32, "d_ff": 64, "h": 2, "P_drop": 0.1},
        "train": {"vocab_size": 300, "max_tokens": 160, "warmup": 20, "max_steps": 12, "eval_every": 6,
                  "checkpoint_every": 3, "checkpoint_minutes": None, "seed": 3,
                  "amp": False, **train},  # no timing probe: two runs compare step for step
    }  # fmt: skip
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def losses(run: Path) -> dict[int, float]:
    """Each step's training loss as logged: unrounded, so that equal means bit for bit."""
    return dict(train_records(run))


def train_records(run: Path) -> list[tuple[int, float]]:
    """(step, loss) of each training line of metrics.jsonl in order, duplicates and all."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    return write_corpus(root)


def test_train_writes_model_checkpoints_and_metrics(tmp_path, corpus):
    run = RunConfig.from_yaml(write_config(tmp_path, corpus), parse_overrides(["--train.keep_checkpoints", "2"]))
    result = train(run, tmp_path / "run", progress=False, log=lambda _: None)
    out = tmp_path / "run"
    assert result.step == 12
    assert [p.name for p in list_checkpoints(out)] == ["step_00000009", "step_00000012"]  # keep the newest 2
    assert latest_checkpoint(out).name == "step_00000012"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, 13))
    assert [r["step"] for r in records if r["kind"] == "dev"] == [6, 12]
    assert records[-1]["kind"] == "final" and "dev_bleu" in records[-1]
    # the checkpoint and the final model are directories that from_pretrained loads
    for directory in (out / "model", latest_checkpoint(out)):
        model = Transformer.from_pretrained(directory)
        tokenizer = Tokenizer.load(directory / "tokenizer.json")
        assert model.config.vocab_size == tokenizer.vocab_size
    assert not list((out / "checkpoints").glob(".*.tmp"))


def test_dev_size_zero_skips_the_dev_bleu_but_not_the_dev_loss(tmp_path, corpus):
    run = RunConfig.from_yaml(
        write_config(tmp_path, corpus, max_steps=3, eval_every=3), parse_overrides(["--data.dev_size", "0"])
    )
    train(run, tmp_path / "run", progress=False, log=lambda _: None)
    final = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert final["kind"] == "final" and "dev_loss" in final and "dev_bleu" not in final


def test_training_reduces_dev_loss(tmp_path, corpus):
    run = RunConfig.from_yaml(write_config(tmp_path, corpus, max_steps=80, eval_every=20, lr_scale=0.15))
    train(run, tmp_path / "run", progress=False, log=lambda _: None)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    dev = [r["loss"] for r in records if r["kind"] == "dev"]
    assert dev[-1] < 0.5 * dev[0]


def aiayn(*args: str) -> list[str]:
    return [sys.executable, "-m", "aiayn", *args]


def start_until(args: list[str], path: Path, what: str) -> subprocess.Popen:
    """``aiayn ARGS`` as a process, returned once ``path`` exists (within 120 s, while it runs)."""
    proc = subprocess.Popen(aiayn(*args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not path.is_dir():
        assert proc.poll() is None and time.time() < deadline, f"the run ended before {what}"
        time.sleep(0.005)
    return proc


def test_resume_after_kill_repeats_the_same_losses(tmp_path, corpus):
    config = write_config(tmp_path, corpus, max_steps=16, checkpoint_every=2, eval_every=4)
    reference = tmp_path / "reference"
    subprocess.run(aiayn("train", "--config", str(config), "--out", str(reference)), check=True, capture_output=True)

    killed = tmp_path / "killed"
    command = ["train", "--config", str(config), "--out", str(killed), "--train.max_steps", "100000"]
    proc = start_until(command, killed / "checkpoints" / "step_00000004", "its 4th step")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed_from = int(latest_checkpoint(killed).name.split("_")[1])
    assert 4 <= resumed_from < 16

    subprocess.run(
        aiayn("train", "--config", str(config), "--out", str(killed), "--resume"), check=True, capture_output=True
    )
    # each step logged once, none missing, none twice (a dict would hide a repeated step)
    assert [step for step, _ in train_records(killed)] == list(range(1, 17))
    assert train_records(killed) == train_records(reference)  # step for step, bit for bit


def test_resume_drops_a_metrics_line_cut_short_by_the_kill(tmp_path, corpus):
    """A kill in the middle of a write to metrics.jsonl leaves a last line that is not JSON."""
    config = write_config(tmp_path, corpus, max_steps=4, checkpoint_every=2, eval_every=100)
    train(RunConfig.from_yaml(config), tmp_path / "run", progress=False, log=lambda _: None)
    metrics = tmp_path / "run" / "metrics.jsonl"
    with metrics.open("a") as f:
        f.write('{"kind": "train", "step": 5, "loss": 2.71')  # no closing brace, no newline
    longer = RunConfig.from_yaml(config, parse_overrides(["--train.max_steps", "6"]))
    train(longer, tmp_path / "run", resume=True, progress=False, log=lambda _: None)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, 7))
    assert 2.71 not in [r.get("loss") for r in records]


def test_progress_bar_into_a_log_file_is_not_redrawn_every_step(tmp_path, corpus, capsys):
    """stderr captured, as in `aiayn train ... 2> log`: not a terminal, so a redraw every 30 s."""
    run = RunConfig.from_yaml(write_config(tmp_path, corpus, max_steps=12, checkpoint_every=None, eval_every=100))
    train(run, tmp_path / "run", log=lambda _: None)  # with the progress bar
    redraws = capsys.readouterr().err.count("train:")
    assert 1 <= redraws <= 3  # the first and the last, one more if the run took over 30 s


def test_ddp_two_processes_equal_one_process_with_accumulation(tmp_path, corpus):
    """torchrun --nproc_per_node 2 (gloo on CPU), 1 batch per process per step, against one process
    accumulating the same 2 batches: the parameters after 4 steps agree."""
    config = write_config(tmp_path, corpus, max_steps=4, checkpoint_every=None, eval_every=100)
    no_dropout = ["--model.P_drop", "0.0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    single = tmp_path / "single"
    subprocess.run(
        aiayn("train", "--config", str(config), "--out", str(single), "--train.accumulate", "2", *no_dropout),
        check=True, capture_output=True, env=env,
    )  # fmt: skip
    ddp = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "aiayn",
           "train", "--config", str(config), "--out", str(ddp), "--train.accumulate", "1", *no_dropout]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    a = safetensors.torch.load_file(str(single / "model" / "model.safetensors"))
    b = safetensors.torch.load_file(str(ddp / "model" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-4, msg=name)
    assert losses(single) == pytest.approx(losses(ddp), rel=1e-5)


def test_ddp_with_max_time_and_cooldown_stops_together(tmp_path, corpus):
    """torchrun --nproc_per_node 2 with train.max_time and a cooldown by time: the processes agree
    on the seconds spent (their mean), so both stop at one step and the run ends, and every step's
    rate is eq. 3 times the cooldown at a time between the previous step's end and its own. A smoke
    test of the path: the clocks of two processes on one machine rarely differ enough to split."""
    max_time, warmup = 4.0, 4
    config = write_config(tmp_path, corpus, max_steps=None, max_time=max_time, cooldown=1.0, warmup=warmup,
                          checkpoint_every=None, eval_every=10_000)  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "aiayn",
           "train", "--config", str(config), "--out", str(tmp_path / "ddp"), "--train.accumulate", "1"]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(max_time)" in result.stdout + result.stderr
    logged = [json.loads(line) for line in (tmp_path / "ddp" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in logged if r["kind"] == "train"]
    assert len(steps) > 3
    before = 0.0
    for k, r in enumerate(steps, 1):
        factor = r["lr"] / (32**-0.5 * min(k**-0.5, k * warmup**-1.5))  # d_model 32, lr_scale 1
        # the mean of the two processes' clocks: within a step's length (plus slack) of the main one's
        assert 1 - r["elapsed"] / max_time - 0.1 <= factor <= 1 - before / max_time + 0.1, (k, factor)
        before = r["elapsed"]


def test_fresh_run_refuses_a_directory_with_checkpoints(tmp_path, corpus):
    run = RunConfig.from_yaml(write_config(tmp_path, corpus, max_steps=3))
    train(run, tmp_path / "run", progress=False, log=lambda _: None)
    with pytest.raises(ValueError, match="--resume"):
        train(run, tmp_path / "run", progress=False, log=lambda _: None)


def write_phrases(root: Path, n: int = 200) -> None:
    """Dictionary entries: single words and two-word phrases of the same 7-word dictionary."""
    write_split(root, "phrases", n, torch.Generator().manual_seed(1), max_words=2)


def test_phrases_resampled_each_epoch_resume_exactly(tmp_path):
    """With data.resample_phrases the examples change every epoch; stopping after step 6 (inside the
    second epoch) and resuming gives the losses of the uninterrupted run, step for step."""
    data = tmp_path / "data"
    data.mkdir()
    write_corpus(data, n_train=60)
    write_phrases(data)
    config = write_config(tmp_path, data, max_steps=14, checkpoint_every=None, eval_every=100)
    phrases = ["--data.phrases", "1.0", "--data.resample_phrases", "true"]
    said: list[str] = []
    full = RunConfig.from_yaml(config, parse_overrides(phrases))
    result = train(full, tmp_path / "full", progress=False, log=said.append)
    assert result.epoch >= 2  # the run crossed at least two epoch boundaries
    assert any("a fresh draw of 60 each epoch" in line for line in said), said

    first = RunConfig.from_yaml(config, parse_overrides([*phrases, "--train.max_steps", "6"]))
    train(first, tmp_path / "parts", progress=False, log=lambda _: None)
    train(full, tmp_path / "parts", resume=True, progress=False, log=lambda _: None)
    assert losses(tmp_path / "parts") == losses(tmp_path / "full")

    with pytest.raises(ValueError, match=r"resample_phrases needs data\.phrases"):
        RunConfig.from_yaml(config, parse_overrides(["--data.resample_phrases", "true"]))


def test_train_tokenizer_gives_runs_one_vocabulary_that_ensembles(tmp_path, corpus):
    """``train.tokenizer``: a second run reads the first's tokenizer instead of learning a BPE
    (its own ``vocab_size`` unused), so the two models, of different seeds, make an ensemble."""
    from aiayn.decode import Ensemble
    from aiayn.translator import Translator

    config = write_config(tmp_path, corpus, max_steps=3, eval_every=3)
    train(RunConfig.from_yaml(config), tmp_path / "a", progress=False, log=lambda _: None)
    said: list[str] = []
    shared = ["--train.tokenizer", str(tmp_path / "a" / "model"), "--train.seed", "4", "--train.vocab_size", "50"]
    train(RunConfig.from_yaml(config, parse_overrides(shared)), tmp_path / "b", progress=False, log=said.append)
    assert any("no BPE learnt" in line for line in said)
    assert not any("training a joint BPE" in line for line in said)
    a, b = tmp_path / "a" / "model", tmp_path / "b" / "model"
    assert (b / "tokenizer.json").read_bytes() == (a / "tokenizer.json").read_bytes()
    model_a, model_b = Transformer.from_pretrained(a), Transformer.from_pretrained(b)
    assert model_b.config.vocab_size == model_a.config.vocab_size == Tokenizer.load(a / "tokenizer.json").vocab_size
    assert not torch.equal(model_a.src_embedding.weight, model_b.src_embedding.weight)  # another seed
    translator = Translator.from_pretrained([a, b])
    assert isinstance(translator.model, Ensemble) and len(translator.translate(["haus und katze"], beam=2)) == 1
    with pytest.raises(ValueError, match=r"train\.tokenizer and train\.init both"):
        RunConfig.from_yaml(config, parse_overrides(["--train.tokenizer", str(a), "--train.init", str(a)]))
    missing = parse_overrides(["--train.tokenizer", str(tmp_path / "none")])
    with pytest.raises(FileNotFoundError, match=r"none/tokenizer.json: no such file"):
        train(RunConfig.from_yaml(config, missing), tmp_path / "c", progress=False, log=lambda _: None)
    assert not (tmp_path / "c").exists()  # refused before anything is written
