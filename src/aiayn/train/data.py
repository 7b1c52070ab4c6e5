"""Reading the text of a run's splits, as ``DataConfig`` describes it: parallel pairs
(``load_split``) or monolingual texts (``load_texts``)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

from ..data.corpus import load_hf_dataset, read_jsonl, read_parallel, read_text, read_tsv
from .config import DataConfig

__all__ = ["load_phrases", "load_split", "load_texts", "sample_phrases"]


def _path(data: DataConfig, split: str, side: str, suffix: str) -> Path | None:
    explicit = getattr(data, f"{split}_{side}", None) if split in ("train", "dev", "test") else None
    if explicit:
        return Path(explicit)
    if data.dir is None:
        return None
    return Path(data.dir) / f"{split}.{suffix}"


def load_split(
    data: DataConfig, split: str, log: Callable[[str], None] = print, seed: int = 0, required: bool = True
) -> list[tuple[str, str]]:
    """The (source, target) pairs of ``split`` (train, dev or test). For train, Ding's phrase and
    word pairs are mixed in when ``data.phrases`` > 0: at most ``phrases`` of them per sentence
    pair, drawn once with ``seed`` (unless ``data.resample_phrases``: then the trainer draws them
    each epoch from ``load_phrases``). Every skipped line is counted in the printed report."""
    if data.format == "hf":
        hf_split = {"dev": "validation"}.get(split, split)
        pairs, report = load_hf_dataset(
            data.hf_name, data.src_lang, data.tgt_lang, split=hf_split, config=data.hf_config
        )
    else:
        if data.format == "parallel":
            src, tgt = _path(data, split, "src", data.src_lang), _path(data, split, "tgt", data.tgt_lang)
            exists = src is not None and tgt is not None and src.is_file() and tgt.is_file()
        else:
            src = _path(data, split, "src", data.format)
            exists = src is not None and src.is_file()
        if not exists:
            if required:
                raise FileNotFoundError(
                    f"no {split} data: set data.dir (files {split}.{data.src_lang} and {split}.{data.tgt_lang}) "
                    f"or data.{split}_src / data.{split}_tgt; looked for {src}"
                )
            return []
        if data.format == "parallel":
            pairs, report = read_parallel(src, tgt, on_error=data.on_error)
        elif data.format == "tsv":
            pairs, report = read_tsv(src, on_error=data.on_error)
        else:
            pairs, report = read_jsonl(src, data.src_lang, data.tgt_lang, on_error=data.on_error)
    log(f"{split}: {report.summary()}")
    if split == "train" and data.phrases > 0 and not data.resample_phrases:
        chosen = sample_phrases(load_phrases(data, log), data.phrases, len(pairs), seed)
        if chosen:
            log(f"phrases: mixing in {len(chosen):,} ({data.phrases:g} per sentence pair), the same for every epoch")
        pairs = pairs + chosen
    return pairs


def sample_phrases(
    phrases: list[tuple[str, str]], per_sentence: float, sentences: int, seed: int
) -> list[tuple[str, str]]:
    """A seeded sample of at most ``per_sentence`` phrase pairs per sentence pair."""
    return random.Random(seed).sample(phrases, min(len(phrases), int(per_sentence * sentences)))


def load_phrases(data: DataConfig, log: Callable[[str], None] = print) -> list[tuple[str, str]]:
    """All of Ding's phrase and word pairs, ``{dir}/phrases.{src_lang,tgt_lang}`` (written by
    ``aiayn data ding``), or none when the files are not there (said in the log)."""
    if data.dir is None:
        return []
    phrase_src = Path(data.dir) / f"phrases.{data.src_lang}"
    phrase_tgt = Path(data.dir) / f"phrases.{data.tgt_lang}"
    if not (phrase_src.is_file() and phrase_tgt.is_file()):
        log(f"phrases: none found at {phrase_src}; training on sentences only")
        return []
    phrases, report = read_parallel(phrase_src, phrase_tgt, on_error=data.on_error)
    log(f"phrases: {report.summary()}")
    return phrases


def load_texts(data: DataConfig, split: str, log: Callable[[str], None] = print, required: bool = True) -> list[str]:
    """The texts of ``split`` (train, dev or test) for ``data.format: text``, one a line:
    ``data.{split}_text`` or ``{dir}/{split}.{lang}``. Every skipped line is counted in the
    printed report."""
    if data.format != "text":
        raise ValueError(f"load_texts reads data.format text, not {data.format}")
    explicit = getattr(data, f"{split}_text", None) if split in ("train", "dev", "test") else None
    path = Path(explicit) if explicit else None if data.dir is None else Path(data.dir) / f"{split}.{data.lang}"
    if path is None or not path.is_file():
        if required:
            raise FileNotFoundError(
                f"no {split} text: set data.dir (file {split}.{data.lang}) or data.{split}_text; looked for {path}"
            )
        return []
    texts, report = read_text(path, on_error=data.on_error)
    log(f"{split}: {report.summary()}")
    return texts
