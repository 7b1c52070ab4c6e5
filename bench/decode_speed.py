"""Decoding speed of aiayn against Hugging Face's MarianMTModel.generate at the base shape, in one run.

(i)  greedy decoding on the KV cache against recomputing the whole prefix every step (aiayn both);
(ii) greedy and beam-4 translation of the same 64 sentences with aiayn (fp32, and int8 with
     ``--quantize int8``'s dynamic quantization) and with Marian's ``generate`` (fp32);
(iii) beside Marian, CTranslate2 (issue 25: ``pip install ctranslate2``, or the ``bench`` extra), fp32
     and int8, greedy and beam 4, in the same alternating rounds; ``--skip-ctranslate2`` leaves it out;
(iv) with ``--model DIR``: a trained model on the Ding test split, fp32 against int8: speed and
     BLEU (the int8 BLEU change); its decoders alternate too (at most 3 rounds).
With ``--bf16``, (ii) and (iv) add the paper's model with its weights in bfloat16 (unprepared: the
engine is float32's), the rows that tell whether bf16 pays for decoding on this CPU.
aiayn's fp32 rows come three times, the same search in the same run: on the engine as
configured (``aiayn.engine.prepare``: the flat decoding step, the C++ kernels, products by oneDNN
on packed weights where torch runs AVX-512 kernels, else by MKL), on the paper's model unprepared
(its modules on ``model/cache.py``), and on the engine with MKL's products
(``EngineOptions(gemm="mkl")``) where the default is oneDNN's.

Work is equal: random weights (d_model 512, d_ff 2048, h 8, 6 + 6 layers, vocabulary 8,000,
shared and tied), the same 64 random source sentences of 20-30 tokens, and every output forced to
exactly ``--length`` tokens (EOS blocked before, as ``min_new_tokens`` does for Marian). Times are
the median of ``--repeats`` runs; in (ii) the runs of Marian, aiayn fp32 and aiayn int8 alternate
(greedy, then beam 4); sentences/s = 64 / time. The speed-up is the ratio of the medians, and
again round by round (the peer's time over aiayn's in the same round: median and range), which
shows how much of a ratio is the machine's spread. "Matmul FLOP/s" counts the linear
layers' multiply-adds (2 per MAC) over the decoder steps and the encoder, against the machine's
fp32 matmul peak.

CTranslate2 translates with a Marian model of the same shape (random weights, seed 0) passed
through its own converter, ``ctranslate2.converters.TransformersConverter``: the MarianMTModel is
saved in Hugging Face's Marian layout (the vocabulary plus the ``<pad>`` row Transformers appends,
which the converter's Marian loader drops again: 8,000 tokens, as aiayn's), beside a word-level
tokenizer (``tokenizer.json``, ``tokenizer_config.json`` naming ``PreTrainedTokenizerFast``)
instead of Marian's SentencePiece files, because the converter reads only the token list and
the special tokens from the tokenizer. Converted once in float32; the int8 rows load the same
model with ``compute_type="int8"`` (CTranslate2 quantizes on load). Each compute type decodes in
its own process (``_CT2_WORKER``: no torch there), with ``intra_threads`` = torch's threads and
``inter_threads=1``, one batch of all the sentences (``max_batch_size``), the sources as token
strings (id i -> ``w{i}``, EOS ``</s>`` included as in aiayn's rows), and ``min_decoding_length =
max_decoding_length = --length``: every sentence takes ``--length`` decoder steps, as aiayn's
(``min_len = max_len``: the last of its steps is the forced EOS; CTranslate2 blocks EOS
throughout), which the run checks on both sides. The worker times only ``translate_batch`` and
reports the seconds; its runs take their turn in the rounds of (ii) with the others, and the
speed-up is CTranslate2's time over aiayn's (fp32 against fp32, int8 against int8).

    python bench/decode_speed.py [--length 40] [--repeats 3] [--model runs/ding/model]
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from aiayn import ModelConfig, Transformer, engine
from aiayn.decode import beam_search, greedy_decode
from aiayn.engine import EngineOptions
from common import alternating, machine, matmul_peak, median, paired, table, write_result

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


ONEDNN = EngineOptions().onednn  # whether the engine's default products may be oneDNN's here (large weights)


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return median(times)


# CTranslate2 (issue 25): a Marian model of the same shape through CTranslate2's converter, each
# compute type decoding in a process of its own (module docstring)

_CT2_WORKER = """
import json, sys, time
import ctranslate2

setup = json.loads(sys.stdin.readline())
translator = ctranslate2.Translator(
    setup["model"], device="cpu", compute_type=setup["compute_type"], intra_threads=setup["threads"], inter_threads=1
)
sentences = setup["sentences"]
print(json.dumps({"compute_type": translator.compute_type}), flush=True)
for line in sys.stdin:
    beam, length = json.loads(line)
    penalty = {"length_penalty": 0.6} if beam > 1 else {}
    start = time.perf_counter()
    results = translator.translate_batch(
        sentences, beam_size=beam, max_batch_size=len(sentences), min_decoding_length=length,
        max_decoding_length=length, return_end_token=True, **penalty,
    )
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "lengths": sorted({len(r.hypotheses[0]) for r in results})}), flush=True)
"""


def ct2_token(i: int) -> str:
    """The token string of id ``i`` in the converted model's vocabulary (aiayn's special ids)."""
    return {0: "<blank>", 1: "<s>", 2: "</s>", 3: "<unk>"}.get(i, f"w{i}")


def ctranslate2_model(directory: Path) -> str:
    """A random Marian model of aiayn's shape, converted by ``TransformersConverter`` into
    ``directory/ct2`` (float32); returns that path."""
    from ctranslate2.converters import TransformersConverter
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import MarianMTModel

    config = marian().config  # the shape of the Marian rows, in Hugging Face's Marian layout:
    config.vocab_size = config.decoder_vocab_size = VOCAB + 1  # the <pad> row last
    config.pad_token_id = config.decoder_start_token_id = VOCAB
    torch.manual_seed(0)
    MarianMTModel(config).eval().save_pretrained(directory / "hf")
    tokens = [ct2_token(i) for i in range(VOCAB)] + ["<pad>"]
    tokenizer = Tokenizer(WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    tokenizer.save(str(directory / "hf" / "tokenizer.json"))
    specials = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    (directory / "hf" / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **specials})
    )
    out = TransformersConverter(str(directory / "hf")).convert(str(directory / "ct2"), force=True)
    vocabulary = json.loads((Path(out) / "shared_vocabulary.json").read_text())
    assert len(vocabulary) == VOCAB, len(vocabulary)  # the converter dropped the <pad> row again
    return out


class CTranslate2Process:
    """A CTranslate2 ``Translator`` in a process of its own, holding ``sentences``; ``(beam)``
    translates them all and returns ``translate_batch``'s seconds (as timed in that process)."""

    def __init__(self, model: str, compute_type: str, threads: int, sentences: list[list[str]], length: int):
        self.length = length
        self.process = subprocess.Popen(
            [sys.executable, "-c", _CT2_WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        setup = {"model": model, "compute_type": compute_type, "threads": threads, "sentences": sentences}
        self.compute_type = self._ask(setup)["compute_type"]

    def _ask(self, message) -> dict:
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the CTranslate2 process ended (exit status {self.process.wait()})")
        return json.loads(line)

    def __call__(self, beam: int) -> float:
        reply = self._ask([beam, self.length])
        if reply["lengths"] != [self.length]:  # every sentence: --length tokens, no EOS
            raise RuntimeError(f"CTranslate2 output lengths {reply['lengths']}, not {self.length}")
        return float(reply["seconds"])

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def ctranslate2_processes(src: torch.Tensor, length: int) -> dict[str, CTranslate2Process] | None:
    """CTranslate2 fp32 and int8 processes holding ``src`` as token strings, or None (printing
    why) where ctranslate2 or transformers is not installed."""
    missing = [name for name in ("ctranslate2", "transformers") if importlib.util.find_spec(name) is None]
    if missing:
        print(f"CTranslate2 rows skipped: {', '.join(missing)} not installed (pip install -e '.[bench]')")
        return None
    import ctranslate2

    sentences = [[ct2_token(i) for i in row if i != 0] for row in src.tolist()]  # up to EOS, no padding
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="aiayn-ct2-") as tmp:
        model = ctranslate2_model(Path(tmp))
        processes = {
            weights: CTranslate2Process(model, compute_type, threads, sentences, length)
            for weights, compute_type in (("fp32", "float32"), ("int8", "int8"))
        }  # loaded: the directory may go
    print(
        f"CTranslate2 {ctranslate2.__version__}: intra_threads={threads}, inter_threads=1, compute types "
        + ", ".join(p.compute_type for p in processes.values()),
        flush=True,
    )
    return processes


def check_aiayn_steps(model: Transformer, src: torch.Tensor, length: int) -> None:
    """aiayn's outputs with ``min_len = max_len = length`` take ``length`` decoder steps: ``length - 1``
    tokens and the forced EOS (greedy and beam 4, on two sentences)."""
    eos = model.config.eos_id
    out = greedy_decode(model, src[:2], max_len=length, min_len=length)
    assert out.size(1) == length and bool((out[:, -1] == eos).all()), out
    hyps = beam_search(model, src[:2], beam=4, max_len=length, min_len=length)
    assert all(len(h[0].tokens) == length - 1 for h in hyps), [len(h[0].tokens) for h in hyps]


@torch.no_grad()
def main() -> None:
    global SENTENCES  # --sentences
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=40, help="output tokens per sentence (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per row (median; default %(default)s)")
    parser.add_argument("--model", help="a trained model directory: also compare fp32 and int8 on --split")
    parser.add_argument("--data", default="data/ding", help="with --model: {split}.de/.en files (%(default)s)")
    parser.add_argument("--split", default="test", help="with --model: the split (default %(default)s)")
    parser.add_argument("--skip-marian", action="store_true", help="no Marian generate rows")
    parser.add_argument("--skip-ctranslate2", action="store_true", help="no CTranslate2 rows")
    parser.add_argument("--sentences", type=int, default=SENTENCES, help="source sentences (default %(default)s)")
    parser.add_argument("--bf16", action="store_true", help="add the paper's model in bfloat16 to (ii) and (iv)")
    parser.add_argument("--name", default="decode_speed", help="the result's name (bench/results/NAME.json)")
    args = parser.parse_args()
    SENTENCES = args.sentences
    if not args.skip_marian and importlib.util.find_spec("transformers") is None:
        parser.error("the peer needs Hugging Face transformers: pip install transformers (or --skip-marian)")
    L = args.length
    info = machine()
    peak = matmul_peak()
    print(f"{info['cpu']}, {info['torch_threads']} threads, torch {info['torch']}; peak {peak / 1e9:.1f} GFLOP/s")
    src = sources(torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    paper = Transformer(ModelConfig.base(VOCAB, P_drop=0.0)).eval()  # the paper's modules, unprepared
    model = engine.prepare(paper)
    int8 = engine.prepare(paper, quantize="int8")
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
    recompute = timed(lambda: greedy_decode(paper, src, max_len=L, min_len=L, use_cache=False), 1)
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
    # the same searches on the paper's model, and on the engine with MKL's products
    runs["module greedy"] = lambda: greedy_decode(paper, src, max_len=L, min_len=L)
    runs["module beam"] = lambda: beam_search(paper, src, beam=4, max_len=L, min_len=L)
    if args.bf16:
        bf16 = copy.deepcopy(paper).to(torch.bfloat16)
        runs["bf16 greedy"] = lambda: greedy_decode(bf16, src, max_len=L, min_len=L)
        runs["bf16 beam"] = lambda: beam_search(bf16, src, beam=4, max_len=L, min_len=L)
    if ONEDNN:
        mkl = engine.prepare(paper, options=EngineOptions(gemm="mkl"))
        runs["mkl greedy"] = lambda: greedy_decode(mkl, src, max_len=L, min_len=L)
        runs["mkl beam"] = lambda: beam_search(mkl, src, beam=4, max_len=L, min_len=L)
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
    ct2 = None if args.skip_ctranslate2 else ctranslate2_processes(src, L)
    if ct2:
        check_aiayn_steps(model, src, L)
        for weights, process in ct2.items():
            runs[f"ct2 {weights} greedy"] = functools.partial(process, 1)
            runs[f"ct2 {weights} beam"] = functools.partial(process, 4)
    vs_ct2: list[dict] = []
    for kind, beam, title in (("greedy", 1, "greedy"), ("beam", 4, "beam 4")):
        names = (f"Marian {kind}", f"ct2 fp32 {kind}", kind, f"module {kind}", f"mkl {kind}", f"int8 {kind}",
                 f"ct2 int8 {kind}", f"bf16 {kind}")  # fmt: skip
        times = alternating({k: runs[k] for k in names if k in runs}, args.repeats)  # each round's seconds
        peer = times.get(f"Marian {kind}")
        if peer is not None:
            row(f"Marian generate {title} (fp32)", peer, beam)
        for weights, ours in (("fp32", kind), ("int8", f"int8 {kind}")):  # CTranslate2 against aiayn, same weights
            if f"ct2 {weights} {kind}" in times:
                theirs = times[f"ct2 {weights} {kind}"]
                row(f"CTranslate2 {title} ({weights})", theirs, beam)
                vs_ct2.append({
                    "search": title, "weights": weights, "aiayn_seconds": round(median(times[ours]), 3),
                    "ctranslate2_seconds": round(median(theirs), 3),
                    "speedup": round(median(theirs) / median(times[ours]), 2),
                    "speedup_by_round": paired(theirs, times[ours]),
                })  # fmt: skip
        row(f"aiayn {title} (fp32)", times[kind], beam, peer=peer)
        row(f"aiayn {title} (fp32, the paper's model unprepared)", times[f"module {kind}"], beam, peer=peer)
        if f"mkl {kind}" in times:
            row(f"aiayn {title} (fp32, MKL's products)", times[f"mkl {kind}"], beam, peer=peer)
        row(f"aiayn {title} (int8)", times[f"int8 {kind}"], beam, peer=peer)
        if f"bf16 {kind}" in times:
            row(f"aiayn {title} (bf16 weights, the paper's model unprepared)", times[f"bf16 {kind}"], beam, peer=peer)
    if ct2:
        for process in ct2.values():
            process.close()
    result = {
        "machine": info, "matmul_peak_flops": peak, "cpu_products": "auto: onednn >= 512x512" if ONEDNN else "mkl",
        "length": L, "sentences": SENTENCES, "repeats": args.repeats,
        "rows": rows,
    }  # fmt: skip
    if ct2:
        import ctranslate2

        result["ctranslate2"] = {
            "version": ctranslate2.__version__, "intra_threads": torch.get_num_threads(), "inter_threads": 1,
            "compute_types": {w: p.compute_type for w, p in ct2.items()}, "rows": vs_ct2,
        }  # fmt: skip
    if args.model:
        result["ding"] = trained(args)
    print(table(rows, COLUMNS))
    if vs_ct2:
        for r in vs_ct2:
            r["by_round"] = "{median} ({min}-{max})".format(**r["speedup_by_round"])
        print("\naiayn against CTranslate2 (speed-up: CTranslate2's seconds over aiayn's, same weights):")
        print(table(vs_ct2, CT2_COLUMNS))
    print(f"written {write_result(args.name, result)}")


COLUMNS = [
    ("name", "decoding (64 sentences)"), ("seconds", "seconds"), ("sent_per_s", "sentences/s"),
    ("ms_per_step", "ms/step"), ("matmul_fraction_of_peak", "matmul / peak"), ("vs_peer", "speed-up vs peer"),
    ("by_round", "by round: median (range)"),
]  # fmt: skip
CT2_COLUMNS = [
    ("search", "search"), ("weights", "weights"), ("aiayn_seconds", "aiayn s"),
    ("ctranslate2_seconds", "CTranslate2 s"), ("speedup", "aiayn speed-up"), ("by_round", "by round: median (range)"),
]  # fmt: skip


def trained(args: argparse.Namespace) -> dict:
    """fp32 against int8 on a real test split: sentences/s and BLEU, greedy and beam 4. The
    decoders of a search (fp32 on the engine, fp32 on the paper's model, int8, fp32 with MKL's
    products where the default is oneDNN's, and with ``--bf16`` the paper's model in bfloat16)
    alternate, as in (ii); BLEU is scored on each one's first (warm-up) output."""
    from aiayn import Translator
    from aiayn.evaluate import score_translations

    data = Path(args.data)
    sources_text = (data / f"{args.split}.de").read_text(encoding="utf-8").splitlines()
    references = (data / f"{args.split}.en").read_text(encoding="utf-8").splitlines()
    translators = {
        "flat": Translator.from_pretrained(args.model, alone=True),
        "modules": Translator.from_pretrained(args.model, alone=True),
        "int8": Translator.from_pretrained(args.model, quantize="int8", alone=True),
        "flat, MKL's products": Translator.from_pretrained(args.model, options=EngineOptions(gemm="mkl"), alone=True),
    }
    translators["modules"].model = Transformer.from_pretrained(args.model).eval()  # the paper's model, unprepared
    if args.bf16:
        translators["bf16"] = Translator.from_pretrained(args.model, alone=True)
        translators["bf16"].model = Transformer.from_pretrained(args.model).eval().to(torch.bfloat16)
    rounds = min(args.repeats, 3)
    out = []
    for beam in (1, 4):
        hypotheses: dict[str, list[str]] = {}
        decoders = {"fp32 flat": (None, "flat"), "fp32 modules": (None, "modules"), "int8 flat": ("int8", "int8")}
        if ONEDNN:
            decoders["fp32 mkl"] = (None, "flat, MKL's products")
        if args.bf16:
            decoders["bf16 modules"] = ("bf16", "bf16")
        fns = {
            name: _decoder(translators[which], sources_text, beam, hypotheses, name)
            for name, (_, which) in decoders.items()
        }
        times = alternating(fns, rounds)
        for name, (quantize, step) in decoders.items():
            step = {"int8": "flat", "bf16": "modules"}.get(step, step)
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


def _decoder(translator, sources_text: list[str], beam: int, hypotheses: dict, name: str):
    """A timed call translating ``sources_text`` that keeps its first output in
    ``hypotheses[name]`` and checks every later one against it."""
    run = functools.partial(translator.translate, sources_text, beam=beam)

    def fn():
        out = run()
        if hypotheses.setdefault(name, out) != out:
            raise RuntimeError(f"{name}, beam {beam}: a repeated translation differs from the first")

    return fn


if __name__ == "__main__":
    main()
