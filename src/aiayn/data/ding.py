"""The Ding German–English dictionary as parallel training data.

Ding (Frank Richter, TU Chemnitz, GPL-2.0-or-later; Debian package ``trans-de-en``) is a
dictionary of about 200,000 lines, one entry a line::

    German side :: English side

Each side holds alternatives separated by `` | `` that correspond position by position (a
headword, its plural, then example phrases and sentences). Within an alternative, synonyms are
separated by ``; ``. Annotations are ``{..}`` (word class: ``{m}``, ``{adj}``), ``[..]`` (register,
field: ``[ugs.]``, ``[geh.]``), ``<..>`` (search forms: ``<purer>``) and ``/ABBR/`` (abbreviations:
``/AGB/``). Example::

    ... | Es war purer Zufall. | ... :: ... | It was sheer/pure coincidence. | ...

This module turns the file into about 20,000 aligned *sentence* pairs (the example sentences, a
small German→English test bed for the paper's translation task; §5.1 trains on WMT 2014's 4.5
million pairs, far too many for a laptop) and about 400,000 *phrase* pairs (words and phrases),
and splits the sentences into train/dev/test by a stable hash of the German side.

Rules (what :func:`parse_ding` keeps, drops and why) are in its docstring; every dropped line,
alternative, variant and duplicate is counted in :attr:`DingCorpus.skipped`.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import shutil
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .substitute import format_nouns, noun_lexicon

__all__ = [
    "DING_URLS",
    "DingCorpus",
    "find_ding",
    "parse_ding",
    "split_ding",
    "prepare_ding",
]

Pair = tuple[str, str]

# The upstream file, newest first: the development snapshot (what Debian's trans-de-en ships,
# "Version :: devel ..."), then the last release.
DING_URLS = (
    "https://ftp.tu-chemnitz.de/pub/Local/urz/ding/de-en-devel/de-en.txt.gz",
    "https://ftp.tu-chemnitz.de/pub/Local/urz/ding/de-en/de-en.txt.gz",
)
SYSTEM_PATH = Path("/usr/share/trans/de-en")
ENV_VAR = "AIAYN_DING_PATH"
DEFAULT_CACHE_DIR = Path("~/.cache/aiayn")
CACHE_NAME = "de-en.txt"


# --------------------------------------------------------------------------------------------
# Finding the file


def find_ding(
    path: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    download: bool = True,
    urls: Sequence[str] = DING_URLS,
    timeout: float = 60.0,
) -> Path:
    """The path of the Ding de-en file: the first that exists of

    1. ``path``, when given;
    2. the environment variable ``AIAYN_DING_PATH``, when set;
    3. ``/usr/share/trans/de-en`` (Debian/Ubuntu: ``apt install trans-de-en``);
    4. ``cache_dir/de-en.txt`` (``cache_dir`` defaults to ``~/.cache/aiayn``), an earlier download;
    5. a download of ``urls`` (tried in order) into ``cache_dir/de-en.txt``, gunzipped when
       the file is gzip-compressed, written to a temporary file and renamed, so an interrupted
       download never leaves a partial file under the final name.

    An explicit ``path`` or ``AIAYN_DING_PATH`` that names a missing file is an error rather
    than being silently replaced by another copy. Raises ``FileNotFoundError`` listing every
    place looked (and every download error) when nothing works.
    """
    if path is not None:
        path = Path(path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"Ding dictionary: {path} (given as path) is not a file")
        return path
    env = os.environ.get(ENV_VAR)
    if env:
        env_path = Path(env).expanduser()
        if not env_path.is_file():
            raise FileNotFoundError(f"Ding dictionary: {env_path} (from ${ENV_VAR}) is not a file")
        return env_path
    if SYSTEM_PATH.is_file():
        return SYSTEM_PATH
    cache = Path(cache_dir if cache_dir is not None else DEFAULT_CACHE_DIR).expanduser()
    cached = cache / CACHE_NAME
    if cached.is_file():
        return cached

    looked = [f"${ENV_VAR} (not set)", f"{SYSTEM_PATH} (missing)", f"{cached} (missing)"]
    if not download:
        looked.append("download disabled (download=False)")
    else:
        for url in urls:
            try:
                return _download(url, cached, timeout)
            except (OSError, ValueError, EOFError) as e:  # URLError is an OSError; bad gzip is OSError/EOFError
                looked.append(f"{url} (download failed: {e})")
    raise FileNotFoundError(
        "Ding dictionary (de-en) not found. Looked at:\n  "
        + "\n  ".join(looked)
        + f"\nInstall the Debian package trans-de-en, set ${ENV_VAR}, or pass path=."
    )


def _temp_path(dest: Path, suffix: str) -> Path:
    """A fresh name beside ``dest``, so that ``os.replace`` is a rename within one file system.
    (Not ``tempfile.mkstemp``: its files are private, 0600, whatever the umask says.)"""
    return dest.with_name(f".{dest.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}{suffix}")


def _download(url: str, dest: Path, timeout: float) -> Path:
    """Fetch ``url`` into ``dest`` atomically, gunzipping a gzip payload (by its magic bytes)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    raw_name, text_name = _temp_path(dest, ".download"), _temp_path(dest, ".tmp")
    try:
        request = urllib.request.Request(url, headers={"User-Agent": "aiayn (Python urllib)"})
        with urllib.request.urlopen(request, timeout=timeout) as response, open(raw_name, "xb") as raw:
            shutil.copyfileobj(response, raw)
        with open(raw_name, "rb") as raw:
            gzipped = raw.read(2) == b"\x1f\x8b"
        with gzip.open(raw_name, "rb") if gzipped else open(raw_name, "rb") as src, open(text_name, "xb") as out:
            shutil.copyfileobj(src, out)
        with open(text_name, "rb") as check:
            head = check.read(1 << 16)
        if b" :: " not in head:
            raise ValueError("the file does not look like the Ding format (no ' :: ' in its first 64 KiB)")
        os.replace(text_name, dest)
        return dest
    finally:
        raw_name.unlink(missing_ok=True)
        text_name.unlink(missing_ok=True)


# --------------------------------------------------------------------------------------------
# Parsing


@dataclass
class DingCorpus:
    """The pairs parsed from one Ding file, and what was skipped.

    ``sentences`` and ``phrases`` are ``(german, english)`` pairs in file order, exact
    duplicates removed (first occurrence kept). ``skipped`` counts, by reason, everything that
    did not become a pair (see :func:`parse_ding`); ``lines`` counts the entry lines read
    (comments and blank lines are counted apart).
    """

    sentences: list[Pair]
    phrases: list[Pair]
    skipped: dict[str, int] = field(default_factory=dict)
    lines: int = 0
    comment_lines: int = 0
    blank_lines: int = 0
    source: str | None = None


_CURLY = re.compile(r"\{[^{}]*\}")
_SQUARE = re.compile(r"\[[^\[\]]*\]")
_ANGLE = re.compile(r"<[^<>\s][^<>]*>")
# "/AGB/", "/z. Hd., z. H./": an abbreviation after a space (or at the start), never the
# English slash alternatives ("sheer/pure", "selbst / allein": no space before, or one after).
_ABBREVIATION = re.compile(r"(?:^|(?<=\s))/[^/\s](?:[^/]*[^/\s])?/(?=[\s;,.)]|$)")
_SPACE_BEFORE_PUNCT = re.compile(r"\s+(?=[.,!?])")
_TERMINAL = "[.!?]"
_CLOSING_QUOTES = "\"'“”‘’»«"
_OPENING = "\"'„“‚‘»«"
# A note in round brackets after a sentence's final punctuation: "Lies das Handbuch! (Chat-Jargon)".
_TRAILING_NOTE = re.compile(rf"(?:(?<={_TERMINAL})|(?<={_TERMINAL}[{_CLOSING_QUOTES}]))\s*\([^()]*\)$")
_SENTENCE_LAST = frozenset(".!?" + _CLOSING_QUOTES)
_SENTENCE_END = re.compile(rf"{_TERMINAL}[{_CLOSING_QUOTES}]*$")
# Dictionary templates rather than sentences: placeholders for somebody/something, and "…"
# for a gap ("Die Bezeichnung … ist in Frankreich nicht zugelassen.").
_TEMPLATE = re.compile(r"(?:^|(?<=[\s(/]))(?:jd|jdm|jdn|jds|jdes|etw|sb|sth)\.|…|\.\.\.")
_ABBREVIATION_END = re.compile(r"(?:^|(?<=\s))(?:usw|etc|o\. ?ä|u\. ?ä|u\. ?a|bzw|Co)\.$")


def _strip_annotations(text: str) -> str:
    """Remove {..} [..] <..> and /ABBR/ annotations (repeatedly, for nested ones), and the space
    a removal leaves before punctuation ("schön [ugs.]." -> "schön.")."""
    original = text
    previous = None
    while previous != text and ("{" in text or "[" in text or "<" in text):
        previous = text
        text = _ANGLE.sub(" ", _SQUARE.sub(" ", _CURLY.sub(" ", text)))
    if "/" in text:
        text = _ABBREVIATION.sub(" ", text)
    return text if text is original else _SPACE_BEFORE_PUNCT.sub("", text)


def _drop_trailing_notes(text: str) -> str:
    """Drop notes in round brackets after a sentence's final punctuation (or closing quote)."""
    while text.endswith(")"):
        shorter = _TRAILING_NOTE.sub("", text).rstrip()
        if shorter == text:
            break
        text = shorter
    return text


def _split_variants(text: str) -> list[str]:
    """Split on ``; `` outside round brackets: "(theatre; film, TV)" is one note, not two variants.

    A side with unbalanced brackets ("öffnende runde Klammer / ( /") is split on every ``; ``.
    """
    if "(" not in text or text.count("(") != text.count(")"):
        return text.split("; ")
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth = max(depth - 1, 0)
        elif ch == ";" and depth == 0 and text.startswith("; ", i):
            parts.append(text[start:i])
            start = i + 2
    parts.append(text[start:])
    return parts


def _variants(alternative: str) -> list[str]:
    """Cleaned ``; `` variants: annotations removed, whitespace (line separators too) collapsed."""
    return [" ".join(v.split()) for v in _split_variants(_strip_annotations(alternative))]


def _is_sentence(text: str) -> bool:
    """A German sentence: a capital letter, digit or opening quote or bracket first; . ! ? (then
    closing quotes) last; at least two words; not a template ("jdm.", "etw.", "…") and not
    ending with an abbreviation ("usw.")."""
    if text[-1:] not in _SENTENCE_LAST:
        return False
    first = text.lstrip("(")[:1]
    return (
        bool(first)
        and (first.isupper() or first.isdigit() or first in _OPENING)
        and _SENTENCE_END.search(text) is not None
        and " " in text
        and not _TEMPLATE.search(text)
        and not _ABBREVIATION_END.search(text)
    )


def parse_ding(path: str | os.PathLike[str]) -> DingCorpus:
    """Parse a Ding de-en file into aligned sentence pairs and phrase pairs.

    Rules, applied line by line:

    - ``#`` lines are comments, blank lines are ignored (both counted). A line must contain
      `` :: `` exactly once (else ``no_separator`` / ``several_separators``) and decode as UTF-8
      (else ``invalid_utf8``); the two sides must have the same number of `` | `` alternatives
      (else the whole line is skipped: ``alternative_count_mismatch``).
    - Each alternative is cleaned: annotations ``{..}``, ``[..]``, ``<..>`` and ``/ABBR/`` are
      removed and whitespace is collapsed; round brackets are kept ("Das ist (total) im
      Arsch.", "Aal (auf der Speisekarte)"), as are English slash alternatives ("sheer/pure").
      The alternative is then split into ``; `` variants (never inside round brackets). In
      sentence alternatives (below), a note in round brackets after the final punctuation is
      dropped on both sides: "Lies das Handbuch! (Chat-Jargon)" -> "Lies das Handbuch!".
    - A German variant is a *sentence* when it starts with a capital letter, a digit or an
      opening quote (or a round bracket before one: "(Ich) passe!"), ends with ``.``, ``!`` or
      ``?`` (optionally followed by closing quotes), has at least two words, is not a
      dictionary template (placeholders ``jd.``, ``jdm.``, ``jdn.``, ``jds.``, ``etw.``, a gap
      ``…``: "Das geht jdn. nichts an.") and does not end with an abbreviation (``usw.``,
      ``etc.``, ``o. ä.``...). An alternative with at least one sentence variant is a sentence
      alternative; its variants are paired position by position when both sides have as many,
      otherwise every German variant with the *first* English variant (the German side usually
      lists paraphrases of one English sentence; the other English variants are counted as
      ``sentence_en_variants_unpaired``). A pair goes to ``sentences`` when its German side is
      a sentence and its English side has no template placeholder (``sb.``, ``sth.``, ``…``),
      else to ``phrases`` ("Verzeih mir; Vergib mir!" :: "Forgive me!"). The English side is
      not otherwise checked: a few English sentences lack their final full stop.
    - Every other alternative gives *phrase* pairs: ``; `` synonyms paired position by position
      when both sides have as many, otherwise only the first with the first (the others are
      counted as ``phrase_variants_unpaired``).
    - A pair with an empty side after cleaning is skipped (``empty_after_cleaning``); exact
      duplicate pairs keep their first occurrence (``duplicate_sentence`` / ``duplicate_phrase``).
    """
    path = Path(path)
    skipped: Counter[str] = Counter()
    sentences: dict[Pair, None] = {}  # a dict keeps insertion order: dedup in file order
    phrases: dict[Pair, None] = {}
    lines = comments = blanks = 0

    def add(pairs: dict[Pair, None], pair: Pair, reason: str) -> None:
        if not pair[0] or not pair[1]:
            skipped["empty_after_cleaning"] += 1
        elif pair in pairs:
            skipped[reason] += 1
        else:
            pairs[pair] = None

    with path.open("rb") as f:
        for raw in f:
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError:
                lines += 1
                skipped["invalid_utf8"] += 1
                continue
            if line.startswith("#"):
                comments += 1
                continue
            if not line.strip():
                blanks += 1
                continue
            lines += 1
            n_separators = line.count(" :: ")
            if n_separators != 1:
                skipped["no_separator" if n_separators == 0 else "several_separators"] += 1
                continue
            german, english = line.split(" :: ")
            de_alternatives, en_alternatives = german.split(" | "), english.split(" | ")
            if len(de_alternatives) != len(en_alternatives):
                skipped["alternative_count_mismatch"] += 1
                continue
            for de_alt, en_alt in zip(de_alternatives, en_alternatives, strict=True):
                de, en = _variants(de_alt), _variants(en_alt)
                de_sentences = [_drop_trailing_notes(v) for v in de]
                if any(_is_sentence(v) for v in de_sentences):
                    de, en = de_sentences, [_drop_trailing_notes(v) for v in en]
                    if len(de) != len(en):
                        skipped["sentence_en_variants_unpaired"] += len(en) - 1
                        en = en[:1] * len(de)
                    for pair in zip(de, en, strict=True):
                        if _is_sentence(pair[0]) and not _TEMPLATE.search(pair[1]):
                            add(sentences, pair, "duplicate_sentence")
                        else:
                            add(phrases, pair, "duplicate_phrase")
                else:
                    if len(de) != len(en):
                        skipped["phrase_variants_unpaired"] += len(de) + len(en) - 2
                        de, en = de[:1], en[:1]
                    for pair in zip(de, en, strict=True):
                        add(phrases, pair, "duplicate_phrase")
    return DingCorpus(
        sentences=list(sentences),
        phrases=list(phrases),
        skipped=dict(sorted(skipped.items())),
        lines=lines,
        comment_lines=comments,
        blank_lines=blanks,
        source=str(path),
    )


# --------------------------------------------------------------------------------------------
# Splitting and writing


def _sha1(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8")).hexdigest()


def split_ding(sentences: Iterable[Pair], n_test: int = 1000, n_dev: int = 1000) -> dict[str, list[Pair]]:
    """Split sentence pairs into ``train``/``dev``/``test`` by a stable hash of the German side.

    The distinct German sentences are sorted by SHA-1 of their UTF-8 bytes (ties, which need a
    SHA-1 collision, by the text): the first ``n_test`` go to test, the next ``n_dev`` to dev,
    the rest to train. All pairs of one German sentence land in the same split, so no German
    sentence is in two splits, and the split does not depend on the order of the input (pairs
    keep their input order within a split). The same holds across dictionary versions as far
    as the hashes allow: a new sentence moves at most the sentences that sort after it.
    """
    if n_test < 0 or n_dev < 0:
        raise ValueError(f"n_test and n_dev must be >= 0, got {n_test} and {n_dev}")
    sentences = list(sentences)
    german = sorted({de for de, _ in sentences}, key=lambda de: (_sha1(de), de))
    split_of = {de: "test" for de in german[:n_test]}
    split_of.update({de: "dev" for de in german[n_test : n_test + n_dev]})
    splits: dict[str, list[Pair]] = {"train": [], "dev": [], "test": []}
    for pair in sentences:
        splits[split_of.get(pair[0], "train")].append(pair)
    return splits


def _file_sha1(path: Path) -> str:
    digest = hashlib.sha1()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_atomic(path: Path, text: str) -> None:
    tmp = _temp_path(path, ".tmp")
    try:
        with open(tmp, "x", encoding="utf-8", newline="\n") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _write_parallel(out_dir: Path, name: str, pairs: Sequence[Pair]) -> None:
    for side, suffix in ((0, "de"), (1, "en")):
        lines = [pair[side] for pair in pairs]
        for line in lines:
            # parse_ding never yields these (it collapses all whitespace, line separators
            # included); a caller's own pairs might, and one would shift every line after it.
            if not line.strip() or len(line.splitlines()) != 1:
                raise ValueError(f"{name}.{suffix}: a line is empty or contains a line break: {line!r}")
        _write_atomic(out_dir / f"{name}.{suffix}", "".join(line + "\n" for line in lines))


def prepare_ding(
    out_dir: str | os.PathLike[str],
    path: str | os.PathLike[str] | None = None,
    n_test: int = 1000,
    n_dev: int = 1000,
    cache_dir: str | os.PathLike[str] | None = None,
    download: bool = True,
) -> dict:
    """Find, parse and split Ding; write ``out_dir/{train,dev,test,phrases}.{de,en}``.

    Each pair of files is parallel, one sentence (or phrase) a line, UTF-8. ``nouns.tsv`` holds
    Ding's nouns with their gender (``data.substitute``; ``substitute.noun_lexicon``). ``stats.json``
    records the counts, the skips, the source path and its SHA-1. Every file is written to a
    temporary name and renamed. Returns the dict written to ``stats.json``.
    """
    source = find_ding(path, cache_dir=cache_dir, download=download)
    corpus = parse_ding(source)
    splits = split_ding(corpus.sentences, n_test=n_test, n_dev=n_dev)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, pairs in splits.items():
        _write_parallel(out, name, pairs)
    _write_parallel(out, "phrases", corpus.phrases)
    nouns = noun_lexicon(source.read_text(encoding="utf-8", errors="replace").split("\n"))
    _write_atomic(out / "nouns.tsv", format_nouns(nouns))
    stats = {
        "source": str(source),
        "source_sha1": _file_sha1(source),
        "lines": corpus.lines,
        "comment_lines": corpus.comment_lines,
        "blank_lines": corpus.blank_lines,
        "sentences": len(corpus.sentences),
        "phrases": len(corpus.phrases),
        "nouns": len(nouns),
        "splits": {
            name: {"pairs": len(pairs), "german_sentences": len({de for de, _ in pairs})}
            for name, pairs in splits.items()
        },
        "skipped": corpus.skipped,
    }
    _write_atomic(out / "stats.json", json.dumps(stats, indent=2, ensure_ascii=False) + "\n")
    return stats
