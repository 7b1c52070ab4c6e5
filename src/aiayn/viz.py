"""Plots people would rather look at than numbers: training curves, attention maps (§3.2),
the positional encodings (§3.5) and the learning-rate schedule (§5.3).

Legend: S source length, T target length, H heads.

Every figure is a ``matplotlib.figure.Figure`` made without pyplot (no global state, no backend
switch, nothing to close). ``plot_run`` saves its figure as a PNG and returns the path; the
others return the figure, which ``out`` also saves as a PNG (Agg).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from .data.tokenizer import Tokenizer
    from .model import Transformer
    from .model.transformer import Attention

__all__ = [
    "read_metrics",
    "plot_run",
    "plot_runs",
    "run_figure",
    "ATTENTION_KINDS",
    "TranslationAttention",
    "translation_attention",
    "plot_attention",
    "plot_positional_encoding",
    "plot_schedule",
]

# kind -> (field of ``Attention``, title)
ATTENTION_KINDS = {
    "enc": ("encoder", "encoder self-attention"),
    "dec": ("decoder_self", "decoder self-attention"),
    "cross": ("decoder_cross", "encoder-decoder attention"),
}
DPI = 100  # of the attention grid's PNG
MAX_PIXELS = 2**28  # the largest attention grid drawn (1 GB as RGBA); larger asks for a smaller selection


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of a run's metrics.jsonl, in order (a bad line names the file and line)."""
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


def _bleu_by_minutes(records: list[dict]) -> tuple[list[float], list[float]]:
    """(minutes of training, dev BLEU) of a run's ``dev_bleu`` records (``train.bleu_every``)
    and of its final evaluation."""
    points = [(r["elapsed"], r["bleu"]) for r in records if r.get("kind") == "dev_bleu"]
    points += [(r["elapsed"], r["dev_bleu"]) for r in records if r.get("kind") == "final" and "elapsed" in r
               and "dev_bleu" in r]  # fmt: skip
    points.sort()
    return [t / 60 for t, _ in points], [b for _, b in points]


def _plot_bleu_by_minutes(ax: Any, label: str, records: list[dict]) -> None:
    minutes, bleu = _bleu_by_minutes(records)
    ax.plot(minutes, bleu, "o-", ms=4, label=label)
    for m, b in zip(minutes, bleu, strict=True):
        ax.annotate(f"{b:.1f}", (m, b), textcoords="offset points", xytext=(0, 5), ha="center", fontsize=7)
    ax.set(xlabel="minutes of training (train.max_time)", ylabel="dev BLEU (greedy)", title="what more time buys")


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw loss (train and dev), learning rate, dev perplexity and BLEU of a run into one PNG
    (default ``RUN/curves.png``; ``run_figure``)."""
    run_dir = Path(run_dir)
    out = Path(out) if out is not None else run_dir / "curves.png"
    run_figure(run_dir).savefig(out, dpi=100)
    return out


def run_figure(run_dir: str | Path) -> Figure:
    """Loss (train and dev), learning rate, dev perplexity and BLEU of a run; with
    ``train.bleu_every``, a fourth panel: dev BLEU against minutes of training. A run of
    ``train.members`` adds its other members' dev perplexity and the members' together at the end."""
    from matplotlib.figure import Figure

    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    train = [r for r in records if r.get("kind") == "train"]
    dev = [r for r in records if r.get("kind") == "dev"]
    final = [r for r in records if r.get("kind") == "final"]
    together = [r for r in records if r.get("kind") == "ensemble"]
    members = sorted(p for p in run_dir.glob("member*") if (p / "metrics.jsonl").is_file())
    over_time = any(r.get("kind") == "dev_bleu" for r in records)
    fig = Figure(figsize=(20 if over_time else 15, 4), layout="tight")
    axes = fig.subplots(1, 4 if over_time else 3)
    if over_time:
        _plot_bleu_by_minutes(axes[3], run_dir.name, records)
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
        label = "dev perplexity" + (", member 1" if members else "")
        ax.plot([r["step"] for r in dev], [r["ppl"] for r in dev], "o-", label=label)
        ax.set_yscale("log")
    for member in members:
        theirs = [r for r in read_metrics(member) if r.get("kind") == "dev"]
        ax.plot([r["step"] for r in theirs], [r["ppl"] for r in theirs], "o-", ms=3, label=f"{member.name}")
    end = final[-1]["step"] if final else (dev[-1]["step"] if dev else 0)
    if together:
        ax.plot([end], [together[-1]["dev_ppl"]], "k*", ms=12, label=f"the {together[-1]['members']} together")
    twin = None
    if final and "dev_bleu" in final[-1]:
        twin = ax.twinx()
        bleu = final[-1]["dev_bleu"]
        alone = ", member 1" if together else ""
        twin.plot([final[-1]["step"]], [bleu], "r*", ms=12, label=f"greedy dev BLEU {bleu:.1f}{alone}")
    if together and "dev_bleu" in together[-1]:
        twin = twin if twin is not None else ax.twinx()
        bleu = together[-1]["dev_bleu"]
        twin.plot([end], [bleu], "m*", ms=12, label=f"greedy dev BLEU {bleu:.1f}, together")
    if twin is not None:
        twin.set_ylabel("BLEU")
        twin.legend(loc="center right")
        ax.set_zorder(twin.get_zorder() + 1)  # the perplexities on top of the BLEU stars
        ax.patch.set_visible(False)
    ax.set(xlabel="step", title="dev perplexity and BLEU")
    if dev:
        ax.legend(loc="upper center")  # the final stars stand at the right
    return fig


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path | None = None) -> Figure:
    """Compare runs: dev perplexity against training step, one line per run, labelled with the
    run's directory name and its final greedy dev BLEU where it has one (e.g. a recipe's levers, one
    change at a time, on the same dev split); where a run logged dev BLEU during training
    (``train.bleu_every``), a second panel: dev BLEU against minutes. Saved as a PNG at ``out``
    if given."""
    from matplotlib.figure import Figure

    runs = [(Path(run_dir), read_metrics(Path(run_dir))) for run_dir in run_dirs]
    over_time = any(r.get("kind") == "dev_bleu" for _, records in runs for r in records)
    fig = Figure(figsize=(16 if over_time else 8, 5), layout="tight")
    axes = fig.subplots(1, 2 if over_time else 1)
    ax = axes[0] if over_time else axes
    if over_time:
        for run_dir, records in runs:
            _plot_bleu_by_minutes(axes[1], run_dir.name, records)
        axes[1].legend()
    for run_dir, records in runs:
        dev = [r for r in records if r.get("kind") == "dev"]
        final = [r for r in records if r.get("kind") == "final" and "dev_bleu" in r]
        label = run_dir.name + (f" (greedy dev BLEU {final[-1]['dev_bleu']:.2f})" if final else "")
        ax.plot([r["step"] for r in dev], [r["ppl"] for r in dev], "o-", ms=3, label=label)
    ax.set_yscale("log")
    ax.set(xlabel="step", ylabel="dev perplexity (per BPE token)", title="dev perplexity")
    ax.legend()
    if out is not None:
        fig.savefig(out, dpi=100)
    return fig


class TranslationAttention(NamedTuple):
    """Every attention map of a model translating one sentence (``translation_attention``)."""

    sentence: str
    translation: str
    source: list[str]  # S source tokens, ending in </s>
    target: list[str]  # T decoder inputs: <s> and the output tokens, one per decoding step
    attention: Attention  # per layer: encoder (H, S, S), decoder_self (H, T, T), decoder_cross (H, T, S)


def translation_attention(
    model: Transformer,
    tokenizer: Tokenizer,
    sentence: str,
    max_len: int | None = None,
    beam: int = 1,
    alpha: float = 0.6,
) -> TranslationAttention:
    """Translate ``sentence`` (greedily, or with beam search of ``beam`` and ``alpha``, §6.1), then
    run the model teacher-forced on the source and its own output to get every layer's attention
    weights (§3.2.3: the three uses of attention). The decoder is causal, so these are the
    weights it computed at each step of the output's path, beam search's included.

    The decoder inputs are ``<s>`` and the output tokens up to, not including, ``</s>``: one row
    per decoding step, the step that predicted the next token. Put the model in eval mode first.
    ``max_len`` caps the output tokens (default: source length + 50, §6.1). A source longer than
    the model's ``max_len`` positions is truncated with a warning, as ``Translator`` does.
    """
    import warnings

    import torch

    from .decode import beam_search, greedy_decode
    from .model.transformer import Attention

    config = model.config
    device = next(model.parameters()).device
    ids = tokenizer.encode(sentence)
    if len(ids) > config.max_len - 1:
        warnings.warn(
            f"the sentence's {len(ids)} tokens were truncated to the model's {config.max_len - 1}", stacklevel=2
        )
        ids = ids[: config.max_len - 1]
    src = torch.tensor([[*ids, config.eos_id]], device=device)  # (1, S)
    if beam > 1:
        output = [*beam_search(model, src, beam=beam, alpha=alpha, max_len=max_len)[0][0].tokens, config.eos_id]
    else:
        output = greedy_decode(model, src, max_len=max_len)[0].tolist()
    steps = output.index(config.eos_id) + 1 if config.eos_id in output else len(output)
    tgt = [config.bos_id, *output][: max(steps, 1)]  # the tokens fed to the decoder while translating
    with torch.no_grad():
        _, attention = model(src, torch.tensor([tgt], device=device), return_attention=True)
    per_layer = [None if weights is None else [w[0].float().cpu() for w in weights] for weights in attention]
    return TranslationAttention(
        sentence=sentence,
        translation=tokenizer.decode(output),
        source=tokenizer.pieces(src[0].tolist()),
        target=tokenizer.pieces(tgt, target=True),
        attention=Attention(*per_layer),  # without the batch dimension
    )


def _select(chosen: Sequence[int] | None, count: int, what: str) -> list[int]:
    if chosen is None:
        return list(range(count))
    chosen = list(chosen)
    bad = [i for i in chosen if not 0 <= i < count]
    if bad or not chosen:
        raise ValueError(f"{what} {bad or chosen}: the model has {count} {what} (0 to {count - 1})")
    return chosen


def plot_attention(
    maps: TranslationAttention,
    kinds: Sequence[str] = ("enc", "dec", "cross"),
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    out: str | Path | None = None,
) -> Figure:
    """A grid of attention heatmaps (§3.2.3): one row per kind and layer, one column per head.

    Each panel shows ``softmax(QKᵀ/√d_k)`` of one head: a row per query, a column per key, each
    row summing to 1, with the tokens on both axes. ``kinds`` are ``enc`` (encoder
    self-attention, source × source), ``dec`` (decoder masked self-attention, target × target)
    and ``cross`` (encoder-decoder attention, target × source); ``layers`` and ``heads`` count
    from 0 (default: all). Colour runs from 0 to 1 in every panel, so heads compare directly.

    Returns the figure, with ``len(kinds) · len(layers) · len(heads)`` axes; saved as a PNG
    at ``out`` if given.
    """
    from matplotlib.figure import Figure

    unknown = [k for k in kinds if k not in ATTENTION_KINDS]
    if unknown or not kinds:
        raise ValueError(f"attention kinds {unknown or list(kinds)}: choose from {', '.join(ATTENTION_KINDS)}")
    grid = []  # one row of panels per kind and layer: (title, weights (query, key), query tokens, key tokens)
    for kind in kinds:
        field, title = ATTENTION_KINDS[kind]
        weights = getattr(maps.attention, field)
        if weights is None:
            raise ValueError(f"this model has no {title}")
        rows = maps.source if kind == "enc" else maps.target
        columns = maps.target if kind == "dec" else maps.source
        for layer in _select(layers, len(weights), f"{kind} layers"):
            heads_of = _select(heads, weights[layer].size(0), "heads")
            grid.append([(f"{title}, layer {layer}, head {h}", weights[layer][h], rows, columns) for h in heads_of])
    size = 1.5 + 0.2 * max(len(maps.source), len(maps.target))  # inches per panel: room for the tick labels
    width, height = size * len(grid[0]), size * len(grid) + 0.6
    pixels = (round(width * DPI), round(height * DPI))
    if max(pixels) >= 2**16 or pixels[0] * pixels[1] > MAX_PIXELS:  # Agg's limit per side; ~1 GB of RGBA
        raise ValueError(
            f"the attention figure would be {pixels[0]} x {pixels[1]} pixels ({len(grid)} x {len(grid[0])} panels "
            f"of {max(len(maps.source), len(maps.target))} tokens); choose fewer kinds, layers or heads, "
            "or a shorter sentence"
        )
    fig = Figure(figsize=(width, height), layout="constrained")
    fig.suptitle(f"{maps.sentence}  →  {maps.translation}", fontsize=10)
    axes = fig.subplots(len(grid), len(grid[0]), squeeze=False)
    for row_axes, row in zip(axes, grid, strict=True):
        for ax, (title, weights, rows, columns) in zip(row_axes, row, strict=True):
            ax.imshow(weights.numpy(), cmap="viridis", vmin=0.0, vmax=1.0)
            ax.set_xticks(range(len(columns)), labels=columns, rotation=90, fontsize=7)
            ax.set_yticks(range(len(rows)), labels=rows, fontsize=7)
            ax.set_title(title, fontsize=8)
    if out is not None:
        fig.savefig(out, dpi=DPI)
    return fig


def plot_positional_encoding(
    length: int = 100, d_model: int = 64, base: float = 10000.0, out: str | Path | None = None
) -> Figure:
    """The sinusoidal positional encodings PE(pos, 2i) = sin(pos / 10000^(2i/d_model)),
    PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model)) (§3.5) as a heatmap: a row per position, a
    column per dimension. Returns the figure; saved as a PNG at ``out`` if given."""
    from matplotlib.figure import Figure

    from .model.embedding import sinusoidal_encoding

    if length <= 0 or d_model <= 0:
        raise ValueError(f"length and d_model must be positive, got {length} and {d_model}")
    fig = Figure(figsize=(8, 6), layout="constrained")
    ax = fig.subplots()
    image = ax.imshow(sinusoidal_encoding(length, d_model, base).numpy(), cmap="RdBu", vmin=-1, vmax=1, aspect="auto")
    ax.set(
        xlabel="dimension (even: sin, odd: cos)",
        ylabel="position",
        title=f"positional encoding (§3.5), d_model = {d_model}",
    )
    fig.colorbar(image, ax=ax)
    if out is not None:
        fig.savefig(out, dpi=100)
    return fig


def plot_schedule(
    d_model: int,
    warmup: int = 4000,
    scale: float = 1.0,
    steps: int | None = None,
    out: str | Path | None = None,
    cooldown: float = 0.0,
    budget: str = "",
) -> Figure:
    """lrate = scale · d_model^-0.5 · min(step^-0.5, step · warmup^-1.5) (§5.3, eq. 3) for steps
    1 to ``steps`` (default 10 · warmup): a linear rise to the peak at ``warmup``, then an
    inverse-square-root decay; with ``cooldown`` (``train.cooldown``) the rate falls linearly to
    0 over that last fraction of the ``steps``, taken as the run's budget (``budget`` says what
    else it stands for, e.g. a run's ``max_time``). Returns the figure; saved as a PNG at ``out``
    if given."""
    from matplotlib.figure import Figure

    from .train.schedule import cooldown_factor, paper_lr

    steps = 10 * warmup if steps is None else steps
    if steps <= 0:
        raise ValueError(f"steps must be positive, got {steps}")
    x = list(range(1, steps + 1))
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.subplots()
    # step k starts with k - 1 steps of the budget spent, as in the trainer
    ax.plot(x, [paper_lr(step, d_model, warmup, scale) * cooldown_factor((step - 1) / steps, cooldown) for step in x])
    if warmup <= steps:
        peak = paper_lr(warmup, d_model, warmup, scale)
        ax.axvline(warmup, color="grey", ls=":", label=f"warmup = {warmup}: peak {peak:.3g}")
    if cooldown > 0:
        label = f"cooldown: the last {cooldown:g} of {steps:,} steps" + (f" ({budget})" if budget else "")
        ax.axvline((1 - cooldown) * steps, color="grey", ls="--", label=label)
    if warmup <= steps or cooldown > 0:
        ax.legend()
    ax.set(
        xlabel="step",
        ylabel="learning rate",
        title=f"learning rate (§5.3): d_model = {d_model}, warmup = {warmup}, scale = {scale:g}",
    )
    if out is not None:
        fig.savefig(out, dpi=100)
    return fig
