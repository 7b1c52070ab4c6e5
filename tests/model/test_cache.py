"""The paper's KV cache (model/cache.py): incremental decoding equals recomputing the whole
prefix, token by token (trax transformer_test ``_test_fast_inference``), also after ``reorder``,
on models whose every parameter is random. (The engine's cache: tests/engine/test_cache.py.)"""

import pytest
import torch

from aiayn import DecoderOnly, KVCache, ModelConfig, Transformer
from helpers import randomize_

V = 32
VARIANTS = {
    "post-norm": {},
    "pre-norm": {"norm_first": True},
    "learned": {"positional": "learned"},
    "window": {"attention_window": 3},
    "deeper-decoder": {"N": 1, "N_dec": 3, "activation": "gelu"},
}
ATOL = 1e-5


def tokens(B: int, L: int, seed: int) -> torch.Tensor:
    """Random ids that are never padding (id 0)."""
    return torch.randint(3, V, (B, L), generator=torch.Generator().manual_seed(seed))


def padded_source(B: int = 3, S: int = 9) -> torch.Tensor:
    src = tokens(B, S, seed=1)
    for b, length in enumerate([S, 5, 2][:B]):
        src[b, length:] = 0
    return src


def build(cls, overrides: dict, seed: int = 0):
    torch.manual_seed(seed)
    return randomize_(cls(ModelConfig.tiny(V, **overrides)).eval(), seed)


def step_by_step(model, tgt: torch.Tensor, cache: KVCache, prefix: int = 0) -> torch.Tensor:
    """Logits from feeding ``tgt[:, :prefix]`` at once (if prefix), then one token at a time."""
    steps = []
    if prefix:
        steps.append(model.decode(tgt[:, :prefix], cache=cache).logits)
    for t in range(prefix, tgt.size(1)):
        out = model.decode(tgt[:, t : t + 1], cache=cache)
        assert out.cache is cache
        assert cache.length == t + 1
        steps.append(out.logits)
    return torch.cat(steps, dim=1)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("prefix", [0, 4])
def test_transformer_cached_decoding_equals_teacher_forcing(variant, prefix):
    model = build(Transformer, VARIANTS[variant])
    src, tgt = padded_source(), tokens(3, 40, seed=2)
    with torch.no_grad():
        full = model(src, tgt)
        enc = model.encode(src)
        cache = model.init_cache(enc.memory, enc.mask)
        incremental = step_by_step(model, tgt, cache, prefix)
    assert incremental.shape == full.shape == (3, 40, V)
    torch.testing.assert_close(incremental, full, atol=ATOL, rtol=0)
    assert cache.self_attn[0].k.shape == (3, 4, 40, 8)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("prefix", [0, 5])
def test_decoder_only_cached_decoding_equals_full_recomputation(variant, prefix):
    model = build(DecoderOnly, VARIANTS[variant])
    seq = tokens(2, 40, seed=3)
    with torch.no_grad():
        full = model(seq)
        incremental = step_by_step(model, seq, model.init_cache(), prefix)
    torch.testing.assert_close(incremental, full, atol=ATOL, rtol=0)


def test_cross_attention_keys_and_values_are_computed_once():
    model = build(Transformer, {})
    src = padded_source()
    with torch.no_grad():
        enc = model.encode(src)
        cache = model.init_cache(enc.memory, enc.mask)
        before = [(c.k.clone(), c.v.clone()) for c in cache.cross_attn]
        step_by_step(model, tokens(3, 5, seed=4), cache)
    assert all(c.static for c in cache.cross_attn)
    for c, (k, v) in zip(cache.cross_attn, before, strict=True):
        assert torch.equal(c.k, k) and torch.equal(c.v, v)
        assert c.k.shape == (3, 4, src.size(1), 8)
    # the source padding mask travels with the cache
    assert torch.equal(cache.memory_mask, src[:, None, None, :] != 0)


@pytest.mark.parametrize("variant", ["post-norm", "window"])
@pytest.mark.parametrize("kind", ["permutation", "beam-expansion"])
def test_transformer_reorder_equals_decoding_the_reordered_batch(variant, kind):
    model = build(Transformer, VARIANTS[variant])
    src = padded_source()
    indices = torch.tensor([2, 0, 1]) if kind == "permutation" else torch.arange(3).repeat_interleave(2)
    before, after = 6, 20
    prefix = tokens(3, before, seed=5)
    continuation = tokens(len(indices), after, seed=6)  # every new row continues differently
    with torch.no_grad():
        enc = model.encode(src)
        cache = model.init_cache(enc.memory, enc.mask)
        step_by_step(model, prefix, cache)
        assert cache.reorder(indices) is cache
        resumed = [model.decode(continuation[:, t : t + 1], cache=cache).logits for t in range(after)]
        resumed = torch.cat(resumed, dim=1)
        from_scratch = model(src[indices], torch.cat([prefix[indices], continuation], dim=1))
    torch.testing.assert_close(resumed, from_scratch[:, before:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["permutation", "beam-expansion"])
def test_decoder_only_reorder_equals_decoding_the_reordered_batch(kind):
    model = build(DecoderOnly, {"norm_first": True})
    indices = torch.tensor([1, 2, 0]) if kind == "permutation" else torch.tensor([0, 0, 0, 2, 2, 1])
    prefix, continuation = tokens(3, 7, seed=7), tokens(len(indices), 18, seed=8)
    with torch.no_grad():
        cache = model.init_cache()
        step_by_step(model, prefix, cache)
        cache.reorder(indices)
        resumed = step_by_step_from(model, continuation, cache)
        from_scratch = model(torch.cat([prefix[indices], continuation], dim=1))
    torch.testing.assert_close(resumed, from_scratch[:, 7:], atol=ATOL, rtol=0)


def step_by_step_from(model, new_tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    return torch.cat([model.decode(new_tokens[:, t : t + 1], cache=cache).logits for t in range(new_tokens.size(1))], 1)


@pytest.mark.parametrize("cls", [Transformer, DecoderOnly])
@pytest.mark.parametrize("variant", ["post-norm", "window"])
def test_chunks_of_any_size_equal_teacher_forcing(cls, variant):
    """Several tokens at a time after a non-empty cache: the causal mask must start at the offset."""
    model = build(cls, VARIANTS[variant])
    tgt, chunks = tokens(3, 23, seed=9), [3, 1, 5, 2, 7, 1, 4]
    with torch.no_grad():
        if cls is Transformer:
            src = padded_source()
            full = model(src, tgt)
            enc = model.encode(src)
            cache = model.init_cache(enc.memory, enc.mask)
        else:
            full, cache = model(tgt), model.init_cache()
        starts = [sum(chunks[:i]) for i in range(len(chunks))]
        pieces = [model.decode(tgt[:, s : s + n], cache=cache).logits for s, n in zip(starts, chunks, strict=True)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=ATOL, rtol=0)


def test_decoder_only_cache_respects_left_padding():
    """Batched prompts of different lengths are left-padded; the cache must not attend to the
    padding (the cache records which keys were padding in its key mask), as the same model
    without a cache does not."""
    model = build(DecoderOnly, {})
    seq = tokens(2, 8, seed=10)
    seq[1, :3] = 0  # row 1: a 5-token prompt, left-padded to 8
    real = seq != 0
    with torch.no_grad():
        full = model(seq)
        cached = step_by_step(model, seq, model.init_cache(), prefix=4)
    torch.testing.assert_close(cached[real], full[real], atol=ATOL, rtol=0)


def test_cache_not_made_by_init_cache_keeps_the_memory_mask():
    """A bare KVCache fed memory and its padding mask at every step equals teacher forcing."""
    model = build(Transformer, {})
    src, tgt = padded_source(), tokens(3, 12, seed=4)
    with torch.no_grad():
        full = model(src, tgt)
        enc = model.encode(src)
        cache = KVCache(len(model.decoder.layers), cross=True)
        steps = [model.decode(tgt[:, t : t + 1], enc.memory, enc.mask, cache=cache).logits for t in range(12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=ATOL, rtol=0)


def test_the_key_mask_stays_none_until_a_padded_position_arrives():
    cache = KVCache(1)
    real = torch.ones(2, 1, 1, 3, dtype=torch.bool)
    assert cache.extend_key_mask(real) is None and cache.key_mask is None
    cache.self_attn[0].append(torch.zeros(2, 1, 3, 4), torch.zeros(2, 1, 3, 4))  # those three positions
    padded = torch.tensor([True, False]).view(2, 1, 1, 1)
    mask = cache.extend_key_mask(padded)
    assert torch.equal(mask, torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool).view(2, 1, 1, 4))
    cache.self_attn[0].append(torch.zeros(2, 1, 1, 4), torch.zeros(2, 1, 1, 4))
    assert cache.extend_key_mask(real[:, :, :, :1]).shape == (2, 1, 1, 5)  # once kept, always extended
