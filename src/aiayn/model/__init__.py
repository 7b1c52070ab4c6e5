"""The Transformer of "Attention Is All You Need", section by section (§3)."""

from pathlib import Path

from .attention import MultiHeadAttention, scaled_dot_product_attention
from .cache import KVCache, LayerCache
from .config import ModelConfig
from .dropout import Dropout
from .embedding import LearnedPositionalEmbedding, SinusoidalPositionalEncoding, TokenEmbedding, sinusoidal_encoding
from .feed_forward import PositionwiseFeedForward
from .layers import DecoderLayer, EncoderLayer, ResidualNorm
from .masks import causal_mask, padding_mask, window_mask
from .pretrained import CONFIG_NAME, WEIGHTS_NAME
from .transformer import (
    Attention,
    Decoder,
    DecoderOnly,
    DecoderOutput,
    Encoder,
    EncoderOnly,
    EncoderOutput,
    Transformer,
    init_weights,
)

ARCHITECTURES = {cls.__name__: cls for cls in (Transformer, DecoderOnly, EncoderOnly)}


def load_pretrained(directory: str | Path, device: str = "cpu") -> Transformer | DecoderOnly | EncoderOnly:
    """Load any aiayn model saved by ``save_pretrained``, whatever its architecture."""
    if not Path(directory).is_dir():
        raise FileNotFoundError(f"{directory}: not a model directory")
    _, metadata = ModelConfig.load(Path(directory) / CONFIG_NAME)
    name = metadata.get("architecture")
    if name not in ARCHITECTURES:
        raise ValueError(f"{Path(directory) / CONFIG_NAME}: unknown architecture {name!r}")
    return ARCHITECTURES[name].from_pretrained(directory, device)


__all__ = [
    "ARCHITECTURES",
    "Attention",
    "CONFIG_NAME",
    "Decoder",
    "DecoderLayer",
    "DecoderOnly",
    "DecoderOutput",
    "Dropout",
    "Encoder",
    "EncoderLayer",
    "EncoderOnly",
    "EncoderOutput",
    "KVCache",
    "LayerCache",
    "LearnedPositionalEmbedding",
    "ModelConfig",
    "MultiHeadAttention",
    "PositionwiseFeedForward",
    "ResidualNorm",
    "SinusoidalPositionalEncoding",
    "TokenEmbedding",
    "Transformer",
    "WEIGHTS_NAME",
    "causal_mask",
    "init_weights",
    "load_pretrained",
    "padding_mask",
    "scaled_dot_product_attention",
    "sinusoidal_encoding",
    "window_mask",
]
