"""Plots people would rather look at than numbers: training curves (and, later, attention maps)."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["plot_run"]


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (is {run_dir} a training run directory?)")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not valid JSON: {e}") from None
    return records


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw loss (train and dev), learning rate, dev perplexity and BLEU of a run into one PNG
    (default ``RUN/curves.png``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    records = _records(run_dir)
    train = [r for r in records if r.get("kind") == "train"]
    dev = [r for r in records if r.get("kind") == "dev"]
    final = [r for r in records if r.get("kind") == "final"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ax = axes[0]
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], lw=0.8, label="train (label-smoothed)")
    if dev:
        ax.plot([r["step"] for r in dev], [r["loss"] for r in dev], "o-", label="dev (NLL)")
    ax.set(xlabel="step", ylabel="loss per token", title="loss")
    ax.legend()
    ax = axes[1]
    ax.plot([r["step"] for r in train], [r["lr"] for r in train])
    ax.set(xlabel="step", ylabel="learning rate", title="learning rate (§5.3)")
    ax = axes[2]
    if dev:
        ax.plot([r["step"] for r in dev], [r["ppl"] for r in dev], "o-", label="dev perplexity")
        ax.set_yscale("log")
    if final and "dev_bleu" in final[-1]:
        twin = ax.twinx()
        twin.plot(
            [final[-1]["step"]], [final[-1]["dev_bleu"]], "r*", ms=12, label=f"dev BLEU {final[-1]['dev_bleu']:.1f}"
        )
        twin.set_ylabel("BLEU")
        twin.legend(loc="center right")
    ax.set(xlabel="step", title="dev perplexity and BLEU")
    if dev:
        ax.legend(loc="upper right")
    fig.tight_layout()
    out = Path(out) if out is not None else run_dir / "curves.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
