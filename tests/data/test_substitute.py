"""Dictionary-driven noun substitution (``data.substitute``): the lexicon read off Ding lines,
the nouns it aligns in a sentence pair, and the swap, against hand-worked cases."""

import random

import pytest

from aiayn.data.substitute import NounLexicon, format_nouns, noun_lexicon, read_nouns

DING_LINES = [
    "# a comment :: ignored\n",
    "Hund {m} [zool.] | Hunde {pl} | einen Hund abrichten :: dog; dawg | dogs; dawgs | to train a dog\n",
    "Katze {f} | Katzen {pl} :: cat | cats\n",
    "Haus {n}; Gebäude {n} :: house; building\n",
    "laufen {vi} | läuft :: to run | runs\n",  # a verb: no noun
    "Baum {m} | Bäume {pl} :: tree\n",  # alternatives do not match: the line is skipped
    "Hund {m} :: canine\n",  # a noun keeps its first entry
    "Schiff {n} :: ship (vessel) [naut.]\n",  # a note after the English word
    "Stadt-Land {n} :: Categories\n",  # hyphenated German, capitalised English: neither kept
]


def test_noun_lexicon_reads_the_first_variants_of_each_alternative_with_their_gender_and_line_size():
    assert noun_lexicon(DING_LINES) == [
        ("Hund", "dog", "m", 3),
        ("Hunde", "dogs", "pl", 3),
        ("Katze", "cat", "f", 2),
        ("Katzen", "cats", "pl", 2),
        ("Haus", "house", "n", 1),
        ("Schiff", "ship", "n", 1),
    ]


def test_nouns_round_trip(tmp_path):
    nouns = noun_lexicon(DING_LINES)
    path = tmp_path / "nouns.tsv"
    path.write_text(format_nouns(nouns), encoding="utf-8")
    assert read_nouns(path) == nouns


@pytest.mark.parametrize(
    "bad", ["Katze\tcat\tx\t2", "Katze\tcat\tf", "katze\tcat\tf\t2", "Katze\tTV\tf\t2", "Katze\tcat\tf\t²"]
)
def test_a_bad_nouns_line_names_the_file_and_line(tmp_path, bad):
    path = tmp_path / "nouns.tsv"
    path.write_text(f"Hund\tdog\tm\t3\n{bad}\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"nouns\.tsv:2: .*m\|f\|n\|pl"):
        read_nouns(path)


LEXICON = [
    ("Hund", "dog", "m", 3),
    ("Kater", "tomcat", "m", 5),
    ("Katze", "cat", "f", 5),  # the only common f noun: it can become nothing else
    ("Hunde", "dogs", "pl", 3),
    ("Mäuse", "mice", "pl", 4),
    ("Floh", "flea", "m", 1),  # found in sentences, never a replacement (rare)
    ("Maus", "mouse", "f", 1),
]


def test_candidates_are_nouns_aligned_once_on_both_sides_and_not_first():
    lexicon = NounLexicon(LEXICON, common=3)
    assert lexicon.candidates("Der Hund jagt die Maus.", "The dog chases the mouse.") == [
        ("Hund", "dog", "m"),
        ("Maus", "mouse", "f"),
    ]
    assert lexicon.candidates("Hund und Maus.", "Dog and mouse.") == [("Maus", "mouse", "f")]  # not the first word
    assert lexicon.candidates("Der Hund sieht einen Hund.", "The dog sees a dog.") == []  # twice: no alignment
    assert lexicon.candidates("Der Hund bellt.", "The hound barks.") == []  # its translation is absent
    assert lexicon.candidates("Ein Floh.", "A flea.") == [("Floh", "flea", "m")]
    assert lexicon.candidates("Die Katzen schlafen.", "The cats sleep.") == []  # not in the lexicon
    assert lexicon.candidates("Die Katze schläft.", "The cat sleeps.") == []  # no other f noun to become


def test_substitute_swaps_whole_words_on_both_sides_for_another_noun_of_the_same_gender():
    lexicon = NounLexicon(LEXICON, common=3)
    assert lexicon.pool == {
        "m": [("Hund", "dog"), ("Kater", "tomcat")],
        "f": [("Katze", "cat")],
        "n": [],
        "pl": [("Hunde", "dogs"), ("Mäuse", "mice")],
    }
    rng = random.Random(0)
    seen = {lexicon.substitute("Der Flohmarkt hat einen Floh.", "The fleamarket has a flea.", rng) for _ in range(40)}
    # the m pool has two nouns; the compounds before the nouns are other words
    assert seen == {
        ("Der Flohmarkt hat einen Hund.", "The fleamarket has a dog."),
        ("Der Flohmarkt hat einen Kater.", "The fleamarket has a tomcat."),
    }
    seen = {lexicon.substitute("Der Hund sah die Maus.", "The dog saw the mouse.", rng) for _ in range(40)}
    assert seen == {
        ("Der Kater sah die Maus.", "The tomcat saw the mouse."),  # never itself
        ("Der Hund sah die Katze.", "The dog saw the cat."),
    }
    # a capital stays a capital; the only other pl noun
    assert lexicon.substitute("Die Hunde bellen.", "Dogs bark.", rng) == ("Die Mäuse bellen.", "Mice bark.")
    assert lexicon.substitute("Der Hund bellt.", "The hound barks.", rng) is None
