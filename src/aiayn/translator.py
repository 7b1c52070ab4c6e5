"""Translating text with a trained model: tokenizer, model and search in one object.

translator = Translator.from_pretrained("runs/ding/model")
translator.translate(["Es war purer Zufall."])            # beam 4, α = 0.6 (§6.1)
translator.translate(["Es war purer Zufall."], beam=1)    # greedy
translator.translate(["Es war purer Zufall."], nbest=3)   # [[(text, score), ...]]
Translator.from_pretrained(["runs/ding/model", "runs/ding2/model"])  # an ensemble (one tokenizer)
Translator.from_pretrained("runs/ding/model")  # with train.members 2: its ensemble.json's too
Translator.from_pretrained("runs/ding/model", alone=True)  # the model alone
Translator.from_pretrained("runs/ding/model", knn=False)  # without its datastore (kNN-MT, train.knn)
for line in translator.translate_stream(read_lines("big.de")):  # aiayn.data.read_lines: a file or
    print(line)                                                   # a pipe, 1,000 lines at a time
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable, Iterator, Sequence, Sized
from pathlib import Path
from typing import Any

import torch

from .data.tokenizer import Tokenizer, load_tokenizer, tokenizer_contents
from .decode import Ensemble, translate_ids
from .engine import EngineOptions, is_prepared, prepare
from .model import Transformer
from .retrieval import DATASTORE_NAME, Datastore

__all__ = ["ENSEMBLE_NAME", "Translator", "ensemble_members", "load_datastores"]

ENSEMBLE_NAME = "ensemble.json"  # in a model directory: the other members of its ensemble (train.members)


class Translator:
    """A ``Transformer`` with its tokenizer: text in, text out, batched by tokens.

    The model decodes on the engine (``aiayn.engine.prepare``, with ``quantize`` and ``options``;
    ``self.model`` is the prepared model, sharing the given one's parameters); an ``Ensemble``'s
    members are prepared each and decode together (``aiayn.decode.Ensemble``). Inputs longer than
    the model's ``max_len`` positions are truncated with a warning; an empty or whitespace-only
    input gives an empty output without running the model.
    """

    def __init__(
        self,
        model: Transformer | Ensemble,
        tokenizer: Tokenizer,
        quantize: str | None = None,
        options: EngineOptions | None = None,
        datastores: Sequence[Datastore | None] | None = None,
    ) -> None:
        if tokenizer.vocab_size > model.config.vocab_size:
            raise ValueError(
                f"the tokenizer has {tokenizer.vocab_size} tokens but the model only {model.config.vocab_size}"
            )
        members = list(model.members) if isinstance(model, Ensemble) else [model]
        stores = [None] * len(members) if datastores is None else list(datastores)
        if len(stores) != len(members):
            raise ValueError(f"{len(stores)} datastores for {len(members)} model(s)")
        if any(is_prepared(m) and store is not None for m, store in zip(members, stores, strict=True)):
            raise ValueError("a prepared model takes its datastore from aiayn.engine.prepare, not here")
        members = [
            m if is_prepared(m) else prepare(m.eval(), quantize, options, store)
            for m, store in zip(members, stores, strict=True)
        ]
        self.model = Ensemble(members).eval() if isinstance(model, Ensemble) else members[0]
        self.tokenizer = tokenizer

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path | Sequence[str | Path],
        device: str | torch.device = "cpu",
        quantize: str | None = None,
        options: EngineOptions | None = None,
        alone: bool = False,
        knn: bool = True,
        retrieval: dict[str, Any] | None = None,
    ) -> Translator:
        """Load ``config.json``, ``model.safetensors`` and the tokenizer (``tokenizer.json``, or a
        converted Marian model's SentencePiece files) from ``directory``. Several directories
        make an ensemble (``aiayn.decode.Ensemble``); their tokenizer files must be identical
        (runs trained with ``train.tokenizer`` pointing at one of them). A directory with an
        ``ensemble.json`` (a run of ``train.members`` 2 or more) brings the members it names,
        unless ``alone``.

        ``quantize="int8"`` applies dynamic int8 quantization to the Linear layers (CPU only);
        ``options``: the engine's choices (``aiayn.engine.EngineOptions``). A model directory
        with a ``datastore.safetensors`` (``train.knn``) decodes with it (kNN-MT,
        ``aiayn.retrieval``) unless ``knn`` is False; ``retrieval`` overrides its
        ``RetrievalConfig`` (e.g. ``{"lam": 0.5}``). Missing or unreadable files raise an error
        naming the file.
        """
        if quantize not in (None, "int8"):  # before loading anything
            raise ValueError(f"quantize must be 'int8' or None, got {quantize!r}")
        if quantize is not None and torch.device(device).type != "cpu":
            raise ValueError("int8 quantization runs on the CPU only")
        given = [directory] if isinstance(directory, (str, Path)) else list(directory)
        if not given:
            raise ValueError("no model directory given")
        directories = [Path(d) for d in given] if alone else [m for d in given for m in ensemble_members(d)]
        seen: dict[Path, Path] = {}  # each model once, where it first comes
        again = [d for d in directories if seen.setdefault(d.resolve(), d) is not d]
        if again:
            names = ", ".join(map(str, again))
            warnings.warn(f"{names}: given more than once (an ensemble.json names it too?); decoded once", stacklevel=2)
            directories = list(seen.values())
        stores = load_datastores(directories, knn, retrieval)
        if len(directories) > 1:
            ensemble = _load_ensemble(directories, device)
            sizes = ensemble.config.vocab_size, ensemble.config.tgt_vocab_size
            return cls(ensemble, load_tokenizer(directories[0], *sizes), quantize, options, stores)
        directory = directories[0]
        model = Transformer.from_pretrained(directory, device=device)
        tokenizer = load_tokenizer(directory, model.config.vocab_size, model.config.tgt_vocab_size)
        return cls(model, tokenizer, quantize, options, stores)

    @property
    def max_source_tokens(self) -> int:
        """The longest input, in tokens without EOS, that the model takes (``config.max_len``)."""
        return self.model.config.max_len - 1

    def encode(self, sentences: Sequence[str]) -> list[list[int]]:
        """Token ids of each sentence, truncated to ``max_source_tokens`` (with a warning)."""
        ids, too_long = self._encode(sentences)
        self._warn_truncated(too_long, no_grad=False)
        return ids

    def _encode(self, sentences: Sequence[str], target: bool = False) -> tuple[list[list[int]], int]:
        """Token ids (of target-side text with ``target``) truncated to ``max_source_tokens``, and
        how many were truncated."""
        ids = self.tokenizer.encode_batch(list(sentences), target=target)
        limit = self.max_source_tokens
        return [x[:limit] for x in ids], sum(len(x) > limit for x in ids)

    def _warn_truncated(self, too_long: int, what: str = "input(s)", no_grad: bool = True) -> None:
        """Warn of ``too_long`` truncated lines, attributed to the caller of the public method
        that called this one (``no_grad``: through ``torch.no_grad``'s wrapper, one frame more)."""
        if too_long:
            limit = self.max_source_tokens
            message = f"{too_long} {what} longer than the model's {limit} tokens were truncated"
            warnings.warn(message, stacklevel=4 if no_grad else 3)

    @torch.no_grad()
    def translate(
        self,
        sentences: Sequence[str],
        beam: int = 4,
        alpha: float = 0.6,
        nbest: int = 1,
        max_tokens: int = 4096,
        max_len_a: int = 50,
        progress: bool | Any = False,
        no_repeat_ngram_size: int = 0,
    ) -> list[str] | list[list[tuple[str, float]]]:
        """Translate ``sentences``; results in input order.

        Args:
            beam: beam size (1: greedy). alpha: length penalty α. nbest: with ``nbest > 1`` each
                result is a list of ``(translation, score)``, best first (score = log P / lp).
            max_tokens: source positions per batch. max_len_a: each output may be this many
                tokens longer than its source. progress: show a progress bar (or advance a
                tqdm bar of the caller's: ``translate_ids``). no_repeat_ngram_size: n > 0
                forbids repeating an n-gram of the output (``aiayn.decode``).
        """
        search = dict(
            beam=beam,
            alpha=alpha,
            nbest=nbest,
            max_tokens=max_tokens,
            max_len_a=max_len_a,
            no_repeat_ngram_size=no_repeat_ngram_size,
        )
        if isinstance(sentences, str):
            raise TypeError("translate takes a list of sentences, not one string")
        if progress is not True:  # no bar, or a caller's bar (advanced by the sentences that end)
            results, too_long = self._translate(sentences, progress, **search)
        else:  # one bar over every line, the empty ones included, as translate_stream's
            from .progress import progress_bar

            with progress_bar(total=len(sentences), desc="translate", unit="sent") as bar:
                results, too_long = self._translate_buffer(list(sentences), bar, search)
        self._warn_truncated(too_long)
        return results

    def _translate(
        self, sentences: Sequence[str], progress: bool | Any, nbest: int = 1, **search: Any
    ) -> tuple[list, int]:
        """``translate``'s results, and how many inputs were truncated (not warned of here);
        ``search``: ``translate_ids``' keyword arguments."""
        keep = [i for i, s in enumerate(sentences) if s.strip()]
        sources, too_long = self._encode([sentences[i] for i in keep])
        out = translate_ids(self.model, sources, nbest=nbest, progress=progress, **search)
        empty: str | list[tuple[str, float]] = [("", 0.0)] if nbest > 1 else ""
        results: list = [empty] * len(sentences)
        for i, result in zip(keep, out, strict=True):
            if nbest > 1:
                results[i] = [(self.tokenizer.decode(h.tokens), h.score) for h in result]
            else:
                results[i] = self.tokenizer.decode(result)
        return results, too_long

    def translate_stream(
        self,
        sentences: Iterable[str],
        buffer_size: int = 1000,
        progress: bool = False,
        total: int | None = None,
        **search: Any,
    ) -> Iterator[str | list[tuple[str, float]]]:
        """Translate sentences as they come, e.g. the lines of a large file or of a pipe
        (``aiayn.data.read_lines``, which removes the newlines).

        ``buffer_size`` sentences are read, translated as ``translate`` does (batched by tokens,
        sentences of similar length together), and their results yielded in input order before
        more input is read: memory stays bounded and the first results come early; a larger
        buffer batches better. ``search``: the keyword arguments of ``translate`` (beam, alpha,
        nbest, max_tokens, max_len_a, no_repeat_ngram_size). ``progress`` shows one bar over
        all buffers, counting sentences, of ``total`` (default: ``len(sentences)`` when it has
        one). Inputs longer than the model takes are truncated, with one warning at the end.
        """
        if isinstance(sentences, str):
            raise TypeError("translate_stream takes an iterable of sentences, not one string")
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be at least 1, got {buffer_size}")
        if total is None and isinstance(sentences, Sized):
            total = len(sentences)
        bar = None
        if progress:
            from .progress import progress_bar

            bar = progress_bar(total=total, desc="translate", unit="sent")
        too_long = 0
        try:
            buffer: list[str] = []
            for sentence in sentences:
                buffer.append(sentence)
                if len(buffer) == buffer_size:
                    results, truncated = self._translate_buffer(buffer, bar, search)
                    too_long += truncated
                    yield from results
                    buffer = []
            if buffer:
                results, truncated = self._translate_buffer(buffer, bar, search)
                too_long += truncated
                yield from results
        finally:
            if bar is not None:
                bar.close()
        self._warn_truncated(too_long, no_grad=False)  # from the generator: the frame that iterates

    def _translate_buffer(self, buffer: list[str], bar: Any, search: dict) -> tuple[list, int]:
        """One buffer of ``translate_stream``: results and truncations; empty lines advance the bar."""
        results, too_long = self._translate(buffer, bar if bar is not None else False, **search)
        if bar is not None:
            bar.update(sum(1 for s in buffer if not s.strip()))  # empty lines, not run through the model
        return results, too_long

    @torch.no_grad()
    def perplexity(self, sources: Sequence[str], references: Sequence[str], max_tokens: int = 4096) -> float:
        """exp(mean NLL per reference token, EOS included) under teacher forcing."""
        from .evaluate import evaluate_loss

        (source_ids, long_sources) = self._encode(sources)
        (reference_ids, long_references) = self._encode(references, target=True)
        self._warn_truncated(long_sources + long_references, what="source or reference line(s) of the perplexity")
        pairs = list(zip(source_ids, reference_ids, strict=True))
        device = next(self.model.parameters()).device
        return evaluate_loss(self.model, pairs, max_tokens, device)[1]


def _load_ensemble(directories: list[Path], device: str | torch.device) -> Ensemble:
    """The models of ``directories`` as an ``Ensemble``, after checking that each holds the same
    tokenizer files as the first (the members read and write the same ids)."""
    first = tokenizer_contents(directories[0])
    for directory in directories[1:]:
        if tokenizer_contents(directory) != first:
            raise ValueError(
                f"{directory} has another tokenizer than {directories[0]}: the models of an ensemble must share one "
                f"(train them with --train.tokenizer {directories[0]})"
            )
    return Ensemble([Transformer.from_pretrained(d, device=device) for d in directories], names=directories)


def load_datastores(
    directories: Sequence[Path], knn: bool = True, retrieval: dict[str, Any] | None = None
) -> list[Datastore | None]:
    """Each model directory's kNN-MT datastore (``aiayn.retrieval``; None where it has none, or
    all None unless ``knn``), ``retrieval`` overriding its config: an error where no directory
    has one to override."""
    stores = [Datastore.load(d, **(retrieval or {})) if knn else None for d in directories]
    if retrieval and knn and all(store is None for store in stores):
        names = ", ".join(str(Path(d) / DATASTORE_NAME) for d in directories)
        raise ValueError(f"{names}: no kNN-MT datastore to read with {retrieval} (train.knn makes one)")
    return stores


def ensemble_members(model_dir: str | Path) -> list[Path]:
    """The model directories of ``model_dir``'s ensemble: itself, then the members its
    ``ensemble.json`` names (none: itself alone). A named member that is missing is an error
    naming the file."""
    model_dir = Path(model_dir)
    path = model_dir / ENSEMBLE_NAME
    if not path.exists():
        return [model_dir]
    try:
        names = json.loads(path.read_text())["members"]
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        raise ValueError(f'{path}: not an ensemble file (expected {{"members": [directories]}})') from None
    members = [Path(os.path.normpath(model_dir / n)) for n in names]
    for member in members:
        if not (member / "config.json").exists():
            raise ValueError(
                f"{path}: member {member} has no model (config.json missing); "
                "decode this model alone with --alone (alone=True)"
            )
    return [model_dir, *members]
