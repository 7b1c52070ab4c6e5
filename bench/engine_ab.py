"""Each piece of the inference engine (``aiayn.engine``) against the engine without it, end to
end, in alternating rounds: a piece that gains under 5% goes (issue 25).

Two workloads, each decoded greedily and with beam 4:
- ``ding``: a trained model (``--model``, e.g. the demo's) translating the Ding test split
  (``--data``/test.de, 1,007 lines), as ``aiayn translate`` does (``Translator.translate``);
- ``base``: the base shape with random weights (d_model 512, 6 + 6 layers, vocabulary 8,000),
  64 random sentences of 20-30 tokens, every output forced to ``--length`` tokens, as
  ``bench/decode_speed.py`` decodes them (``translate_ids``).

Variants: the engine as configured (``EngineOptions()``), then one option off at a time:
``kernels=False`` (torch's attention instead of the C++ kernel), ``gemm="mkl"`` and
``gemm="onednn"`` (every product MKL's, transposed at decoding steps, or every one oneDNN's,
instead of ``auto``'s choice by CPU and weight size, where the default takes oneDNN for some),
and the paper's model unprepared (its modules on ``model/cache.py``: no engine at all). The
gain of a piece is the time without it over the time with everything, median over rounds and
round by round. Outputs are checked equal to the engine's (float32).

    python bench/engine_ab.py --model runs/ding/model [--rounds 3] [--skip-base]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from aiayn import ModelConfig, Transformer, Translator, engine
from aiayn.decode import translate_ids
from aiayn.engine import EngineOptions
from common import alternating, machine, median, paired, table, write_result

VARIANTS = {
    "engine": EngineOptions(),
    "kernels off": EngineOptions(kernels=False),
    "mkl products": EngineOptions(gemm="mkl"),
    "onednn products": EngineOptions(gemm="onednn"),
}
COLUMNS = [
    ("workload", "workload"), ("search", "search"), ("variant", "variant"), ("seconds", "seconds"),
    ("gain", "engine's gain"), ("by_round", "by round: median (range)"),
]  # fmt: skip


def variants() -> dict[str, EngineOptions | None]:
    chosen: dict[str, EngineOptions | None] = dict(VARIANTS)
    if not EngineOptions().onednn:  # the default is MKL's already: no A/B
        del chosen["mkl products"], chosen["onednn products"]
    chosen["paper model"] = None
    return chosen


def ding(model_dir: str, data: Path, beam: int) -> tuple[dict, dict]:
    """Timed translations of the test split, one per variant; checks outputs against the engine's."""
    sources = (data / "test.de").read_text(encoding="utf-8").splitlines()
    paper = Transformer.from_pretrained(model_dir).eval()
    fns, outputs = {}, {}
    for name, options in variants().items():
        translator = Translator.from_pretrained(model_dir, options=options or EngineOptions(), alone=True)
        if options is None:
            translator.model = paper  # the paper's modules, unprepared

        def fn(translator=translator, name=name):
            out = translator.translate(sources, beam=beam)
            outputs.setdefault(name, out)

        fns[name] = fn
    return fns, outputs


def base(length: int, beam: int) -> tuple[dict, dict]:
    """Timed ``translate_ids`` of 64 random sources at the base shape, one per variant; outputs run
    to their limits (source length + ``length`` - 20: EOS's embedding is zero, its logit 0)."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(20, 31, (64,), generator=g)
    sources = [torch.randint(4, 8000, (int(n),), generator=g).tolist() for n in lengths]
    torch.manual_seed(0)
    paper = Transformer(ModelConfig.base(8000, P_drop=0.0, max_len=256)).eval()
    with torch.no_grad():  # no EOS before `length` tokens: every sentence decodes `length` steps
        paper.tgt_embedding.weight[paper.config.eos_id] = 0.0
    fns, outputs = {}, {}
    for name, options in variants().items():
        model = paper if options is None else engine.prepare(paper, options=options)

        def fn(model=model, name=name):
            out = translate_ids(model, sources, beam=beam, max_len_a=length - 20)
            outputs.setdefault(name, out)

        fns[name] = fn
    return fns, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a trained model directory (the Ding workload)")
    parser.add_argument("--data", default="data/ding", type=Path, help="with --model: test.de there (%(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating timed rounds (default %(default)s)")
    parser.add_argument("--length", type=int, default=40, help="base workload: tokens per output (%(default)s)")
    parser.add_argument("--skip-base", action="store_true", help="only the Ding workload")
    args = parser.parse_args()
    info = machine()
    print(f"{info['cpu']}, {info['torch_threads']} threads, torch {info['torch']}")
    workloads = {}
    if args.model:
        workloads["ding"] = lambda beam: ding(args.model, args.data, beam)
    if not args.skip_base:
        workloads["base"] = lambda beam: base(args.length, beam)
    rows = []
    print(table([], COLUMNS))
    for workload, make in workloads.items():
        for beam in (1, 4):
            fns, outputs = make(beam)
            start = time.perf_counter()
            times = alternating(fns, args.rounds)
            reference = outputs["engine"]
            for name, t in times.items():
                same = outputs[name] == reference
                row = {
                    "workload": workload, "search": "greedy" if beam == 1 else f"beam {beam}", "variant": name,
                    "seconds": round(median(t), 3), "runs": [round(x, 3) for x in t], "same_output": same,
                }  # fmt: skip
                if name != "engine":
                    row["gain"] = round(median(t) / median(times["engine"]), 3)
                    row["by_round"] = "{median} ({min}-{max})".format(**paired(t, times["engine"]))
                rows.append(row)
                print(table([row], COLUMNS).splitlines()[-1] + ("" if same else "  OUTPUT DIFFERS"), flush=True)
            print(f"  ({time.perf_counter() - start:.0f} s)", flush=True)
    path = write_result("engine_ab", {"machine": info, "rounds": args.rounds, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
