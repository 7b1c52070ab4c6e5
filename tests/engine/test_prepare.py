"""``aiayn.engine.prepare``: a prepared model computes what the paper's model computes, on
models whose every weight, bias and layer-norm parameter is random; model/ stays the paper."""

from pathlib import Path

import pytest
import torch

import aiayn
from aiayn import engine
from aiayn.engine.step import Decoding
from aiayn.model import DecoderOnly, ModelConfig
from helpers import random_model

CONFIGS = {
    "post-norm": dict(),
    "pre-norm, gelu": dict(norm_first=True, activation="gelu"),
    "untied, unshared": dict(share_embeddings=False, tie_output=False, tgt_vocab_size=23),
}


def _sources() -> torch.Tensor:
    src = torch.randint(4, 29, (3, 7))
    src[1, 4:] = 0  # padding (pad_id 0)
    return src


@pytest.mark.parametrize("quantize", [None, "int8"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_steps_equal_teacher_forcing(name, quantize):
    """Step by step on the engine's cache, with K = 2 beams per sentence sharing its source K/V and
    rows reordered between steps, the logits equal the model's teacher-forced ones (int8: close)."""
    model = random_model(**CONFIGS[name])
    prepared = engine.prepare(model, quantize=quantize)
    src, K = _sources(), 2
    state = Decoding(prepared, src, beam=K, steps=6)
    rows = torch.arange(3).repeat_interleave(K)  # each row's sentence
    tgt = torch.full((3 * K, 1), model.config.bos_id)
    for _ in range(5):
        logits = state(tgt[:, -1])  # (R, V)
        expected = model(src[rows], tgt)[:, -1]  # teacher forcing over the whole prefix
        if quantize is None:
            torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
        else:  # int8: close to float32, and far from a wrong model's
            assert (logits - expected).abs().max() < 0.1 * expected.abs().max()
        order = torch.tensor([1, 0, 2, 2, 5, 4])  # within each sentence's beams: parents swapped, one copied
        state.reorder(order, sentences_changed=False)
        tgt = torch.cat([tgt[order], torch.randint(4, 23, (3 * K, 1))], dim=1)


def test_prepare_shares_the_parameters_and_leaves_the_model_alone():
    model = random_model(1)
    before = {n: p.clone() for n, p in model.state_dict().items()}
    prepared = engine.prepare(model)
    assert engine.is_prepared(prepared) and not engine.is_prepared(model)
    assert prepared.encoder.layers[0].self_attn.in_proj.weight is model.encoder.layers[0].self_attn.in_proj.weight
    assert prepared.tgt_embedding.weight is model.tgt_embedding.weight
    assert type(model.encoder.layers[0].self_attn.in_proj) is torch.nn.Linear  # the paper's model is untouched
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())
    src, tgt = _sources(), torch.randint(4, 23, (3, 5))
    with torch.no_grad():  # the prepared model's forward (packed products) gives the model's logits
        torch.testing.assert_close(prepared(src, tgt), model(src, tgt), rtol=1e-5, atol=1e-5)


def test_prepare_errors():
    model = random_model(2)
    with pytest.raises(ValueError, match="quantize must be 'int8' or None, got 'int4'"):
        engine.prepare(model, quantize="int4")
    with pytest.raises(ValueError, match="already prepared"):
        engine.prepare(engine.prepare(model))
    with pytest.raises(TypeError, match="encoder-decoder Transformer, got DecoderOnly"):
        engine.prepare(DecoderOnly(ModelConfig.tiny()))


def test_model_package_is_the_paper():
    """model/ holds no C/C++ source, reads no environment and stays under 1,700 lines."""
    package = Path(aiayn.model.__file__).parent
    assert not [p for p in package.rglob("*") if p.suffix in (".c", ".cc", ".cpp", ".h")]
    sources = list(package.glob("*.py"))
    assert not [p.name for p in sources if "environ" in p.read_text() or "getenv" in p.read_text()]
    lines = sum(len(p.read_text().splitlines()) for p in sources)
    assert lines < 1700, f"model/ has {lines} lines"
