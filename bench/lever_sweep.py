"""A screen of the Ding preset's levers with several seeds each: many step-matched runs at once.

The demo trains for 840 s on a 2-core CPU, about 3,250 steps on a Zen 4. One CPU run takes its 15
minutes, so a lever there gets one or two seeds, and single runs differ by about 0.4 BLEU. On a
GPU the same steps take a minute or two and one GPU runs several at once: each lever gets several
seeds. Every run stops at the steps the CPU makes in 840 s with that lever (``--steps`` times the
lever's ``factor``, its step rate on the CPU against the preset's, measured there), its cooldown
over the last part of those steps as the preset's is over the last part of its time; then it
translates the dev split with the demo's search (beam 4, α 1.5), scored by sacreBLEU. Runs share
one tokenizer (``--tokenizer``), so their perplexities compare. A screen, not a result: a lever
that gains here is then trained on the CPU for the demo's 840 s.

The levers are a YAML list (``bench/levers_ding.yaml``): ``name``, ``factor``, ``args`` (aiayn
train overrides). Jobs run seed by seed (every lever's first seed, then every lever's second), so
a sweep stopped at ``--deadline`` still compares like with like (the jobs it skips are counted).
Writes the JSON after every job (``--json``, default ``bench/results/lever_sweep.json``; an
existing file is refused) and prints a table: per lever the mean over seeds, and the mean of its
differences from the preset's run of the same seed.
``--summarize A.json B.json`` prints that table over the rows of finished sweeps together (and
``--plot PNG`` draws each run's dev BLEU by lever) without training.

    python bench/lever_sweep.py --levers bench/levers_ding.yaml --tokenizer RUN/model --seeds 1 2 3 \\
        --parallel 8 --device cuda --work /tmp/sweep --json bench/results/lever_sweep_gpu.json
    python bench/lever_sweep.py --summarize bench/results/lever_sweep_h200.json --plot sweep.png
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).parent))
from aiayn.evaluate import score_translations
from aiayn.viz import read_metrics
from common import RESULTS, machine, table

COLUMNS = [("lever", "lever"), ("factor", "step factor"), ("steps", "steps"), ("n", "seeds"),
           ("ppl", "dev ppl, mean"), ("greedy", "greedy BLEU / chrF, mean"), ("beam", "beam 4 BLEU / chrF, mean"),
           ("beam_sd", "beam 4 BLEU, sd"), ("delta", "beam 4 BLEU − preset, same seed (mean; each)")]  # fmt: skip


def read_levers(path: Path) -> list[dict]:
    """The levers file: a list of {name, factor, args}; the first is the preset (no args)."""
    levers = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(levers, list) or not levers:
        raise SystemExit(f"{path}: expected a list of levers")
    for i, lever in enumerate(levers):
        if not isinstance(lever, dict) or not {"name", "factor"} <= lever.keys():
            raise SystemExit(f"{path}: lever {i + 1} needs a name and a factor, got {lever!r}")
        lever.setdefault("args", [])
        if not isinstance(lever["args"], list) or not all(isinstance(a, str | int | float) for a in lever["args"]):
            raise SystemExit(f"{path}: lever {lever['name']!r}: args must be a list of strings")
        lever["args"] = [str(a) for a in lever["args"]]
    return levers


def run_job(job: dict, args: argparse.Namespace) -> dict:
    """Train one lever with one seed for its steps, then translate and score the dev split."""
    out = Path(args.work) / f"{job['lever']}_s{job['seed']}"
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), AIAYN_CPU_KERNELS="0", PYTHONUNBUFFERED="1")
    aiayn = [sys.executable, "-m", "aiayn"]
    train = [*aiayn, "train", "--config", args.config, "--out", str(out), "--device", args.device,
             "--data.dir", args.data, "--train.tokenizer", args.tokenizer, "--train.amp", "false",
             "--train.max_time", "null", "--train.max_steps", str(job["steps"]), "--train.seed", str(job["seed"]),
             "--train.checkpoint_minutes", "1000", *job["args"]]  # fmt: skip
    start = time.perf_counter()
    log = out.with_suffix(".log")
    with log.open("w") as f:
        done = subprocess.run(train, stdout=f, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        return dict(job, error=f"train exited {done.returncode}: see {log}")
    train_seconds = time.perf_counter() - start
    finals = [row for row in read_metrics(out) if row.get("kind") == "final"]
    if not finals:
        return dict(job, error=f"no final row in {out / 'metrics.jsonl'}")
    final = finals[-1]
    hyp = out / "dev.beam4.en"
    evaluate = [*aiayn, "evaluate", "--model", str(out / "model"), "--data", args.data, "--split", "dev",
                "--beam", "4", "--alpha", "1.5", "--device", args.device, "--output", str(hyp)]  # fmt: skip
    with log.open("a") as f:
        done = subprocess.run(evaluate, stdout=f, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        return dict(job, error=f"evaluate exited {done.returncode}: see {log}")
    references = (Path(args.data) / "dev.en").read_text(encoding="utf-8").splitlines()
    beam = score_translations(hyp.read_text(encoding="utf-8").splitlines(), references)
    return dict(
        job, ppl=round(final["dev_ppl"], 2), greedy_bleu=round(final["dev_bleu"], 2),
        greedy_chrf=round(final["dev_chrf"], 2), beam_bleu=round(beam.bleu, 2), beam_chrf=round(beam.chrf, 2),
        seconds=round(time.perf_counter() - start, 1), train_seconds=round(train_seconds, 1),
    )  # fmt: skip


def summarize(levers: list[dict], rows: list[dict]) -> list[dict]:
    """Per lever: means over its finished seeds, and its differences from the preset's same seed."""
    done = [r for r in rows if "error" not in r]
    base = {r["seed"]: r for r in done if r["lever"] == levers[0]["name"]}
    out = []
    for lever in levers:
        mine = sorted((r for r in done if r["lever"] == lever["name"]), key=lambda r: r["seed"])
        if not mine:
            continue

        def mean(key: str, rs: list[dict] = mine) -> float:
            return statistics.fmean(r[key] for r in rs)

        deltas = [round(r["beam_bleu"] - base[r["seed"]]["beam_bleu"], 2) for r in mine if r["seed"] in base]
        out.append({
            "lever": lever["name"], "factor": lever["factor"], "steps": mine[0]["steps"], "n": len(mine),
            "seeds": [r["seed"] for r in mine], "ppl": round(mean("ppl"), 2),
            "greedy": f"{mean('greedy_bleu'):.2f} / {mean('greedy_chrf'):.2f}",
            "beam": f"{mean('beam_bleu'):.2f} / {mean('beam_chrf'):.2f}",
            "beam_bleu_mean": round(mean("beam_bleu"), 3), "beam_chrf_mean": round(mean("beam_chrf"), 3),
            "beam_sd": round(statistics.stdev(r["beam_bleu"] for r in mine), 2) if len(mine) > 1 else "",
            "delta": (f"{statistics.fmean(deltas):+.2f}; " + ", ".join(f"{d:+.2f}" for d in deltas))
            if deltas and lever is not levers[0] else "",
        })  # fmt: skip
    return out


def merged(paths: list[str]) -> tuple[list[dict], list[dict]]:
    """The levers (first seen first, the preset first) and rows of several sweeps' JSON files."""
    levers: dict[str, dict] = {}
    rows: list[dict] = []
    for path in paths:
        result = json.loads(Path(path).read_text(encoding="utf-8"))
        for lever in result["levers"]:
            known = levers.setdefault(lever["name"], lever)
            if known["factor"] != lever["factor"] or known["args"] != lever["args"]:
                raise SystemExit(f"{path}: lever {lever['name']!r} differs from an earlier file's")
        rows += result["rows"]
    seen: dict[tuple[str, int], int] = {}
    for row in rows:
        key = (row["lever"], row["seed"])
        if key in seen:
            raise SystemExit(f"lever {key[0]!r} seed {key[1]} is in more than one row: a seed counts once")
        seen[key] = row["steps"]
    for name in levers:
        if len({steps for (lever, _), steps in seen.items() if lever == name}) > 1:
            raise SystemExit(f"lever {name!r} ran for different steps in these files (--steps differed)")
    return list(levers.values()), rows


def plot(levers: list[dict], rows: list[dict], path: str) -> None:
    """Each run's dev BLEU (beam 4) by lever, the lever's mean as a bar, the preset's as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if "error" not in r]
    levers = [lv for lv in levers if any(r["lever"] == lv["name"] for r in done)]  # as summarize() shows them
    fig, ax = plt.subplots(figsize=(1.0 + 0.8 * len(levers), 4))
    for x, lever in enumerate(levers):
        bleu = [r["beam_bleu"] for r in done if r["lever"] == lever["name"]]
        ax.scatter([x] * len(bleu), bleu, s=18, color="C0", alpha=0.7)
        ax.hlines(statistics.fmean(bleu), x - 0.3, x + 0.3, color="C3")
        if x == 0:
            ax.axhline(statistics.fmean(bleu), color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(levers)), [lv["name"] for lv in levers], rotation=30, ha="right")
    ax.set_ylabel("dev BLEU, beam 4, α 1.5")
    ax.set_title("each seed (dots) and the mean (bar); dashed: the preset's mean", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plotted {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levers", default=str(Path(__file__).parent / "levers_ding.yaml"))
    parser.add_argument("--config", default="configs/ding.yaml")
    parser.add_argument("--data", default="data/ding", help="the data directory (train and dev splits)")
    parser.add_argument("--tokenizer", help="a model directory whose tokenizer every run shares")
    parser.add_argument("--steps", type=int, default=3250, help="the preset's steps in the demo's 840 s")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these levers of the file alone (and the preset)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--parallel", type=int, default=4, help="runs at once")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per run")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--deadline", type=float, default=None, help="seconds after which no job starts")
    parser.add_argument("--work", help="a new directory for the runs")
    parser.add_argument("--json", default=str(RESULTS / "lever_sweep.json"))
    parser.add_argument("--summarize", nargs="+", metavar="JSON", help="finished sweeps: print their table")
    parser.add_argument("--plot", help="with --summarize: a PNG of each run's dev BLEU by lever")
    args = parser.parse_args()
    if args.summarize:
        levers, rows = merged(args.summarize)
        print(table(summarize(levers, rows), COLUMNS))
        if args.plot:
            plot(levers, rows, args.plot)
        return
    if args.tokenizer is None or args.work is None:
        parser.error("a sweep needs --tokenizer and --work")
    levers = read_levers(Path(args.levers))
    if args.only:
        unknown = set(args.only) - {lever["name"] for lever in levers}
        if unknown:
            parser.error(f"--only: no lever {sorted(unknown)} in {args.levers}")
        levers = [lever for i, lever in enumerate(levers) if i == 0 or lever["name"] in args.only]
    if Path(args.json).exists():
        parser.error(f"{args.json} exists: give --json a new file")
    if Path(args.work).exists() and any(Path(args.work).iterdir()):
        parser.error(f"{args.work} is not empty: its runs would clash with this sweep's")
    Path(args.work).mkdir(parents=True, exist_ok=True)
    jobs = [
        {"lever": lever["name"], "seed": seed, "steps": round(args.steps * lever["factor"]), "args": lever["args"]}
        for seed in args.seeds
        for lever in levers
    ]
    info = machine()
    gpu = info["cuda"] or "no GPU"
    print(f"{info['cpu']}; {gpu}; torch {info['torch']}; {len(jobs)} jobs, {args.parallel} at once")
    rows: list[dict] = []
    skipped: list[dict] = []
    lock = threading.Lock()
    start = time.perf_counter()

    def write() -> None:
        result = {"machine": info, "steps": args.steps, "levers": levers, "rows": rows,
                  "summary": summarize(levers, rows), "search": "beam 4, alpha 1.5", "split": "dev",
                  "skipped": skipped}  # fmt: skip
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")

    def one(job: dict) -> None:
        if args.deadline is not None and time.perf_counter() - start > args.deadline:
            with lock:
                skipped.append({"lever": job["lever"], "seed": job["seed"]})
            return
        row = run_job(job, args)
        with lock:
            rows.append(row)
            write()
            shown = row.get("error") or (f"ppl {row['ppl']}, greedy {row['greedy_bleu']}, beam 4 "
                                         f"{row['beam_bleu']} / {row['beam_chrf']}, {row['seconds']} s")  # fmt: skip
            print(f"[{time.perf_counter() - start:6.0f} s] {job['lever']} seed {job['seed']}: {shown}", flush=True)

    with ThreadPoolExecutor(args.parallel) as pool:
        list(pool.map(one, jobs))
    if skipped:
        write()
        print(
            f"{len(skipped)} jobs not started (past --deadline): "
            + ", ".join(f"{j['lever']} seed {j['seed']}" for j in skipped)
        )
    print(table(summarize(levers, rows), COLUMNS))
    print(f"written {args.json}")


if __name__ == "__main__":
    main()
