"""``train.members``: models of one run trained at once in child processes, one tokenizer, decoded
as one ensemble; ``auto`` decides from the steps of the first 5% of ``max_time``."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tests.train.test_trainer import aiayn, start_until, train_records, write_config, write_corpus

from aiayn.decode import Ensemble, translate_ids
from aiayn.model import Transformer
from aiayn.train.checkpoint import latest_checkpoint
from aiayn.train.config import RunConfig, parse_overrides
from aiayn.train.members import choose_members, split_threads
from aiayn.train.trainer import train
from aiayn.translator import Translator, ensemble_members

QUIET = dict(progress=False, log=lambda _: None)


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    return write_corpus(root)


def records(run: Path, kind: str) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


@pytest.mark.parametrize(
    ("step", "seconds", "threads", "expected"),
    [
        (500, 42.0, 2, 2),  # 500 / 42 * 840 = 10,000 steps >= 7,000
        (350, 42.0, 2, 2),  # exactly 7,000
        (349, 42.0, 2, 1),  # 6,980
        (200, 42.0, 2, 1),  # 4,000
        (500, 42.0, 1, 1),  # one thread: nothing to split
    ],
)
def test_auto_pairs_when_the_projected_steps_reach_the_threshold(step, seconds, threads, expected):
    members, why = choose_members(step, seconds, 840.0, 7000, threads)
    assert members == expected
    assert f"project {round(step / seconds * 840):,}" in why


@pytest.mark.parametrize(
    ("threads", "members", "expected"), [(2, 2, (1, 1)), (3, 2, (2, 1)), (16, 3, (6, 5)), (1, 2, (1, 1))]
)
def test_threads_are_split_evenly_and_member_1_keeps_the_rest(threads, members, expected):
    assert split_threads(threads, members) == expected


def test_no_thread_is_left_idle_and_each_member_gets_one():
    for threads in range(1, 17):
        for members in range(1, 5):
            own, each = split_threads(threads, members)
            assert own >= each >= 1 and own - each < members  # as even as whole threads allow
            assert own + each * (members - 1) == max(threads, members)  # all used; one each at least


def test_two_members_train_two_seeds_on_one_tokenizer_and_decode_as_one_ensemble(tmp_path, corpus):
    threads = torch.get_num_threads()
    config = write_config(tmp_path, corpus, members=2, max_steps=6, eval_every=6, checkpoint_every=3)
    said: list[str] = []
    result = train(RunConfig.from_yaml(config), tmp_path / "run", progress=False, log=said.append)
    assert torch.get_num_threads() == threads  # this process gets its threads back
    run, member = tmp_path / "run", tmp_path / "run" / "member2"
    assert result.members == 2 and result.ensemble_dev_scores is not None
    assert any("members: 2 (train.members); member 2 in" in line for line in said)
    # member 2: seed 3 + 1000, the run's tokenizer (no BPE of its own), one member, its log
    member_run = json.loads((member / "run.json").read_text())["train"]
    assert (member_run["seed"], member_run["members"], member_run["tokenizer"]) == (1003, 1, str(run))
    assert "no BPE learnt" in (member / "train.log").read_text()
    assert (member / "model" / "tokenizer.json").read_bytes() == (run / "model" / "tokenizer.json").read_bytes()
    assert [s for s, _ in train_records(member)] == list(range(1, 7))
    # member 2 is the run its own command makes: the same seed and tokenizer, trained alone (all threads here)
    alone = ["--train.seed", "1003", "--train.members", "1", "--train.tokenizer", str(run)]
    train(RunConfig.from_yaml(config, parse_overrides(alone)), tmp_path / "alone", **QUIET)
    got, want = train_records(member), train_records(tmp_path / "alone")
    assert [s for s, _ in got] == [s for s, _ in want]
    assert [loss for _, loss in got] == pytest.approx([loss for _, loss in want], rel=1e-4)
    # the model directory names its ensemble; translate and the dev scores use both members
    assert ensemble_members(run / "model") == [run / "model", member / "model"]
    one, two = Transformer.from_pretrained(run / "model"), Transformer.from_pretrained(member / "model")
    assert not torch.equal(one.src_embedding.weight, two.src_embedding.weight)
    translator = Translator.from_pretrained(run / "model")
    assert isinstance(translator.model, Ensemble) and len(translator.model.members) == 2
    sentences = ["haus und katze", "der rote hund", "klein"]
    ids = [translator.tokenizer.encode(s) for s in sentences]
    by_hand = Ensemble([one.eval(), two.eval()])
    assert translator.translate(sentences, beam=2) == translator.tokenizer.decode_batch(
        translate_ids(by_hand, ids, beam=2)
    )
    assert isinstance(Translator.from_pretrained(run / "model", alone=True).model, Transformer)
    with pytest.warns(UserWarning, match=r"member2/model: given more than once .*; decoded once"):
        twice = Translator.from_pretrained([run / "model", member / "model"])  # member 2 through ensemble.json too
    assert len(twice.model.members) == 2 and twice.translate(sentences, beam=2) == translator.translate(
        sentences, beam=2
    )
    [together] = records(run, "ensemble")
    [final] = records(run, "final")
    assert together["members"] == 2 and together["dev_ppl"] != final["dev_ppl"]
    assert together["dev_bleu"] == result.ensemble_dev_scores.bleu


def test_auto_decides_after_the_first_twentieth_of_max_time(tmp_path, corpus):
    base = dict(max_steps=None, max_time=3, eval_every=1000, checkpoint_every=None)
    pair = write_config(tmp_path, corpus, members="auto", members_auto_steps=1, **base)
    result = train(RunConfig.from_yaml(pair), tmp_path / "pair", **QUIET)
    [decided] = records(tmp_path / "pair", "members")
    assert decided["members"] == result.members == 2 and "at least 1 (train.members_auto_steps)" in decided["reason"]
    assert (tmp_path / "pair" / "member2" / "model" / "config.json").exists()
    member_time = json.loads((tmp_path / "pair" / "member2" / "run.json").read_text())["train"]["max_time"]
    assert 0 < member_time <= 3 * 0.95  # the rest of max_time: the members end together

    one = write_config(tmp_path, corpus, members="auto", members_auto_steps=10**9, **base)
    result = train(RunConfig.from_yaml(one), tmp_path / "one", **QUIET)
    [decided] = records(tmp_path / "one", "members")
    assert decided["members"] == result.members == 1 and "one model" in decided["reason"]
    assert not (tmp_path / "one" / "member2").exists()
    assert ensemble_members(tmp_path / "one" / "model") == [tmp_path / "one" / "model"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_run_stops_its_member_and_resumes_with_it(tmp_path, corpus):
    config = write_config(tmp_path, corpus, members=2, max_steps=30, checkpoint_every=2, eval_every=100000)
    run = tmp_path / "run"
    command = ["train", "--config", str(config), "--out", str(run), "--train.max_steps", "100000"]
    proc = start_until(command, run / "member2" / "checkpoints" / "step_00000004", "its member's 4th step")
    children = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _member_of(p, run)]
    assert children, "no member process found"
    environ = (children[0] / "environ").read_bytes().split(b"\0")
    threads = max(1, int(subprocess.check_output(aiayn_python("import torch; print(torch.get_num_threads())"))) // 2)
    assert f"OMP_NUM_THREADS={threads}".encode() in environ  # its share of the run's threads
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 30
    while any(_alive(p) for p in children):
        assert time.time() < deadline, "the member kept training after its run was killed"
        time.sleep(0.05)
    # member 2 started on its own while this run trained on: resume both to past the run's checkpoint
    last = max(int(latest_checkpoint(d).name.split("_")[1]) for d in (run, run / "member2")) + 10
    resumed = subprocess.run(
        aiayn("train", "--config", str(config), "--out", str(run), "--resume", "--train.max_steps", str(last)),
        capture_output=True, text=True,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "members: 2 (as the run it resumes)" in resumed.stdout
    assert "resumed from" in (run / "member2" / "train.log").read_text()
    for directory in (run, run / "member2"):  # each step once, none missing
        assert [s for s, _ in train_records(directory)] == list(range(1, last + 1))
    assert len(ensemble_members(run / "model")) == 2


def aiayn_python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _member_of(proc: Path, run: Path) -> bool:
    try:
        return str(run / "member2") in (proc / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def _alive(proc: Path) -> bool:
    try:
        return (proc / "stat").read_text().split(") ")[1][0] not in "ZX"
    except (OSError, IndexError):
        return False


def test_a_member_that_fails_stops_the_run_with_an_error_naming_its_log(tmp_path, corpus, monkeypatch):
    config = write_config(tmp_path, corpus, members=2, max_steps=5000, eval_every=10, checkpoint_every=None)
    monkeypatch.setattr(sys, "executable", shutil.which("false"))  # the member's command fails at once
    with pytest.raises(RuntimeError, match=r"member 2 \(.*member2\) failed with exit code 1; see .*train\.log"):
        train(RunConfig.from_yaml(config), tmp_path / "run", **QUIET)
    assert train_records(tmp_path / "run")[-1][0] < 5000  # said while training, not after max_steps
    assert not (tmp_path / "run" / "model" / "ensemble.json").exists()


def test_a_checkpoint_from_before_members_resumes_as_one_model(tmp_path, corpus):
    config = write_config(tmp_path, corpus, max_steps=4, checkpoint_every=2, eval_every=100)
    train(RunConfig.from_yaml(config), tmp_path / "run", **QUIET)
    state_file = latest_checkpoint(tmp_path / "run") / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state.pop("members"), state.pop("member_max_time")  # as an older version wrote it
    state_file.write_text(json.dumps(state))
    # auto would decide at once (5% of 1 s is spent) and pair (any projection reaches 1 step)
    auto = ["--train.members", "auto", "--train.members_auto_steps", "1", "--train.max_time", "1"]
    longer = RunConfig.from_yaml(config, parse_overrides([*auto, "--train.max_steps", "40"]))
    result = train(longer, tmp_path / "run", resume=True, **QUIET)
    assert result.members == 1 and not (tmp_path / "run" / "member2").exists()
    assert [s for s, _ in train_records(tmp_path / "run")] == list(range(1, result.step + 1))


def test_a_run_resumed_before_auto_decided_decides_then(tmp_path, corpus):
    auto = ["--train.members", "auto", "--train.members_auto_steps", "1", "--train.max_steps", "4"]
    config = write_config(tmp_path, corpus, checkpoint_every=2, eval_every=100)
    early = RunConfig.from_yaml(config, parse_overrides([*auto, "--train.max_time", "1000"]))  # decides at 50 s
    train(early, tmp_path / "run", **QUIET)
    assert json.loads((latest_checkpoint(tmp_path / "run") / "trainer_state.json").read_text())["members"] == "auto"
    later = RunConfig.from_yaml(config, parse_overrides([*auto, "--train.max_time", "1", "--train.max_steps", "40"]))
    result = train(later, tmp_path / "run", resume=True, **QUIET)
    assert result.members == 2 and (tmp_path / "run" / "member2" / "model" / "config.json").exists()


def test_members_need_a_translation_task_and_a_positive_count(tmp_path, corpus):
    config = write_config(tmp_path, corpus)
    for value in ("0", "two", "true"):
        with pytest.raises(ValueError, match=r"train\.members must be auto or a positive integer"):
            RunConfig.from_yaml(config, parse_overrides(["--train.members", value]))
    with pytest.raises(ValueError, match=r"train\.members .* train\.task translation"):
        RunConfig.from_yaml(config, parse_overrides(["--train.members", "2", "--train.task", "lm"]))


def test_an_ensemble_file_naming_a_missing_member_is_an_error_naming_it(tmp_path, corpus):
    config = write_config(tmp_path, corpus, max_steps=2, eval_every=100)
    train(RunConfig.from_yaml(config), tmp_path / "run", **QUIET)
    model = tmp_path / "run" / "model"
    (model / "ensemble.json").write_text(json.dumps({"members": ["../member2/model"]}))
    with pytest.raises(ValueError, match=r"ensemble\.json: member .*member2/model has no model"):
        Translator.from_pretrained(model)
    (model / "ensemble.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"ensemble\.json: not an ensemble file"):
        Translator.from_pretrained(model)
    assert isinstance(Translator.from_pretrained(model, alone=True).model, Transformer)


def test_commands_that_take_one_model_say_they_take_the_member_alone(tmp_path, corpus):
    config = write_config(tmp_path, corpus, members=2, max_steps=2, eval_every=100)
    train(RunConfig.from_yaml(config), tmp_path / "run", **QUIET)
    model = str(tmp_path / "run" / "model")
    env = dict(os.environ, MPLBACKEND="Agg")
    shown = subprocess.run(
        aiayn("attention", "--model", model, "haus", "--out", str(tmp_path / "a.png")),
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert f"{model} is the first model of an ensemble (ensemble.json); attention takes it alone" in shown.stdout
    scored = subprocess.run(
        aiayn("evaluate", "--model", model, "--data", str(corpus), "--split", "dev", "--beam", "1"),
        capture_output=True, text=True,
    )  # fmt: skip
    assert scored.returncode == 0, scored.stderr[-2000:]
    assert "greedy, an ensemble of 2 models" in scored.stdout
    alone = subprocess.run(
        aiayn("evaluate", "--model", model, "--alone", "--data", str(corpus), "--split", "dev", "--beam", "1"),
        capture_output=True, text=True,
    )  # fmt: skip
    assert alone.returncode == 0 and "ensemble" not in alone.stdout
