"""The flat decoding step (``model/incremental.py``) against the module-by-module decoder:
bit-identical logits and caches, for both norms and activations, beams sharing the source K/V,
padded sources and prompts, windowed attention, reordered caches, decoder-only and int8
models, large batches, autocast and torch's attention; and it serves exactly the calls it
claims to (decoding steps in eval mode without autograd), the module path the rest. Every test
runs with each of the CPU's float32 products (``model/linear.py``): MKL's, and oneDNN's on packed
weights with the feed-forward's ReLU inside the product.
(tests/model/test_cache.py checks the cached steps, fast path included, against teacher forcing.)"""

import pytest
import torch

from aiayn import DecoderOnly, ModelConfig, Transformer
from aiayn.decode import beam_search, greedy_decode
from aiayn.model import incremental
from aiayn.model import linear as linear_module
from aiayn.model.linear import SMALL_ROWS
from aiayn.quantize import quantize_int8

V = 40
VARIANTS = {
    "post-norm relu": {},
    "pre-norm gelu": {"norm_first": True, "activation": "gelu"},
    "deeper decoder": {"N": 1, "N_dec": 3},
    "untied output": {"tie_output": False, "share_embeddings": False},
    "d_k != d_v": {"d_k": 6, "d_v": 10},
    "dropout (eval mode)": {"P_drop": 0.3, "attention_dropout": 0.2, "activation_dropout": 0.1},
    "windowed attention": {"attention_window": 3},  # a self-attention mask at every step
}


@pytest.fixture(
    autouse=True,
    params=[
        False,
        pytest.param(True, marks=pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")),
    ],
    ids=["mkl", "onednn"],
)
def products(request, monkeypatch):
    monkeypatch.setattr(linear_module, "PACKED", request.param)


def build(cls=Transformer, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return cls(ModelConfig.tiny(V, **overrides)).eval()


def source(B: int = 4, S: int = 9, seed: int = 1) -> torch.Tensor:
    """Random ids, rows padded (id 0) to different lengths."""
    src = torch.randint(3, V, (B, S), generator=torch.Generator().manual_seed(seed))
    for b in range(B):
        src[b, max(1, S - 3 * b) :] = 0
    return src


def decode_steps(model, src: torch.Tensor, tgt: torch.Tensor, fast: bool, monkeypatch, group: int = 1, rows=None):
    """Logits ``(B, T, V)`` of feeding ``tgt`` one token at a time, and the final cache; with
    ``rows``, the cache is reordered (``reorder(rows)``, encoder-decoder K/V too) first."""
    monkeypatch.setattr(incremental, "enabled", fast)
    with torch.no_grad():
        enc = model.encode(src)
        cache = model.init_cache(enc.memory, enc.mask).expand(group)
        if rows is not None:
            cache.reorder(rows)
        steps = [model.decode(tgt[:, t : t + 1], cache=cache).logits for t in range(tgt.size(1))]
    return torch.cat(steps, dim=1), cache


def assert_same_cache(a, b):
    for x, y in zip(a.self_attn, b.self_attn, strict=True):
        assert torch.equal(x.k, y.k) and torch.equal(x.v, y.v)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_steps_are_bit_identical_to_the_module_path(variant, monkeypatch):
    model = build(**VARIANTS[variant])
    src = source()
    tgt = torch.randint(3, V, (4, 20), generator=torch.Generator().manual_seed(2))  # past the cache's first capacity
    fast, fast_cache = decode_steps(model, src, tgt, True, monkeypatch)
    slow, slow_cache = decode_steps(model, src, tgt, False, monkeypatch)
    assert torch.equal(fast, slow)
    assert_same_cache(fast_cache, slow_cache)


def test_beams_sharing_the_source_keys_and_values_are_bit_identical(monkeypatch):
    model = build()
    src = source(B=3)
    tgt = torch.randint(3, V, (3 * 4, 6), generator=torch.Generator().manual_seed(3))
    fast, _ = decode_steps(model, src, tgt, True, monkeypatch, group=4)
    slow, _ = decode_steps(model, src, tgt, False, monkeypatch, group=4)
    assert torch.equal(fast, slow)


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_searches_give_the_same_outputs_and_scores(search, monkeypatch):
    model = build()
    src = source(B=5)

    def run(fast):
        monkeypatch.setattr(incremental, "enabled", fast)
        if search == "greedy":
            return greedy_decode(model, src, max_len=12).tolist()
        return [[(h.tokens, h.score) for h in hyps] for hyps in beam_search(model, src, beam=3, nbest=3, max_len=12)]

    assert run(True) == run(False)


def test_greedy_with_the_fast_step_equals_recomputing_the_prefix(monkeypatch):
    model = build(norm_first=True)
    src = source(B=5)
    monkeypatch.setattr(incremental, "enabled", True)
    assert torch.equal(greedy_decode(model, src, max_len=10), greedy_decode(model, src, max_len=10, use_cache=False))


def test_decoder_only_steps_are_bit_identical(monkeypatch):
    model = build(DecoderOnly)
    tokens = torch.randint(3, V, (3, 12), generator=torch.Generator().manual_seed(4))

    def run(fast):
        monkeypatch.setattr(incremental, "enabled", fast)
        cache = model.init_cache()
        with torch.no_grad():
            return torch.cat([model.decode(tokens[:, t : t + 1], cache=cache).logits for t in range(12)], dim=1)

    assert torch.equal(run(True), run(False))


def test_int8_steps_are_bit_identical(monkeypatch):
    model = quantize_int8(build())
    src = source()
    tgt = torch.randint(3, V, (4, 8), generator=torch.Generator().manual_seed(5))
    assert torch.equal(
        decode_steps(model, src, tgt, True, monkeypatch)[0], decode_steps(model, src, tgt, False, monkeypatch)[0]
    )


def test_batches_above_the_transposed_products_rows_are_bit_identical(monkeypatch):
    model = build()
    B = SMALL_ROWS + 3  # linear() takes F.linear here; so must the step
    src = source(B=B, seed=6)
    tgt = torch.randint(3, V, (B, 3), generator=torch.Generator().manual_seed(6))
    assert torch.equal(
        decode_steps(model, src, tgt, True, monkeypatch)[0], decode_steps(model, src, tgt, False, monkeypatch)[0]
    )


def test_a_model_made_under_inference_mode_is_bit_identical(monkeypatch):
    """Its weights have no version counter, so no packed copies: both paths take MKL's products."""
    with torch.inference_mode():
        model = build()
    src = source()
    tgt = torch.randint(3, V, (4, 5), generator=torch.Generator().manual_seed(8))
    fast, _ = decode_steps(model, src, tgt, True, monkeypatch)
    slow, _ = decode_steps(model, src, tgt, False, monkeypatch)
    assert torch.equal(fast, slow)


def test_torchs_attention_serves_when_the_kernels_are_off(monkeypatch):
    monkeypatch.setenv("AIAYN_CPU_KERNELS", "0")
    model = build()
    src = source()
    tgt = torch.randint(3, V, (4, 5), generator=torch.Generator().manual_seed(7))
    fast, _ = decode_steps(model, src, tgt, True, monkeypatch)
    slow, _ = decode_steps(model, src, tgt, False, monkeypatch)
    assert torch.equal(fast, slow)


def test_a_reordered_cache_and_rows_sharing_one_source_are_bit_identical(monkeypatch):
    model = build()
    src = source()
    rows = torch.tensor([3, 0, 0, 2])  # encoder-decoder K/V gathered too (cross=True)
    tgt = torch.randint(3, V, (4, 5), generator=torch.Generator().manual_seed(8))
    fast, _ = decode_steps(model, src, tgt, True, monkeypatch, rows=rows)
    slow, _ = decode_steps(model, src, tgt, False, monkeypatch, rows=rows)
    assert torch.equal(fast, slow)
    one = source(B=1)  # one encoded source for 4 rows, not expanded: attention broadcasts its row
    fast, _ = decode_steps(model, one, tgt, True, monkeypatch)
    slow, _ = decode_steps(model, one, tgt, False, monkeypatch)
    assert torch.equal(fast, slow)


def test_steps_after_a_left_padded_prompt_are_bit_identical(monkeypatch):
    model = build(DecoderOnly)
    prompt = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10], [0, 11, 12, 13]])  # left-padded: a key mask from here on
    tokens = torch.randint(3, V, (3, 6), generator=torch.Generator().manual_seed(9))

    def run(fast):
        monkeypatch.setattr(incremental, "enabled", fast)
        cache = model.init_cache()
        with torch.no_grad():
            model.decode(prompt, cache=cache)
            return torch.cat([model.decode(tokens[:, t : t + 1], cache=cache).logits for t in range(6)], dim=1)

    assert torch.equal(run(True), run(False))


def test_autocast_steps_are_bit_identical(monkeypatch):
    model = build()
    src = source()
    tgt = torch.randint(3, V, (4, 4), generator=torch.Generator().manual_seed(10))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast, _ = decode_steps(model, src, tgt, True, monkeypatch)
        slow, _ = decode_steps(model, src, tgt, False, monkeypatch)
    assert fast.dtype == slow.dtype and torch.equal(fast, slow)


def test_with_autograd_on_every_trainable_layer_gets_its_gradient(monkeypatch):
    """Eval mode with autograd on and the first layer frozen: attention in later layers must not
    run in the CPU kernel (no backward), so the module path serves such calls."""
    model = build()
    for p in [*model.src_embedding.parameters(), *model.encoder.parameters(), *model.decoder.layers[0].parameters()]:
        p.requires_grad_(False)
    src, bos = source(), torch.ones(4, 1, dtype=torch.long)

    def grads(fast):
        monkeypatch.setattr(incremental, "enabled", fast)
        model.zero_grad(set_to_none=True)
        enc = model.encode(src)
        cache = model.init_cache(enc.memory, enc.mask)
        model.decode(bos, cache=cache)
        model.decode(bos, cache=cache).logits.square().sum().backward()
        return model.decoder.layers[1].self_attn.in_proj.weight.grad

    fast, slow = grads(True), grads(False)
    assert slow is not None and fast is not None and torch.equal(fast, slow)


def count_steps(monkeypatch) -> list[int]:
    calls = [0]
    real = incremental.step

    def spy(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(incremental, "enabled", True)
    monkeypatch.setattr(incremental, "step", spy)
    return calls


def test_greedy_runs_every_step_on_the_fast_path(monkeypatch):
    calls = count_steps(monkeypatch)
    out = greedy_decode(build(), source(), max_len=7, min_len=7)
    assert out.size(1) == 7 and calls[0] == 7


def test_the_module_path_serves_training_weights_prompts_and_autograd(monkeypatch):
    calls = count_steps(monkeypatch)
    model = build()
    src = source()
    enc = model.encode(src)
    bos = torch.ones(4, 1, dtype=torch.long)
    with torch.no_grad():
        cache = model.init_cache(enc.memory, enc.mask)
        model.decode(torch.ones(4, 3, dtype=torch.long), cache=cache)  # a prompt of 3 positions
        model.decode(bos, cache=cache, return_attention=True)  # weights asked for
        model.train()
        model.decode(bos, cache=model.init_cache(enc.memory, enc.mask))
        model.eval()
    model.decode(bos, cache=model.init_cache(enc.memory, enc.mask))  # autograd on
    assert calls[0] == 0
    with torch.no_grad():
        cache = model.init_cache(enc.memory, enc.mask)
        model.decode(bos, cache=cache)
        model.decode(torch.tensor([[1], [0], [1], [1]]), cache=cache)  # a padded key: masked, still flat
    assert calls[0] == 2
