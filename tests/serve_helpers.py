"""Shared by the server tests (``tests/test_serve.py``, ``tests/test_explorer.py``): a tiny model
directory whose translations end at different lengths."""

import torch

from aiayn.data.tokenizer import TOKENIZER_NAME, Tokenizer
from aiayn.model import ModelConfig, Transformer
from helpers import randomize_

SENTENCES = [
    "Das Haus ist groß.", "The house is big.", "Die Katze schläft.", "The cat is asleep.",
    "Der Hund bellt laut.", "The dog barks loudly.", "Es war purer Zufall.", "It was sheer coincidence.",
]  # fmt: skip


def make_model_dir(directory):
    """A tiny model (every parameter random) and its BPE in ``directory``."""
    tokenizer = Tokenizer.train(SENTENCES * 4, vocab_size=300)
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(vocab_size=tokenizer.vocab_size, max_len=48))
    randomize_(model, 44)
    with torch.no_grad():
        model.tgt_embedding.weight[2] *= 3  # a likely EOS: outputs of different lengths
    model.save_pretrained(directory)
    tokenizer.save(directory / TOKENIZER_NAME)
    return directory
