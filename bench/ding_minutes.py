"""What minutes of training buy on the Ding demo: single models trained for longer against
ensembles of models trained for the demo's 14 minutes each, on one dev-split axis.

Each ``--models`` group is one system: one run directory is a single model, several make an
ensemble (``aiayn.decode.Ensemble``: the mean of the members' next-token probabilities; their
tokenizers must be identical, ``train.tokenizer``). Every system translates the dev split with
the demo's search (beam 4, α 1.5) and is scored by sacreBLEU; its minutes are the training
seconds its runs took in all (``elapsed`` of each run's ``final`` row in metrics.jsonl). Prints a
table, writes ``bench/results/NAME.json`` (``--name``, default ``ding_minutes``) and plots dev BLEU
against minutes (``--out``).

    python bench/ding_minutes.py --models runs/w/n1d5 --models runs/w/t28 \\
        --models runs/w/n1d5 runs/w/s2tok [--split dev] [--out docs/ding_minutes.png]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from aiayn import Translator
from aiayn.evaluate import score_translations
from aiayn.viz import read_metrics
from common import machine, table, write_result


def training_seconds(run: Path) -> float:
    """The seconds of training a run took: its metrics.jsonl's ``final`` row."""
    try:
        rows = read_metrics(run)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(str(e)) from None
    finals = [row for row in rows if row.get("kind") == "final"]
    if not finals:
        raise SystemExit(f"{run / 'metrics.jsonl'}: no final row (the run did not finish)")
    return float(finals[-1]["elapsed"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", action="append", required=True, metavar="RUN",
                        help="one system: a run directory, or several for an ensemble (repeat for more)")  # fmt: skip
    parser.add_argument("--data", default="data/ding", help="{split}.de/.en files (default %(default)s)")
    parser.add_argument("--split", default="dev", help="the split (default %(default)s)")
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--alpha", type=float, default=1.5)
    parser.add_argument("--out", help="PNG: dev BLEU against minutes of training")
    parser.add_argument("--name", default="ding_minutes", help="the result's name (bench/results/NAME.json)")
    args = parser.parse_args()
    data = Path(args.data)
    sources = (data / f"{args.split}.de").read_text(encoding="utf-8").splitlines()
    references = (data / f"{args.split}.en").read_text(encoding="utf-8").splitlines()
    info = machine()
    print(f"{info['cpu']}, {info['torch_threads']} threads, torch {info['torch']}")
    rows = []
    for group in args.models:
        runs = [Path(r) for r in group]
        minutes = sum(training_seconds(r) for r in runs) / 60
        translator = Translator.from_pretrained([r / "model" for r in runs], alone=True)  # a pair: RUN RUN/member2
        start = time.perf_counter()
        with torch.inference_mode():
            hypotheses = translator.translate(sources, beam=args.beam, alpha=args.alpha)
        seconds = time.perf_counter() - start
        scores = score_translations(hypotheses, references)
        rows.append({
            "system": " + ".join(r.name for r in runs), "runs": [str(r) for r in runs], "models": len(runs),
            "minutes": round(minutes, 1), "bleu": round(scores.bleu, 2), "chrf": round(scores.chrf, 2),
            "decode_seconds": round(seconds, 1),
        })  # fmt: skip
        print(table(rows[-1:], COLUMNS).splitlines()[-1], flush=True)
    print(table(rows, COLUMNS))
    result = {
        "machine": info, "split": args.split, "beam": args.beam, "alpha": args.alpha,
        "bleu_signature": scores.bleu_signature, "chrf_signature": scores.chrf_signature, "rows": rows,
    }  # fmt: skip
    print(f"written {write_result(args.name, result)}")
    if args.out:
        plot(rows, args, Path(args.out))
        print(f"written {args.out}")


def plot(rows: list[dict], args: argparse.Namespace, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for models in sorted({r["models"] for r in rows}):
        chosen = [r for r in rows if r["models"] == models]
        label = "one model" if models == 1 else f"an ensemble of {models}"
        marker = "os^Dv*"[min(models, 6) - 1]
        ax.scatter([r["minutes"] for r in chosen], [r["bleu"] for r in chosen], marker=marker, s=40, label=label)
    for r in rows:
        ax.annotate(r["system"], (r["minutes"], r["bleu"]), fontsize=6, xytext=(4, 2), textcoords="offset points")
    ax.set(
        xlabel="minutes of training, all models together",
        ylabel=f"{args.split} BLEU (beam {args.beam}, α {args.alpha})",
        title="what minutes of training buy: one model or an ensemble",
    )
    ax.set_xlim(0, 1.4 * max(r["minutes"] for r in rows))  # room for the labels
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


COLUMNS = [("system", "models"), ("minutes", "minutes of training"), ("bleu", "BLEU"), ("chrf", "chrF"),
           ("decode_seconds", "decoding s")]  # fmt: skip


if __name__ == "__main__":
    main()
