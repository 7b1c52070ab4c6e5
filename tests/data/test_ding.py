"""Ding: hand-written dictionary lines against hand-written pairs; the real file when installed."""

import gzip
import hashlib
import json
import random
from pathlib import Path

import pytest

from aiayn.data import DingCorpus, find_ding, parse_ding, prepare_ding, split_ding
from aiayn.data import ding as ding_module

# Real Ding format: annotations, several alternatives, ; variants, a mismatched alternative
# count, umlauts and ß, comments, a blank line, a line without separator, duplicates.
FIXTURE_LINES = [
    "# Version :: fixture 2024-01-01",
    "# Aal {m} :: eel",
    "Aal {m} [zool.] | Aale {pl} :: eel | eels",
    "Straße {f}; Gasse {f} | Straßen {pl}; Gassen {pl} :: street; lane | streets; lanes",
    "blank; pur; rein [geh.] {adj} <purer> | Es war purer Zufall. | Das ist blanker Unsinn. :: "
    "sheer; pure | It was sheer/pure coincidence. | That is sheer/pure nonsense.",
    "Fuß {m} | Füße {pl} | zu Fuß :: foot | feet",
    "kaputte Zeile ohne Trenner",
    "",
    "wissen {vt} | Ich weiß es nicht.; Keine Ahnung! :: to know | I don't know.; No idea!",
    "müde {adj} | Er ist müde.; Er ist erschöpft.; Er ist kaputt. [ugs.] :: tired | He is tired.; He is exhausted.",
    "Handbuch {n} | Lies das Handbuch! (Chat-Jargon) :: manual | Read the manual! /RTM/ (chat jargon)",
    "Dunkel {n} | Tappe immer noch im Dunkeln (Chat-Jargon) :: dark | Still in the dark. /SITD/ (chat jargon)",
    "vor {prp; +Dat.} | vor dem Haus :: in front of | in front of the house",
    "Doppelrolle {f} (Theater; Film) :: double role",
    "Allgemeine Geschäftsbedingungen {pl} /AGB/ :: general terms and conditions /GTC/",
    "angehen {vt} | Das geht jdn. nichts an. :: to concern | That is none of sb.'s business.",
    "Achtung! [mil.] :: Attention!",
    "„Ja“, sagte er. :: 'Yes', he said.",
    "Drei mal vier ist zwölf.; 3 mal 4 ist 12. :: Three times four is twelve.; 3 times 4 is 12.",
    "es regnet. :: it's raining.",
    "schön {adj} | Das ist schön [ugs.]! :: nice | That's nice!",
    "Kram {m} | [ugs.] :: stuff | junk",
    "Aal {m} :: eel",
    "Es war purer Zufall. :: It was sheer/pure coincidence.",
    "a :: b :: c",
    "Er ist müde. :: He is weary.",
]
INVALID_UTF8_LINE = "Fuß {m} :: foot".encode("latin-1")  # ß as one Latin-1 byte: not UTF-8

EXPECTED_SENTENCES = [
    ("Es war purer Zufall.", "It was sheer/pure coincidence."),
    ("Das ist blanker Unsinn.", "That is sheer/pure nonsense."),
    ("Ich weiß es nicht.", "I don't know."),
    ("Keine Ahnung!", "No idea!"),
    # three German variants, two English: every German variant gets the first English one
    ("Er ist müde.", "He is tired."),
    ("Er ist erschöpft.", "He is tired."),
    ("Er ist kaputt.", "He is tired."),
    ("Lies das Handbuch!", "Read the manual!"),
    ("„Ja“, sagte er.", "'Yes', he said."),
    ("Drei mal vier ist zwölf.", "Three times four is twelve."),
    ("3 mal 4 ist 12.", "3 times 4 is 12."),
    ("Das ist schön!", "That's nice!"),  # no space left where [ugs.] was
    ("Er ist müde.", "He is weary."),
]
EXPECTED_PHRASES = [
    ("Aal", "eel"),
    ("Aale", "eels"),
    ("Straße", "street"),
    ("Gasse", "lane"),
    ("Straßen", "streets"),
    ("Gassen", "lanes"),
    ("blank", "sheer"),  # three German synonyms, two English: first with first
    ("wissen", "to know"),
    ("müde", "tired"),
    ("Handbuch", "manual"),
    ("Dunkel", "dark"),
    # not a sentence (no final punctuation): a phrase, and phrases keep their notes
    ("Tappe immer noch im Dunkeln (Chat-Jargon)", "Still in the dark. (chat jargon)"),
    ("vor", "in front of"),
    ("vor dem Haus", "in front of the house"),
    ("Doppelrolle (Theater; Film)", "double role"),
    ("Allgemeine Geschäftsbedingungen", "general terms and conditions"),
    ("angehen", "to concern"),
    ("Das geht jdn. nichts an.", "That is none of sb.'s business."),  # a template, not a sentence
    ("Achtung!", "Attention!"),  # one word
    ("es regnet.", "it's raining."),  # lowercase start
    ("schön", "nice"),
    ("Kram", "stuff"),
]
EXPECTED_SKIPPED = {
    "alternative_count_mismatch": 1,
    "duplicate_phrase": 1,
    "duplicate_sentence": 1,
    "empty_after_cleaning": 1,
    "invalid_utf8": 1,
    "no_separator": 1,
    "phrase_variants_unpaired": 3,
    "sentence_en_variants_unpaired": 1,
    "several_separators": 1,
}


def write_fixture(path: Path, lines=FIXTURE_LINES) -> Path:
    path.write_bytes(b"".join(line.encode("utf-8") + b"\n" for line in lines) + INVALID_UTF8_LINE + b"\n")
    return path


@pytest.fixture
def fixture_file(tmp_path) -> Path:
    return write_fixture(tmp_path / "de-en.txt")


# ---- parse_ding ------------------------------------------------------------------------------


def test_parse_fixture_gives_hand_written_pairs(fixture_file):
    corpus = parse_ding(fixture_file)
    assert isinstance(corpus, DingCorpus)
    assert corpus.sentences == EXPECTED_SENTENCES
    assert corpus.phrases == EXPECTED_PHRASES
    assert corpus.skipped == EXPECTED_SKIPPED
    assert (corpus.lines, corpus.comment_lines, corpus.blank_lines) == (24, 2, 1)  # 23 entry lines + the invalid one
    assert corpus.source == str(fixture_file)


def test_parse_handles_crlf(tmp_path):
    path = tmp_path / "crlf.txt"
    path.write_bytes("Straße {f} | Es war purer Zufall. :: street | It was sheer/pure coincidence.\r\n".encode())
    corpus = parse_ding(path)
    assert corpus.phrases == [("Straße", "street")]
    assert corpus.sentences == [("Es war purer Zufall.", "It was sheer/pure coincidence.")]


# ---- split_ding ------------------------------------------------------------------------------


def sha1(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8")).hexdigest()


def test_split_by_sha1_of_german_sentence():
    corpus_sentences = EXPECTED_SENTENCES
    splits = split_ding(corpus_sentences, n_test=2, n_dev=3)
    german = sorted({de for de, _ in corpus_sentences}, key=sha1)  # 11 distinct German sentences
    assert {de for de, _ in splits["test"]} == set(german[:2])
    assert {de for de, _ in splits["dev"]} == set(german[2:5])
    assert {de for de, _ in splits["train"]} == set(german[5:])
    # every pair lands somewhere, in input order within its split
    assert sorted(splits["train"] + splits["dev"] + splits["test"]) == sorted(corpus_sentences)
    for pairs in splits.values():
        assert pairs == [p for p in corpus_sentences if p in pairs]
    # both pairs of "Er ist müde." are in the same split
    assert (
        sum(("Er ist müde.", "He is tired.") in s and ("Er ist müde.", "He is weary.") in s for s in splits.values())
        == 1
    )


def test_split_is_independent_of_line_order(tmp_path):
    reference = split_ding(parse_ding(write_fixture(tmp_path / "a.txt")).sentences, n_test=3, n_dev=3)
    for seed in range(3):
        lines = FIXTURE_LINES[:]
        random.Random(seed).shuffle(lines)
        shuffled = split_ding(parse_ding(write_fixture(tmp_path / f"s{seed}.txt", lines)).sentences, n_test=3, n_dev=3)
        assert {k: sorted(v) for k, v in shuffled.items()} == {k: sorted(v) for k, v in reference.items()}


def test_split_with_too_few_sentences_fills_test_first():
    splits = split_ding([("Ein Satz.", "A sentence."), ("Zwei Sätze.", "Two sentences.")], n_test=5, n_dev=5)
    assert (len(splits["test"]), len(splits["dev"]), len(splits["train"])) == (2, 0, 0)
    with pytest.raises(ValueError):
        split_ding([], n_test=-1)


# ---- prepare_ding ----------------------------------------------------------------------------


def read_lines(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    assert text.endswith("\n")
    return text[:-1].split("\n")


def test_prepare_writes_parallel_files_and_stats(fixture_file, tmp_path):
    out = tmp_path / "out"
    stats = prepare_ding(out, path=fixture_file, n_test=2, n_dev=2)
    splits = split_ding(EXPECTED_SENTENCES, n_test=2, n_dev=2)
    for name, pairs in [*splits.items(), ("phrases", EXPECTED_PHRASES)]:
        de, en = read_lines(out / f"{name}.de"), read_lines(out / f"{name}.en")
        assert list(zip(de, en, strict=True)) == pairs
        assert all(line.strip() for line in de + en)
    written = json.loads((out / "stats.json").read_text(encoding="utf-8"))
    assert written == stats
    assert stats["source"] == str(fixture_file)
    assert stats["source_sha1"] == hashlib.sha1(fixture_file.read_bytes()).hexdigest()
    assert stats["sentences"] == len(EXPECTED_SENTENCES) and stats["phrases"] == len(EXPECTED_PHRASES)
    assert stats["splits"]["test"]["german_sentences"] == 2 and stats["splits"]["dev"]["german_sentences"] == 2
    assert sum(s["pairs"] for s in stats["splits"].values()) == len(EXPECTED_SENTENCES)
    assert stats["skipped"] == EXPECTED_SKIPPED
    assert stats["nouns"] == 7
    assert (out / "nouns.tsv").read_text(encoding="utf-8") == (
        "Aal\teel\tm\t2\nAale\teels\tpl\t2\nStraße\tstreet\tf\t2\nStraßen\tstreets\tpl\t2\n"
        "Handbuch\tmanual\tn\t2\nDunkel\tdark\tn\t2\nKram\tstuff\tm\t2\n"
    )  # Fuß's line has 3 German alternatives to 2; the Latin-1 Fuß line is not UTF-8
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [f"{n}.{s}" for n in ("train", "dev", "test", "phrases") for s in ("de", "en")] + ["nouns.tsv", "stats.json"]
    )  # no temporary files left behind


def test_prepare_refuses_lines_that_would_break_alignment(tmp_path):
    for bad in ["", "  ", "zwei\nZeilen", "zwei\u2028Zeilen", "mit\rCR"]:
        with pytest.raises(ValueError, match=r"line break|empty"):
            ding_module._write_parallel(tmp_path, "x", [("gut", "good"), (bad, "bad")])
    assert not list(tmp_path.iterdir())


# ---- find_ding -------------------------------------------------------------------------------


@pytest.fixture
def no_installed_ding(monkeypatch, tmp_path):
    """Hide the system copy and the environment variable, whatever this machine has."""
    monkeypatch.setattr(ding_module, "SYSTEM_PATH", tmp_path / "no-system-copy")
    monkeypatch.delenv("AIAYN_DING_PATH", raising=False)


def test_find_explicit_path_and_env_var(fixture_file, monkeypatch, tmp_path):
    assert find_ding(fixture_file, download=False) == fixture_file
    with pytest.raises(FileNotFoundError, match=r"missing\.txt"):
        find_ding(tmp_path / "missing.txt")
    monkeypatch.setenv("AIAYN_DING_PATH", str(fixture_file))
    assert find_ding(download=False) == fixture_file
    monkeypatch.setenv("AIAYN_DING_PATH", str(tmp_path / "gone.txt"))
    with pytest.raises(FileNotFoundError, match=r"gone\.txt.*AIAYN_DING_PATH"):
        find_ding(download=False)


def test_find_prefers_system_copy_then_cache(fixture_file, no_installed_ding, monkeypatch, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "de-en.txt").write_text("Aal {m} :: eel\n", encoding="utf-8")
    assert find_ding(cache_dir=cache, urls=["file:///nonexistent/never-fetched"]) == cache / "de-en.txt"
    monkeypatch.setattr(ding_module, "SYSTEM_PATH", fixture_file)
    assert find_ding(cache_dir=cache) == fixture_file


@pytest.mark.parametrize("compress", [False, True])
def test_find_downloads_into_cache(fixture_file, no_installed_ding, tmp_path, compress):
    source = fixture_file
    if compress:
        source = tmp_path / "de-en.txt.gz"
        source.write_bytes(gzip.compress(fixture_file.read_bytes()))
    cache = tmp_path / "cache"
    missing = (tmp_path / "missing.txt.gz").as_uri()
    found = find_ding(cache_dir=cache, urls=[missing, source.as_uri()])
    assert found == cache / "de-en.txt"
    assert found.read_bytes() == fixture_file.read_bytes()
    assert [p.name for p in cache.iterdir()] == ["de-en.txt"]  # temporary files removed
    assert parse_ding(found).sentences == EXPECTED_SENTENCES


def test_find_reports_everywhere_it_looked(no_installed_ding, tmp_path):
    not_ding = tmp_path / "index.html"
    not_ding.write_text("<html>no dictionary here</html>\n", encoding="utf-8")
    cache = tmp_path / "cache"
    urls = [(tmp_path / "missing.gz").as_uri(), not_ding.as_uri()]
    with pytest.raises(FileNotFoundError) as info:
        find_ding(cache_dir=cache, urls=urls)
    message = str(info.value)
    for place in ["AIAYN_DING_PATH", "no-system-copy", str(cache / "de-en.txt"), *urls, "Ding format"]:
        assert place in message
    assert not list(cache.iterdir())  # nothing half-written in the cache
    with pytest.raises(FileNotFoundError, match="download disabled"):
        find_ding(cache_dir=cache, download=False)


# ---- the real dictionary (Debian package trans-de-en) ------------------------------------------

REAL = Path("/usr/share/trans/de-en")


@pytest.fixture(scope="module")
def real_corpus() -> DingCorpus:
    if not REAL.is_file():
        pytest.skip(f"{REAL} not installed (apt install trans-de-en)")
    return parse_ding(REAL)


def test_real_file_sentences_and_phrases(real_corpus):
    assert 15_000 <= len(real_corpus.sentences) <= 30_000
    assert ("Es war purer Zufall.", "It was sheer/pure coincidence.") in real_corpus.sentences
    assert len(real_corpus.phrases) >= 200_000
    assert ("Aalsuppe", "eel soup") in real_corpus.phrases
    assert len(set(real_corpus.sentences)) == len(real_corpus.sentences)
    for de, en in real_corpus.sentences[::50]:
        assert de == de.strip() and en == en.strip() and "\n" not in de + en
        assert not any(c in de + en for c in "{}[]")


def test_real_file_split(real_corpus):
    splits = split_ding(real_corpus.sentences)
    german = {name: {de for de, _ in pairs} for name, pairs in splits.items()}
    assert len(german["test"]) == 1000 and len(german["dev"]) == 1000
    assert not german["test"] & german["dev"] and not german["test"] & german["train"]
    assert not german["dev"] & german["train"]
    assert sum(len(p) for p in splits.values()) == len(real_corpus.sentences)
    shuffled = real_corpus.sentences[:]
    random.Random(0).shuffle(shuffled)
    again = split_ding(shuffled)
    assert {k: set(v) for k, v in again.items()} == {k: set(v) for k, v in splits.items()}


@pytest.mark.slow
def test_real_file_prepare(tmp_path):
    if not REAL.is_file():
        pytest.skip(f"{REAL} not installed")
    stats = prepare_ding(tmp_path, path=REAL)
    for name in ("train", "dev", "test", "phrases"):
        de, en = read_lines(tmp_path / f"{name}.de"), read_lines(tmp_path / f"{name}.en")
        assert len(de) == len(en) == (stats["phrases"] if name == "phrases" else stats["splits"][name]["pairs"])
        assert all(line.strip() for line in de + en)
