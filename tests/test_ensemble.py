"""Ensembles (``aiayn.decode.Ensemble``: the mean of several models' next-token probabilities)
against independent truths: the mean computed by hand from each model's own teacher-forced
softmax, greedy decoding written out step by step on it, a brute-force search over every output
of a toy vocabulary, the engine against the modules, and the perplexity from the same sums."""

import itertools
import math
import shutil

import pytest
import torch
import torch.nn.functional as F

from aiayn.cli import main
from aiayn.data.tokenizer import TOKENIZER_NAME, Tokenizer
from aiayn.decode import Ensemble, beam_search, greedy_decode, length_penalty, translate_ids
from aiayn.engine import prepare
from aiayn.evaluate import evaluate_loss
from aiayn.model import DecoderOnly, ModelConfig, Transformer
from aiayn.translator import Translator
from helpers import random_model
from test_decode import _sources, _trim

PAD, BOS, EOS = 0, 1, 2


def _members(vocab_size: int = 16, eos_boost: float = 2.5) -> list[Transformer]:
    """Two random models of one vocabulary and different shapes (1 + 2 and 2 + 1 layers, 2 and
    4 heads); every parameter random (``randomize_``), EOS likely enough that outputs end at
    different lengths."""
    a = random_model(seed=11, vocab_size=vocab_size, N=1, N_dec=2, h=2)
    b = random_model(seed=12, vocab_size=vocab_size, N=2, N_dec=1, h=4)
    with torch.no_grad():
        for m in (a, b):
            m.tgt_embedding.weight[EOS] *= eos_boost
    return [a, b]


@torch.no_grad()
def _mean_logp(models, src: torch.Tensor, prefix: list[int]) -> torch.Tensor:
    """log of the mean over models of softmax(logits) for the token after BOS + prefix ``(V,)``,
    each model's distribution from its own teacher-forced pass over the whole prefix."""
    tgt = torch.tensor([[BOS, *prefix]])
    probs = [F.softmax(m(src, tgt)[0, -1].double(), dim=-1) for m in models]
    return torch.log(sum(probs) / len(probs))


def test_an_ensemble_of_one_model_decodes_as_the_model():
    model = _members()[0]
    src = _sources([3, 6, 1, 5])
    assert torch.equal(greedy_decode(Ensemble([model]), src), greedy_decode(model, src))
    alone, together = beam_search(model, src, beam=3, nbest=3), beam_search(Ensemble([model]), src, beam=3, nbest=3)
    assert [[h.tokens for h in s] for s in together] == [[h.tokens for h in s] for s in alone]
    assert [h.score for s in together for h in s] == pytest.approx([h.score for s in alone for h in s], abs=1e-5)


def test_greedy_on_an_ensemble_takes_the_most_probable_token_of_the_mean_distribution():
    """Greedy written out: at each step the argmax (padding excluded) of the mean of the two
    models' softmaxes, each from a full teacher-forced pass; EOS forced at the limit. The
    search runs the sentences batched, each member on its own KV cache."""
    models = _members()
    src = _sources([4, 7, 2, 5, 3])
    limit = 6
    found = greedy_decode(Ensemble(models), src, max_len=limit).tolist()
    ties = 0
    for row, out in zip(src, found, strict=True):
        source = row[row != PAD][None]
        prefix: list[int] = []
        for t in range(1, limit + 1):
            logp = _mean_logp(models, source, prefix)
            logp[PAD] = -math.inf
            top2 = logp.topk(2).values
            ties += bool(top2[0] - top2[1] < 1e-6)
            token = EOS if t == limit else int(logp.argmax())
            if token == EOS:
                break
            prefix.append(token)
        assert _trim(out) == prefix
    assert ties == 0  # no near-tie that float error could decide
    # the ensemble differs from each member alone here: the test sees the mean, not one model
    assert any(greedy_decode(m, src, max_len=limit).tolist() != found for m in models)


@pytest.mark.parametrize("alpha", [0.0, 1.5])
def test_wide_beam_on_an_ensemble_finds_the_best_sequence_by_brute_force(alpha):
    """Vocabulary of 5 (pad, bos, eos and two words), outputs of at most 4 tokens: every
    sequence ending in EOS is scored Σ_t log(mean_m p_m(y_t)) / lp by hand; a beam keeping every
    prefix must return exactly that ranking and those scores."""
    models = _members(vocab_size=5, eos_boost=1.0)
    src = torch.tensor([[3, 4, 3, EOS]])
    L = 4
    truth = []
    for n in range(1, L + 1):
        for words in itertools.product([BOS, 3, 4], repeat=n - 1):
            tokens = [*words, EOS]
            log_prob = sum(float(_mean_logp(models, src, tokens[:t])[tokens[t]]) for t in range(n))
            truth.append((log_prob / length_penalty(n, alpha), list(words)))
    truth.sort(key=lambda x: x[0], reverse=True)
    found = beam_search(Ensemble(models), src, beam=len(truth), nbest=len(truth), alpha=alpha, max_len=L)[0]
    assert [h.tokens for h in found] == [words for _, words in truth]
    assert [h.score for h in found] == pytest.approx([score for score, _ in truth], abs=1e-5)


@pytest.mark.parametrize("beam", [1, 4])
def test_an_ensemble_on_the_engine_equals_the_ensemble_of_the_modules(beam):
    """Members prepared for the engine (its caches and flat step) decode together as the
    members on their own modules do: the same outputs and scores, batched by ``translate_ids``."""
    models = _members()
    sources = [[5 + (i * 7 + j) % 11 for j in range(1 + i % 6)] for i in range(9)]
    plain = translate_ids(Ensemble(models), sources, beam=beam, nbest=2 if beam > 1 else 1, max_tokens=24)
    engine = translate_ids(
        Ensemble([prepare(m) for m in models]), sources, beam=beam, nbest=2 if beam > 1 else 1, max_tokens=24
    )
    if beam == 1:
        assert engine == plain
    else:
        assert [[h.tokens for h in s] for s in engine] == [[h.tokens for h in s] for s in plain]
        assert [h.score for s in engine for h in s] == pytest.approx([h.score for s in plain for h in s], abs=1e-4)


def test_the_ensembles_perplexity_is_that_of_the_mean_probability():
    models = _members()
    pairs = [([5, 9, 7], [8, 6]), ([11, 5], [9, 9, 10, 7]), ([6, 6, 6, 12], [13])]
    nll, tokens = 0.0, 0
    for src, tgt in pairs:
        source = torch.tensor([[*src, EOS]])
        for t, token in enumerate([*tgt, EOS]):
            nll -= float(_mean_logp(models, source, tgt[:t])[token])
            tokens += 1
    loss, perplexity = evaluate_loss(Ensemble(models), pairs, max_tokens=12, device=torch.device("cpu"))
    assert loss == pytest.approx(nll / tokens, abs=1e-5)
    assert perplexity == pytest.approx(math.exp(nll / tokens), rel=1e-5)


def test_an_ensemble_of_eval_members_stays_in_eval_mode_after_evaluate_loss():
    """``evaluate_loss`` restores the mode it found: an ensemble of eval members is in eval mode,
    so its members keep dropout off for the searches that follow."""
    members = [random_model(seed=s, vocab_size=16, P_drop=0.3) for s in (1, 2)]
    ensemble = Ensemble(members)
    evaluate_loss(ensemble, [([5, 6], [7, 8])], max_tokens=12, device=torch.device("cpu"))
    assert not ensemble.training and not any(m.training for m in ensemble.modules())
    src = _sources([3, 4])
    assert torch.equal(greedy_decode(ensemble, src, max_len=5), greedy_decode(ensemble, src, max_len=5))


def test_a_token_one_member_suppresses_the_ensemble_never_produces():
    a = random_model(seed=1, vocab_size=8)
    tagged = random_model(seed=2, vocab_size=8, suppress_ids=(5,))
    ensemble = Ensemble([a, tagged])
    assert ensemble.config.suppress_ids == (5,)
    src = _sources([3, 5, 2, 4], vocab_size=8)
    assert 5 in greedy_decode(a, src, max_len=8)  # a alone produces it here
    assert 5 not in greedy_decode(ensemble, src, max_len=8)
    assert all(5 not in h.tokens for s in beam_search(ensemble, src, beam=4, nbest=4, max_len=8) for h in s)


def test_members_must_share_the_vocabulary_and_be_encoder_decoders():
    a = random_model(seed=1, vocab_size=16)
    with pytest.raises(ValueError, match="member 1 does not match member 0: vocab_size 20 != 16"):
        Ensemble([a, random_model(seed=2, vocab_size=20)])
    with pytest.raises(TypeError, match="member 1 is a DecoderOnly"):
        Ensemble([a, DecoderOnly(ModelConfig.tiny(vocab_size=16))])
    with pytest.raises(ValueError, match="at least one"):
        Ensemble([])
    learned = random_model(seed=3, vocab_size=16, positional="learned", max_len=12)
    assert Ensemble([a, learned]).config.max_len == 12  # outputs fit the learned positions
    assert Ensemble([a, learned]).config.positional == "learned"
    with pytest.raises(ValueError, match="no model directory"):
        Translator.from_pretrained([])


SENTENCES = ["Das Haus ist groß.", "The house is big.", "Die Katze schläft.", "The cat is asleep."]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Two model directories sharing one tokenizer, a third with another (other merges, the
    same size)."""
    root = tmp_path_factory.mktemp("ensemble")
    tokenizer = Tokenizer.train(SENTENCES * 4, vocab_size=300)
    dirs = []
    for seed in (21, 22):
        model = random_model(seed=seed, vocab_size=tokenizer.vocab_size, max_len=48)
        model.save_pretrained(root / f"m{seed}")
        tokenizer.save(root / f"m{seed}" / TOKENIZER_NAME)
        dirs.append(root / f"m{seed}")
    other = root / "other"
    shutil.copytree(dirs[1], other)
    Tokenizer.train(["Ganz andere Sätze, über Bäume."] * 4, vocab_size=300).save(other / TOKENIZER_NAME)
    return dirs, other


def test_translator_and_commands_take_several_models_as_one_ensemble(model_dirs, tmp_path, capsys):
    dirs, other = model_dirs
    translator = Translator.from_pretrained(dirs)
    assert isinstance(translator.model, Ensemble) and len(translator.model.members) == 2
    models = [Transformer.from_pretrained(d).eval() for d in dirs]
    ids = [translator.tokenizer.encode(s) for s in SENTENCES]
    expected = [translator.tokenizer.decode(t) for t in translate_ids(Ensemble(models), ids, beam=3)]
    assert translator.translate(SENTENCES, beam=3) == expected
    two = ["--model", str(dirs[0]), "--model", str(dirs[1])]
    assert main(["translate", *two, *SENTENCES]) == 0  # sentences right after --model: not taken for models
    default = [translator.tokenizer.decode(t) for t in translate_ids(Ensemble(models), ids, beam=4)]
    assert capsys.readouterr().out.splitlines() == [" ".join(e.splitlines()) for e in default]
    assert main(["translate", *two, "--beam", "3", *SENTENCES]) == 0
    assert capsys.readouterr().out.splitlines() == [" ".join(e.splitlines()) for e in expected]
    (tmp_path / "src.txt").write_text("\n".join(SENTENCES) + "\n")
    (tmp_path / "ref.txt").write_text("\n".join(SENTENCES[::-1]) + "\n")
    files = ["--src", str(tmp_path / "src.txt"), "--ref", str(tmp_path / "ref.txt")]
    assert main(["evaluate", *two, *files]) == 0
    assert "an ensemble of 2 models" in capsys.readouterr().out
    # another tokenizer: a one-line error naming the directory, before anything is translated
    assert main(["translate", "--model", str(dirs[0]), "--model", str(other), "Das Haus."]) == 1
    err = capsys.readouterr().err
    assert err.startswith("aiayn translate: error:") and f"{other} has another tokenizer" in err
    assert "--train.tokenizer" in err and len(err.splitlines()) == 1
    assert main(["serve", *two]) == 1
    assert "serve takes one --model" in capsys.readouterr().err
