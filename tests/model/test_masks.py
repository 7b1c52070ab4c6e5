"""Mask helpers against hand-written truth tables (True = may attend)."""

import pytest
import torch

from aiayn.model.masks import causal_mask, padding_mask, window_mask


def table(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.bool)


def test_padding_mask_truth_table_and_shape():
    tokens = torch.tensor([[5, 6, 7, 0, 0], [3, 0, 0, 0, 0], [0, 4, 9, 8, 2]])
    mask = padding_mask(tokens, pad_id=0)
    assert mask.shape == (3, 1, 1, 5)
    assert mask.dtype == torch.bool
    expected = table([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [0, 1, 1, 1, 1]])
    assert torch.equal(mask[:, 0, 0], expected)


def test_padding_mask_with_a_start_token_that_is_the_pad_id():
    """Marian's decoder starts from its padding token: ``start`` keeps position 0 a real key."""
    tokens = torch.tensor([[0, 5, 6, 0], [0, 0, 0, 0], [7, 0, 8, 9]])
    expected = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(padding_mask(tokens, 0, start=True), expected[:, None, None, :])
    assert torch.equal(padding_mask(tokens, 0), (tokens != 0)[:, None, None, :])  # unchanged without


def test_padding_mask_uses_the_given_pad_id():
    tokens = torch.tensor([[0, 3, 3, 1]])
    assert torch.equal(padding_mask(tokens, pad_id=3)[0, 0, 0], table([[1, 0, 0, 1]])[0])


def test_causal_mask_square():
    mask = causal_mask(4)
    assert mask.shape == (1, 1, 4, 4)
    expected = table(
        [
            [1, 0, 0, 0],
            [1, 1, 0, 0],
            [1, 1, 1, 0],
            [1, 1, 1, 1],
        ]
    )
    assert torch.equal(mask[0, 0], expected)


def test_causal_mask_with_offset_covers_the_cached_prefix():
    # two new queries at positions 3 and 4 of a sequence whose keys are positions 0..4
    mask = causal_mask(2, offset=3)
    assert mask.shape == (1, 1, 2, 5)
    expected = table(
        [
            [1, 1, 1, 1, 0],
            [1, 1, 1, 1, 1],
        ]
    )
    assert torch.equal(mask[0, 0], expected)


def test_causal_mask_with_explicit_key_length():
    mask = causal_mask(3, S=5)
    assert mask.shape == (1, 1, 3, 5)
    expected = table(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 1, 1, 0, 0],
        ]
    )
    assert torch.equal(mask[0, 0], expected)


def test_causal_mask_with_offset_and_key_length():
    mask = causal_mask(2, S=6, offset=1)
    expected = table(
        [
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
        ]
    )
    assert torch.equal(mask[0, 0], expected)


def test_window_mask_r1():
    mask = window_mask(5, r=1)
    assert mask.shape == (1, 1, 5, 5)
    expected = table(
        [
            [1, 1, 0, 0, 0],
            [1, 1, 1, 0, 0],
            [0, 1, 1, 1, 0],
            [0, 0, 1, 1, 1],
            [0, 0, 0, 1, 1],
        ]
    )
    assert torch.equal(mask[0, 0], expected)


def test_window_mask_r2_with_offset():
    # one query at position 4 of keys 0..4 (one decoding step with a cache of 4 positions)
    assert torch.equal(window_mask(1, r=2, offset=4)[0, 0], table([[0, 0, 1, 1, 1]]))
    mask = window_mask(2, S=7, r=2, offset=2)
    assert mask.shape == (1, 1, 2, 7)
    expected = table(
        [
            [1, 1, 1, 1, 1, 0, 0],
            [0, 1, 1, 1, 1, 1, 0],
        ]
    )
    assert torch.equal(mask[0, 0], expected)


def test_window_and_causal_combine_to_r_previous_positions():
    mask = causal_mask(5) & window_mask(5, r=2)
    expected = table(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 1, 1, 0, 0],
            [0, 1, 1, 1, 0],
            [0, 0, 1, 1, 1],
        ]
    )
    assert torch.equal(mask[0, 0], expected)


@pytest.mark.parametrize("T,S,offset", [(1, None, 0), (3, None, 2), (2, 9, 0), (4, 4, 0)])
def test_causal_and_window_masks_broadcast_against_padding(T, S, offset):
    keys = (offset + T) if S is None else S
    tokens = torch.ones(2, keys, dtype=torch.long)
    tokens[1, -1] = 0
    combined = padding_mask(tokens, 0) & causal_mask(T, S, offset) & window_mask(T, S, r=1, offset=offset)
    assert combined.shape == (2, 1, T, keys)
    for b in range(2):
        for i in range(T):
            for j in range(keys):
                expected = (j <= offset + i) and abs(offset + i - j) <= 1 and bool(tokens[b, j] != 0)
                assert bool(combined[b, 0, i, j]) == expected
