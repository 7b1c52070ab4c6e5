"""kNN-MT (``aiayn.retrieval``, ``train.knn``) on the Ding dev split: BLEU and chrF of trained runs
(each ``--run`` a model directory, with its ``ensemble.json``'s members: a pair of ``train.members``)
decoded without (λ 0) and with their datastores over a grid of λ, T and α, beam 4; and the seconds
each decoding took (λ 0 skips the search). A run without datastores gets them built here from the
training sentences (as ``train.knn`` builds them; written to its model directories only with
``--save``).

The test split is never read: this is where kNN-MT's settings are chosen.

    python bench/knn_dev.py --run runs/ding/model [--run ...] [--lam 0 0.2 0.3 0.4] [--temperature 10 20]
        [--alpha 1.5 2.0] [--k 16] [--save]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from aiayn.data.tokenizer import load_tokenizer
from aiayn.decode import Ensemble
from aiayn.evaluate import score_translations
from aiayn.model import Transformer
from aiayn.retrieval import Datastore, RetrievalConfig
from aiayn.translator import Translator, ensemble_members
from common import machine, table, write_result

DATA = Path(__file__).parent.parent / "data" / "ding"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", action="append", required=True, help="a model directory (its ensemble's too)")
    parser.add_argument("--lam", type=float, nargs="+", default=[0.0, 0.2, 0.3, 0.4])
    parser.add_argument("--temperature", type=float, nargs="+", default=[10.0])
    parser.add_argument("--alpha", type=float, nargs="+", default=[1.5, 2.0])
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--save", action="store_true", help="write the datastores built here into the directories")
    parser.add_argument("--name", default="knn_dev")
    args = parser.parse_args()
    sources = (DATA / "dev.de").read_text(encoding="utf-8").splitlines()
    references = (DATA / "dev.en").read_text(encoding="utf-8").splitlines()
    train = list(
        zip(
            (DATA / "train.de").read_text(encoding="utf-8").splitlines(),
            (DATA / "train.en").read_text(encoding="utf-8").splitlines(),
            strict=True,
        )
    )
    rows = []
    for run in args.run:
        directories = ensemble_members(run)
        models = [Transformer.from_pretrained(d).eval() for d in directories]
        model = Ensemble(models).eval() if len(models) > 1 else models[0]
        tokenizer = load_tokenizer(directories[0], model.config.vocab_size, model.config.tgt_vocab_size)
        encoded = [(tokenizer.encode(s), tokenizer.encode(t)) for s, t in train]
        stores = []
        for directory, member in zip(directories, models, strict=True):
            store = Datastore.load(directory)
            if store is None:
                limit = min(64, member.config.max_len)  # the Ding preset's data.max_len
                pairs = [(s, t) for s, t in encoded if 0 < len(s) < limit and 0 < len(t) < limit]
                t0 = time.perf_counter()
                store = Datastore.build(member, pairs)
                print(f"{directory}: built {len(store):,} keys in {time.perf_counter() - t0:.0f} s", flush=True)
                if args.save:
                    store.save(directory)
            stores.append(store)
        for alpha, lam, temperature in itertools.product(args.alpha, args.lam, args.temperature):
            if lam == 0 and temperature != args.temperature[0]:
                continue  # without the store T changes nothing
            config = RetrievalConfig(k=args.k, temperature=temperature, lam=lam)
            translator = Translator(model, tokenizer, datastores=[s.with_config(config) for s in stores])
            t0 = time.perf_counter()
            with torch.inference_mode():
                hypotheses = translator.translate(sources, beam=args.beam, alpha=alpha)
            seconds = time.perf_counter() - t0
            scores = score_translations(hypotheses, references)
            row = {"run": run, "models": len(directories), "alpha": alpha, "lam": lam, "temperature": temperature,
                   "k": args.k, "bleu": round(scores.bleu, 2), "chrf": round(scores.chrf, 2),
                   "seconds": round(seconds, 1)}  # fmt: skip
            rows.append(row)
            print(f"{run} α {alpha} λ {lam} T {temperature}: BLEU {row['bleu']} chrF {row['chrf']} ({seconds:.0f} s)",
                  flush=True)  # fmt: skip
    summary = []
    for alpha, lam, temperature in sorted({(r["alpha"], r["lam"], r["temperature"]) for r in rows}):
        same = [r for r in rows if (r["alpha"], r["lam"], r["temperature"]) == (alpha, lam, temperature)]
        summary.append({
            "alpha": alpha, "lam": lam, "temperature": temperature, "runs": len(same),
            "bleu": round(statistics.mean(r["bleu"] for r in same), 2),
            "chrf": round(statistics.mean(r["chrf"] for r in same), 2),
            "seconds": round(statistics.mean(r["seconds"] for r in same), 1),
        })  # fmt: skip
    columns = [("alpha", "α"), ("lam", "λ"), ("temperature", "T"), ("runs", "runs"), ("bleu", "dev BLEU (mean)"),
               ("chrf", "chrF"), ("seconds", "s to decode")]  # fmt: skip
    print(table(summary, columns))
    result = {"benchmark": args.name, "command": "python " + " ".join(sys.argv), "machine": machine(),
              "threads": torch.get_num_threads(), "k": args.k, "beam": args.beam, "rows": rows,
              "summary": summary}  # fmt: skip
    print(f"\nwritten to {write_result(args.name, result)}")


if __name__ == "__main__":
    main()
