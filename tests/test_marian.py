"""``aiayn.interop.from_marian`` and ``aiayn convert marian`` against transformers' MarianMTModel:
the same logits, attention weights, greedy and beam outputs, on random Marian models of several
shapes (every weight, bias, layer norm and the final logits bias random) and on one trained for
a moment to reverse its input (so that its outputs end at many lengths); the converted directory
in every aiayn command; fine-tuning it; errors naming the problem."""

import json
import math
import shutil
import warnings

import pytest
import torch

pytest.importorskip("sentencepiece")
transformers = pytest.importorskip("transformers")

from aiayn.cli import main  # noqa: E402
from aiayn.decode import beam_search, greedy_decode  # noqa: E402
from aiayn.engine import prepare  # noqa: E402
from aiayn.interop import from_marian, from_marian_state, to_marian_state  # noqa: E402
from aiayn.model import Transformer  # noqa: E402
from aiayn.translator import Translator  # noqa: E402
from marian_helpers import ENGLISH, GERMAN, lines, marian, marian_vocab, train_spm, write  # noqa: E402

ATOL = 1e-5
SHAPES = {
    # the OPUS-MT layout: one shared vocabulary, swish
    "shared-swish": dict(d_model=32, encoder_layers=2, decoder_layers=2, heads=4, ffn=64, activation="swish"),
    # separate source and target vocabularies and embeddings, more decoder layers, GELU
    "separate-gelu": dict(
        d_model=16, encoder_layers=1, decoder_layers=3, heads=2, ffn=40, activation="gelu",
        share_encoder_decoder_embeddings=False, decoder_vocab_size=45,
    ),
    # an output projection of its own, 3 heads of 8, ReLU
    "untied-relu": dict(
        d_model=24, encoder_layers=2, decoder_layers=1, heads=3, ffn=48, activation="relu", tie_word_embeddings=False
    ),
}  # fmt: skip


def marian_config(V: int = 60, pad: int | None = None, **shape) -> transformers.MarianConfig:
    pad = V - 1 if pad is None else pad
    heads, ffn = shape.pop("heads"), shape.pop("ffn")
    if "decoder_vocab_size" in shape:
        pad = min(pad, shape["decoder_vocab_size"] - 1)
    return transformers.MarianConfig(
        vocab_size=V, encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=ffn,
        decoder_ffn_dim=ffn, activation_function=shape.pop("activation"), max_position_embeddings=256,
        pad_token_id=pad, eos_token_id=0, decoder_start_token_id=pad, forced_eos_token_id=0, scale_embedding=True,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, **shape,
    )  # fmt: skip


@torch.no_grad()
def randomize_marian_(model, seed: int = 0):
    """Every parameter random (as tests/helpers.randomize_), and the final logits bias (a buffer);
    not the sinusoidal tables, which are a function of d_model."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "embed_positions" in name:
            continue
        noise = torch.randn(p.shape, generator=g)
        if p.dim() >= 2:
            p.copy_(noise / math.sqrt(p.size(-1)))
        else:
            p.copy_(1 + 0.3 * noise if "layer_norm.weight" in name else 0.3 * noise)
    model.final_logits_bias.copy_(0.3 * torch.randn(model.final_logits_bias.shape, generator=g))
    return model


def random_marian(name: str, seed: int = 0):
    torch.manual_seed(seed)
    config = marian_config(**SHAPES[name])
    return randomize_marian_(transformers.MarianMTModel._from_config(config, attn_implementation="eager").eval(), seed)


def sources(config, B: int = 4, S: int = 9, seed: int = 1, padded: bool = True) -> torch.Tensor:
    """``(B, S)`` source ids ending in EOS, padded on the right (one row whole) if ``padded``."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(1, config.pad_token_id, (B, S), generator=g)
    lengths = torch.randint(2, S, (B,), generator=g) if padded else torch.full((B,), S - 1)
    lengths[0] = S - 1
    for b, L in enumerate(lengths.tolist()):
        src[b, L] = config.eos_token_id
        src[b, L + 1 :] = config.pad_token_id
    return src


def hf_generate(m, src: torch.Tensor, beam: int, max_new_tokens: int) -> list[list[int]]:
    """``m.generate``'s outputs without the start token and padding, ending in EOS. Beam search as
    aiayn's with α = 0: no length normalisation, done once K hypotheses are finished; the
    padding token is never produced (aiayn's rule)."""
    pad = m.config.pad_token_id
    options = dict(num_beams=beam, length_penalty=0.0, early_stopping=True) if beam > 1 else {}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = m.generate(
            input_ids=src, attention_mask=src != pad, do_sample=False, max_new_tokens=max_new_tokens,
            suppress_tokens=[pad], **options,
        )  # fmt: skip
    return [[t for t in row[1:] if t != pad] for row in out.tolist()]


def convert_fails(capsys, src, out) -> str:
    """``aiayn convert marian src out`` fails: its one-line error (stderr)."""
    assert main(["convert", "marian", str(src), str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("aiayn convert: error: ") and err.count("\n") == 1, err
    return err


def strip(out: torch.Tensor, pad: int) -> list[list[int]]:
    return [[t for t in row if t != pad] for row in out.tolist()]


# The model -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SHAPES)
def test_logits_equal_marian(name):
    m = random_marian(name)
    model = from_marian(m)
    config = m.config
    tgt_vocab = config.decoder_vocab_size if not config.share_encoder_decoder_embeddings else config.vocab_size
    g = torch.Generator().manual_seed(2)
    tgt = torch.randint(1, min(tgt_vocab, config.pad_token_id), (4, 7), generator=g)
    tgt[:, 0] = config.decoder_start_token_id
    with torch.no_grad():
        src = sources(config, padded=False)  # the contract as the issue states it: no attention mask
        expected = m(input_ids=src, decoder_input_ids=tgt).logits
        torch.testing.assert_close(model(src, tgt), expected, atol=ATOL, rtol=0)
        src = sources(config)  # padded sources: Marian needs the attention mask aiayn derives from pad_id
        expected = m(input_ids=src, attention_mask=src != config.pad_token_id, decoder_input_ids=tgt).logits
        torch.testing.assert_close(model(src, tgt), expected, atol=ATOL, rtol=0)
    assert expected.abs().max() > 1.0  # logits of a size where a mix-up shows
    assert model.output_bias is not None and model.output_bias.abs().max() > 0.1


def test_attention_weights_equal_marian():
    """The permutation of the model dimension leaves every head's weights as Marian's: what
    ``aiayn attention`` draws is what the Marian model computed."""
    m = random_marian("shared-swish")
    model = from_marian(m)
    src = sources(m.config)
    tgt = torch.randint(1, m.config.pad_token_id, (src.size(0), 6), generator=torch.Generator().manual_seed(3))
    tgt[:, 0] = m.config.decoder_start_token_id
    with torch.no_grad():
        out = m(
            input_ids=src, attention_mask=src != m.config.pad_token_id, decoder_input_ids=tgt, output_attentions=True
        )
        _, ours = model(src, tgt, return_attention=True)
    real = (src != m.config.pad_token_id)[:, None, :, None]  # (B, 1, S, 1): queries at real source positions
    for theirs, mine in zip(out.encoder_attentions, ours.encoder, strict=True):
        torch.testing.assert_close(mine * real, theirs * real, atol=1e-6, rtol=0)
    for kind, theirs_all, ours_all in (
        ("decoder self", out.decoder_attentions, ours.decoder_self),
        ("cross", out.cross_attentions, ours.decoder_cross),
    ):
        assert len(theirs_all) == len(ours_all), kind
        for theirs, mine in zip(theirs_all, ours_all, strict=True):
            torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=0)


def test_start_token_is_padding_yet_attended():
    """Marian's decoder starts from its padding token: aiayn's decoder must attend to it at
    position 0 (a masked start would leave the first query nothing to attend to)."""
    m = random_marian("shared-swish")
    model = from_marian(m)
    assert model.config.bos_id == model.config.pad_id == m.config.pad_token_id
    src = sources(m.config)
    start = torch.full((src.size(0), 1), model.config.bos_id)
    with torch.no_grad():
        expected = m(input_ids=src, attention_mask=src != model.config.pad_id, decoder_input_ids=start).logits
        enc = model.encode(src)
        cache = model.init_cache(enc.memory, enc.mask)
        torch.testing.assert_close(model.decode(start, cache=cache).logits, expected, atol=ATOL, rtol=0)


# Search: a Marian model trained for a moment to reverse its input -----------------------------------


@pytest.fixture(scope="module")
def spm_files(tmp_path_factory):
    """A source and a target SentencePiece model (German-like, English-like) and their joint
    OPUS-MT-style vocab.json (``</s>`` 0, ``<unk>`` 1, ``<pad>`` last)."""
    source, target = train_spm(lines(f"{GERMAN} {ENGLISH}", 0)), train_spm(lines(ENGLISH, 1))
    return source, target, marian_vocab(source, target)


@pytest.fixture(scope="module")
def trained(spm_files):
    """A Marian model (the OPUS-MT layout) of this vocabulary, every parameter random, then trained
    300 steps to reverse random id sequences (~4 s): its outputs end in EOS at many lengths."""
    *_, vocab = spm_files
    V = len(vocab)
    torch.manual_seed(0)
    config = marian_config(V, **SHAPES["shared-swish"])
    m = randomize_marian_(transformers.MarianMTModel._from_config(config, attn_implementation="eager"))
    pad, eos = config.pad_token_id, config.eos_token_id
    g = torch.Generator().manual_seed(0)
    optimizer = torch.optim.Adam(m.parameters(), lr=3e-3)
    m.train()
    for _ in range(300):
        lengths = torch.randint(2, 10, (32,), generator=g).tolist()
        S = max(lengths) + 1
        src, tgt_in, labels = torch.full((32, S), pad), torch.full((32, S), pad), torch.full((32, S), -100)
        for b, L in enumerate(lengths):
            x = torch.randint(2, pad, (L,), generator=g)
            src[b, : L + 1] = torch.cat([x, torch.tensor([eos])])
            tgt_in[b, : L + 1] = torch.cat([torch.tensor([pad]), x.flip(0)])
            labels[b, : L + 1] = torch.cat([x.flip(0), torch.tensor([eos])])
        loss = m(input_ids=src, attention_mask=src != pad, decoder_input_ids=tgt_in, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return m.eval()


@pytest.mark.parametrize("engine", [False, True], ids=["model", "engine"])
def test_greedy_equals_generate(trained, engine):
    model = from_marian(trained)
    model = prepare(model) if engine else model
    src = sources(trained.config, B=16, S=11, seed=5)
    expected = hf_generate(trained, src, beam=1, max_new_tokens=40)
    ours = strip(greedy_decode(model, src, max_len_a=40), trained.config.pad_token_id)
    assert ours == expected
    lengths = {len(x) for x in expected}
    assert len(lengths) >= 4 and max(lengths) < 40  # ended by EOS, at many lengths, not by the limit


@pytest.mark.parametrize("K", [2, 4])
@pytest.mark.parametrize("engine", [False, True], ids=["model", "engine"])
def test_beam_equals_generate(trained, K, engine):
    model = from_marian(trained)
    model = prepare(model) if engine else model
    src = sources(trained.config, B=16, S=11, seed=6)
    expected = hf_generate(trained, src, beam=K, max_new_tokens=40)
    found = beam_search(model, src, beam=K, alpha=0.0, max_len_a=40)
    ours = [[*hyps[0].tokens, trained.config.eos_token_id] for hyps in found]
    assert ours == expected
    assert ours != hf_generate(trained, src, beam=1, max_new_tokens=40)  # the beam changed something


# The directory: aiayn convert marian, then every command ---------------------------------------------


@pytest.fixture(scope="module")
def hf_dir(trained, spm_files, tmp_path_factory):
    """A Hugging Face Marian directory, as OPUS-MT publishes them: config.json, model.safetensors,
    source.spm, target.spm, vocab.json."""
    source, target, vocab = spm_files
    directory = tmp_path_factory.mktemp("opus-mt-xx-yy")
    trained.save_pretrained(directory)
    write(directory, source, target, vocab)
    return directory


@pytest.fixture(scope="module")
def converted(hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("converted") / "model"
    assert main(["convert", "marian", str(hf_dir), str(out)]) == 0
    return out


SENTENCES = ["Die Straße ist groß.", "Das Haus war schön, heute nicht.", "Größe 42!", "the weather is nice"]


def hf_translate(hf_dir, m, texts: list[str], beam: int) -> list[str]:
    """MarianTokenizer + generate + decode: what a transformers user gets (aiayn's limit: source
    tokens + 50)."""
    tokenizer = marian(hf_dir)
    out = []
    for text in texts:
        src = torch.tensor([tokenizer(text).input_ids])
        (ids,) = hf_generate(m, src, beam, max_new_tokens=src.size(1) + 50)
        # the target model (transformers decodes with the source one unless told: a quirk)
        out.append(tokenizer.decode(ids, skip_special_tokens=True, use_source_tokenizer=False))
    return out


def test_perplexity_of_references_is_marians(hf_dir, trained, converted):
    """References are split by target.spm, as MarianTokenizer(text_target=...) splits them, and
    scored by the same model: the perplexity equals exp(mean NLL) of transformers' loss."""
    references = ["the house is nice today.", "the weather is not big.", "sweet apples and oil", "Größe 42!"]
    tokenizer = marian(hf_dir)
    nll, count = 0.0, 0
    with torch.no_grad():
        for source, reference in zip(SENTENCES, references, strict=True):
            batch = tokenizer(source, text_target=reference, return_tensors="pt")
            loss = trained(**batch).loss  # mean over the reference's tokens, EOS included
            nll, count = nll + float(loss) * batch["labels"].numel(), count + batch["labels"].numel()
    expected = math.exp(nll / count)
    assert Translator.from_pretrained(converted).perplexity(SENTENCES, references) == pytest.approx(expected, rel=1e-5)
    assert tokenizer(text_target=references[3]).input_ids != tokenizer(references[3]).input_ids  # two models


@pytest.mark.parametrize("beam", [1, 4])
def test_converted_translates_as_marian(hf_dir, trained, converted, beam):
    translator = Translator.from_pretrained(converted)
    assert translator.translate(SENTENCES, beam=beam, alpha=0.0) == hf_translate(hf_dir, trained, SENTENCES, beam)


def test_converted_directory_holds_the_same_model(trained, converted):
    config = json.loads((converted / "config.json").read_text())
    assert config["converted_from"].startswith("marian: ")
    assert (config["activation"], config["output_bias"], config["bos_id"]) == (
        "silu",
        True,
        trained.config.pad_token_id,
    )
    model = Transformer.from_pretrained(converted)
    reference = from_marian(trained)
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_pytorch_model_bin_loads_without_unpickling_objects(hf_dir, trained, tmp_path, capsys):
    directory = tmp_path / "bin"
    shutil.copytree(hf_dir, directory)
    (directory / "model.safetensors").unlink()
    torch.save(trained.state_dict(), directory / "pytorch_model.bin")
    assert main(["convert", "marian", str(directory), str(tmp_path / "out")]) == 0
    a, b = Transformer.from_pretrained(tmp_path / "out"), from_marian(trained)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    torch.save(
        {"weights": trained.state_dict(), "evil": Exception("a pickled object")}, directory / "pytorch_model.bin"
    )
    err = convert_fails(capsys, directory, tmp_path / "out2")
    assert "pytorch_model.bin: not a readable weights file (loaded with weights_only=True)" in err
    assert "Unsupported global" in err


def test_evaluate_and_attention_on_the_converted_model(hf_dir, trained, converted, tmp_path, capsys):
    import sacrebleu

    references = ["Die Straße ist groß .", "Das Haus ist schön", "Größe 42", "the weather is not nice"]
    (tmp_path / "src.txt").write_text("\n".join(SENTENCES) + "\n")
    (tmp_path / "ref.txt").write_text("\n".join(references) + "\n")
    args = ["--model", str(converted), "--src", str(tmp_path / "src.txt"), "--ref", str(tmp_path / "ref.txt")]
    assert main(["evaluate", *args, "--beam", "1"]) == 0
    expected = sacrebleu.corpus_bleu(hf_translate(hf_dir, trained, SENTENCES, 1), [references]).score
    assert f"BLEU {expected:.2f}" in capsys.readouterr().out
    out = tmp_path / "attention.png"
    assert main(["attention", "--model", str(converted), SENTENCES[0], "--out", str(out)]) == 0
    assert out.stat().st_size > 1000


def _small_run(tmp_path):
    """A run config (d_model 512 as the converted model's) over a data directory of SENTENCES."""
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "dev"):
        (data / f"{split}.de").write_text("\n".join(SENTENCES) + "\n")
        (data / f"{split}.en").write_text("\n".join(SENTENCES) + "\n")
    config = tmp_path / "run.yaml"
    config.write_text(f"data:\n  dir: {data}\nmodel:\n  d_model: 512\ntrain:\n  max_tokens: 256\n  max_steps: 1\n")
    return config


def test_train_tokenizer_refuses_a_marian_models_tokenizer(converted, tmp_path, capsys):
    """``train.tokenizer`` takes aiayn's BPE only: a Marian model's ids (EOS 0, padding as BOS)
    are not what a fresh model is built with; fine-tuning it is ``train.init``."""
    config, out = _small_run(tmp_path), tmp_path / "run"
    assert main(["train", "--config", str(config), "--out", str(out), "--train.tokenizer", str(converted)]) == 1
    err = capsys.readouterr().err
    assert "holds a Marian model's tokenizer" in err and "train.init" in err and not out.exists()


def test_fine_tuning_starts_from_the_converted_model(converted, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "dev"):
        (data / f"{split}.de").write_text("\n".join(SENTENCES * 4) + "\n")
        (data / f"{split}.en").write_text("\n".join(reversed(SENTENCES * 4)) + "\n")
    config = tmp_path / "run.yaml"
    config.write_text(f"data:\n  dir: {data}\nmodel:\n  d_model: 512\n  P_drop: 0.2\ntrain:\n  max_tokens: 256\n")
    common = ["--train.init", str(converted), "--train.max_steps", "2", "--train.amp", "false"]
    # a learning rate of ~0: the run's model is the converted one (random weights would differ)
    assert (
        main(["train", "--config", str(config), "--out", str(tmp_path / "still"), *common, "--train.lr_scale", "1e-12"])
        == 0
    )
    start, still = Transformer.from_pretrained(converted), Transformer.from_pretrained(tmp_path / "still" / "model")
    assert still.config == start.config.replace(P_drop=0.2)  # the model's config; the run's dropout only
    for (name, a), b in zip(start.state_dict().items(), still.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=name)
    assert (
        main(["train", "--config", str(config), "--out", str(tmp_path / "tuned"), *common, "--train.lr_scale", "1"])
        == 0
    )
    tuned = Translator.from_pretrained(tmp_path / "tuned" / "model")  # with the SentencePiece tokenizer
    assert type(tuned.tokenizer).__name__ == "SentencePieceTokenizer"
    tuned = Transformer.from_pretrained(tmp_path / "tuned" / "model")
    assert any(not torch.equal(a, b) for a, b in zip(start.parameters(), tuned.parameters(), strict=True))
    # a resumed run goes on with its checkpoint's model, --train.init given or not
    resume = ["--out", str(tmp_path / "tuned"), "--resume", "--train.max_steps", "3", "--train.amp", "false"]
    assert main(["train", "--config", str(config), *resume]) == 0
    assert Transformer.from_pretrained(tmp_path / "tuned" / "model").config == tuned.config


@pytest.mark.parametrize(("lever", "needs"), [("word_dropout", "its special ids"), ("bpe_dropout", "its merges")])
def test_token_levers_refuse_a_marian_tokenizer(converted, tmp_path, capsys, lever, needs):
    """word_dropout and bpe_dropout need aiayn's BPE: on a SentencePiece model they refuse, never a silent no-op."""
    config = _small_run(tmp_path)
    args = ["train", "--config", str(config), "--out", str(tmp_path / "run"), "--train.init", str(converted)]
    assert main([*args, "--train.max_steps", "1", "--train.amp", "false", f"--train.{lever}", "0.1"]) == 1
    err = capsys.readouterr().err
    expected = f"aiayn train: error: train.{lever} needs aiayn's BPE tokenizer ({needs}), not a Marian model's"
    assert err.strip().endswith(expected), err
    assert not (tmp_path / "run" / "checkpoints").exists()  # refused before any step


# The other way: aiayn -> Marian --------------------------------------------------------------------


@pytest.mark.parametrize("name", SHAPES)
def test_export_inverts_the_import(name):
    """Marian -> aiayn -> Marian gives back every tensor, bit for bit (a permutation is exact)."""
    m = random_marian(name)
    config, state = to_marian_state(from_marian(m))
    again = transformers.MarianMTModel(transformers.MarianConfig(**config)).eval()
    missing, unexpected = again.load_state_dict(state, strict=False)
    assert not unexpected and all("embed_positions" in k for k in missing)  # the sinusoid: a function of d_model
    for key, value in m.state_dict().items():
        if "embed_positions" not in key and key in state:
            assert torch.equal(value, state[key]), key
    src = sources(m.config)
    with torch.no_grad():
        expected = m.generate(input_ids=src, max_new_tokens=5)
        torch.testing.assert_close(again.generate(input_ids=src, max_new_tokens=5), expected)


def test_an_aiayn_model_exports_to_marian(tmp_path):
    """A model trained in aiayn (post-norm, every parameter random, an output bias) read by
    transformers: the same logits."""
    from helpers import random_model

    model = random_model(vocab_size=40, output_bias=True, activation="silu", N_dec=3)
    config, state = to_marian_state(model)
    m = transformers.MarianMTModel(transformers.MarianConfig(**config)).eval()
    m.load_state_dict(state, strict=False)
    src = torch.randint(3, 40, (3, 7), generator=torch.Generator().manual_seed(0))
    tgt = torch.randint(3, 40, (3, 5), generator=torch.Generator().manual_seed(1))
    tgt[:, 0] = model.config.bos_id
    with torch.no_grad():
        torch.testing.assert_close(m(input_ids=src, decoder_input_ids=tgt).logits, model(src, tgt), atol=ATOL, rtol=0)
    prenorm = random_model(vocab_size=40, norm_first=True)
    with pytest.raises(ValueError, match=r"Marian cannot express this model: norm_first=True .*final_norm=True"):
        to_marian_state(prenorm)


def test_export_command_round_trip(hf_dir, trained, converted, tmp_path):
    """`aiayn export marian` of a converted OPUS-MT-style model: transformers reads the directory
    (MarianMTModel and MarianTokenizer) and translates as aiayn does."""
    assert main(["export", "marian", str(converted), str(tmp_path / "hf")]) == 0
    m = transformers.MarianMTModel.from_pretrained(tmp_path / "hf").eval()
    assert hf_translate(tmp_path / "hf", m, SENTENCES, 1) == Translator.from_pretrained(converted).translate(
        SENTENCES, beam=1
    )


# Errors -------------------------------------------------------------------------------------------


def test_not_marian_is_named(hf_dir, tmp_path, capsys):
    directory = tmp_path / "bart"
    shutil.copytree(hf_dir, directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "model_type": "bart"}))
    assert "config.json: model_type 'bart', not 'marian'" in convert_fails(capsys, directory, tmp_path / "out")
    assert "config.json: no such file" in convert_fails(capsys, tmp_path, tmp_path / "out")
    (directory / "model.safetensors").unlink()
    (directory / "config.json").write_text(json.dumps(config))
    assert "no model.safetensors or pytorch_model.bin" in convert_fails(capsys, directory, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"scale_embedding": False}, "scale_embedding is false"),
        ({"decoder_attention_heads": 2}, "encoder_attention_heads=4 and decoder_attention_heads=2 differ"),
        ({"decoder_ffn_dim": 32}, "encoder_ffn_dim=64 and decoder_ffn_dim=32 differ"),
        ({"activation_function": "gelu_new"}, "activation_function 'gelu_new' is not one of"),
        ({"normalize_before": True}, "normalize_before=True: aiayn converts Marian models with normalize_before=False"),
    ],
)
def test_variants_aiayn_cannot_express_are_named(hf_dir, tmp_path, change, message, capsys):
    directory = tmp_path / "variant"
    shutil.copytree(hf_dir, directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **change}))
    assert message in convert_fails(capsys, directory, tmp_path / "out")


def test_config_fields_left_out_take_marians_defaults(trained):
    """A config.json without activation_function is GELU to transformers (MarianConfig's default)."""
    config = {k: v for k, v in trained.config.to_dict().items() if k != "activation_function"}
    assert transformers.MarianConfig(**config).activation_function == "gelu"
    assert from_marian_state(config, trained.state_dict()).config.activation == "gelu"
    with pytest.raises(ValueError, match=r"eos_token_id=\[0, 3\]: aiayn takes one token id"):
        from_marian_state({**config, "eos_token_id": [0, 3]}, trained.state_dict())


def test_a_stored_positional_table_must_be_the_sinusoid(trained):
    """transformers uses a checkpoint's stored table: aiayn checks it is the formula it rebuilds."""
    config, state = trained.config.to_dict(), dict(trained.state_dict())
    table = state["model.encoder.embed_positions.weight"]
    from_marian_state(config, state)  # transformers' own table passes
    state["model.encoder.embed_positions.weight"] = table + 1e-3 * torch.randn(table.shape)
    with pytest.raises(ValueError, match=r"encoder\.embed_positions\.weight is not Marian's sinusoidal table"):
        from_marian_state(config, state)


def test_separate_vocabularies_with_a_larger_target_convert(spm_files, tmp_path):
    source, target, _ = spm_files
    vocab, target_vocab = marian_vocab(source), marian_vocab(source, target)
    assert len(target_vocab) > len(vocab)
    config = marian_config(len(vocab), **SHAPES["separate-gelu"])
    config.decoder_vocab_size, config.pad_token_id = len(target_vocab), len(vocab) - 1
    config.decoder_start_token_id = config.pad_token_id
    m = randomize_marian_(transformers.MarianMTModel(config).eval())
    m.save_pretrained(tmp_path / "hf")
    write(tmp_path / "hf", source, target, vocab, target_vocab)
    assert main(["convert", "marian", str(tmp_path / "hf"), str(tmp_path / "out")]) == 0
    translator = Translator.from_pretrained(tmp_path / "out")
    assert translator.model.config.tgt_vocab_size == len(target_vocab)
    src = sources(m.config)
    with torch.no_grad():
        expected = m(input_ids=src, attention_mask=src != config.pad_token_id, decoder_input_ids=src[:, :4]).logits
        got = Transformer.from_pretrained(tmp_path / "out")(src, src[:, :4])
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_unknown_or_missing_tensors_are_named(trained):
    config = trained.config.to_dict()
    state = dict(trained.state_dict())
    with pytest.raises(ValueError, match=r"tensors aiayn does not know: encoder\.layernorm_embedding"):
        from_marian_state(config, {**state, "model.encoder.layernorm_embedding.weight": torch.ones(32)})
    del state["model.decoder.layers.1.fc2.bias"]
    with pytest.raises(ValueError, match=r"no tensor 'decoder\.layers\.1\.fc2\.bias'"):
        from_marian_state(config, state)
