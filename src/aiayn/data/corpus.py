"""Readers for users' own parallel corpora: two aligned text files, TSV, JSON lines, Hugging Face;
and plain monolingual text (for the language models).

Every parallel reader returns ``(pairs, report)``: a list of ``(source, target)`` strings and a
:class:`ReadReport` that counts what was read and every pair that was skipped, and why
(``read_text`` returns texts, with the same report). Nothing is dropped silently:

- a pair with an empty (whitespace-only) side is skipped and counted;
- a pair with a side longer than ``max_chars`` characters is skipped and counted;
- a malformed line (invalid UTF-8, too few TSV columns, bad JSON, a missing key) raises
  :class:`CorpusError` naming the file and the 1-based line, or, with ``on_error="skip"``, is
  skipped and counted.

Lines are split on ``\\n`` only; each side is stripped of surrounding whitespace (which takes
the ``\\r`` of CRLF files with it); a UTF-8 byte-order mark at the start of a file is dropped.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, Literal

__all__ = [
    "CorpusError",
    "ReadReport",
    "read_parallel",
    "read_tsv",
    "read_jsonl",
    "read_text",
    "read_lines",
    "count_lines",
    "load_hf_dataset",
]

Pair = tuple[str, str]
OnError = Literal["raise", "skip"]
PathLike = str | os.PathLike[str]


class CorpusError(ValueError):
    """A corpus file that cannot be read as asked; the message names the file (and line)."""

    def __init__(self, message: str, path: PathLike | None = None, line: int | None = None) -> None:
        super().__init__(message)
        self.path = None if path is None else str(path)
        self.line = line


@dataclass
class ReadReport:
    """What a reader read and skipped. ``lines`` counts input lines (or rows, or line pairs)."""

    sources: tuple[str, ...]
    lines: int = 0
    pairs: int = 0
    skipped_empty: int = 0
    skipped_invalid_utf8: int = 0
    skipped_malformed: int = 0
    skipped_too_long: int = 0
    max_chars: int | None = None
    unit: str = "pairs"  # what ``pairs`` counts ("texts" for read_text)

    @property
    def skipped(self) -> int:
        return self.skipped_empty + self.skipped_invalid_utf8 + self.skipped_malformed + self.skipped_too_long

    def summary(self) -> str:
        """One line, e.g. ``train.de + train.en: 998 pairs from 1,000 lines; skipped 2 (2 empty)``."""
        names = " + ".join(self.sources)
        reasons = [
            (self.skipped_empty, "empty"),
            (self.skipped_invalid_utf8, "invalid UTF-8"),
            (self.skipped_malformed, "malformed"),
            (self.skipped_too_long, f"over {self.max_chars} characters"),
        ]
        detail = ", ".join(f"{n:,} {why}" for n, why in reasons if n)
        skipped = f"skipped {self.skipped:,} ({detail})" if self.skipped else "skipped none"
        return f"{names}: {self.pairs:,} {self.unit} from {self.lines:,} lines; {skipped}"


class _Collector:
    """Shared bookkeeping: the report, the on_error policy and the checks every pair passes."""

    def __init__(self, sources: tuple[str, ...], on_error: str, max_chars: int | None) -> None:
        if on_error not in ("raise", "skip"):
            raise ValueError(f'on_error must be "raise" or "skip", got {on_error!r}')
        if max_chars is not None and max_chars < 1:
            raise ValueError(f"max_chars must be a positive integer or None, got {max_chars!r}")
        self.on_error = on_error
        self.report = ReadReport(sources=sources, max_chars=max_chars)
        self.pairs: list[Pair] = []

    def error(self, kind: Literal["invalid_utf8", "malformed"], message: str, path: PathLike, line: int) -> None:
        """Raise, or count the bad line and carry on."""
        if self.on_error == "raise":
            raise CorpusError(f"{path}:{line}: {message}", path=path, line=line)
        if kind == "invalid_utf8":
            self.report.skipped_invalid_utf8 += 1
        else:
            self.report.skipped_malformed += 1

    def add(self, src: str, tgt: str) -> None:
        src, tgt = src.strip(), tgt.strip()
        max_chars = self.report.max_chars
        if not src or not tgt:
            self.report.skipped_empty += 1
        elif max_chars is not None and (len(src) > max_chars or len(tgt) > max_chars):
            self.report.skipped_too_long += 1
        else:
            self.pairs.append((src, tgt))
            self.report.pairs += 1

    def result(self) -> tuple[list[Pair], ReadReport]:
        return self.pairs, self.report


def _raw_lines(path: PathLike | BinaryIO) -> Iterator[bytes]:
    """The lines of a file (a path, or a binary stream read as it comes) as bytes, split on
    b"\\n" only, without the newline."""
    with open(path, "rb") if isinstance(path, (str, os.PathLike)) else contextlib.nullcontext(path) as f:
        for i, raw in enumerate(f):
            if i == 0 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            yield raw.rstrip(b"\n")


def read_lines(source: PathLike | BinaryIO, name: str | None = None) -> Iterator[str]:
    """The lines of UTF-8 text, one string each, as they are read: ``source`` is a path or a
    binary stream (``sys.stdin.buffer``: a pipe is translated while it is still being written;
    any iterable of byte lines will do).

    Lines are split on ``\\n`` only, as ``wc -l`` counts them, plus a last line without one
    (``str.splitlines`` would also split at U+2028, form feeds and other separators inside a
    sentence); the newline and the ``\\r`` of a CRLF file are removed, nothing else; a
    byte-order mark at the start is dropped. A line that is not UTF-8 raises
    :class:`CorpusError` naming ``name`` (default: the path, or the stream's ``name``) and the
    1-based line.
    """
    if name is None:
        name = str(source) if isinstance(source, (str, os.PathLike)) else str(getattr(source, "name", "<stream>"))
    for i, raw in enumerate(_raw_lines(source), start=1):
        try:
            yield raw.removesuffix(b"\r").decode("utf-8")
        except UnicodeDecodeError as e:
            raise CorpusError(f"{name}:{i}: invalid UTF-8 ({e.reason} at byte {e.start})", path=name, line=i) from None


def _decode(raw: bytes, path: PathLike, line: int, collector: _Collector) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        collector.error("invalid_utf8", f"invalid UTF-8 ({e.reason} at byte {e.start})", path, line)
        return None


def count_lines(path: PathLike) -> int:
    """The lines ``read_lines`` would give, counted without decoding them."""
    return sum(1 for _ in _raw_lines(path))


def read_parallel(
    src_path: PathLike,
    tgt_path: PathLike,
    on_error: OnError = "raise",
    max_chars: int | None = None,
) -> tuple[list[Pair], ReadReport]:
    """Read two line-aligned plain-text files (line i of one translates line i of the other).

    Files with different numbers of lines raise :class:`CorpusError` naming both files and both
    counts, whatever ``on_error`` says: a missing line shifts every pair after it.
    """
    n_src, n_tgt = count_lines(src_path), count_lines(tgt_path)
    if n_src != n_tgt:
        raise CorpusError(
            f"parallel files differ in length: {src_path} has {n_src:,} lines, {tgt_path} has {n_tgt:,} lines",
            path=src_path,
        )
    collector = _Collector((str(src_path), str(tgt_path)), on_error, max_chars)
    for i, (raw_src, raw_tgt) in enumerate(zip(_raw_lines(src_path), _raw_lines(tgt_path), strict=True), start=1):
        collector.report.lines += 1
        src = _decode(raw_src, src_path, i, collector)
        if src is None:
            continue
        tgt = _decode(raw_tgt, tgt_path, i, collector)
        if tgt is None:
            continue
        collector.add(src, tgt)
    return collector.result()


def _text_lines(path: PathLike, collector: _Collector) -> Iterator[tuple[int, str]]:
    """(line number, text) of each line that decodes and is not blank; the others are counted."""
    for i, raw in enumerate(_raw_lines(path), start=1):
        collector.report.lines += 1
        text = _decode(raw, path, i, collector)
        if text is None:
            continue
        if not text.strip():
            collector.report.skipped_empty += 1
            continue
        yield i, text


def read_text(
    path: PathLike, on_error: OnError = "raise", max_chars: int | None = None
) -> tuple[list[str], ReadReport]:
    """Read plain text, one example (a sentence, a paragraph) a line, each stripped of surrounding
    whitespace. Blank lines are skipped as empty; ``report.pairs`` counts the texts kept."""
    collector = _Collector((str(path),), on_error, max_chars)
    collector.report.unit = "texts"
    texts = []
    for _, text in _text_lines(path, collector):
        text = text.strip()
        if max_chars is not None and len(text) > max_chars:
            collector.report.skipped_too_long += 1
            continue
        texts.append(text)
        collector.report.pairs += 1
    return texts, collector.report


def read_tsv(
    path: PathLike,
    src_column: int = 0,
    tgt_column: int = 1,
    on_error: OnError = "raise",
    max_chars: int | None = None,
) -> tuple[list[Pair], ReadReport]:
    """Read tab-separated lines, the source in column ``src_column`` and the target in
    ``tgt_column`` (0-based). A line with too few columns is malformed; a blank line is empty.
    No quoting: a tab always separates columns (the format of Tatoeba and most MT corpora).
    """
    if src_column < 0 or tgt_column < 0:
        raise ValueError(f"columns must be >= 0, got src_column={src_column}, tgt_column={tgt_column}")
    needed = max(src_column, tgt_column) + 1
    collector = _Collector((str(path),), on_error, max_chars)
    for i, text in _text_lines(path, collector):
        fields = text.rstrip("\r").split("\t")
        if len(fields) < needed:
            collector.error(
                "malformed", f"expected at least {needed} tab-separated columns, found {len(fields)}", path, i
            )
            continue
        collector.add(fields[src_column], fields[tgt_column])
    return collector.result()


def _pick(row: Any, src_key: str, tgt_key: str) -> tuple[Any, Any] | str:
    """The two values of a row, flat ``{src_key: .., tgt_key: ..}`` or Hugging Face
    ``{"translation": {src_key: .., tgt_key: ..}}``; or a message saying what is wrong."""
    if not isinstance(row, dict):
        return f"expected a JSON object, found {type(row).__name__}"
    if src_key in row and tgt_key in row:
        values = row[src_key], row[tgt_key]
    elif isinstance(row.get("translation"), dict) and src_key in row["translation"] and tgt_key in row["translation"]:
        values = row["translation"][src_key], row["translation"][tgt_key]
    else:
        inner = row.get("translation")
        keys = sorted(row) + ([f"translation.{k}" for k in sorted(inner)] if isinstance(inner, dict) else [])
        return f"missing key {src_key!r} or {tgt_key!r} (found keys: {', '.join(map(str, keys)) or 'none'})"
    for key, value in zip((src_key, tgt_key), values, strict=True):
        if not isinstance(value, str):
            return f"value of {key!r} is {type(value).__name__}, not a string"
    return values


def read_jsonl(
    path: PathLike,
    src_key: str,
    tgt_key: str,
    on_error: OnError = "raise",
    max_chars: int | None = None,
) -> tuple[list[Pair], ReadReport]:
    """Read JSON lines, one object a line: ``{"de": "...", "en": "..."}`` with ``src_key="de"``,
    ``tgt_key="en"``, or the Hugging Face translation layout ``{"translation": {"de": .., "en": ..}}``.
    Bad JSON, a missing key or a non-string value is malformed; a blank line is empty.
    """
    collector = _Collector((str(path),), on_error, max_chars)
    for i, text in _text_lines(path, collector):
        try:
            row = json.loads(text)
        except json.JSONDecodeError as e:
            collector.error("malformed", f"invalid JSON ({e.msg} at column {e.colno})", path, i)
            continue
        picked = _pick(row, src_key, tgt_key)
        if isinstance(picked, str):
            collector.error("malformed", picked, path, i)
            continue
        collector.add(*picked)
    return collector.result()


def _rows(dataset: Any) -> Iterator[dict]:
    """The rows of a ``datasets`` dataset, read in batches (row by row is several times slower)."""
    if not hasattr(dataset, "iter"):
        yield from dataset
        return
    for batch in dataset.iter(batch_size=1000):
        keys = list(batch)
        for values in zip(*(batch[key] for key in keys), strict=True):
            yield dict(zip(keys, values, strict=True))


def load_hf_dataset(
    name: str,
    src_lang: str,
    tgt_lang: str,
    split: str = "train",
    config: str | None = None,
    on_error: OnError = "raise",
    max_chars: int | None = None,
    **kwargs: Any,
) -> tuple[list[Pair], ReadReport]:
    """Read a split of a Hugging Face dataset through ``datasets.load_dataset``.

    Works with hub datasets in the translation layout, e.g.
    ``load_hf_dataset("wmt14", "de", "en", config="de-en")`` (on the hub: ``wmt/wmt14``), and with the local loaders,
    e.g. ``load_hf_dataset("json", "de", "en", data_files="pairs.jsonl")``. Rows are either
    ``{"translation": {src_lang: .., tgt_lang: ..}}`` or flat columns ``src_lang`` and
    ``tgt_lang``. ``kwargs`` go to ``load_dataset`` (``data_files``, ``revision``, ``cache_dir``,
    ``streaming``...). A bad row raises :class:`CorpusError` naming the dataset and the row
    (1-based, as ``line``), or is skipped and counted with ``on_error="skip"``.

    Needs the optional dependency ``datasets`` (``pip install aiayn[hf]``).
    """
    if not isinstance(split, str):
        raise ValueError(f"split must name one split, e.g. 'train' or 'train[:1000]', got {split!r}")
    try:
        import datasets
    except ImportError as e:
        raise ImportError("load_hf_dataset needs the optional dependency `datasets`: pip install aiayn[hf]") from e
    dataset = datasets.load_dataset(name, config, split=split, **kwargs)
    source = f"{name}{'/' + config if config else ''}[{split}]"
    collector = _Collector((source,), on_error, max_chars)
    for i, row in enumerate(_rows(dataset), start=1):
        collector.report.lines += 1
        picked = _pick(row, src_lang, tgt_lang)
        if isinstance(picked, str):
            collector.error("malformed", picked.replace("JSON object", "row"), source, i)
            continue
        collector.add(*picked)
    return collector.result()
