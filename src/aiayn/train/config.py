"""Run configuration: data, tokenizer, model and training settings, read from YAML.

A run is ``RunConfig(data, model, train)``: ``model`` holds ``ModelConfig`` fields (the
vocabulary size comes from the tokenizer). ``train.task`` says what is trained: ``translation``
(the paper's encoder-decoder ``Transformer`` on parallel text), ``lm`` (a ``DecoderOnly`` causal
language model) or ``mlm`` (an ``EncoderOnly`` masked language model), the last two on
monolingual text (``data.format: text``). YAML presets live in ``configs/``; command-line
overrides such as ``--train.max_steps 100`` or ``--model.d_model 256`` make a new config.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..model.config import ModelConfig

__all__ = ["DataConfig", "TrainConfig", "RunConfig", "TASKS", "parse_overrides"]

TASKS = ("translation", "lm", "mlm")
_EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")  # a number in scientific notation
INIT_FIELDS = ("P_drop", "attention_dropout", "activation_dropout")  # what a run changes of train.init's model


@dataclass(frozen=True)
class DataConfig:
    """Where the text comes from.

    ``format``:
    - ``parallel``: plain-text files ``{dir}/{split}.{src_lang}`` and ``{dir}/{split}.{tgt_lang}``
      (what ``aiayn data ding`` writes), or explicit ``train_src``/``train_tgt``/... paths;
    - ``tsv`` / ``jsonl``: ``{dir}/{split}.tsv`` / ``{dir}/{split}.jsonl`` or explicit paths;
    - ``hf``: a Hugging Face dataset ``hf_name`` (``hf_config``), splits by name;
    - ``text``: monolingual text for the language models, one example a line:
      ``{dir}/{split}.{lang}`` (one side of a parallel corpus, e.g. Ding's English) or explicit
      ``train_text``/``dev_text``/``test_text`` paths (any text file).
    ``phrases`` > 0 mixes in ``{dir}/phrases.{lang}`` pairs (Ding's dictionary entries), at most
    that many per sentence pair (parallel formats only): one seeded sample for the whole run, or,
    with ``resample_phrases``, a fresh one each epoch, so that the run sees more of the dictionary
    while the ratio to the sentences stays the same. ``phrase_tag`` puts the token ``<phrase>``
    before each phrase pair's source, so that the model can tell dictionary entries from
    sentences (as tagged back-translation tags synthetic pairs: Caswell et al., 2019); the model
    then never produces it (``ModelConfig.suppress_ids``), and real sources never carry it.
    ``substitute`` (not in the paper; after Fadaee et al., 2017): each epoch, that share of the
    sentence pairs that align a noun of ``{dir}/nouns.tsv`` (Ding's nouns with their gender,
    written by ``aiayn data ding``) get it swapped for another noun of the same gender on both
    sides (``aiayn.data.substitute``); with ``train.bpe_dropout`` every example of the epoch,
    swapped or not, is then split (from ``bpe_dropout_from``; ``trainer._in_turn``). Examples
    longer than ``max_len`` tokens are skipped and counted.
    """

    format: str = "parallel"
    dir: str | None = None
    src_lang: str = "de"
    tgt_lang: str = "en"
    train_src: str | None = None
    train_tgt: str | None = None
    dev_src: str | None = None
    dev_tgt: str | None = None
    test_src: str | None = None
    test_tgt: str | None = None
    hf_name: str | None = None
    hf_config: str | None = None
    phrases: float = 0.0
    resample_phrases: bool = False
    phrase_tag: bool = False  # <phrase> before the source of each phrase pair (Caswell et al., 2019)
    substitute: float = 0.0  # share of sentence pairs with one noun swapped each epoch ({dir}/nouns.tsv)
    max_len: int = 128
    on_error: str = "raise"
    dev_size: int | None = None  # evaluate on the first N dev pairs (None: all)
    lang: str = "en"  # format text: the language suffix of {dir}/{split}.{lang}
    train_text: str | None = None
    dev_text: str | None = None
    test_text: str | None = None

    def __post_init__(self) -> None:
        if self.format not in ("parallel", "tsv", "jsonl", "hf", "text"):
            raise ValueError(f"data.format must be parallel, tsv, jsonl, hf or text, got {self.format!r}")
        if self.format == "text" and self.phrases:
            raise ValueError("data.phrases mixes in phrase pairs: parallel formats only, not data.format text")
        if self.on_error not in ("raise", "skip"):
            raise ValueError(f"data.on_error must be raise or skip, got {self.on_error!r}")
        if self.phrases < 0:
            raise ValueError("data.phrases must be >= 0")
        if self.resample_phrases and not self.phrases:
            raise ValueError("data.resample_phrases needs data.phrases > 0 (phrase pairs per sentence pair)")
        if not 0 <= self.substitute <= 1:
            raise ValueError(f"data.substitute is a share of sentence pairs, between 0 and 1, got {self.substitute}")
        if self.substitute:
            if self.format != "parallel" or self.dir is None:
                raise ValueError("data.substitute reads {dir}/nouns.tsv (aiayn data ding): format parallel with a dir")
            if {self.src_lang, self.tgt_lang} != {"de", "en"}:
                raise ValueError(f"data.substitute swaps German and English nouns, not {self.src_lang}-{self.tgt_lang}")
            if self.phrases and not self.resample_phrases:
                raise ValueError("data.substitute changes sentence pairs; with data.phrases set resample_phrases true")
        if self.phrase_tag and not self.resample_phrases:
            raise ValueError("data.phrase_tag tags the phrase pairs drawn each epoch: it needs data.resample_phrases")


@dataclass(frozen=True)
class TrainConfig:
    """The recipe of §5, with the knobs a small machine needs.

    Adam β1 = 0.9, β2 = 0.98, ε = 1e-9 (§5.3); lrate = lr_scale · d_model^-0.5 ·
    min(step^-0.5, step · warmup^-1.5); label smoothing ε_ls = 0.1 (§5.4). A step is
    ``accumulate`` micro-batches of at most ``max_tokens`` padded positions per side (per process).

    ``task`` is ``translation``, ``lm`` (next-token prediction) or ``mlm`` (masked tokens, as in
    BERT: ``mask_prob`` of the tokens chosen, of those 80% replaced by ``<mask>``, 10% by a random
    token, 10% kept; not in the paper).

    ``word_dropout`` (not in the paper; Sennrich & Zhang, 2019, for low-resource NMT after Gal &
    Ghahramani, 2016): in training batches each source and decoder-input token is replaced by
    ``<unk>`` with this probability, so that the model cannot lean on any one word; the targets
    the loss scores are untouched.

    ``bpe_dropout`` (not in the paper; after Provilkov et al., 2020, for low-resource NMT): each
    epoch, each source and target token of the training examples is split top down through its
    BPE merge tree, each split with this probability (``objectives.split_merges``), so a word
    comes in several segmentations; the split examples are then batched within ``max_tokens``
    (an epoch holds 0.116 more tokens per merged token at 0.1, so more batches). Evaluation and
    translation segment as usual. ``bpe_dropout_from``: the first epoch (counted from 0, as
    metrics.jsonl's ``epoch``) whose examples are split; the epochs before it hold the plain
    encodings. BPE-dropout regularises a model that has seen the data many times; a short run
    (few epochs) loses by it, so a late start gives its gain to the CPUs that run many epochs
    without costing those that run few.

    ``init`` (fine-tuning): start from the model directory ``init``, its config, weights and
    tokenizer (an aiayn model, or an OPUS-MT model converted by ``aiayn convert marian``), not
    from a fresh BPE and random weights. Of the run's ``model`` section only the dropout fields
    (``P_drop``, ``attention_dropout``, ``activation_dropout``) apply; the others are the model's.

    ``tokenizer``: a model or run directory whose tokenizer this run reads and writes with,
    instead of learning a BPE (``vocab_size`` then unused), so that runs share one vocabulary:
    the members of an ensemble (``aiayn.decode.Ensemble``; fairseq's ``--srcdict``), or runs whose
    per-token perplexities are to be compared. Not with ``init``, which brings its own.

    ``cooldown`` (not in the paper; off by default): over the last ``cooldown`` fraction of the
    run's budget the rate falls linearly to 0 (``schedule.cooldown_factor``), as a run with a
    known end can afford. The budget is the first of ``max_steps``, ``max_epochs`` and
    ``max_time`` to run out: by steps and epochs the rates are the same from run to run; by
    ``max_time`` they follow the seconds the machine takes (under several processes, the mean
    of their clocks; ``elapsed`` in metrics.jsonl is the main process's own). A run resumed with
    a larger budget takes the rate its budget gives: a cooled-down rate rises again.

    ``bleu_every`` (steps; off by default): also translate the dev sources greedily and log BLEU
    and chrF (``kind: dev_bleu`` in metrics.jsonl), as fairseq's ``--eval-bleu`` does, to see what
    more time buys. Its seconds count towards ``max_time``, like the dev loss's.

    ``members`` (not in the paper; off by default): train this many models of different seeds at
    once, each process on a share of the CPU's threads, and decode them as an ensemble
    (``members.py``); ``auto`` trains two where one model would make at least
    ``members_auto_steps`` steps in ``max_time`` (projected from the first 5% of it), one
    elsewhere. One machine's CPU only: under torchrun or on a GPU it stays one.

    ``knn`` (not in the paper; off by default): at the end of the run, write into each model
    directory (each member's too) the kNN-MT datastore of its decoder states over the training
    pairs (``aiayn.retrieval``; phrase pairs resampled each epoch left out), with which ``aiayn
    translate``, ``evaluate`` and ``serve`` then decode (``--no-knn``: without); the run's final
    dev BLEU is scored with it.
    """

    task: str = "translation"
    mask_prob: float = 0.15
    vocab_size: int = 8000
    max_tokens: int = 4096
    accumulate: int = 1
    warmup: int = 4000
    lr_scale: float = 1.0
    cooldown: float = 0.0  # the last fraction of the budget, over which the rate falls to 0
    betas: tuple[float, float] = (0.9, 0.98)
    adam_eps: float = 1e-9
    eps_ls: float = 0.1
    word_dropout: float = 0.0  # each input token replaced by <unk> with this probability (training only)
    bpe_dropout: float = 0.0  # each training token split through its BPE merges, each split with this probability
    bpe_dropout_from: int = 0  # the first epoch (from 0) that bpe_dropout splits
    clip_norm: float | None = None
    max_steps: int | None = None
    max_epochs: int | None = None
    max_time: float | None = None  # seconds of training
    eval_every: int = 500
    bleu_every: int | None = None  # steps: also translate the dev sources (greedy) and log BLEU, chrF
    checkpoint_every: int | None = None  # steps
    checkpoint_minutes: float | None = 10.0
    keep_checkpoints: int = 5
    average_last: int = 0  # average the last N checkpoints at the end (0: off)
    seed: int = 0
    compile: bool = False
    amp: bool | str = "auto"  # bf16 autocast: auto (where it pays: precision.py), true, false
    log_every: int = 1
    init: str | None = None  # fine-tune the model in this directory (its config, weights, tokenizer)
    tokenizer: str | None = None  # use this model or run directory's tokenizer instead of learning a BPE
    members: int | str = 1  # models trained at once on a share of the cores each, an ensemble (members.py); auto
    members_auto_steps: int = 6400  # members auto: two when one model would make this many steps in max_time
    knn: bool = False  # kNN-MT: a datastore of the training sentences in each model directory (aiayn.retrieval)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_tokens", "accumulate", "warmup", "eval_every", "keep_checkpoints", "log_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"train.{name} must be a positive integer, got {value!r}")
        if self.bleu_every is not None and (not isinstance(self.bleu_every, int) or self.bleu_every <= 0):
            raise ValueError(f"train.bleu_every must be a positive integer or null, got {self.bleu_every!r}")
        if self.bleu_every is not None and self.task != "translation":
            raise ValueError("train.bleu_every scores translations: it needs train.task translation")
        if self.max_steps is None and self.max_epochs is None and self.max_time is None:
            raise ValueError("set at least one of train.max_steps, train.max_epochs, train.max_time")
        if self.task not in TASKS:
            raise ValueError(f"train.task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if not 0 < self.mask_prob < 1:
            raise ValueError(f"train.mask_prob must be in (0, 1), got {self.mask_prob!r}")
        if not 0 <= self.word_dropout < 1:
            raise ValueError(f"train.word_dropout must be in [0, 1), got {self.word_dropout!r}")
        if self.word_dropout and self.task == "mlm":
            raise ValueError("train.word_dropout is for translation and lm; the masked LM corrupts its input already")
        if not 0 <= self.bpe_dropout < 1:
            raise ValueError(f"train.bpe_dropout must be in [0, 1), got {self.bpe_dropout!r}")
        if self.bpe_dropout and self.task == "mlm":
            raise ValueError("train.bpe_dropout is for translation and lm")
        epoch = self.bpe_dropout_from
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"train.bpe_dropout_from must be an epoch (an integer >= 0), got {epoch!r}")
        if isinstance(self.cooldown, bool) or not 0 <= self.cooldown <= 1:
            raise ValueError(f"train.cooldown must be in [0, 1] (a fraction of the budget), got {self.cooldown!r}")
        if self.tokenizer is not None and self.init is not None:
            raise ValueError("train.tokenizer and train.init both give the tokenizer: set one (init brings its own)")
        if self.amp not in (True, False, "auto"):
            raise ValueError(f"train.amp must be auto, true or false, got {self.amp!r}")
        members = self.members
        if members != "auto" and (isinstance(members, bool) or not isinstance(members, int) or members < 1):
            raise ValueError(f"train.members must be auto or a positive integer, got {members!r}")
        if members != 1 and self.task != "translation":
            raise ValueError("train.members decodes the members as one translation ensemble: train.task translation")
        if isinstance(self.members_auto_steps, bool) or not isinstance(self.members_auto_steps, int):
            raise ValueError(f"train.members_auto_steps must be an integer, got {self.members_auto_steps!r}")
        if not isinstance(self.knn, bool):
            raise ValueError(f"train.knn must be true or false, got {self.knn!r}")
        if self.knn and self.task != "translation":
            raise ValueError("train.knn keeps a datastore of translations: train.task translation")
        object.__setattr__(self, "betas", tuple(self.betas))


@dataclass(frozen=True)
class RunConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: dict[str, Any] = field(default_factory=dict)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(max_epochs=1))

    def __post_init__(self) -> None:
        monolingual = self.train.task in ("lm", "mlm")
        if monolingual != (self.data.format == "text"):
            raise ValueError(
                f"train.task {self.train.task} needs "
                + ("monolingual text: data.format text" if monolingual else "parallel text, not data.format text")
            )

    def model_config(self, vocab_size: int, **fields: Any) -> ModelConfig:
        return ModelConfig(vocab_size=vocab_size, **{**self.model, **fields})

    def init_config(self, **fields: Any) -> ModelConfig:
        """The config of ``train.init``'s model, with this run's dropout fields (``TrainConfig``)."""
        config, _ = ModelConfig.load(Path(self.train.init) / "config.json")
        dropout = {k: v for k, v in self.model.items() if k in INIT_FIELDS}
        return config.replace(**dropout, **fields)

    def to_dict(self) -> dict[str, Any]:
        return {
            "data": dataclasses.asdict(self.data),
            "model": dict(self.model),
            "train": {**dataclasses.asdict(self.train), "betas": list(self.train.betas)},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> RunConfig:
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected sections data, model, train (a mapping), got {type(data).__name__}")
        for section in ("data", "model", "train"):
            value = data.get(section)
            if value is not None and not isinstance(value, dict):
                kind = type(value).__name__
                raise ValueError(f"{source}: section {section} must be a mapping of field: value, got {kind} {value!r}")
        unknown = set(data) - {"data", "model", "train"}
        if unknown:
            raise ValueError(f"{source}: unknown section(s) {sorted(unknown)}; expected data, model, train")
        try:
            model = dict(data.get("model") or {})
            model.pop("vocab_size", None)  # comes from the tokenizer
            _check_fields(ModelConfig, model, "model", skip=("vocab_size",))
            ModelConfig(vocab_size=1 << 16, **model)  # validate the values now, not after data preparation
            return cls(
                data=_build(DataConfig, data.get("data") or {}, "data"),
                model=model,
                train=_build(TrainConfig, data.get("train") or {}, "train"),
            )
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from None

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> RunConfig:
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: no such config file") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: not valid YAML: {e}") from None
        for key, value in (overrides or {}).items():
            section, _, name = key.partition(".")
            if not name or section not in ("data", "model", "train"):
                raise ValueError(f"override {key!r}: use SECTION.NAME with SECTION data, model or train")
            data.setdefault(section, {})
            data[section] = {**(data[section] or {}), name: value}
        return cls.from_dict(data, str(path))


def _check_fields(cls: type, values: dict[str, Any], section: str, skip: tuple[str, ...] = ()) -> None:
    """A ValueError for names in ``values`` that are not fields of ``cls``: it names the section,
    each unknown name (with the closest field, for a typo) and the known fields, in their order."""
    known = [f.name for f in dataclasses.fields(cls) if f.name not in skip]
    unknown = [name for name in values if name not in known]
    if unknown:
        named = []
        for name in unknown:
            close = difflib.get_close_matches(str(name), known, n=1)
            named.append(f"{name} (did you mean {close[0]}?)" if close else str(name))
        raise ValueError(f"{section}: unknown field(s) {', '.join(named)}; known fields: {', '.join(known)}")


def _build(cls: type, values: dict[str, Any], section: str) -> Any:
    _check_fields(cls, values, section)
    return cls(**values)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["--train.max_steps", "100", "--model.N", "3"]`` -> ``{"train.max_steps": 100, "model.N": 3}``
    (values are parsed as YAML scalars: numbers, booleans, null, strings)."""
    overrides: dict[str, Any] = {}
    it = iter(items)
    for item in it:
        if not item.startswith("--"):
            raise ValueError(f"unexpected argument {item!r}; overrides look like --train.max_steps 100")
        key, eq, value = item[2:].partition("=")
        if not eq:
            try:
                value = next(it)
            except StopIteration:
                raise ValueError(f"override {item} needs a value") from None
        parsed = yaml.safe_load(value)
        if isinstance(parsed, str) and _EXPONENT.fullmatch(parsed):  # YAML 1.1 reads 1e-4 (no dot) as text
            parsed = float(parsed)
        overrides[key.replace("-", "_")] = parsed
    return overrides
