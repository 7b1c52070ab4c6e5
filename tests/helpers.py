"""Shared test helpers (importable from any test module: ``tests/conftest.py`` puts this
directory on ``sys.path``).

``randomize_``: equivalence tests (the flat decoding step against the module path, the cache
against teacher forcing, int8 against float32, batched against one by one...) must run on a
model whose every parameter matters. The default initialisation gives zero biases and LayerNorm
weights of 1 and biases of 0: a path that drops a bias or a layer norm's affine transform
computes exactly what the reference computes, and the test comparing them cannot fail.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from aiayn.model.layers import ScaleNorm

__all__ = ["random_model", "randomize_"]


@torch.no_grad()
def randomize_(model: nn.Module, seed: int = 0, scale: float = 0.3) -> nn.Module:
    """Fill every parameter of ``model`` with seeded random values, in place; return ``model``.

    - matrices (projection weights, token and learned positional embeddings, shape ``(out, in)``
      or ``(V, d_model)``): N(0, 1 / in), the scale of the default initialisation (Xavier for
      the square projections; N(0, d_model^-0.5) for embeddings, which the model scales by
      √d_model), so activations and logits keep their usual size;
    - LayerNorm (and any other normalisation) weights: 1 + ``scale`` · N(0, 1);
    - ScaleNorm's g: √d_model · (1 + ``scale`` · N(0, 1)), around its initial value;
    - every bias (linear layers, layer norms, an output bias): ``scale`` · N(0, 1).

    The values depend only on ``seed``, the parameters' names and shapes, and their order, not
    on the global random state (a private generator draws them). Tied parameters (one tensor
    under several names) are drawn once. Buffers (the sinusoidal table) are left as they are.
    """
    g = torch.Generator().manual_seed(seed)
    norm_weights = {
        id(m.weight)
        for m in model.modules()
        if isinstance(m, (nn.LayerNorm, nn.GroupNorm, getattr(nn, "RMSNorm", nn.LayerNorm))) and m.weight is not None
    }
    scale_norm_gains = {id(m.g): m.d_model for m in model.modules() if isinstance(m, ScaleNorm)}
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g, dtype=torch.float64)
        if id(p) in scale_norm_gains:
            value = math.sqrt(scale_norm_gains[id(p)]) * (1 + scale * noise)
        elif p.dim() >= 2:
            value = noise / math.sqrt(p.size(-1))
        elif id(p) in norm_weights or name.rsplit(".", 1)[-1] == "weight":
            value = 1 + scale * noise
        else:
            value = scale * noise
        p.copy_(value.to(p.dtype))
    return model


def random_model(seed: int = 0, cls: type[nn.Module] | None = None, **overrides) -> nn.Module:
    """A tiny model (``ModelConfig.tiny(**overrides)``, an encoder-decoder ``Transformer`` unless
    ``cls`` says otherwise) in eval mode, every parameter random (``randomize_(model, seed)``)."""
    from aiayn.model import ModelConfig, Transformer

    torch.manual_seed(seed)
    model = (cls or Transformer)(ModelConfig.tiny(**overrides)).eval()
    return randomize_(model, seed)
