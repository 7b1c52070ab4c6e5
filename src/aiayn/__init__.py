"""aiayn: the Transformer of "Attention Is All You Need" (Vaswani et al., 2017) on PyTorch."""

from .model import (
    DecoderOnly,
    EncoderOnly,
    KVCache,
    ModelConfig,
    MultiHeadAttention,
    Transformer,
    load_pretrained,
)
from .translator import Translator

__version__ = "0.1.0"

__all__ = [
    "DecoderOnly",
    "EncoderOnly",
    "KVCache",
    "ModelConfig",
    "MultiHeadAttention",
    "Transformer",
    "Translator",
    "__version__",
    "load_pretrained",
]
