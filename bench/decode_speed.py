"""Decoding speed of aiayn against Hugging Face's MarianMTModel.generate at the base shape, in one run.

(i)  greedy decoding on the KV cache against recomputing the whole prefix every step (aiayn both);
(ii) greedy and beam-4 translation of the same 64 sentences with aiayn (fp32, and int8 with
     ``--quantize int8``'s dynamic quantization) and with Marian's ``generate`` (fp32);
(iii) with ``--model DIR``: a trained model on the Ding test split, fp32 against int8: speed and
     BLEU (the int8 BLEU change); its decoders alternate too (at most 3 rounds).
aiayn's fp32 rows come three times, the same search in the same run: as configured (the flat
decoding step of ``model/incremental.py``; products by oneDNN on packed weights where torch runs
AVX-512 kernels, else by MKL: ``model/linear.py``), module by module (``AIAYN_FAST_STEP=0``), and
with MKL's products (``AIAYN_CPU_GEMM=mkl``) where the default is oneDNN's.

Work is equal: random weights (d_model 512, d_ff 2048, h 8, 6 + 6 layers, vocabulary 8,000,
shared and tied), the same 64 random source sentences of 20-30 tokens, and every output forced to
exactly ``--length`` tokens (EOS blocked before, as ``min_new_tokens`` does for Marian). Times are
the median of ``--repeats`` runs; in (ii) the runs of Marian, aiayn fp32 and aiayn int8 alternate
(greedy, then beam 4); sentences/s = 64 / time. The speed-up is the ratio of the medians, and
again round by round (the peer's time over aiayn's in the same round: median and range), which
shows how much of a ratio is the machine's spread. "Matmul FLOP/s" counts the linear
layers' multiply-adds (2 per MAC) over the decoder steps and the encoder, against the machine's
fp32 matmul peak.

    python bench/decode_speed.py [--length 40] [--repeats 3] [--model runs/ding/model]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from aiayn import ModelConfig, Transformer
from aiayn.decode import beam_search, greedy_decode
from aiayn.model import incremental
from aiayn.model import linear as linear_module
from aiayn.quantize import quantize_int8
from common import machine, matmul_peak, median, table, write_result

VOCAB, D, D_FF, N = 8000, 512, 2048, 6
SENTENCES = 64


def sources(generator: torch.Generator) -> torch.Tensor:
    """64 random sentences of 20-30 tokens plus EOS (id 2), right-padded with 0."""
    lengths = torch.randint(20, 31, (SENTENCES,), generator=generator)
    src = torch.zeros(SENTENCES, int(lengths.max()) + 1, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        src[i, :n] = torch.randint(5, VOCAB, (n,), generator=generator)
        src[i, n] = 2
    return src


def marian():
    from transformers import MarianConfig, MarianMTModel

    config = MarianConfig(
        vocab_size=VOCAB, d_model=D, encoder_layers=N, decoder_layers=N, encoder_attention_heads=8,
        decoder_attention_heads=8, encoder_ffn_dim=D_FF, decoder_ffn_dim=D_FF, activation_function="relu",
        dropout=0.1, attention_dropout=0.0, activation_dropout=0.0, scale_embedding=True, pad_token_id=0,
        eos_token_id=2, decoder_start_token_id=1, max_position_embeddings=512, share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True, forced_eos_token_id=None, bad_words_ids=None,
    )  # fmt: skip
    torch.manual_seed(0)
    return MarianMTModel(config).eval()


def matmul_flops(src: torch.Tensor, length: int, beam: int) -> int:
    """Linear-layer FLOPs of translating ``src``: encoder once per source token, decoder per step per beam."""
    src_tokens = int((src != 0).sum())
    encoder = src_tokens * 2 * N * (4 * D * D + 2 * D * D_FF)
    cross_kv = src_tokens * 2 * N * 2 * D * D  # the encoder-decoder K/V, once per source token
    step = 2 * (N * (4 * D * D + 2 * D * D + 2 * D * D_FF) + D * VOCAB)  # self QKV+O, cross Q+O, FFN, output
    return encoder + cross_kv + SENTENCES * beam * length * step


def _switched_off(module, flag: str, fn):
    """``fn`` run with ``module.flag`` set to False, restored afterwards."""

    def run():
        before = getattr(module, flag)
        setattr(module, flag, False)
        try:
            return fn()
        finally:
            setattr(module, flag, before)

    return run


def module_path(fn):
    """``fn`` with decoding steps run module by module (``AIAYN_FAST_STEP=0``), for comparison."""
    return _switched_off(incremental, "enabled", fn)


def mkl_products(fn):
    """``fn`` with the CPU's float32 products by MKL (``AIAYN_CPU_GEMM=mkl``), for comparison."""
    return _switched_off(linear_module, "PACKED", fn)


def alternating(fns: dict, repeats: int) -> dict[str, list[float]]:
    """Seconds of each function in each round: one warm-up each, then ``repeats`` rounds that run
    them in turn (in reverse order every other round)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(repeats):
        for name, fn in list(fns.items())[:: 1 if r % 2 == 0 else -1]:
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def paired(peer: list[float], ours: list[float]) -> dict:
    """The speed-up round by round (the peer's time over ours in the same round): its median and
    range show how far the machine's spread moves the ratio of medians."""
    ratios = sorted(p / o for p, o in zip(peer, ours, strict=True))
    return {"median": round(median(ratios), 2), "min": round(ratios[0], 2), "max": round(ratios[-1], 2)}


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return median(times)


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=40, help="output tokens per sentence (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per row (median; default %(default)s)")
    parser.add_argument("--model", help="a trained model directory: also compare fp32 and int8 on --split")
    parser.add_argument("--data", default="data/ding", help="with --model: {split}.de/.en files (%(default)s)")
    parser.add_argument("--split", default="test", help="with --model: the split (default %(default)s)")
    parser.add_argument("--skip-marian", action="store_true", help="only aiayn rows")
    args = parser.parse_args()
    if not args.skip_marian and importlib.util.find_spec("transformers") is None:
        parser.error("the peer needs Hugging Face transformers: pip install transformers (or --skip-marian)")
    L = args.length
    info = machine()
    peak = matmul_peak()
    print(f"{info['cpu']}, {info['torch_threads']} threads, torch {info['torch']}; peak {peak / 1e9:.1f} GFLOP/s")
    src = sources(torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = Transformer(ModelConfig.base(VOCAB, P_drop=0.0)).eval()
    int8 = quantize_int8(model)
    rows: list[dict] = []

    def row(name: str, seconds: float | list[float], beam: int, peer: float | list[float] | None = None) -> dict:
        runs = seconds if isinstance(seconds, list) else None
        seconds = median(runs) if runs else seconds
        r = {
            "name": name, "seconds": round(seconds, 3), "sent_per_s": round(SENTENCES / seconds, 1),
            "ms_per_step": round(1000 * seconds / L, 1),
            "matmul_fraction_of_peak": round(matmul_flops(src, L, beam) / seconds / peak, 3),
        }  # fmt: skip
        if runs:
            r["runs"] = [round(t, 3) for t in runs]
        if peer is not None:
            r["vs_peer"] = round((median(peer) if isinstance(peer, list) else peer) / seconds, 2)
        if runs and isinstance(peer, list):
            r["vs_peer_by_round"] = paired(peer, runs)
            r["by_round"] = "{median} ({min}-{max})".format(**r["vs_peer_by_round"])
        rows.append(r)
        print(table([r], COLUMNS).splitlines()[-1], flush=True)
        return r

    print(table([], COLUMNS))
    # (i) the cache against recomputation
    recompute = timed(lambda: greedy_decode(model, src, max_len=L, min_len=L, use_cache=False), 1)
    row("aiayn greedy, no cache (recompute prefix)", recompute, 1)
    cached = timed(lambda: greedy_decode(model, src, max_len=L, min_len=L), args.repeats)
    row("aiayn greedy, KV cache", cached, 1, peer=recompute)
    # (ii) against Marian generate: each group's runs alternate, so a slow spell of the machine
    # falls on every decoder alike
    runs = {
        "greedy": lambda: greedy_decode(model, src, max_len=L, min_len=L),
        "int8 greedy": lambda: greedy_decode(int8, src, max_len=L, min_len=L),
        "beam": lambda: beam_search(model, src, beam=4, max_len=L, min_len=L),
        "int8 beam": lambda: beam_search(int8, src, beam=4, max_len=L, min_len=L),
    }
    for kind in ("greedy", "beam"):  # the same search module by module, and with MKL's products
        runs[f"module {kind}"] = module_path(runs[kind])
        if linear_module.PACKED:
            runs[f"mkl {kind}"] = mkl_products(runs[kind])
    if not args.skip_marian:
        hf = marian()
        attention_mask = (src != 0).long()

        def generate(beams: int):
            beam_flags = {"early_stopping": False, "length_penalty": 0.6} if beams > 1 else {}  # greedy takes neither
            out = hf.generate(
                input_ids=src, attention_mask=attention_mask, num_beams=beams, do_sample=False,
                min_new_tokens=L, max_new_tokens=L, **beam_flags,
            )  # fmt: skip
            assert out.size(1) == L + 1, out.shape  # decoder start + L tokens

        runs["Marian greedy"], runs["Marian beam"] = lambda: generate(1), lambda: generate(4)
    for kind, beam, title in (("greedy", 1, "greedy"), ("beam", 4, "beam 4")):
        names = (f"Marian {kind}", kind, f"module {kind}", f"mkl {kind}", f"int8 {kind}")
        times = alternating({k: runs[k] for k in names if k in runs}, args.repeats)  # each round's seconds
        peer = times.get(f"Marian {kind}")
        if peer is not None:
            row(f"Marian generate {title} (fp32)", peer, beam)
        row(f"aiayn {title} (fp32)", times[kind], beam, peer=peer)
        row(f"aiayn {title} (fp32, steps module by module)", times[f"module {kind}"], beam, peer=peer)
        if f"mkl {kind}" in times:
            row(f"aiayn {title} (fp32, MKL's products)", times[f"mkl {kind}"], beam, peer=peer)
        row(f"aiayn {title} (int8)", times[f"int8 {kind}"], beam, peer=peer)
    result = {
        "machine": info, "matmul_peak_flops": peak, "cpu_products": "onednn packed" if linear_module.PACKED else "mkl",
        "length": L, "sentences": SENTENCES, "repeats": args.repeats,
        "rows": rows,
    }  # fmt: skip
    if args.model:
        result["ding"] = trained(args)
    print(table(rows, COLUMNS))
    print(f"written {write_result('decode_speed', result)}")


COLUMNS = [
    ("name", "decoding (64 sentences)"), ("seconds", "seconds"), ("sent_per_s", "sentences/s"),
    ("ms_per_step", "ms/step"), ("matmul_fraction_of_peak", "matmul / peak"), ("vs_peer", "speed-up vs peer"),
    ("by_round", "by round: median (range)"),
]  # fmt: skip


def trained(args: argparse.Namespace) -> dict:
    """fp32 against int8 on a real test split: sentences/s and BLEU, greedy and beam 4. The
    decoders of a search (fp32 with the flat step, fp32 module by module, int8, and fp32 with
    MKL's products where the default is oneDNN's) alternate, as in (ii); BLEU is scored on each
    one's first (warm-up) output."""
    from aiayn import Translator
    from aiayn.evaluate import score_translations

    data = Path(args.data)
    sources_text = (data / f"{args.split}.de").read_text(encoding="utf-8").splitlines()
    references = (data / f"{args.split}.en").read_text(encoding="utf-8").splitlines()
    translators = {
        None: Translator.from_pretrained(args.model),
        "int8": Translator.from_pretrained(args.model, quantize="int8"),
    }
    rounds = min(args.repeats, 3)
    out = []
    for beam in (1, 4):
        hypotheses: dict[str, list[str]] = {}
        decoders = {"fp32 flat": (None, "flat"), "fp32 modules": (None, "modules"), "int8 flat": ("int8", "flat")}
        if linear_module.PACKED:
            decoders["fp32 mkl"] = (None, "flat, MKL's products")
        fns = {
            name: _decoder(translators[quantize], sources_text, beam, step, hypotheses, name)
            for name, (quantize, step) in decoders.items()
        }
        times = alternating(fns, rounds)
        for name, (quantize, step) in decoders.items():
            scores = score_translations(hypotheses[name], references)
            seconds = median(times[name])
            out.append({
                "weights": quantize or "fp32", "step": step, "beam": beam, "seconds": round(seconds, 2),
                "runs": [round(t, 3) for t in times[name]], "sent_per_s": round(len(sources_text) / seconds, 1),
                "bleu": round(scores.bleu, 2), "chrf": round(scores.chrf, 2),
            })  # fmt: skip
    print(f"\n{args.model} on {args.split} ({len(sources_text)} sentences; median of {rounds} alternating rounds):")
    print(table(out, [("weights", "weights"), ("step", "decoding step"), ("beam", "beam"), ("seconds", "seconds"),
                      ("sent_per_s", "sentences/s"), ("bleu", "BLEU"), ("chrf", "chrF")]))  # fmt: skip
    return {"model": args.model, "split": args.split, "rounds": rounds, "rows": out}


def _decoder(translator, sources_text: list[str], beam: int, step: str, hypotheses: dict, name: str):
    """A timed call translating ``sources_text`` (``step``: "flat", "modules" for module by module,
    or "flat, MKL's products") that keeps its first output in ``hypotheses[name]`` and checks every
    later one against it."""
    translate = functools.partial(translator.translate, sources_text, beam=beam)
    run = {"flat": translate, "modules": module_path(translate), "flat, MKL's products": mkl_products(translate)}[step]

    def fn():
        out = run()
        if hypotheses.setdefault(name, out) != out:
            raise RuntimeError(f"{name}, beam {beam}: a repeated translation differs from the first")

    return fn


if __name__ == "__main__":
    main()
