"""KV cache: incremental decoding equals recomputing the whole prefix, token by token
(trax transformer_test ``_test_fast_inference``), also after ``reorder`` and past the cache's
initial capacity."""

import pytest
import torch

from aiayn import DecoderOnly, KVCache, ModelConfig, Transformer

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
    return cls(ModelConfig.tiny(V, **overrides)).eval()


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
    src, tgt = padded_source(), tokens(3, 40, seed=2)  # 40 steps: past the initial capacity of 16
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
    before, after = 6, 20  # after reorder, keep going past the capacity again
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


@pytest.mark.parametrize("variant", ["post-norm", "pre-norm"])
def test_expanded_beams_share_one_cross_attention_cache_and_equal_the_replicated_batch(variant):
    # beam search's cache life: expand to K beams, gather by parent within each sentence, drop a
    # finished sentence; against recomputing every row from scratch on an explicitly replicated batch
    model = build(Transformer, VARIANTS[variant])
    src, K = padded_source(), 2
    prefix, cont1, cont2, cont3 = tokens(3, 4, 13), tokens(6, 5, 14), tokens(6, 5, 15), tokens(4, 20, 16)
    parents = torch.tensor([1, 1, 2, 3, 5, 4])  # rows stay within their sentence's two beams
    keep = torch.tensor([0, 1, 5, 4])  # sentence 1 finished; sentence 2's beams swapped
    with torch.no_grad():
        enc = model.encode(src)
        cache = model.init_cache(enc.memory, enc.mask).reserve(30)
        step_by_step(model, prefix, cache)
        assert cache.self_attn[0]._k.size(1) == 30  # reserved at the first step, not 16
        assert cache.expand(K) is cache and cache.group == K
        assert cache.cross_attn[0].k.size(0) == 3 and cache.memory_mask.size(0) == 3  # one copy per sentence
        got1 = step_by_step_from(model, cont1, cache)
        cache.reorder(parents, cross=False)
        got2 = step_by_step_from(model, cont2, cache)
        cache.reorder(keep, cross=True)
        assert cache.cross_attn[0].k.size(0) == 2 and cache.memory_mask.size(0) == 2
        got3 = step_by_step_from(model, cont3, cache)  # 34 positions: past the reserved 30
        rows = torch.arange(3).repeat_interleave(K)
        hist1, src1 = torch.cat([prefix[rows], cont1], 1), src[rows]
        hist2, src2 = torch.cat([hist1[parents], cont2], 1), src1[parents]
        hist3, src3 = torch.cat([hist2[keep], cont3], 1), src2[keep]
        want = [model(src1, hist1)[:, 4:], model(src2, hist2)[:, 9:], model(src3, hist3)[:, 14:]]
    for got, expected in zip([got1, got2, got3], want, strict=True):
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_the_key_mask_stays_none_until_a_padded_position_arrives():
    cache = KVCache(1)
    real = torch.ones(2, 1, 1, 3, dtype=torch.bool)
    assert cache.extend_key_mask(real) is None and cache.key_mask is None
    cache.self_attn[0].length = 3  # as after appending those three positions
    padded = torch.tensor([True, False]).view(2, 1, 1, 1)
    mask = cache.extend_key_mask(padded)
    assert torch.equal(mask, torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool).view(2, 1, 1, 4))
    cache.self_attn[0].length = 4
    assert cache.extend_key_mask(real[:, :, :, :1]).shape == (2, 1, 1, 5)  # once kept, always extended


def test_expanded_beams_return_per_row_attention_weights_and_keep_a_padded_key_mask():
    # return_attention through the folded encoder-decoder attention, and a key mask (a padded
    # target position) carried through expand and a reorder by parent
    model = build(Transformer, {})
    src, K = padded_source(), 2
    prefix, cont = tokens(3, 3, 17), tokens(6, 4, 18)
    prefix[1, 1] = 0  # a padded target position in sentence 1: the key mask is kept from here on
    parents = torch.tensor([1, 0, 2, 3, 4, 4])
    with torch.no_grad():
        enc = model.encode(src)
        cache = model.init_cache(enc.memory, enc.mask)
        step_by_step(model, prefix, cache)
        assert cache.key_mask is not None
        cache.expand(K).reorder(parents, cross=False)
        outs = [model.decode(cont[:, t : t + 1], cache=cache, return_attention=True) for t in range(4)]
        rows = torch.arange(3).repeat_interleave(K)[parents]
        full = model.decode(torch.cat([prefix[rows], cont], 1), *model_memory(model, src[rows]), return_attention=True)
    for t, out in enumerate(outs):
        torch.testing.assert_close(out.logits[:, 0], full.logits[:, 3 + t], atol=ATOL, rtol=0)
        for got, want in zip(out.cross_attention, full.cross_attention, strict=True):
            assert got.shape == (6, 4, 1, src.size(1))
            torch.testing.assert_close(got[:, :, 0], want[:, :, 3 + t], atol=ATOL, rtol=0)


def model_memory(model, src):
    enc = model.encode(src)
    return enc.memory, enc.mask


def test_expand_rejects_a_group_below_one_and_a_batch_that_does_not_fill_the_groups():
    model = build(Transformer, {})
    with torch.no_grad():
        enc = model.encode(padded_source())
        cache = model.init_cache(enc.memory, enc.mask)
        with pytest.raises(ValueError, match="at least 1"):
            cache.expand(0)
        cache.expand(2)
        with pytest.raises(ValueError, match="5 query rows do not fill 3 cached rows of 2 beams"):
            model.decode(tokens(5, 1, 19), cache=cache)


@torch.no_grad()
def test_the_cache_stores_each_rows_keys_and_values_as_one_block():
    """Position-major buffers (B, capacity, H, D): row b's first ``length`` positions are one
    contiguous run of length·H·D values, before and after a beam reorder, and the (B, H, L, D)
    views hold exactly what was appended."""
    model = build(Transformer, {})
    H, D = model.config.h, model.config.d_k
    src, tgt = padded_source(), tokens(3, 5, seed=2)
    enc = model.encode(src)
    cache = model.init_cache(enc.memory, enc.mask)
    appended = []
    for t in range(tgt.size(1)):
        model.decode(tgt[:, t : t + 1], cache=cache)
        appended.append(cache.self_attn[0].k[:, :, -1:].clone())  # (B, H, 1, D) the new keys
    cache.reorder(torch.tensor([2, 0, 0]))
    for layer_cache in cache.self_attn + cache.cross_attn:
        L = layer_cache.length
        for buffer in (layer_cache._k, layer_cache._v):
            rows = buffer[:, :L]  # (B, L, H, D)
            assert rows.shape[2:] == (H, D)
            assert rows.stride()[1:] == (H * D, D, 1)  # positions, heads, features: one block per row
    assert torch.equal(cache.self_attn[0].k, torch.cat(appended, dim=2)[[2, 0, 0]])
