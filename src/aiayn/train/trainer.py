"""The training loop (§5): token batches, Adam with warmup and inverse-square-root decay,
label smoothing, dropout; gradient accumulation, checkpoints with exact resume, validation,
and DistributedDataParallel under torchrun.

One loop for the three tasks of ``train.task`` (translation, causal LM, masked LM): what a
micro-batch holds and how it is scored is the task's ``Objective`` (``objectives.py``).

One step = ``accumulate`` micro-batches on each of ``world`` processes. The loss of a step is
the sum of label-smoothed token losses divided by the number of scored tokens in the whole step
(all micro-batches, all processes), so one process with accumulation and several processes
with DDP take the same step. The masked LM's random choice of tokens is seeded by the step and
the micro-batch, so it too is the same after a resume.
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from ..data.batching import RemadeBatcher, ResampledBatcher, TokenBatcher, padding_fraction
from ..data.substitute import NounLexicon, read_nouns
from ..data.tokenizer import Tokenizer, load_tokenizer, save_tokenizer
from ..decode import Ensemble, translate_ids
from ..engine import kernels
from ..evaluate import Scores, evaluate_loss, score_translations
from ..model import ModelConfig, Transformer
from ..model.pretrained import CONFIG_NAME, atomic_write
from ..progress import progress_bar
from ..retrieval import DATASTORE_NAME, Datastore
from ..translator import Translator
from .allocator import keep_freed_memory
from .checkpoint import list_checkpoints, load_checkpoint, resumable_checkpoint, save_checkpoint
from .config import DataConfig, RunConfig, TrainConfig
from .data import load_phrases, sample_phrases
from .distributed import all_reduce_sum, barrier, setup_distributed, teardown_distributed
from .members import (
    AUTO_AT,
    ENSEMBLE_NAME,
    Member,
    choose_members,
    member_seed,
    split_threads,
    start_member,
    write_ensemble,
)
from .objectives import Objective, Translation, objective_for
from .precision import Precision, choose_precision, time_passes
from .schedule import cooldown_factor, paper_lr

__all__ = ["TrainResult", "train"]

Log = Callable[[str], None]


@dataclass
class TrainResult:
    step: int
    epoch: int
    train_loss: float | None
    dev_loss: float | None
    dev_ppl: float | None
    dev_scores: Scores | None
    model_dir: Path
    seconds: float
    members: int = 1  # models trained at once (train.members); more than one: an ensemble
    ensemble_dev_scores: Scores | None = None  # the members' together, greedy


class _Metrics:
    """metrics.jsonl: one JSON object per line (train steps, validations, final scores)."""

    def __init__(self, path: Path, enabled: bool, keep_until_step: int | None) -> None:
        self.path, self.enabled = path, enabled
        if enabled and keep_until_step is not None and path.exists():
            # resuming: drop what a killed run logged after its last checkpoint, including a last
            # line that the kill cut short (not JSON); rewritten atomically, as a kill may come again
            lines = [line for line in path.read_text().splitlines() if line.strip()]
            if lines and not _is_json(lines[-1]):
                lines.pop()
            kept = [line for line in lines if json.loads(line).get("step", 0) <= keep_until_step]
            atomic_write(path, lambda tmp: Path(tmp).write_text("".join(line + "\n" for line in kept)))
        elif enabled and keep_until_step is None:
            path.write_text("")
        self.writer = None
        if enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(path.parent / "tensorboard"))
            except ImportError:
                pass

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in record.items():
                if key not in ("step", "kind") and isinstance(value, (int, float)):
                    self.writer.add_scalar(f"{record.get('kind', 'train')}/{key}", value, record.get("step", 0))


def _is_json(line: str) -> bool:
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return False
    return True


def _adam(model: torch.nn.Module, lr: float, cfg: TrainConfig) -> torch.optim.Adam:
    """Adam (§5.3) with torch's fused kernel: one pass over each parameter for the whole update, on
    the CPU too (4-5x faster updates than the multi-tensor one, at the Ding preset and the base
    shape; 1.07x a bf16 training step of the preset, Zen 4: docs/benchmarks.md). Where this torch
    has no fused kernel for the device (the CPU before torch 2.4), the multi-tensor update."""
    try:
        return torch.optim.Adam(model.parameters(), lr=lr, betas=cfg.betas, eps=cfg.adam_eps, fused=True)
    except RuntimeError:
        return torch.optim.Adam(model.parameters(), lr=lr, betas=cfg.betas, eps=cfg.adam_eps, foreach=True)


def _positions(
    batcher: TokenBatcher | ResampledBatcher | RemadeBatcher, epoch: int, index: int
) -> Iterator[tuple[int, int, int, list[int]]]:
    """(epoch, index, batches in that epoch, batch) from a position on, across epochs."""
    while True:
        batches = batcher.epoch(epoch)
        while index < len(batches):
            yield epoch, index, len(batches), batches[index]
            index += 1
        epoch, index = epoch + 1, 0


def dev_translation_scores(
    model: Transformer | Ensemble,
    tokenizer: Tokenizer,
    sources: list[str],
    references: list[str],
    datastores: list[Datastore] | None = None,
) -> Scores:
    """BLEU and chrF (sacreBLEU) of the model's (or ensemble's) greedy translations of ``sources``,
    decoded by the engine as ``aiayn translate`` decodes (``aiayn.engine.prepare``; with each
    member's kNN-MT ``datastores`` where given); leaves the model in eval mode."""
    model.eval()
    fast = Translator(model, tokenizer, datastores=datastores).model  # on the engine (an ensemble: each member)
    hypotheses = tokenizer.decode_batch(translate_ids(fast, [tokenizer.encode(s) for s in sources]))
    return score_translations(hypotheses, references)


PROBE_BATCHES = 9  # a warm-up and 8 timed: about 1 s at the demo's size, 10 s at d_model 512


def _datastores(
    model: Transformer, model_dir: Path, member_dirs: list[Path], pairs: list[Any], device: torch.device, say: Log
) -> list[Datastore]:
    """``train.knn``: the kNN-MT datastore (``aiayn.retrieval``) of the run's model and of each
    member over the training sentence ``pairs``, each saved into its model directory (a member's
    own run saved its own: loaded)."""
    stores = []
    for directory in [model_dir, *member_dirs]:
        if directory != model_dir and (store := Datastore.load(directory)) is not None:
            stores.append(store)
            continue
        t0 = time.perf_counter()
        m = model if directory == model_dir else Transformer.from_pretrained(directory, device=device)
        store = Datastore.build(m, pairs)
        store.save(directory)
        seconds = time.perf_counter() - t0
        where = directory / DATASTORE_NAME
        say(f"kNN-MT: {len(store):,} keys of {len(pairs):,} sentence pairs in {where} ({seconds:.0f} s)")
        stores.append(store)
    return stores


def _probe(
    model: torch.nn.Module, objective: Objective, batches: list[Any], device: torch.device
) -> tuple[float, float]:
    """(fp32, bf16) seconds of forward and backward passes over ``batches`` (the first a warm-up),
    for ``choose_precision``. It leaves no trace: the random state (dropout) is restored and the
    gradients dropped."""
    batches = [b.to(device) for b in batches]

    def passes(bf16: bool, i: int) -> None:
        context = Precision("bf16" if bf16 else "fp32", "probe").autocast(device)
        loss, _ = objective.loss(model, batches[i], 0.1, context)
        (loss / batches[i].num_tokens).backward()

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        seconds = time_passes(passes, len(batches))
    model.zero_grad(set_to_none=True)
    return seconds


def _nouns(data: DataConfig) -> NounLexicon:
    """``data.substitute``'s lexicon, ``{dir}/nouns.tsv``."""
    path = Path(str(data.dir)) / "nouns.tsv"
    if not path.is_file():
        raise FileNotFoundError(f"data.substitute: {path} not found; aiayn data ding --out {data.dir} writes it")
    return NounLexicon(read_nouns(path))


def _substitution(
    lexicon: NounLexicon,
    examples: list[Any],
    raw: list[tuple[str, str]],
    tokenizer: Tokenizer,
    objective: Translation,
    data: DataConfig,
    seed: int,
    say: Callable[[str], None],
) -> Callable[[list[int], int], list[Any]]:
    """``data.substitute``: a remake of each epoch's examples (given as indices into ``examples``)
    in which that share of the sentence pairs have a noun of Ding swapped on both sides
    (``aiayn.data.substitute``); the other examples, phrase pairs among them, as they are."""
    german_first = data.src_lang == "de"
    each = objective.encode_each(tokenizer, raw, data.max_len)
    kept = [pair for pair, example in zip(raw, each, strict=True) if example is not None]  # examples[i]'s pair
    sentences = [pair if german_first else pair[::-1] for pair in kept]  # (German, English)
    eligible = [i for i, pair in enumerate(sentences) if lexicon.candidates(*pair)]
    say(
        f"substitute: {len(eligible):,} of {len(sentences):,} sentence pairs align a noun of the "
        f"{len(lexicon.nouns):,} of {data.dir}/nouns.tsv; {data.substitute:g} of them changed each epoch"
    )

    def remake(indices: list[int], epoch: int) -> list[Any]:
        rng = random.Random(f"substitute {seed} {epoch}")  # a stream of its own, apart from BPE-dropout's
        chosen = {i for i in eligible if rng.random() < data.substitute}
        swapped = {i: lexicon.substitute(*sentences[i], rng) for i in indices if i in chosen}  # in the epoch's order
        changed = [(i, pair if german_first else pair[::-1]) for i, pair in swapped.items() if pair is not None]
        encoded = objective.encode_each(tokenizer, [pair for _, pair in changed], data.max_len)
        new = {i: example for (i, _), example in zip(changed, encoded, strict=True) if example is not None}
        return [new.get(i, examples[i]) for i in indices]  # too long now: the pair as it was

    return remake


def _in_turn(remakes: list[Callable[[list[Any], int], list[Any]]]) -> Callable[[list[Any], int], list[Any]]:
    """One remake of an epoch's examples that applies ``remakes`` in turn, each to the last one's output."""

    def remake(examples: list[Any], epoch: int) -> list[Any]:
        for each in remakes:
            examples = each(examples, epoch)
        return examples

    return remake


def _remade(
    batcher: TokenBatcher | ResampledBatcher,
    source: list[Any],
    remake: Callable[[list[Any], int], list[Any]],
    objective: Objective,
    cfg: TrainConfig,
) -> RemadeBatcher:
    """Batches of each epoch's examples remade by ``remake`` from ``source`` (every example, or
    the resampled phrase pairs' draw of the epoch), batched by the lengths they then have."""
    everyone = list(range(len(source)))
    members = batcher.members if isinstance(batcher, ResampledBatcher) else (lambda _: everyone)
    return RemadeBatcher(source, members, remake, objective.lengths, cfg.max_tokens, cfg.seed)


def _lengths(batcher: RemadeBatcher, objective: Objective) -> dict[int, tuple[int, int]]:
    """The first epoch's (source, target) lengths by example index, for the padding report."""
    remade = batcher.examples(0)
    return dict(zip(remade, objective.lengths(list(remade.values())), strict=True))


def _batch_seed(seed: int, step: int, index: int) -> int:
    """The seed of micro-batch ``index`` (0 .. accumulate x world - 1) of ``step``: a function of
    the position in training only, so a resumed run draws the same masks."""
    return (seed * 1_000_003 + step) * 10_007 + index


def train(
    run: RunConfig,
    out_dir: str | Path,
    resume: bool = False,
    progress: bool = True,
    log: Log = print,
    device: str | None = None,
) -> TrainResult:
    """Train the model of ``run.train.task`` (a ``Transformer`` for translation, a ``DecoderOnly``
    for ``lm``, an ``EncoderOnly`` for ``mlm``) as ``run`` says, writing checkpoints,
    ``metrics.jsonl`` and the final model (``out_dir/model``) into ``out_dir``. With ``resume``,
    continue from the latest checkpoint exactly where it stopped (from the one before if a file of
    it is missing or cut short, saying so), or start afresh if there is none. With
    ``train.members`` above one, the other members train in child processes (``members.py``),
    stopped if this one fails."""
    members: list[Member] = []
    threads = torch.get_num_threads()
    try:
        return _train(run, out_dir, resume, progress, log, device, members)
    finally:
        for member in members:
            member.stop()
        torch.set_num_threads(threads)


def _train(
    run: RunConfig,
    out_dir: str | Path,
    resume: bool,
    progress: bool,
    log: Log,
    device: str | None,
    members: list[Member],
) -> TrainResult:
    t0 = time.perf_counter()
    d = setup_distributed(device)
    out = Path(out_dir)
    say = log if d.main else (lambda _: None)
    cfg = run.train
    objective = objective_for(cfg)
    unit = objective.unit
    checkpoint = resumable_checkpoint(out, say) if resume else None
    if resume and checkpoint is None:  # killed before its first checkpoint: nothing to lose
        say(f"{out}: no checkpoint to resume from; starting afresh")
    if not resume and any(list_checkpoints(p) for p in [out, *sorted(out.glob("member*"))]):
        raise ValueError(f"{out} already holds checkpoints: continue it with --resume, or choose another --out")
    given = None  # train.tokenizer's, read before anything is written
    if checkpoint is None and cfg.tokenizer is not None:
        given = load_tokenizer(cfg.tokenizer)
        if not isinstance(given, Tokenizer):  # the model's special ids and sizes come from aiayn's BPE
            raise ValueError(
                f"train.tokenizer: {cfg.tokenizer} holds a Marian model's tokenizer; fine-tune it with train.init"
            )
    if d.main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "run.json").write_text(json.dumps(run.to_dict(), indent=2) + "\n")

    # Data and tokenizer -----------------------------------------------------------------------
    train_raw = objective.load(run.data, "train", say, cfg.seed, required=True)
    lexicon = _nouns(run.data) if run.data.substitute else None
    dev_raw = objective.load(run.data, "dev", say, cfg.seed, required=False)
    # with data.resample_phrases, a fresh draw of phrase pairs each epoch (ResampledBatcher)
    pool_raw = load_phrases(run.data, say) if run.data.resample_phrases else []
    bpe_phrases = sample_phrases(pool_raw, run.data.phrases, len(train_raw), cfg.seed)  # what BPE sees
    draw = len(bpe_phrases)  # phrase pairs per epoch
    if checkpoint is not None:
        tokenizer = load_tokenizer(checkpoint)
    elif cfg.init is not None:
        tokenizer = load_tokenizer(cfg.init)
        say(f"fine-tuning {cfg.init}: its tokenizer, config and weights")
    elif given is not None:
        tokenizer = given
        say(f"tokenizer: {cfg.tokenizer}'s, {tokenizer.vocab_size:,} tokens (train.tokenizer; no BPE learnt)")
    else:
        bpe_raw = train_raw + bpe_phrases
        say(f"training a joint BPE of {cfg.vocab_size} tokens on {len(bpe_raw):,} {unit} ...")
        tokenizer = Tokenizer.train(objective.texts(bpe_raw), cfg.vocab_size, phrase_tag=run.data.phrase_tag)
    if d.main and checkpoint is None:
        save_tokenizer(tokenizer, out)
    if cfg.word_dropout and not isinstance(tokenizer, Tokenizer):
        raise ValueError("train.word_dropout needs aiayn's BPE tokenizer (its special ids), not a Marian model's")
    if cfg.bpe_dropout:
        if not isinstance(tokenizer, Tokenizer):
            raise ValueError("train.bpe_dropout needs aiayn's BPE tokenizer (its merges), not a Marian model's")
        objective.merge_parents = tokenizer.merge_parents()
    if run.data.phrase_tag and tokenizer.phrase_id is None:
        src = cfg.init or cfg.tokenizer
        made = "made before it" if src is None else "set data.phrase_tag false, or take a tokenizer made with the tag"
        raise ValueError(f"data.phrase_tag: the tokenizer of {checkpoint or src} has no <phrase> token ({made})")
    train_examples, too_long = objective.encode(tokenizer, train_raw, run.data.max_len)
    say(f"train: {len(train_examples):,} {unit}; skipped {too_long:,} empty or longer than {run.data.max_len} tokens")
    dev_examples, dev_too_long = objective.encode(tokenizer, dev_raw, run.data.max_len)
    if dev_raw:
        say(f"dev: {len(dev_examples):,} {unit}; skipped {dev_too_long:,} empty or too long")
    translation = isinstance(objective, Translation)  # the dev pairs whose translations are scored
    sentence_examples = train_examples  # the training pairs without the phrases: train.knn's datastores
    dev_sources = [s for s, _ in dev_raw][: run.data.dev_size] if translation and dev_examples else []
    dev_references = [t for _, t in dev_raw][: run.data.dev_size] if translation else []

    batcher: TokenBatcher | ResampledBatcher | RemadeBatcher
    if pool_raw:
        tag = 1 if run.data.phrase_tag else 0  # the tag counts towards data.max_len
        pool_examples, pool_skipped = objective.encode(tokenizer, pool_raw, run.data.max_len - tag)
        if run.data.phrase_tag:
            pool_examples = [([tokenizer.phrase_id, *s], t) for s, t in pool_examples]
        say(
            f"phrases: {len(pool_examples):,} pairs (skipped {pool_skipped:,} empty or too long); a fresh draw "
            f"of {draw:,} each epoch ({run.data.phrases:g} per sentence pair)"
        )
        fixed = len(train_examples)
        train_examples = train_examples + pool_examples
        lengths = objective.lengths(train_examples)
        batcher = ResampledBatcher(lengths, fixed, draw, cfg.max_tokens, seed=cfg.seed)
    else:
        lengths = objective.lengths(train_examples)
        batcher = TokenBatcher(lengths, cfg.max_tokens, seed=cfg.seed)
    remakes: list[Callable[[list[Any], int], list[Any]]] = []  # each epoch's examples remade, in this order
    source: list[Any] = train_examples  # what the first remake starts from
    if lexicon is not None:  # each epoch, a share of the sentence pairs with one noun swapped
        assert isinstance(objective, Translation)  # data.substitute needs data.format parallel: a translation task
        remakes.append(_substitution(lexicon, train_examples, train_raw, tokenizer, objective, run.data, cfg.seed, say))
        source = list(range(len(train_examples)))  # the substitution starts from the examples' indices
    if cfg.bpe_dropout:  # each epoch's examples (swapped or not) split afresh, from bpe_dropout_from
        if cfg.bpe_dropout_from:
            say(f"BPE-dropout {cfg.bpe_dropout:g} from epoch {cfg.bpe_dropout_from} (train.bpe_dropout_from)")

        def split(examples: list[Any], epoch: int) -> list[Any]:
            if epoch < cfg.bpe_dropout_from:
                return examples
            return objective.split_examples(examples, run.data.max_len, random.Random(cfg.seed * 1_000_003 + epoch))

        remakes.append(split)
    if remakes:  # then batched by the lengths the examples have after them
        batcher = _remade(batcher, source, _in_turn(remakes), objective, cfg)
        lengths = _lengths(batcher, objective)
    first = batcher.epoch(0)
    say(
        f"batches: {len(first):,} in the first epoch, of <= {cfg.max_tokens} positions per side; "
        f"padding {padding_fraction(lengths, first):.1%}; step = {cfg.accumulate} x {d.world} batches"
    )

    # Model and optimizer ----------------------------------------------------------------------
    host_memory = keep_freed_memory()  # before the probe and the steps: both allocate alike
    say(f"freed host memory: {host_memory}")
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    suppress = tuple(run.model.get("suppress_ids", ())) + ((tokenizer.phrase_id,) if run.data.phrase_tag else ())
    if checkpoint is not None:  # a resumed run goes on with the model it saved
        model_config, _ = ModelConfig.load(checkpoint / CONFIG_NAME)
    elif cfg.init is not None:  # fine-tuning: the model's own config, the run's dropout
        model_config = run.init_config(**({"suppress_ids": suppress} if suppress else {}))
    else:
        model_config = run.model_config(tokenizer.vocab_size, suppress_ids=suppress)  # the tag is never a translation
    model = objective.model_class(model_config).to(d.device)
    if cfg.init is not None and checkpoint is None:
        model.load_state_dict(objective.model_class.from_pretrained(cfg.init, device=d.device).state_dict())
    if d.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    optimizer = _adam(model, paper_lr(1, model_config.d_model, cfg.warmup, cfg.lr_scale), cfg)
    state: dict[str, Any] = {"step": 0, "epoch": 0, "index": 0, "elapsed": 0.0}
    if checkpoint is not None:
        kernel = {k: optimizer.param_groups[0][k] for k in ("fused", "foreach")}
        state = load_checkpoint(checkpoint, model, optimizer)
        for group in optimizer.param_groups:  # this machine's kernel, not the saved run's
            group.update(kernel)
        say(f"resumed from {checkpoint} (step {state['step']}, epoch {state['epoch']}, batch {state['index']})")
    say(f"model: {model.num_parameters():,} parameters; {model_config}")
    ddp = model
    if d.world > 1:
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[d.device] if d.device.type == "cuda" else None
        )
    forward = torch.compile(ddp, dynamic=True) if cfg.compile else ddp
    if d.device.type == "cpu":  # the loss kernel's one-off build (~20 s), outside the probe and max_time
        kernels.loss_kernel_on()
    if "precision" in state:  # a resumed run keeps the precision it started with
        precision = Precision(state["precision"], "as the run it resumes")
    else:

        def probe() -> tuple[float, float]:
            chosen = first[:PROBE_BATCHES]
            batches = [objective.collate([train_examples[i] for i in b], model_config, 0) for b in chosen]
            return _probe(model, objective, batches, d.device)

        precision = choose_precision(cfg.amp, d.device, probe)
        if d.world > 1:  # every process must train alike: the main process's choice
            main_bf16 = all_reduce_sum(torch.tensor(float(precision.bf16 and d.main), device=d.device), d).item()
            precision = precision if precision.bf16 == bool(main_bf16) else Precision(
                "bf16" if main_bf16 else "fp32", "the main process's choice"
            )  # fmt: skip
    state["precision"] = precision.name
    say(f"precision: {precision.name} ({precision.reason})")
    threads = torch.get_num_threads()
    together = d.world == 1 and d.device.type == "cpu"  # members: one machine's CPU cores
    if cfg.members != 1 and not together:
        if cfg.members != "auto":
            raise ValueError(
                "train.members trains several models on one machine's CPU: set 1 under torchrun or on a GPU"
            )
        state["members"] = 1
        say("members: 1 (train.members auto trains several models on one machine's CPU only)")
    elif "members" not in state:  # a resumed run keeps its members; one from before train.members has one
        state["members"] = cfg.members if checkpoint is None else 1  # "auto": decided in the loop
        state["member_max_time"] = cfg.max_time
    if state["members"] == "auto" and cfg.max_time is None:
        state["members"] = 1
        say("members: 1 (train.members auto projects steps in max_time; none set)")

    def start_members(why: str, say: Log = say) -> None:
        """Start members 2.. of ``state["members"]``; this process keeps its share of the threads."""
        count = state["members"]
        own, each = split_threads(threads, count)
        overrides: dict[str, Any] = {}
        if cfg.init is None and cfg.tokenizer is None:
            overrides["tokenizer"] = str(out)  # the tokenizer this run learnt, saved above
        if state["member_max_time"] is not None:
            overrides["max_time"] = state["member_max_time"]
        config = out / "members.yaml"  # the run's config as YAML (YAML reads JSON's 1e-09 as a string)
        atomic_write(config, lambda tmp: Path(tmp).write_text(yaml.safe_dump(run.to_dict(), sort_keys=False)))
        for i in range(2, count + 1):
            members.append(start_member(config, out, i, member_seed(cfg.seed, i), each, resume, overrides))
        torch.set_num_threads(own)
        others = "member 2 in" if count == 2 else f"members 2-{count} in"
        threads_each = f"{each} thread{'s' if each > 1 else ''} each" + (f" (this one {own})" if own != each else "")
        say(f"members: {count} ({why}); {others} {out}/member*, on {threads_each}, logs in train.log there")

    if state["members"] not in (1, "auto"):
        start_members("train.members" if checkpoint is None else "as the run it resumes")
    amp = precision.autocast(d.device)
    metrics = _Metrics(out / "metrics.jsonl", d.main, state["step"] if checkpoint is not None else None)
    metrics.log(
        {
            "kind": "precision", "step": state["step"], "precision": precision.name, "reason": precision.reason,
            "bf16_rows": precision.rows if precision.bf16 and d.device.type == "cpu" else None,
            "host_memory": host_memory,
        }
    )  # fmt: skip

    # Loop ------------------------------------------------------------------------------------
    per_step = cfg.accumulate * d.world
    stream = _positions(batcher, state["epoch"], state["index"])
    step, elapsed_before = state["step"], state["elapsed"]
    barrier(d)  # the processes' clocks start together (max_time, the cooldown)
    start = time.perf_counter()
    last_checkpoint_time = start
    train_loss = dev_loss = dev_ppl = None
    bar = progress_bar(total=cfg.max_steps, initial=step, disable=not (progress and d.main), desc="train", unit="step")
    model.train()

    def clock() -> float:
        """This process's seconds of training so far, the resumed run's before it included."""
        return elapsed_before + time.perf_counter() - start

    def seconds_spent() -> float:
        """Seconds of training so far. With ``max_time``, under several processes, their mean:
        every process then stops at the same step (none waits on the others forever) and takes
        the same cooldown rate."""
        seconds = clock()
        if cfg.max_time is None or d.world == 1:
            return seconds
        return all_reduce_sum(torch.tensor(seconds, dtype=torch.float64), d).item() / d.world

    def stop_reason(seconds: float) -> str | None:
        if cfg.max_steps is not None and step >= cfg.max_steps:
            return "max_steps"
        if cfg.max_epochs is not None and state["epoch"] >= cfg.max_epochs:
            return "max_epochs"
        if cfg.max_time is not None and seconds >= cfg.max_time:
            return "max_time"
        return None

    def budget_spent(position: float, seconds: float) -> float:
        """The fraction of the run's budget spent (steps, epochs or seconds, whichever is ahead)."""
        spent = [0.0]
        if cfg.max_steps is not None:
            spent.append(step / cfg.max_steps)
        if cfg.max_epochs is not None:
            spent.append(position / cfg.max_epochs)
        if cfg.max_time is not None:
            spent.append(seconds / cfg.max_time)
        return max(spent)

    def examples_of(epoch: int) -> Any:
        """The training examples the batches of ``epoch`` index (remade: that epoch's)."""
        return batcher.examples(epoch) if isinstance(batcher, RemadeBatcher) else train_examples

    def checkpoint_now() -> Path:
        state["elapsed"] = clock()
        return save_checkpoint(out, model, tokenizer, optimizer, dict(state, run=run.to_dict()), cfg.keep_checkpoints)

    while (reason := stop_reason(seconds := seconds_spent())) is None:
        step_start = time.perf_counter()
        group = [next(stream) for _ in range(per_step)]
        epoch, index, epoch_batches, _ = group[-1]
        state["epoch"], state["index"] = epoch, index + 1  # where the next step starts
        mine = [
            objective.collate([examples_of(e)[i] for i in indices], model_config, _batch_seed(cfg.seed, step, j), True)
            for j, (e, *_, indices) in enumerate(group)
            if j % d.world == d.rank
        ]
        tokens = all_reduce_sum(torch.tensor(float(sum(b.num_tokens for b in mine))), d).item()
        positions = all_reduce_sum(torch.tensor(float(sum(b.num_positions for b in mine))), d).item()
        lr = paper_lr(step + 1, model_config.d_model, cfg.warmup, cfg.lr_scale)
        if cfg.cooldown:
            lr *= cooldown_factor(budget_spent(group[0][0] + group[0][1] / group[0][2], seconds), cfg.cooldown)
        for g in optimizer.param_groups:
            g["lr"] = lr
        loss_sum = torch.zeros((), device=d.device)
        for i, batch in enumerate(mine):
            batch = batch.to(d.device)
            last = i == len(mine) - 1
            sync = contextlib.nullcontext() if last or d.world == 1 else ddp.no_sync()
            with sync:
                loss, _ = objective.loss(forward, batch, cfg.eps_ls, amp)
                (loss * (d.world / tokens)).backward()  # DDP averages over processes
            loss_sum += loss.detach()
        if cfg.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        state["step"] = step
        if state["index"] >= epoch_batches:
            state["epoch"], state["index"] = epoch + 1, 0
        train_loss = all_reduce_sum(loss_sum, d).item() / tokens
        step_seconds = time.perf_counter() - step_start
        if step % cfg.log_every == 0:
            metrics.log(
                {
                    "kind": "train", "step": step, "epoch": epoch, "loss": train_loss, "lr": lr,
                    "tokens": int(positions), "tokens_per_s": round(positions / step_seconds, 1),
                    "elapsed": round(clock(), 3),
                }
            )  # fmt: skip
        # no refresh: update draws it when due, not every step into a log file (progress.py)
        tok_s = positions / step_seconds
        bar.set_postfix(loss=f"{train_loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}", epoch=epoch, refresh=False)
        bar.update(1)
        if members and step % cfg.eval_every == 0:
            for member in members:  # one that failed: said now, not after max_time
                member.check()
        if dev_examples and step % cfg.eval_every == 0:
            dev_loss, dev_ppl = evaluate_loss(model, dev_examples, cfg.max_tokens, d.device, objective)
            metrics.log({"kind": "dev", "step": step, "loss": round(dev_loss, 6), "ppl": round(dev_ppl, 3)})
            bar.write(f"step {step}: dev loss {dev_loss:.3f}, perplexity {dev_ppl:.2f}") if d.main else None
        if dev_sources and cfg.bleu_every is not None and step % cfg.bleu_every == 0 and d.main:
            scores = dev_translation_scores(model, tokenizer, dev_sources, dev_references)
            model.train()
            elapsed = round(clock(), 3)
            record = {"kind": "dev_bleu", "step": step, "bleu": scores.bleu, "chrf": scores.chrf, "elapsed": elapsed}
            metrics.log(record)
            bar.write(f"step {step}: dev {scores} after {elapsed / 60:.1f} min")
        if state["members"] == "auto" and (spent := clock()) >= AUTO_AT * cfg.max_time:
            state["members"], why = choose_members(step, spent, cfg.max_time, cfg.members_auto_steps, threads)
            if spent >= cfg.max_time:  # the run is over: no time left for another member
                state["members"], why = 1, f"{why}; but max_time is spent"
            state["member_max_time"] = cfg.max_time - spent  # the members end together
            metrics.log({"kind": "members", "step": step, "members": state["members"], "reason": why})
            if state["members"] > 1:
                start_members(why, bar.write)  # a line of its own, not into the bar's
            else:
                bar.write(f"members: 1 ({why})")
        now = time.perf_counter()
        due = (cfg.checkpoint_every is not None and step % cfg.checkpoint_every == 0) or (
            cfg.checkpoint_minutes is not None and now - last_checkpoint_time >= 60 * cfg.checkpoint_minutes
        )
        if due and d.main:
            checkpoint_now()
            last_checkpoint_time = time.perf_counter()
    bar.close()
    say(f"stopped at step {step} ({reason}); {time.perf_counter() - start:.0f} s of training this run")

    # Final checkpoint, averaging, evaluation -------------------------------------------------------
    if not d.main:
        teardown_distributed(d)
        return TrainResult(step, state["epoch"], train_loss, dev_loss, dev_ppl, None, out / "model", 0.0)
    final = checkpoint_now()
    if cfg.average_last > 1:
        from ..average import average_checkpoints

        paths = list_checkpoints(out)[-cfg.average_last :]
        say(f"averaging the last {len(paths)} checkpoints")
        model.load_state_dict(average_checkpoints(paths).state_dict())
    model_dir = out / "model"
    model.save_pretrained(model_dir, step=step)
    if not (cfg.knn and translation):  # a store beside these weights is another model's
        (model_dir / DATASTORE_NAME).unlink(missing_ok=True)
    save_tokenizer(tokenizer, model_dir)
    for member in members:
        say(f"waiting for member {member.index} ({member.out}) ...")
        member.wait()
    torch.set_num_threads(threads)
    if members:
        write_ensemble(model_dir, [m.out / "model" for m in members])
    stores = None
    if cfg.knn and translation:
        stores = _datastores(model, model_dir, [m.out / "model" for m in members], sentence_examples, d.device, say)
    dev_scores = ensemble_scores = None
    if dev_examples and not translation:
        dev_loss, dev_ppl = evaluate_loss(model, dev_examples, cfg.max_tokens, d.device, objective)
        metrics.log({"kind": "final", "step": step, "dev_loss": dev_loss, "dev_ppl": dev_ppl})
        masked = " (of the masked tokens)" if cfg.task == "mlm" else ""
        say(f"dev: loss {dev_loss:.3f}, perplexity {dev_ppl:.2f}{masked}")
    elif dev_examples:
        dev_loss, dev_ppl = evaluate_loss(model, dev_examples, cfg.max_tokens, d.device)
        elapsed = round(state["elapsed"], 3)
        final_metrics = {"kind": "final", "step": step, "dev_loss": dev_loss, "dev_ppl": dev_ppl, "elapsed": elapsed}
        if dev_sources:  # data.dev_size 0: no translations to score
            dev_scores = dev_translation_scores(model, tokenizer, dev_sources, dev_references, stores and stores[:1])
            final_metrics.update(dev_bleu=dev_scores.bleu, dev_chrf=dev_scores.chrf)
        metrics.log(final_metrics)
        alone = " (member 1 alone)" if members else ""
        say(f"dev{alone}: loss {dev_loss:.3f}, perplexity {dev_ppl:.2f}" + (f", {dev_scores}" if dev_scores else ""))
        if members:
            models = [model, *(Transformer.from_pretrained(m.out / "model", device=d.device) for m in members)]
            ensemble = Ensemble(models, names=[model_dir, *(m.out / "model" for m in members)]).eval()
            ensemble_loss, ensemble_ppl = evaluate_loss(ensemble, dev_examples, cfg.max_tokens, d.device)
            record = {"kind": "ensemble", "members": len(models), "dev_loss": ensemble_loss, "dev_ppl": ensemble_ppl}
            if dev_sources:
                ensemble_scores = dev_translation_scores(ensemble, tokenizer, dev_sources, dev_references, stores)
                record.update(dev_bleu=ensemble_scores.bleu, dev_chrf=ensemble_scores.chrf)
            metrics.log(record)
            scored = f", {ensemble_scores}" if ensemble_scores else ""
            together = f"dev, the {len(models)} members together: loss {ensemble_loss:.3f}"
            say(f"{together}, perplexity {ensemble_ppl:.2f}{scored}")
    say(
        f"model saved to {model_dir} (last checkpoint {final})"
        + (f"; the other members in its {ENSEMBLE_NAME}" if members else "")
    )
    teardown_distributed(d)
    return TrainResult(
        step,
        state["epoch"],
        train_loss,
        dev_loss,
        dev_ppl,
        dev_scores,
        model_dir,
        time.perf_counter() - t0,
        1 + len(members),
        ensemble_scores,
    )
