"""kNN-MT (``aiayn.retrieval``): the datastore's keys are the states the output projection reads,
the mixture is the paper's formula, the inverted file probed everywhere is the exact search, a
store of a model's own pairs makes it reproduce them, and the store travels with the model
directory (``train.knn``, ``Translator``, ``aiayn translate --no-knn``)."""

import json
import math

import faiss
import pytest
import torch
from tests.train.test_trainer import write_config, write_corpus

from aiayn import retrieval
from aiayn.cli import main
from aiayn.data.batching import collate
from aiayn.data.tokenizer import TOKENIZER_NAME, Tokenizer
from aiayn.decode import Ensemble, translate_ids
from aiayn.engine import prepare
from aiayn.evaluate import score_translations
from aiayn.retrieval import DATASTORE_NAME, Datastore, RetrievalConfig
from aiayn.train.config import RunConfig
from aiayn.train.trainer import train
from aiayn.translator import Translator
from helpers import random_model

V = 40


def random_pairs(n: int, seed: int = 1, vocab: int = V) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)

    def ids() -> list[int]:
        return torch.randint(5, vocab, (int(torch.randint(2, 8, (1,), generator=g)),), generator=g).tolist()

    pairs: dict[tuple[int, ...], list[int]] = {}
    while len(pairs) < n:  # distinct sources: one source, one translation to reproduce
        pairs.setdefault(tuple(ids()), ids())
    return [(list(s), t) for s, t in pairs.items()]


def test_keys_are_the_states_the_output_projection_reads():
    model = random_model(0, vocab_size=V)
    pairs = random_pairs(12)
    store = Datastore.build(model, pairs)
    assert len(store) == sum(len(t) + 1 for _, t in pairs)  # a key per target token and the EOS
    for src, tgt in pairs:
        one = Datastore.build(model, [(src, tgt)])
        b = collate([(src, tgt)], 0, 1, 2)
        with torch.no_grad():
            logits = model(b.src, b.tgt_in)[0]  # (T, V), teacher forced
            # the projection of the keys (kept at float16's precision, as saved)
            assert torch.allclose(model._logits(one.keys), logits, atol=5e-3)
        assert one.values.tolist() == [*tgt, 2]  # the next token, EOS last
        # each of them is in the store of all the pairs (batched with others: the same states)
        nearest = torch.cdist(one.keys, store.keys, compute_mode="donot_use_mm_for_euclid_dist").min(dim=1)
        assert nearest.values.max() < 1e-2  # float16's rounding at most; other pairs' states lie far
        assert store.values[nearest.indices].tolist() == [*tgt, 2]


def test_the_mixture_is_lambda_p_knn_plus_one_minus_lambda_p_model():
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(50, 8, generator=g), torch.randint(0, 12, (50,), generator=g)
    config = RetrievalConfig(k=3, temperature=2.0, lam=0.4)
    store = Datastore(keys, values, config)
    hidden, logits = torch.randn(5, 8, generator=g), torch.randn(5, 12, generator=g)
    got = store.mix(hidden, logits).exp()
    keys = store.keys  # as stored: float16's values
    for r in range(5):  # by hand: the 3 nearest by squared distance, weights exp(-d / T)
        d = ((keys - hidden[r]) ** 2).sum(-1).double()
        nearest = sorted(range(50), key=lambda i: d[i].item())[:3]
        w = {i: math.exp(-d[i].item() / 2.0) for i in nearest}
        p_knn = torch.zeros(12, dtype=torch.float64)
        for i in nearest:
            p_knn[values[i]] += w[i] / sum(w.values())
        want = 0.4 * p_knn + 0.6 * torch.softmax(logits[r].double(), -1)
        assert torch.allclose(got[r].double(), want, atol=1e-5)
    assert torch.allclose(got.sum(-1), torch.ones(5), atol=1e-5)
    # lambda 0: the model's own distribution
    off = Datastore(keys, values, config.replace(lam=0.0)).mix(hidden, logits)
    assert torch.allclose(off, torch.log_softmax(logits, -1), atol=1e-6)
    # a row whose probed lists held no key keeps the model's distribution (no NaN)
    nowhere = (torch.full((5, 3), math.inf), torch.full((5, 3), -1, dtype=torch.long))
    store.search = lambda queries: nowhere
    assert torch.allclose(store.mix(hidden, logits), torch.log_softmax(logits, -1), atol=1e-6)


def test_the_inverted_file_probed_everywhere_is_the_exact_search(monkeypatch, tmp_path):
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(3000, 16, generator=g), torch.randint(0, 9, (3000,), generator=g)
    queries = torch.randn(20, 16, generator=g)
    exact = Datastore(keys, values, RetrievalConfig(k=5))
    distances, ids = exact.search(queries)
    want = torch.cdist(queries, exact.keys, compute_mode="donot_use_mm_for_euclid_dist") ** 2
    assert torch.allclose(distances, want.topk(5, largest=False).values, rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(retrieval, "FLAT_BELOW", 1000)  # 3,000 keys: an inverted file of 2 √3000 = 110 lists
    inverted = Datastore(keys, values, RetrievalConfig(k=5, nprobe=110))
    assert inverted.index.nlist == 110
    got_distances, got_ids = inverted.search(queries)
    assert torch.equal(got_ids, ids) and torch.allclose(got_distances, distances, rtol=1e-5, atol=1e-5)
    # its lists travel with the store: loaded, it searches the same lists without k-means again
    inverted.save(tmp_path)
    loaded = Datastore.load(tmp_path, nprobe=3)
    assert torch.equal(loaded.centroids, inverted.centroids)
    monkeypatch.setattr(faiss, "Kmeans", lambda *args, **kwargs: pytest.fail("k-means ran again"))
    fewer = inverted.with_config(RetrievalConfig(k=5, nprobe=3))
    assert torch.equal(loaded.search(queries)[1], fewer.search(queries)[1])
    assert not torch.equal(fewer.search(queries)[1], ids)  # 3 lists of 110: not the exact search
    assert torch.equal(fewer.centroids, inverted.centroids)


def test_a_store_of_the_models_own_pairs_makes_it_reproduce_them():
    pairs = random_pairs(30)
    only_knn = RetrievalConfig(k=1, lam=1.0)
    models = [random_model(seed, vocab_size=V) for seed in (0, 1)]
    stores = [Datastore.build(m, pairs, only_knn) for m in models]
    sources, targets = [s for s, _ in pairs], [t for _, t in pairs]
    plain = translate_ids(prepare(models[0]), sources, beam=1)
    assert sum(o == t for o, t in zip(plain, targets, strict=True)) < 3  # a random model does not
    for beam in (1, 4):
        assert translate_ids(prepare(models[0], datastore=stores[0]), sources, beam=beam) == targets
        ensemble = Ensemble([prepare(m, datastore=s) for m, s in zip(models, stores, strict=True)])
        assert translate_ids(ensemble, sources, beam=beam) == targets
    # lambda 0: exactly the outputs without a store
    off = Datastore(stores[0].keys, stores[0].values, only_knn.replace(lam=0.0))
    assert translate_ids(prepare(models[0], datastore=off), sources, beam=4) == translate_ids(
        prepare(models[0]), sources, beam=4
    )


def test_a_store_saves_loads_and_an_unreadable_file_is_an_error_naming_it(tmp_path):
    g = torch.Generator().manual_seed(0)
    store = Datastore(torch.randn(30, 8, generator=g), torch.randint(0, 99, (30,), generator=g),
                      RetrievalConfig(k=4, temperature=3.0, lam=0.2))  # fmt: skip
    path = store.save(tmp_path)
    assert path == tmp_path / DATASTORE_NAME
    loaded = Datastore.load(tmp_path)
    assert loaded.config == store.config and torch.equal(loaded.values, store.values)
    assert torch.equal(loaded.keys, store.keys)  # float16's values, in memory as on disk
    assert Datastore.load(tmp_path, lam=0.7, k=None).config == store.config.replace(lam=0.7)
    assert Datastore.load(tmp_path / "elsewhere") is None
    path.write_bytes(b"\x80\x04not safetensors")  # a pickle's first bytes: never unpickled
    with pytest.raises(ValueError, match=f"{path}: not a readable datastore"):
        Datastore.load(tmp_path)
    with pytest.raises(ValueError, match="lam"):
        RetrievalConfig(lam=1.5)


SENTENCES = [("das haus ist rot", "the house is red"), ("der hund bellt", "the dog barks"),
             ("die katze schläft", "the cat sleeps"), ("es regnet heute", "it rains today")]  # fmt: skip


def test_translate_decodes_with_the_directorys_store_unless_no_knn(tmp_path, capsys):
    tokenizer = Tokenizer.train([t for pair in SENTENCES for t in pair] * 4, vocab_size=120)
    model = random_model(3, vocab_size=tokenizer.vocab_size)
    model.save_pretrained(tmp_path)
    tokenizer.save(tmp_path / TOKENIZER_NAME)
    pairs = [(tokenizer.encode(s), tokenizer.encode(t)) for s, t in SENTENCES]
    Datastore.build(model, pairs, RetrievalConfig(k=1, lam=1.0)).save(tmp_path)
    src = tmp_path / "in.txt"
    src.write_text("".join(s + "\n" for s, _ in SENTENCES))
    assert main(["translate", "--model", str(tmp_path), "--input", str(src), "--beam", "2"]) == 0
    assert capsys.readouterr().out.splitlines() == [t for _, t in SENTENCES]  # its own pairs, reproduced
    assert main(["translate", "--model", str(tmp_path), "--input", str(src), "--beam", "2", "--no-knn"]) == 0
    without = Translator(model, tokenizer).translate([s for s, _ in SENTENCES], beam=2)
    assert capsys.readouterr().out.splitlines() == without != [t for _, t in SENTENCES]
    assert main(["translate", "--model", str(tmp_path), "--input", str(src), "--knn-lambda", "0"]) == 0
    assert capsys.readouterr().out.splitlines() == Translator(model, tokenizer).translate([s for s, _ in SENTENCES])
    with pytest.raises(SystemExit):
        main(["translate", "--model", str(tmp_path), "--knn-lambda", "2"])
    assert "is not a number from 0 to 1" in capsys.readouterr().err
    translator = Translator.from_pretrained(tmp_path, retrieval={"lam": 0.5})
    assert translator.model.datastore.config == RetrievalConfig(k=1, lam=0.5)  # the override, the rest stored
    # a weight for no store, or with --no-knn: said, not ignored
    assert main(["translate", "--model", str(tmp_path), "--knn-lambda", "0.5", "--no-knn", "x"]) != 0
    assert "--knn-lambda sets the datastore's weight, --no-knn decodes without it" in capsys.readouterr().err
    (tmp_path / DATASTORE_NAME).unlink()
    assert main(["translate", "--model", str(tmp_path), "--knn-lambda", "0.5", "x"]) != 0
    assert f"{tmp_path / DATASTORE_NAME}: no kNN-MT datastore to read with" in capsys.readouterr().err


def test_train_knn_keeps_a_store_of_the_training_sentences_in_each_model_directory(tmp_path):
    corpus = tmp_path / "data"
    corpus.mkdir()
    write_corpus(corpus)
    config = write_config(tmp_path, corpus, members=2, max_steps=6, eval_every=6, knn=True)
    said: list[str] = []
    result = train(RunConfig.from_yaml(config), tmp_path / "run", progress=False, log=said.append)
    translator = Translator.from_pretrained(tmp_path / "run" / "model")
    german, english = (corpus / "train.de").read_text().splitlines(), (corpus / "train.en").read_text().splitlines()
    encode = translator.tokenizer.encode
    pairs = [(encode(s), encode(t)) for s, t in zip(german, english, strict=True)]
    for directory in (tmp_path / "run" / "model", tmp_path / "run" / "member2" / "model"):
        store = Datastore.load(directory)
        assert store.config == RetrievalConfig()
        assert len(store) == sum(len(t) + 1 for _, t in pairs)  # every training sentence's targets and EOS
        assert sorted(store.values.tolist()) == sorted(i for _, t in pairs for i in [*t, 2])
        # each built by its own run (member 2's by its process, loaded by the run), said in its log
        member_log = directory.parent / "train.log"
        log = said if directory.parent == tmp_path / "run" else member_log.read_text().splitlines()
        assert any(f"kNN-MT: {len(store):,} keys of {len(pairs)} sentence pairs in " in line for line in log)
    assert all(m.datastore is not None for m in translator.model.members)
    # the run's last dev scores are the ensemble's with its stores, as translate decodes
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    [together] = [r for r in records if r["kind"] == "ensemble"]
    dev = (corpus / "dev.de").read_text().splitlines(), (corpus / "dev.en").read_text().splitlines()
    assert together["dev_bleu"] == result.ensemble_dev_scores.bleu
    assert together["dev_bleu"] == score_translations(translator.translate(dev[0], beam=1), dev[1]).bleu
    with pytest.raises(ValueError, match=r"train\.knn"):
        write_config(tmp_path, corpus, knn=True, task="lm")
        RunConfig.from_yaml(tmp_path / "config.yaml")
