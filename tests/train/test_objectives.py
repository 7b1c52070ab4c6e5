"""The per-task batches: BERT's masking rates on a large sample, the causal LM's shift, the masked
LM's targets; the ``select`` path of the language models; ``<mask>`` in the tokenizer."""

import pytest
import torch

from aiayn import DecoderOnly, EncoderOnly, ModelConfig
from aiayn.data.tokenizer import Tokenizer
from aiayn.train.objectives import CausalLM, MaskedLM, mask_tokens

PAD, BOS, EOS, MASK = 0, 1, 2, 4


def test_masking_rates_are_15_80_10_10():
    """200 x 500 tokens over a 1,000-token vocabulary, the last 100 positions of each row padding:
    80,000 maskable tokens, ~12,000 chosen. Tolerances are ~5 standard deviations."""
    V, B, L = 1000, 200, 500
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(5, V, (B, L), generator=g)
    tokens[:, 400:] = PAD
    maskable = tokens != PAD
    inputs, chosen = mask_tokens(tokens, maskable, V, g)
    n = int(maskable.sum())
    assert not (chosen & ~maskable).any() and torch.equal(inputs[~chosen], tokens[~chosen])
    assert abs(chosen.sum().item() / n - 0.15) < 5 * (0.15 * 0.85 / n) ** 0.5
    c = int(chosen.sum())
    masked = (inputs[chosen] == MASK).sum().item() / c
    kept = (inputs[chosen] == tokens[chosen]).sum().item() / c
    replaced = ((inputs[chosen] != MASK) & (inputs[chosen] != tokens[chosen])).sum().item() / c
    tolerance = 5 * (0.1 * 0.9 / c) ** 0.5
    assert abs(masked - 0.8) < 5 * (0.8 * 0.2 / c) ** 0.5
    # a random replacement equals the original token with probability 1 / 995: counted as kept
    assert abs(kept - (0.1 + 0.1 / (V - 5))) < tolerance
    assert abs(replaced - 0.1 * (1 - 1 / (V - 5))) < tolerance
    random_tokens = inputs[chosen & (inputs != MASK) & (inputs != tokens)]
    assert random_tokens.min() >= 5 and random_tokens.max() < V  # never a special token
    assert len(random_tokens.unique()) > 0.7 * (V - 5)  # spread over the vocabulary


def test_every_sequence_gets_a_target_and_masking_is_seeded():
    tokens = torch.tensor([[7, EOS, PAD, PAD], [8, 9, EOS, PAD], [PAD, PAD, PAD, PAD]])
    maskable = tokens >= 5
    for seed in range(20):
        a = mask_tokens(tokens, maskable, 50, torch.Generator().manual_seed(seed))
        b = mask_tokens(tokens, maskable, 50, torch.Generator().manual_seed(seed))
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert a[1][:2].any(dim=1).all() and not a[1][2].any()  # one target at least, none in an empty row
        assert not (a[1] & ~maskable).any()


def test_causal_lm_batch_is_the_shifted_sequence():
    config = ModelConfig.tiny(32)
    batch = CausalLM().collate([[5, 6, 7], [8]], config, seed=0)
    assert batch.inputs.tolist() == [[BOS, 5, 6, 7], [BOS, 8, PAD, PAD]]
    assert batch.targets.tolist() == [[5, 6, 7, EOS], [8, EOS, PAD, PAD]]
    assert (batch.num_tokens, batch.num_positions) == (6, 6)


def test_masked_lm_batch_scores_only_the_chosen_tokens():
    config = ModelConfig.tiny(32)
    examples = [[5 + i % 20 for i in range(n)] for n in (30, 12, 1)]
    batch = MaskedLM(0.15).collate(examples, config, seed=3)
    tokens = torch.tensor([[*x, EOS] + [PAD] * (30 - len(x)) for x in examples])
    chosen = batch.targets != PAD
    assert torch.equal(batch.targets[chosen], tokens[chosen])  # the original token, where chosen
    assert torch.equal(batch.inputs[~chosen], tokens[~chosen])  # the rest as it was
    assert not chosen[tokens == EOS].any() and chosen.any(dim=1).all()
    assert batch.num_positions == 30 + 12 + 1 + 3
    again = MaskedLM(0.15).collate(examples, config, seed=3)
    assert torch.equal(again.inputs, batch.inputs) and torch.equal(again.targets, batch.targets)
    assert not torch.equal(MaskedLM(0.15).collate(examples, config, seed=4).targets, batch.targets)


@pytest.mark.parametrize("cls", [DecoderOnly, EncoderOnly])
def test_select_computes_the_logits_of_the_selected_positions(cls):
    torch.manual_seed(0)
    model = cls(ModelConfig.tiny(32)).eval()
    tokens = torch.randint(5, 32, (3, 7))
    tokens[1, 4:] = PAD
    select = tokens != PAD
    select[0, 2] = False
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, select=select), model(tokens)[select])


@pytest.fixture(scope="module")
def tokenizer():
    text = ["Das ist ein rotes Haus.", "Das Haus ist groß.", "Ein kleines Haus ist gut."] * 20
    return Tokenizer.train(text, 300)


@pytest.mark.parametrize(
    "masked, plain, position",
    [
        ("Das ist ein <mask> Haus.", "Das ist ein rotes Haus.", 3),  # space before: the masked word carries it
        ("Das ist ein  <mask> Haus.", "Das ist ein rotes Haus.", 3),
        ("Das ist ein rotes <mask>.", "Das ist ein rotes Haus.", 4),  # no prefix space after a mask
        ("<mask> ist ein rotes Haus.", "Das ist ein rotes Haus.", 0),
    ],
)
def test_mask_text_encodes_as_the_masked_word_did_in_training(tokenizer, masked, plain, position):
    """Replacing the word's token by <mask> in the encoding of the plain text is the truth."""
    ids = tokenizer.encode(plain)
    word = tokenizer.encode(plain.split()[position].rstrip("."))
    assert len(word) == 1  # the fixture's words are single tokens
    expected = [MASK if i == word[0] else i for i in ids]
    assert tokenizer.encode(masked) == expected
    assert tokenizer.encode_batch([masked, plain]) == [expected, ids]
    assert tokenizer.tokens(masked)[position] == "<mask>"
