"""Model hyperparameters, with the presets of Table 3 ("Attention Is All You Need").

``ModelConfig`` is a frozen, validated dataclass. It is saved as ``config.json`` beside every
checkpoint and is all that is needed to rebuild the model. Paper symbols are used for field
names: ``N`` layers, ``d_model``, ``d_ff``, ``h`` heads, ``d_k`` / ``d_v`` per-head sizes,
``P_drop`` residual dropout.

What differs from the paper, and why:
- ``N_dec`` lets the decoder depth differ from the encoder depth (the paper uses N for both;
  a deep encoder with a shallow decoder is a common speed trade-off).
- ``final_norm`` adds a LayerNorm after each stack. The paper (post-norm) has none; pre-norm
  needs one, and ``torch.nn.Transformer`` always has one, so it is configurable.
- ``attention_dropout`` and ``activation_dropout`` (dropout on attention weights and inside the
  feed-forward network) default to 0, as in the paper; ``torch.nn.Transformer`` uses P_drop there.
- ``norm="scale"`` replaces every LayerNorm of the stacks with ScaleNorm, g · x / ‖x‖ with
  one learned scalar g (Nguyen & Salazar 2019, "Transformers without Tears"), and
  ``fix_norm`` gives every token embedding unit length before the √d_model scaling and in the
  pre-softmax projection (FixNorm, Nguyen & Chiang 2018). Both are their low-resource recipe;
  the paper's LayerNorm and free embeddings are the defaults.
- ``suppress_ids``: target tokens the search never produces (besides padding), such as the tag
  that marks dictionary pairs' sources in training (``data.phrase_tag``); Hugging Face's
  ``suppress_tokens``.
- ``activation="silu"`` (swish, x·σ(x)) and ``output_bias`` (a bias on the pre-softmax
  projection, Marian's ``final_logits_bias``) exist for models converted from Marian / OPUS-MT
  (``aiayn.interop.from_marian``), as does ``bos_id == pad_id``: Marian's decoder starts from its
  padding token, which the decoder's padding mask then never hides at position 0.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = ["ModelConfig", "ACTIVATIONS", "NORMS"]

ACTIVATIONS = ("relu", "gelu", "silu")  # the feed-forward network's: max(0, x) in the paper (§3.3)
NORMS = ("layer", "scale")  # LayerNorm (§3.1) or ScaleNorm


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of every aiayn model (§3, Table 3).

    ``d_k`` and ``d_v`` default to ``d_model // h`` (the paper: d_k = d_v = d_model / h = 64).
    ``tgt_vocab_size`` defaults to ``vocab_size``; a separate target vocabulary needs
    ``share_embeddings=False``.
    """

    vocab_size: int
    N: int = 6
    N_dec: int | None = None
    d_model: int = 512
    d_ff: int = 2048
    h: int = 8
    d_k: int | None = None
    d_v: int | None = None
    P_drop: float = 0.1
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    activation: Literal["relu", "gelu", "silu"] = "relu"
    norm_first: bool = False
    final_norm: bool | None = None
    layer_norm_eps: float = 1e-5
    norm: Literal["layer", "scale"] = "layer"
    fix_norm: bool = False
    positional: Literal["sinusoidal", "learned"] = "sinusoidal"
    max_len: int = 1024
    share_embeddings: bool = True
    tie_output: bool = True
    output_bias: bool = False
    tgt_vocab_size: int | None = None
    attention_window: int | None = None
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    suppress_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        def fail(msg: str) -> None:
            raise ValueError(f"ModelConfig: {msg}")

        for name in ("vocab_size", "N", "d_model", "d_ff", "h", "max_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                fail(f"{name} must be a positive integer, got {value!r}")
        for name in ("N_dec", "d_k", "d_v", "tgt_vocab_size", "attention_window"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                fail(f"{name} must be a positive integer or None, got {value!r}")
        if self.d_k is None or self.d_v is None:
            if self.d_model % self.h:
                fail(f"d_model={self.d_model} is not divisible by h={self.h}; set d_k and d_v")
            # frozen dataclass: fill derived defaults through object.__setattr__
            object.__setattr__(self, "d_k", self.d_k or self.d_model // self.h)
            object.__setattr__(self, "d_v", self.d_v or self.d_model // self.h)
        if self.N_dec is None:
            object.__setattr__(self, "N_dec", self.N)
        if self.final_norm is None:
            object.__setattr__(self, "final_norm", self.norm_first)
        if self.tgt_vocab_size is None:
            object.__setattr__(self, "tgt_vocab_size", self.vocab_size)
        for name in ("P_drop", "attention_dropout", "activation_dropout"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                fail(f"{name} must be in [0, 1), got {value!r}")
        if self.activation not in ACTIVATIONS:
            fail(f"activation must be one of {', '.join(map(repr, ACTIVATIONS))}, got {self.activation!r}")
        if self.positional not in ("sinusoidal", "learned"):
            fail(f"positional must be 'sinusoidal' or 'learned', got {self.positional!r}")
        if self.norm not in NORMS:
            fail(f"norm must be one of {', '.join(map(repr, NORMS))}, got {self.norm!r}")
        if not isinstance(self.fix_norm, bool):
            fail(f"fix_norm must be true or false, got {self.fix_norm!r}")
        if self.layer_norm_eps <= 0:
            fail(f"layer_norm_eps must be positive, got {self.layer_norm_eps!r}")
        if self.share_embeddings and self.tgt_vocab_size != self.vocab_size:
            fail("share_embeddings=True needs tgt_vocab_size == vocab_size")
        for name in ("pad_id", "bos_id", "eos_id"):
            value = getattr(self, name)
            if not 0 <= value < min(self.vocab_size, self.tgt_vocab_size):
                fail(f"{name}={value} is outside the vocabulary")
        if isinstance(self.suppress_ids, (int, str)):
            fail(f"suppress_ids must be a list of token ids, got {self.suppress_ids!r}")
        object.__setattr__(self, "suppress_ids", tuple(self.suppress_ids))  # a list from JSON
        for value in self.suppress_ids:
            bad = not isinstance(value, int) or isinstance(value, bool)
            if bad or not 0 <= value < self.tgt_vocab_size or value == self.eos_id:
                fail(f"suppress_ids: {value!r} is not a target token id other than EOS")

    # Presets -------------------------------------------------------------------------------

    @classmethod
    def base(cls, vocab_size: int, **overrides: Any) -> ModelConfig:
        """Transformer (base), Table 3: N=6, d_model=512, d_ff=2048, h=8, d_k=d_v=64, P_drop=0.1."""
        kw = dict(N=6, d_model=512, d_ff=2048, h=8, P_drop=0.1)  # d_k = d_v = d_model / h = 64
        return cls(vocab_size=vocab_size, **{**kw, **overrides})

    @classmethod
    def big(cls, vocab_size: int, **overrides: Any) -> ModelConfig:
        """Transformer (big), Table 3: N=6, d_model=1024, d_ff=4096, h=16, d_k=d_v=64, P_drop=0.3."""
        kw = dict(N=6, d_model=1024, d_ff=4096, h=16, P_drop=0.3)  # d_k = d_v = d_model / h = 64
        return cls(vocab_size=vocab_size, **{**kw, **overrides})

    @classmethod
    def tiny(cls, vocab_size: int = 32, **overrides: Any) -> ModelConfig:
        """A model small enough for unit tests: N=2, d_model=32, d_ff=64, h=4, no dropout."""
        kw = dict(N=2, d_model=32, d_ff=64, h=4, P_drop=0.0, max_len=128)
        return cls(vocab_size=vocab_size, **{**kw, **overrides})

    # Serialization -------------------------------------------------------------------------

    def replace(self, **changes: Any) -> ModelConfig:
        """A new config with some fields changed (configs are immutable).

        A field that was derived (``d_k``, ``d_v``, ``N_dec``, ``final_norm``, ``tgt_vocab_size``)
        is derived again from the new values unless it is changed too: ``base(V).replace(h=16)``
        has d_k = 32, as in Table 3 row (A).
        """
        for name, derive in _DERIVED.items():
            if name not in changes and getattr(self, name) == derive(self):
                changes[name] = None
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """All fields, derived ones included (what ``config.json`` holds)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"ModelConfig: unknown field(s) {', '.join(unknown)}")
        return cls(**data)

    def save(self, path: str | Path, **metadata: Any) -> None:
        Path(path).write_text(json.dumps({**metadata, **self.to_dict()}, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> tuple[ModelConfig, dict[str, Any]]:
        """Read ``config.json``; returns the config and the metadata stored beside it."""
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: no such file (a model directory needs config.json)") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not a valid JSON config: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object")
        names = {f.name for f in dataclasses.fields(cls)}
        metadata = {k: data.pop(k) for k in list(data) if k not in names}
        try:
            return cls.from_dict(data), metadata
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: {e}") from None


# Fields left as None are derived from others in __post_init__.
_DERIVED = {
    "d_k": lambda c: c.d_model // c.h,
    "d_v": lambda c: c.d_model // c.h,
    "N_dec": lambda c: c.N,
    "final_norm": lambda c: c.norm_first,
    "tgt_vocab_size": lambda c: c.vocab_size,
}
