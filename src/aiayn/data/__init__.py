"""Corpora: the Ding German–English dictionary and readers for users' own parallel data."""

from .corpus import (
    CorpusError,
    ReadReport,
    load_hf_dataset,
    read_jsonl,
    read_lines,
    read_parallel,
    read_text,
    read_tsv,
)
from .ding import DingCorpus, find_ding, parse_ding, prepare_ding, split_ding
from .tokenizer import Tokenizer

__all__ = [
    "Tokenizer",
    "DingCorpus",
    "find_ding",
    "parse_ding",
    "split_ding",
    "prepare_ding",
    "CorpusError",
    "ReadReport",
    "read_parallel",
    "read_tsv",
    "read_jsonl",
    "read_text",
    "read_lines",
    "load_hf_dataset",
]
