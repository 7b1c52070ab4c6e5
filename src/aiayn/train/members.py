"""Several models of one run, trained at once and decoded as an ensemble (``train.members``).

Not in the paper (§6.1 reports single models); the ensembles are fairseq's and Marian's: the
next-token distribution is the mean of the members' (``aiayn.decode.Ensemble``). On a small CPU a
small model stops gaining long before a generous ``max_time`` ends, and two models of different
seeds, each on half of the cores, then buy more than one model on all of them (issue 24: on a
2-core Zen 5, two one-core models of the Ding preset read dev BLEU 9.02 together in the same 14
minutes, the mean of five pairs, against 8.45 for one model on both cores, while 56 minutes bought
the one model nothing).

The run's process trains member 1 into ``out`` as ever; member i > 1 is a child process,
``aiayn train`` with seed ``seed + 1000 (i - 1)`` (``member_seed``: runs of seeds 1, 2, 3 ...
share none) and the run's tokenizer, into ``out/member{i}`` (its log in ``train.log`` there),
each process on ``threads // members`` threads, member 1 keeping any left over
(``split_threads``). ``out/model/`` then holds member 1 with ``ensemble.json`` naming the others,
so ``aiayn evaluate``, ``translate`` and ``serve`` decode the ensemble
(``aiayn.translator.ensemble_members``) and ``attention``, which draws one model, takes member 1
alone.

``members: auto`` decides after the first ``AUTO_AT`` of ``max_time``: it projects the steps one
model would make in ``max_time`` from the steps so far, and trains a second member when they
reach ``members_auto_steps`` (``choose_members``).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..model.pretrained import atomic_write
from ..translator import ENSEMBLE_NAME

__all__ = ["AUTO_AT", "Member", "choose_members", "member_seed", "split_threads", "start_member", "write_ensemble"]

AUTO_AT = 0.05  # members auto decides after this fraction of max_time (42 s of the demo's 840)


def choose_members(step: int, seconds: float, max_time: float, auto_steps: int, threads: int) -> tuple[int, str]:
    """(members, why) for ``members: auto``: two when one model, at the rate of its first ``step``
    steps in ``seconds``, would make at least ``auto_steps`` steps in ``max_time`` and the
    process has two threads or more to split; one otherwise."""
    projected = step / seconds * max_time
    at = f"{step:,} steps in {seconds:.0f} s project {projected:,.0f} in max_time {max_time:g} s"
    if threads < 2:
        return 1, f"{at}; one thread, nothing to split"
    if projected >= auto_steps:
        return 2, f"{at}, at least {auto_steps:,} (train.members_auto_steps): two models"
    return 1, f"{at}, fewer than {auto_steps:,} (train.members_auto_steps): one model"


def split_threads(threads: int, members: int) -> tuple[int, int]:
    """(this process's threads, each other member's): ``threads // members`` each, this process
    (member 1) keeping what an uneven split leaves over; at least one each."""
    each = max(1, threads // members)
    return max(1, threads - each * (members - 1)), each


def member_seed(seed: int, index: int) -> int:
    """The seed of member ``index`` (1 is the run itself) of a run of ``seed``."""
    return seed + 1000 * (index - 1)


@dataclass
class Member:
    """A member i > 1 of the run, training in a child process."""

    index: int
    out: Path
    process: subprocess.Popen

    @property
    def log(self) -> Path:
        return self.out / "train.log"

    def check(self) -> None:
        """An error naming its log if it has ended in failure (while the run trains on)."""
        if self.process.poll() not in (None, 0):
            self.wait()

    def wait(self) -> None:
        """Wait for it to end; an error naming its log if it failed."""
        code = self.process.wait()
        if code != 0:
            tail = self.log.read_text(errors="replace").strip().splitlines()[-1:] if self.log.exists() else []
            last = f": {tail[0]}" if tail else ""
            raise RuntimeError(f"member {self.index} ({self.out}) failed with exit code {code}; see {self.log}{last}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()


def _death_signal() -> Callable[[], None] | None:
    """What the child runs before exec: SIGTERM when the parent dies (Linux's PR_SET_PDEATHSIG),
    so a killed run leaves no member training on; looked up here, in the parent, so that the
    forked child loads nothing. None elsewhere (the parent's finally stops its members)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (AttributeError, OSError):
        return None
    return lambda: prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def start_member(
    config: Path, out: Path, index: int, seed: int, threads: int, resume: bool, overrides: dict[str, object]
) -> Member:
    """Start member ``index`` of the run whose config is ``config`` (a YAML file):
    ``aiayn train`` into ``out/member{index}`` with ``seed`` and ``overrides`` (``--train.NAME
    VALUE``), on ``threads`` threads, its output in ``train.log`` there."""
    member_out = out / f"member{index}"
    member_out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "aiayn", "train", "--config", str(config), "--out", str(member_out)]
    command += ["--device", "cpu", "--train.seed", str(seed), "--train.members", "1"]
    for name, value in overrides.items():
        command += [f"--train.{name}", json.dumps(value) if not isinstance(value, str) else value]
    command += ["--resume"] if resume else []
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    preexec = _death_signal()
    with open(member_out / "train.log", "a") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=preexec)
    return Member(index, member_out, process)


def write_ensemble(model_dir: Path, members: list[Path]) -> None:
    """``model_dir/ensemble.json``: the other members' model directories, relative to it."""
    names = [os.path.relpath(m, model_dir) for m in members]
    text = json.dumps({"members": names}, indent=2) + "\n"
    atomic_write(model_dir / ENSEMBLE_NAME, lambda tmp: Path(tmp).write_text(text))
