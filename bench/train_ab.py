"""An A/B of two training runs by turns: two ``aiayn train`` processes that differ by some
overrides (``--a``, ``--b``; leading ``NAME=value`` words set a run's environment), run one at a
time in turns of ``--slice`` seconds (the other held by SIGSTOP), each turn going to the run that
has logged fewer steps, so that both take each stretch of steps on the same machine at about the
same time. On a shared 2-core machine whose speed drifts 10-20% over minutes, runs one after the
other cannot tell 5% apart; two identical runs read by turns (docs/benchmarks.md) show how
close these come. POSIX only.

Each run trains ``--steps`` steps of the config (no validation unless the overrides ask for it);
its tokens/s are those the trainer logs per step (metrics.jsonl: source + target positions over
the step's wall time, batching included). A step that held a pause lasts at least one slice; it
is dropped from both runs (the same steps, the same batches, are compared; the count is
reported). The first ``--skip`` steps are left out as warm-up. The table gives each run's
tokens/s in ``--windows`` windows of steps and over all, and B / A.

This is the trainer's own loop over its whole first epochs, one precision per process, as a user
runs it. ``bench/train_precision.py`` times the first ~100 steps from initialisation in one
process and read bf16 higher than whole runs did until bf16's products ran on padded rows
(``precision._CpuBf16``; then both read about 1.39x at the preset on a Zen 4, the trainer 1.26-1.39x
over all readings since; docs/benchmarks.md).

    python bench/train_ab.py --a "--train.amp false" --b "--train.amp true" [--steps 600]
        [--config configs/ding.yaml] [--slice 2] [--name train_ab_precision]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, table, write_result

ROOT = Path(__file__).parent.parent


def records_of(out: Path, kind: str = "train") -> list[dict]:
    """The records of ``kind`` in a run's metrics.jsonl (none yet: [])."""
    path = out / "metrics.jsonl"
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # the line being written
            continue
        if record.get("kind") == kind:
            records.append(record)
    return records


def by_turns(
    commands: dict[str, list[str]], envs: dict[str, dict], outs: dict[str, Path], logs: dict[str, Path],
    slice_s: float, progress: Callable[[int], None],
) -> None:  # fmt: skip
    """Run ``commands`` (in ``envs``) one at a time, ``slice_s`` seconds a turn, each turn going to
    the run that has logged fewer steps (on a tie, the one that waited), so that the two take each
    stretch of steps at about the same time; until both have exited. A run that fails stops both."""
    procs: dict[str, subprocess.Popen] = {}
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill of the harness runs `finally`
    try:
        for name, command in commands.items():
            procs[name] = subprocess.Popen(
                command, cwd=ROOT, env=envs[name], stdout=logs[name].open("w"), stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
            os.killpg(procs[name].pid, signal.SIGSTOP)
        last = None
        while True:
            for name, p in procs.items():
                if p.poll() not in (None, 0):
                    tail = "".join(logs[name].read_text().splitlines(keepends=True)[-15:])
                    raise SystemExit(f"run {name} failed (exit {p.returncode}); the end of {logs[name]}:\n{tail}")
            alive = [name for name, p in procs.items() if p.poll() is None]
            if not alive:
                return
            done = {name: len(records_of(outs[name])) for name in procs}
            progress(sum(done.values()))
            name = min(alive, key=lambda n: (done[n], n == last))
            p, last = procs[name], name
            os.killpg(p.pid, signal.SIGCONT)
            if len(alive) == 1:  # the other has finished: no one to share with
                p.wait()
            else:
                time.sleep(slice_s)
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGSTOP)
    finally:
        signal.signal(signal.SIGTERM, previous)
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGCONT)
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()


def rate(records: list[dict]) -> float:
    """Positions per second over ``records``: their positions over their summed step times."""
    return sum(r["tokens"] for r in records) / sum(r["tokens"] / r["tokens_per_s"] for r in records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--a", required=True,
        help='run A\'s overrides, e.g. "--train.amp false"; leading NAME=value words set its environment',
    )  # fmt: skip
    parser.add_argument("--b", required=True, help="run B's overrides")
    parser.add_argument("--config", default="configs/ding.yaml")
    parser.add_argument("--steps", type=int, default=600, help="training steps of each run")
    parser.add_argument("--slice", type=float, default=2.0, help="seconds per turn")
    parser.add_argument("--skip", type=int, default=10, help="warm-up steps left out")
    parser.add_argument("--windows", type=int, default=4, help="windows of steps in the table")
    parser.add_argument("--name", default="train_ab", help="the result's name (bench/results/NAME.json)")
    args = parser.parse_args()
    if args.steps < args.skip + args.windows:
        parser.error(f"--steps {args.steps} leaves fewer than --windows {args.windows} steps after --skip {args.skip}")
    from tqdm import tqdm

    work = Path(tempfile.mkdtemp(prefix="train_ab_"))
    runs = {"A": args.a, "B": args.b}
    outs = {name: work / name for name in runs}
    commands, envs = {}, {}
    for name, overrides in runs.items():
        words = shlex.split(overrides)
        settings = list(itertools.takewhile(lambda w: re.fullmatch(r"[A-Za-z_]\w*=.*", w) is not None, words))
        envs[name] = dict(os.environ, **dict(w.split("=", 1) for w in settings))  # NAME=value first: environment
        commands[name] = [
            sys.executable, "-m", "aiayn", "train", "--config", args.config, "--out", str(outs[name]),
            "--train.max_steps", str(args.steps), "--train.max_time", "null", "--train.eval_every", "1000000",
            *words[len(settings) :],
        ]  # fmt: skip
    logs = {name: work / f"{name}.log" for name in runs}
    bar = tqdm(total=2 * args.steps, desc="steps, both runs", unit="step")

    print(f"runs and logs in {work}", flush=True)
    by_turns(commands, envs, outs, logs, args.slice, lambda done: bar.update(done - bar.n))
    bar.update(2 * args.steps - bar.n)
    bar.close()

    logged = {}
    for name, out in outs.items():
        logged[name] = [r for r in records_of(out) if r["step"] > args.skip]
        seconds = sorted(r["tokens"] / r["tokens_per_s"] for r in logged[name])
        if seconds[len(seconds) // 2] > args.slice / 4:
            raise SystemExit(f"run {name}'s steps take {seconds[len(seconds) // 2]:.2f} s: make --slice longer")
    # a step that held a pause lasts >= one slice: drop it from both runs, to compare the same steps' batches
    paused = {r["step"] for rs in logged.values() for r in rs if r["tokens"] / r["tokens_per_s"] >= 0.5 * args.slice}
    kept = {name: [r for r in rs if r["step"] not in paused] for name, rs in logged.items()}
    dropped = {name: len(logged[name]) - len(kept[name]) for name in runs}
    precision = {name: next((r["precision"] for r in records_of(out, "precision")), None) for name, out in outs.items()}
    rows = []
    bounds = [args.skip + (args.steps - args.skip) * i // args.windows for i in range(args.windows + 1)]
    for lo, hi in itertools.pairwise(bounds):
        window = {name: [r for r in kept[name] if lo < r["step"] <= hi] for name in runs}
        if all(window.values()):
            a, b = rate(window["A"]), rate(window["B"])
            rows.append({"steps": f"{lo + 1}-{hi}", "A": round(a), "B": round(b), "ratio": round(b / a, 3)})
    a, b = rate(kept["A"]), rate(kept["B"])
    whole = f"all ({args.skip + 1}-{args.steps})"
    rows.append({"steps": whole, "A": round(a), "B": round(b), "ratio": round(b / a, 3)})
    result = {
        "benchmark": "train_ab", "command": "python " + shlex.join(sys.argv), "machine": machine(),
        "commit": subprocess.run(  # "-dirty" when the working tree has uncommitted changes
            ["git", "describe", "--always", "--dirty", "--abbrev=40"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),
        "date": time.strftime("%Y-%m-%d"), "steps": args.steps, "skip": args.skip, "windows": args.windows,
        "config": args.config, "a": args.a, "b": args.b, "precision": precision, "slice_s": args.slice,
        "dropped_steps": dropped, "rows": rows,
    }  # fmt: skip
    path = write_result(args.name, result)
    print(f"\nA: {args.a} (precision {precision['A']}); B: {args.b} (precision {precision['B']})")
    print(f"steps dropped (held a pause, in either run): A {dropped['A']}, B {dropped['B']}\n")
    columns = [("steps", "steps"), ("A", "A tokens/s"), ("B", "B tokens/s"), ("ratio", "B / A")]
    print(table(rows, columns))
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
