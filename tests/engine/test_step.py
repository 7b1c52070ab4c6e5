"""The engine's flat decoding step (``engine/step.py``) against the paper's model: logits equal
to teacher forcing step by step, and the searches' outputs equal, for both norm orders and
ScaleNorm with FixNorm,
activations, unequal head sizes, a deeper decoder, dropout configured (eval mode), windowed
attention, beams sharing the source K/V, padded sources, reordered rows, large batches and
weights made under inference mode. Every model has random biases and layer-norm parameters,
and every test runs with each of the CPU's float32 products (``EngineOptions.gemm``)."""

import pytest
import torch

from aiayn import engine
from aiayn.decode import beam_search, greedy_decode
from aiayn.engine import EngineOptions
from aiayn.engine.linear import SMALL_ROWS
from aiayn.engine.step import Decoding
from helpers import random_model

V = 29
VARIANTS = {
    "post-norm relu": {},
    "pre-norm gelu": {"norm_first": True, "activation": "gelu"},
    "deeper decoder": {"N": 1, "N_dec": 3},
    "untied output": {"tie_output": False, "share_embeddings": False},
    "d_k != d_v": {"d_k": 6, "d_v": 10},
    "dropout (eval mode)": {"P_drop": 0.3, "attention_dropout": 0.2, "activation_dropout": 0.1},
    "windowed attention": {"attention_window": 3},  # a self-attention mask at every step
    # Nguyen & Salazar's low-resource recipe: ScaleNorm everywhere, unit-length embeddings
    "pre-norm scalenorm fixnorm": {"norm_first": True, "norm": "scale", "fix_norm": True},
    "post-norm scalenorm": {"norm": "scale"},
    # a model converted from Marian: swish, an output bias, the decoder starting from the padding id
    "marian's": {"activation": "silu", "output_bias": True, "bos_id": 0},
}


needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")


@pytest.fixture(
    params=["mkl", pytest.param("onednn", marks=needs_onednn), pytest.param("auto-avx512", marks=needs_onednn)]
)
def options(request, monkeypatch) -> EngineOptions:
    """Every product MKL's (transposed at steps), every one oneDNN's, or ``auto`` as on an AVX-512
    CPU with its size threshold lowered to this tiny model's: the 32x96 and 32x64 weights packed
    for oneDNN, the 32x32 and 32x29 ones on MKL's x Wᵀ, mixed in one step."""
    if request.param == "auto-avx512":
        from aiayn.engine import options as engine_options

        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
        monkeypatch.setattr(engine_options, "ONEDNN_MIN_WEIGHT", 2048)
        chosen = EngineOptions()
        assert chosen.onednn_for(32, 96) and not chosen.onednn_for(32, 32) and not chosen.transposed
        return chosen
    return EngineOptions(gemm=request.param)


def source(B: int = 4, S: int = 9, seed: int = 1) -> torch.Tensor:
    """Random ids, rows padded (id 0) to different lengths."""
    src = torch.randint(3, V, (B, S), generator=torch.Generator().manual_seed(seed))
    for b in range(B):
        src[b, max(1, S - 3 * b) :] = 0
    return src


def steps_against_teacher_forcing(model, prepared, src: torch.Tensor, T: int, beam: int = 1) -> None:
    state = Decoding(prepared, src, beam=beam, steps=T)
    R = src.size(0) * beam
    sentence = torch.arange(src.size(0)).repeat_interleave(beam)
    tgt = torch.full((R, 1), model.config.bos_id)
    g = torch.Generator().manual_seed(2)
    for _ in range(T):
        with torch.no_grad():
            expected = model(src[sentence], tgt)[:, -1]  # (R, V), the whole prefix recomputed
        torch.testing.assert_close(state(tgt[:, -1]), expected, rtol=1e-5, atol=1e-5)
        # gather beams by parent, within each sentence (beam search's reorder)
        parents = (torch.randint(0, beam, (R,), generator=g) + sentence * beam) if beam > 1 else torch.arange(R)
        state.reorder(parents, sentences_changed=False)
        tgt = torch.cat([tgt[parents], torch.randint(3, V, (R, 1), generator=g)], dim=1)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("beam", [1, 3])
def test_steps_equal_teacher_forcing(variant, beam, options):
    model = random_model(vocab_size=V, **VARIANTS[variant])
    steps_against_teacher_forcing(model, engine.prepare(model, options=options), source(), T=6, beam=beam)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_searches_give_the_same_outputs_and_scores(variant, search, options):
    """The paper's model (its modules on model/cache.py) and the prepared one find the same outputs."""
    model = random_model(vocab_size=V, **VARIANTS[variant])
    prepared = engine.prepare(model, options=options)
    src = source(B=5)
    if search == "greedy":
        assert torch.equal(greedy_decode(model, src, max_len=12), greedy_decode(prepared, src, max_len=12))
        return
    ours, theirs = (beam_search(m, src, beam=3, nbest=3, max_len=12) for m in (prepared, model))
    for a, b in zip(ours, theirs, strict=True):
        assert [h.tokens for h in a] == [h.tokens for h in b]
        assert [h.score for h in a] == pytest.approx([h.score for h in b], abs=1e-5)


def test_batches_above_the_transposed_products_rows(options):
    """Above ``SMALL_ROWS`` rows MKL's products take ``F.linear``'s orientation."""
    model = random_model(vocab_size=V)
    steps_against_teacher_forcing(model, engine.prepare(model, options=options), source(B=SMALL_ROWS + 3), T=3)


def test_a_model_made_under_inference_mode(options):
    with torch.inference_mode():
        model = random_model(vocab_size=V)
    with torch.inference_mode():
        prepared = engine.prepare(model, options=options)
        src = source()
        assert torch.equal(greedy_decode(model, src, max_len=8), greedy_decode(prepared, src, max_len=8))


def test_autocast_decodes_as_the_paper_model_does():
    """Under bf16 autocast the engine's products are autocast's (F.linear), as the model's are."""
    model = random_model(vocab_size=V, norm_first=True)
    prepared, src = engine.prepare(model), source()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        state = Decoding(prepared, src, beam=1, steps=2)
        bos = torch.full((4,), model.config.bos_id)
        with torch.no_grad():
            expected = model(src, bos[:, None])[:, -1]
        torch.testing.assert_close(state(bos).float(), expected.float(), rtol=2e-2, atol=2e-2)
