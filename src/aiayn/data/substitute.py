"""Dictionary-driven noun substitution: new sentence pairs from Ding's sentences and its nouns.

Not in the paper. Fadaee et al. (2017, "Data Augmentation for Low-Resource Neural Machine
Translation") make new training pairs by swapping a word of a sentence pair for another and its
aligned translation for the other's. Here the alignment and the swap both come from the
dictionary: a German noun of the sentence whose Ding translation occurs once in the English
sentence is replaced by another noun of Ding with the same gender or number (``{m}``, ``{f}``,
``{n}``, ``{pl}``), so that the German articles and adjectives still agree, and the English word
by that noun's translation:

    Das Schiff ist vorige Woche ausgelaufen. :: The ship got under way last week.
    -> Das Schiff ist vorige Einpflanzung ausgelaufen. :: The ship got under way last implantation.

The new pairs are mostly nonsense, and grammatical where the noun stands in the case Ding lists
it in (the nominative; "den Frauen" becomes "den Hunde" in the dative plural, a weak noun keeps
no ending, English "a" stays "a" before a vowel); they put the dictionary's words in sentence
contexts. ``data.substitute`` is the share of the sentence pairs so changed each epoch.
"""

from __future__ import annotations

import os
import random
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["NounLexicon", "format_nouns", "noun_lexicon", "read_nouns"]

GENDERS = ("m", "f", "n", "pl")
_GERMAN_ENTRY = re.compile(r"[A-ZÄÖÜ][a-zäöüß]+")  # a noun of the lexicon: one capitalised word
_ENGLISH_ENTRY = re.compile(r"[a-z]+")  # its translation: one lower-case word
_GERMAN_NOUN = re.compile(rf"^({_GERMAN_ENTRY.pattern}) \{{(m|f|n|pl)\}}")  # "Hund {m} [zool.]"
_ENGLISH_WORD = re.compile(rf"^({_ENGLISH_ENTRY.pattern})(?:\s*[\[(].*)?$")  # "dog", "dog (informal)"
_LETTER = r"[^\W\d_]"  # a Unicode letter
_WORD = re.compile(rf"{_LETTER}+")


def noun_lexicon(lines: Iterable[str]) -> list[tuple[str, str, str, int]]:
    """(German noun, English word, gender or ``pl``, alternatives on its line) from Ding lines.

    From each alternative whose first German variant is one capitalised word with a gender tag
    and whose first English variant is one lower-case word: "Hund {m} [zool.] | Hunde {pl} ... ::
    dog; dawg | dogs; dawgs ..." gives ("Hund", "dog", "m", n) and ("Hunde", "dogs", "pl", n).
    A German noun keeps its first entry. The count of alternatives on the line stands for how
    common the word is (common words have many examples)."""
    seen: dict[str, tuple[str, str, str, int]] = {}
    for line in lines:
        if line.startswith("#") or line.count(" :: ") != 1:
            continue
        german, english = line.rstrip("\r\n").split(" :: ")
        de_alternatives, en_alternatives = german.split(" | "), english.split(" | ")
        if len(de_alternatives) != len(en_alternatives):
            continue
        for de_alt, en_alt in zip(de_alternatives, en_alternatives, strict=True):
            noun = _GERMAN_NOUN.match(de_alt.split("; ")[0].strip())
            word = _ENGLISH_WORD.match(en_alt.split("; ")[0].strip())
            if noun and word and noun.group(1) not in seen:
                seen[noun.group(1)] = (noun.group(1), word.group(1), noun.group(2), len(de_alternatives))
    return list(seen.values())


def format_nouns(nouns: Iterable[tuple[str, str, str, int]]) -> str:
    """``nouns.tsv`` (``aiayn data ding`` writes it): one noun a line, German, English, gender,
    alternatives, tab-separated."""
    return "".join(f"{de}\t{en}\t{g}\t{n}\n" for de, en, g, n in nouns)


def read_nouns(path: str | os.PathLike[str]) -> list[tuple[str, str, str, int]]:
    """The lines :func:`format_nouns` made; a malformed line raises naming the file and line."""
    nouns = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").split("\n")[:-1], 1):
        fields = line.split("\t")
        if (
            len(fields) != 4
            or not _GERMAN_ENTRY.fullmatch(fields[0])
            or not _ENGLISH_ENTRY.fullmatch(fields[1])
            or fields[2] not in GENDERS
            or not re.fullmatch(r"[0-9]+", fields[3])
        ):
            raise ValueError(
                f"{path}:{number}: expected a capitalised German noun, a lower-case English word, m|f|n|pl and "
                f"a count, tab-separated; got {line!r}"
            )
        nouns.append((fields[0], fields[1], fields[2], int(fields[3])))
    return nouns


@dataclass
class NounLexicon:
    """Ding's nouns: which can be found in a sentence pair, and which may replace them.

    ``common``: a replacement comes from the nouns whose line has at least this many
    alternatives (rarer nouns are still found and replaced)."""

    nouns: list[tuple[str, str, str, int]]
    common: int = 3

    def __post_init__(self) -> None:
        self.by_german = {de: (en, g) for de, en, g, _ in self.nouns}
        self.pool: dict[str, list[tuple[str, str]]] = {g: [] for g in GENDERS}
        for de, en, g, n in self.nouns:
            if n >= self.common:
                self.pool[g].append((de, en))
        self._in_pool = {de for pool in self.pool.values() for de, _ in pool}

    def candidates(self, german: str, english: str) -> list[tuple[str, str, str]]:
        """(German noun, English word, gender) aligned in a pair: the noun occurs once in the
        German sentence, not as its first word (capitalised anyway), and its Ding translation
        once in the English sentence (either case)."""
        de_words, en_words = _WORD.findall(german), [w.lower() for w in _WORD.findall(english)]
        de_count, en_count = Counter(de_words), Counter(en_words)
        found = []
        for i, word in enumerate(de_words):
            if i == 0 or de_count[word] != 1 or word not in self.by_german:
                continue
            en, gender = self.by_german[word]
            others = len(self.pool[gender]) - (word in self._in_pool)  # nouns it can become
            if en_count[en] == 1 and others > 0:
                found.append((word, en, gender))
        return found

    def substitute(self, german: str, english: str, rng: random.Random) -> tuple[str, str] | None:
        """The pair with one aligned noun (a random one) swapped for another random noun of the
        same gender or number on both sides; None when no noun aligns. The English word keeps its
        capital where it had one."""
        found = self.candidates(german, english)
        if not found:
            return None
        word, en, gender = rng.choice(found)
        new_de, new_en = rng.choice(self.pool[gender])
        while new_de == word:  # candidates() made sure there is another
            new_de, new_en = rng.choice(self.pool[gender])
        german = _whole_word(word).sub(lambda _: new_de, german, count=1)

        def keep_case(match: re.Match[str]) -> str:
            return new_en[:1].upper() + new_en[1:] if match.group(0)[:1].isupper() else new_en

        english = _whole_word(en, re.IGNORECASE).sub(keep_case, english, count=1)
        return german, english


def _whole_word(word: str, flags: int = 0) -> re.Pattern[str]:
    """``word`` where no letter touches it on either side."""
    return re.compile(rf"(?<!{_LETTER}){re.escape(word)}(?!{_LETTER})", flags)
