"""The language models through the trainer: a tiny causal LM learns a deterministic sequence and
generates it, a tiny masked LM recovers the masked tokens of a repeating pattern; run outputs,
exact resume of the masked LM, configs."""

import json
from pathlib import Path

import pytest
import torch
import yaml

from aiayn import DecoderOnly, EncoderOnly, load_pretrained
from aiayn.data.tokenizer import Tokenizer
from aiayn.decode import fill_mask, generate_ids
from aiayn.train.checkpoint import latest_checkpoint
from aiayn.train.config import RunConfig
from aiayn.train.data import load_texts
from aiayn.train.trainer import train

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]


def cycle(start: int, n: int) -> list[str]:
    return [WORDS[(start + i) % len(WORDS)] for i in range(n)]


def write_text(root: Path, lines_of, n_train: int = 400, n_dev: int = 40, seed: int = 0) -> Path:
    g = torch.Generator().manual_seed(seed)
    for split, n in (("train", n_train), ("dev", n_dev)):
        lines = [" ".join(lines_of(g)) for _ in range(n)]
        (root / f"{split}.xx").write_text("\n".join(lines) + "\n")
    return root


def eight_words(g: torch.Generator) -> list[str]:
    """Eight words of the cycle from a random start: each word's successor, and where the line
    ends, are determined."""
    return cycle(int(torch.randint(len(WORDS), (1,), generator=g)), 8)


def cycle4(g: torch.Generator) -> list[str]:
    """one two three four one two three four ..., from a random phase, 8 to 16 words."""
    start, n = int(torch.randint(4, (1,), generator=g)), int(torch.randint(8, 17, (1,), generator=g))
    return [WORDS[(start + i) % 4] for i in range(n)]


def config(root: Path, data_dir: Path, task: str, **train) -> RunConfig:
    values = {
        "data": {"format": "text", "dir": str(data_dir), "lang": "xx", "max_len": 32},
        "model": {"N": 2, "d_model": 32, "d_ff": 64, "h": 2, "P_drop": 0.0, "norm_first": True},
        "train": {"task": task, "vocab_size": 300, "max_tokens": 256, "warmup": 30, "lr_scale": 0.5,
                  "eps_ls": 0.0, "max_steps": 300, "eval_every": 100, "checkpoint_every": None,
                  "checkpoint_minutes": None, "seed": 1,
                  "amp": False, **train},  # no timing probe: separate runs compare step for step
    }  # fmt: skip
    path = root / f"{task}.yaml"
    path.write_text(yaml.safe_dump(values))
    return RunConfig.from_yaml(path)


def quiet(*args, **kwargs):
    return train(*args, progress=False, log=lambda _: None, **kwargs)


def test_causal_lm_learns_a_deterministic_sequence_and_generates_it(tmp_path):
    data = write_text(tmp_path, eight_words)
    result = quiet(config(tmp_path, data, "lm"), tmp_path / "run")
    # the first word is a 1-in-12 guess, every later token determined: at best exp(ln 12 / 9) = 1.32
    assert result.dev_ppl < 1.4
    model = DecoderOnly.from_pretrained(result.model_dir).eval()
    tokenizer = Tokenizer.load(result.model_dir / "tokenizer.json")
    for start in range(len(WORDS)):
        prompt = cycle(start, 2)
        continuation = generate_ids(model, tokenizer.encode(" ".join(prompt)), max_new_tokens=20, temperature=0.0)
        assert tokenizer.decode(continuation[0]) == " ".join(cycle(start, 8)[2:])  # six words, then EOS


def test_masked_lm_recovers_masked_tokens_of_a_repeating_pattern(tmp_path):
    data = write_text(tmp_path, cycle4)
    result = quiet(config(tmp_path, data, "mlm", max_steps=800), tmp_path / "run")
    assert result.dev_ppl < 1.4
    model = EncoderOnly.from_pretrained(result.model_dir).eval()
    tokenizer = Tokenizer.load(result.model_dir / "tokenizer.json")
    for start, position in [(0, 3), (1, 0), (2, 9), (3, 5), (0, 11), (2, 6)]:
        words = [WORDS[(start + i) % 4] for i in range(12)]
        masked = " ".join("<mask>" if i == position else w for i, w in enumerate(words))
        [candidates] = fill_mask(model, tokenizer.encode(masked), tokenizer.mask_id, top_k=1)
        assert tokenizer.decode([candidates[0][0]]) == words[position]
        assert candidates[0][1] > 0.5


@pytest.mark.parametrize("task, cls", [("lm", DecoderOnly), ("mlm", EncoderOnly)])
def test_language_model_runs_write_run_json_metrics_checkpoints_and_model(tmp_path, task, cls):
    data = write_text(tmp_path, eight_words, n_train=100, n_dev=10)
    quiet(config(tmp_path, data, task, max_steps=6, eval_every=3, checkpoint_every=3), tmp_path / "run")
    out = tmp_path / "run"
    assert json.loads((out / "run.json").read_text())["train"]["task"] == task
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "dev"] == [3, 6]
    assert records[-1]["kind"] == "final" and records[-1]["dev_ppl"] > 1 and "dev_bleu" not in records[-1]
    assert all(r["tokens"] > 0 for r in records if r["kind"] == "train")
    for directory in (out / "model", latest_checkpoint(out)):
        assert isinstance(load_pretrained(directory), cls)


def test_masked_lm_resume_repeats_the_same_losses(tmp_path):
    """Stop after 4 steps and resume to 8: the same masks, dropout and losses as 8 steps at once."""
    data = write_text(tmp_path, cycle4, n_train=100, n_dev=10)
    run = config(tmp_path, data, "mlm", max_steps=8, checkpoint_every=2, eval_every=4)
    run = RunConfig.from_dict({**run.to_dict(), "model": {**run.model, "P_drop": 0.1}})
    quiet(run, tmp_path / "reference")
    first = RunConfig.from_dict({**run.to_dict(), "train": {**run.to_dict()["train"], "max_steps": 4}})
    quiet(first, tmp_path / "resumed")
    quiet(run, tmp_path / "resumed", resume=True)

    def losses(directory):
        records = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}

    assert sorted(losses(tmp_path / "resumed")) == list(range(1, 9))
    assert losses(tmp_path / "resumed") == losses(tmp_path / "reference")


def test_texts_come_from_a_named_file_with_blank_lines_counted(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("first line\n\n  second line  \n")
    run = RunConfig.from_dict(
        {"data": {"format": "text", "train_text": str(path)}, "train": {"task": "lm", "max_steps": 1}}
    )
    logged = []
    assert load_texts(run.data, "train", logged.append) == ["first line", "second line"]
    assert "2 texts from 3 lines; skipped 1 (1 empty)" in logged[0]
    assert load_texts(run.data, "dev", required=False) == []
    with pytest.raises(FileNotFoundError, match="dev_text"):
        load_texts(run.data, "dev")


@pytest.mark.parametrize(
    "values, message",
    [
        ({"data": {"format": "text"}, "train": {"max_steps": 1}}, "parallel text"),
        ({"data": {"format": "parallel"}, "train": {"task": "lm", "max_steps": 1}}, "data.format text"),
        ({"data": {"format": "text", "phrases": 0.5}, "train": {"task": "mlm", "max_steps": 1}}, "phrases"),
        ({"data": {"format": "text"}, "train": {"task": "gpt", "max_steps": 1}}, "train.task"),
        ({"data": {"format": "text"}, "train": {"task": "mlm", "mask_prob": 1.5, "max_steps": 1}}, "mask_prob"),
    ],
)
def test_task_and_data_mismatches_are_clear_errors(values, message):
    with pytest.raises(ValueError, match=message):
        RunConfig.from_dict(values)


@pytest.mark.parametrize("name, task", [("lm", "lm"), ("mlm", "mlm")])
def test_language_model_presets_load(name, task):
    run = RunConfig.from_yaml(CONFIGS / f"{name}.yaml")
    assert run.train.task == task and run.data.format == "text"
    assert run.train.max_time is not None and run.train.max_time <= 600
    run.model_config(run.train.vocab_size)
