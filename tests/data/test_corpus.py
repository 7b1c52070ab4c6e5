"""Corpus readers: hand-written files against hand-written pairs, and every error case."""

import json
import sys

import pytest

from aiayn.data import CorpusError, ReadReport, load_hf_dataset, read_jsonl, read_parallel, read_tsv


def write(path, text: str | bytes):
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
    return path


# ---- read_parallel ---------------------------------------------------------------------------


def test_parallel_reads_pairs_and_counts_skips(tmp_path):
    # CRLF, surrounding spaces, a BOM, an empty line on each side, an over-long line, no final newline.
    src = write(
        tmp_path / "train.de", "\ufeffDie Straße ist naß.\r\n  Grüß Gott!  \n\nEin Satz.\nzu lang, viel zu lang\nEnde"
    )
    tgt = write(tmp_path / "train.en", "The street is wet.\r\nHello!\nEmpty source.\n   \nshort\nEnd\n")
    pairs, report = read_parallel(src, tgt, max_chars=12)
    assert pairs == [("Grüß Gott!", "Hello!"), ("Ende", "End")]  # the first pair: 19 > 12 characters
    assert report == ReadReport(
        sources=(str(src), str(tgt)), lines=6, pairs=2, skipped_empty=2, skipped_too_long=2, max_chars=12
    )
    assert report.skipped == 4
    assert report.summary() == f"{src} + {tgt}: 2 pairs from 6 lines; skipped 4 (2 empty, 2 over 12 characters)"
    pairs, report = read_parallel(src, tgt)
    assert pairs[0] == ("Die Straße ist naß.", "The street is wet.") and len(pairs) == 4
    assert report.summary().endswith("4 pairs from 6 lines; skipped 2 (2 empty)")


def test_parallel_different_line_counts_name_both_files_and_counts(tmp_path):
    src = write(tmp_path / "a.de", "eins\nzwei\ndrei\n")
    tgt = write(tmp_path / "b.en", "one\ntwo\n")
    for on_error in ("raise", "skip"):
        with pytest.raises(CorpusError) as info:
            read_parallel(src, tgt, on_error=on_error)
        message = str(info.value)
        assert "a.de" in message and "b.en" in message and "3 lines" in message and "2 lines" in message
    assert isinstance(info.value, ValueError)
    # a missing final newline does not change the count
    pairs, _ = read_parallel(src, write(tmp_path / "c.en", "one\ntwo\nthree"))
    assert pairs[-1] == ("drei", "three")


def test_parallel_invalid_utf8_raises_with_file_and_line_or_is_skipped(tmp_path):
    src = write(tmp_path / "x.de", "eins\nzwei\ndrei\n")
    tgt = write(tmp_path / "x.en", b"one\nf\xfcnf\nthree\n")  # Latin-1 u-umlaut on line 2
    with pytest.raises(CorpusError, match=r"x\.en:2: invalid UTF-8") as info:
        read_parallel(src, tgt)
    assert (info.value.path, info.value.line) == (str(tgt), 2)
    pairs, report = read_parallel(src, tgt, on_error="skip")
    assert pairs == [("eins", "one"), ("drei", "three")]
    assert report.skipped_invalid_utf8 == 1 and report.pairs == 2 and report.lines == 3
    with pytest.raises(ValueError, match="on_error"):
        read_parallel(src, tgt, on_error="ignore")


# ---- read_tsv --------------------------------------------------------------------------------


def test_tsv_columns_and_malformed_lines(tmp_path):
    path = write(
        tmp_path / "pairs.tsv", "1\tGuten Morgen.\tGood morning.\n2\tTschüß!\n\n3\t \tEmpty.\n4\tJa.\tYes.\r\n"
    )
    with pytest.raises(CorpusError, match=r"pairs\.tsv:2: expected at least 3 tab-separated columns, found 2"):
        read_tsv(path, src_column=1, tgt_column=2)
    pairs, report = read_tsv(path, src_column=1, tgt_column=2, on_error="skip")
    assert pairs == [("Guten Morgen.", "Good morning."), ("Ja.", "Yes.")]
    assert (report.lines, report.pairs, report.skipped_malformed, report.skipped_empty) == (5, 2, 1, 2)
    pairs, _ = read_tsv(path, src_column=2, tgt_column=0, on_error="skip")  # columns in any order
    assert pairs == [("Good morning.", "1"), ("Empty.", "3"), ("Yes.", "4")]


# ---- read_jsonl ------------------------------------------------------------------------------


def test_jsonl_flat_and_translation_layout(tmp_path):
    rows = [
        {"de": "Guten Tag.", "en": "Good day."},
        {"translation": {"de": "Schöne Grüße!", "en": "Best regards!"}},
        {"de": "  ", "en": "blank"},
    ]
    path = write(tmp_path / "pairs.jsonl", "\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n\n")
    pairs, report = read_jsonl(path, "de", "en")
    assert pairs == [("Guten Tag.", "Good day."), ("Schöne Grüße!", "Best regards!")]
    assert (report.lines, report.pairs, report.skipped_empty) == (4, 2, 2)
    pairs, _ = read_jsonl(path, "en", "de")  # either direction
    assert pairs[1] == ("Best regards!", "Schöne Grüße!")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"de": "Hallo", "en": ', "invalid JSON"),
        ('{"de": "Hallo", "fr": "Salut"}', "missing key 'de' or 'en' (found keys: de, fr)"),
        ('{"translation": {"de": "Hallo"}}', "missing key"),
        ('{"de": "Hallo", "en": null}', "value of 'en' is NoneType"),
        ('["Hallo", "Hello"]', "expected a JSON object, found list"),
    ],
)
def test_jsonl_malformed_lines(tmp_path, line, message):
    path = write(tmp_path / "bad.jsonl", '{"de": "Eins.", "en": "One."}\n' + line + "\n")
    with pytest.raises(CorpusError, match=r"bad\.jsonl:2: ") as info:
        read_jsonl(path, "de", "en")
    assert message in str(info.value)
    pairs, report = read_jsonl(path, "de", "en", on_error="skip")
    assert pairs == [("Eins.", "One.")] and report.skipped_malformed == 1


# ---- load_hf_dataset -------------------------------------------------------------------------


def test_hf_dataset_missing_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(ImportError, match=r"pip install aiayn\[hf\]"):
        load_hf_dataset("json", "de", "en", data_files="unused.jsonl")


@pytest.mark.parametrize("layout", ["translation", "flat"])
def test_hf_dataset_local_json(tmp_path, layout):
    pytest.importorskip("datasets")
    pairs = [("Guten Morgen.", "Good morning."), ("Grüß dich!", "Hi!"), ("Straße", "street")]
    rows = [
        {"translation": {"de": de, "en": en}} if layout == "translation" else {"de": de, "en": en} for de, en in pairs
    ]
    rows.append({"translation": {"de": "", "en": "empty"}} if layout == "translation" else {"de": "", "en": "empty"})
    path = write(tmp_path / "pairs.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    read, report = load_hf_dataset("json", "de", "en", data_files=str(path), cache_dir=str(tmp_path / "hf"))
    assert read == pairs
    assert (report.lines, report.pairs, report.skipped_empty) == (4, 3, 1)
    assert report.sources == ("json[train]",)


def test_hf_dataset_bad_rows(tmp_path):
    pytest.importorskip("datasets")
    path = write(tmp_path / "pairs.jsonl", '{"de": "Eins.", "en": "One."}\n{"de": "Zwei.", "en": null}\n')
    with pytest.raises(CorpusError, match=r"json\[train\]:2: value of 'en' is NoneType"):
        load_hf_dataset("json", "de", "en", data_files=str(path), cache_dir=str(tmp_path / "hf"))
    pairs, report = load_hf_dataset(
        "json", "de", "en", data_files=str(path), cache_dir=str(tmp_path / "hf"), on_error="skip"
    )
    assert pairs == [("Eins.", "One.")] and report.skipped_malformed == 1
    with pytest.raises(CorpusError, match="missing key 'de' or 'fr'"):
        load_hf_dataset("json", "de", "fr", data_files=str(path), cache_dir=str(tmp_path / "hf"))


def test_read_lines_splits_on_newline_only_and_names_the_bad_line(tmp_path):
    import io

    from aiayn.data import read_lines

    # a BOM, a CRLF line, U+2028 and a form feed inside lines (str.splitlines would split there),
    # an empty line, no newline at the end
    data = "\ufeffeins\r\nzwei\u2028drei\n\nvier\x0cfünf\nsechs".encode()
    path = tmp_path / "in.txt"
    path.write_bytes(data)
    expected = ["eins", "zwei\u2028drei", "", "vier\x0cfünf", "sechs"]
    assert list(read_lines(path)) == expected
    assert len(expected) == data.count(b"\n") + 1  # wc -l, plus the unterminated last line
    assert list(read_lines(io.BytesIO(data), "<stdin>")) == expected  # a stream reads the same
    # a stream is read as it is consumed (a pipe: the first line is ready before the rest exists)
    pulled = []

    def pipe():
        for line in (b"a\n", b"b\n", b"c\n"):
            pulled.append(line)
            yield line

    lines = read_lines(pipe(), "<stdin>")
    assert next(lines) == "a" and len(pulled) == 1
    assert list(lines) == ["b", "c"] and len(pulled) == 3
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"gut\nauch gut\nschlecht \xff\n")
    with pytest.raises(CorpusError, match=r"bad.txt:3: invalid UTF-8") as e:
        list(read_lines(bad))
    assert e.value.line == 3
    with pytest.raises(CorpusError, match=r"^<stdin>:2: invalid UTF-8"):
        list(read_lines(io.BytesIO(b"ok\n\xc3\n"), "<stdin>"))
