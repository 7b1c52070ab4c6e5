"""The ``aiayn`` command line: a thin layer over functions a user can import.

aiayn data ding --out data/ding
aiayn train --config configs/ding.yaml --out runs/ding [--resume] [--train.max_steps 100 ...]
aiayn evaluate --model runs/ding/model --src data/ding/test.de --ref data/ding/test.en
aiayn translate --model runs/ding/model "Es war purer Zufall."
aiayn evaluate --model runs/ding/model --model runs/ding2/model --split dev   (an ensemble)
aiayn generate --model runs/lm/model "The weather" --temperature 0.8 --top-p 0.9 --seed 1
aiayn fill-mask --model runs/mlm/model "Das ist ein <mask> Haus."
aiayn plot runs/ding
aiayn plot pe | aiayn plot lr --config configs/ding.yaml
aiayn attention --model runs/ding/model "Es war purer Zufall." --kind dec,cross --layers 0,4 --heads 0,1 [--max-len 20]
aiayn average runs/ding/checkpoints/step_* --out runs/ding/averaged
aiayn copy-task
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import math
import os
import sys
import time
import warnings
from collections.abc import Iterable
from pathlib import Path

__all__ = ["main"]


def _copy_task(args: argparse.Namespace) -> int:
    import torch

    from .decode import greedy_decode
    from .tasks import CopyTask, copy_task_accuracy, copy_task_batch, train_copy_task

    task = CopyTask(steps=args.steps, batch_size=args.batch_size, seed=args.seed)
    print(f"copy task: {dataclasses.asdict(task)}")
    start = time.perf_counter()
    model, losses = train_copy_task(task, progress=True)
    seconds = time.perf_counter() - start
    accuracy = copy_task_accuracy(model, task)
    print(
        f"trained {model.num_parameters():,} parameters for {task.steps} steps in {seconds:.1f} s; "
        f"final loss {losses[-1]:.3f}"
    )
    print(f"greedy exact match on 256 new sequences: {accuracy:.1%}")
    src, _ = copy_task_batch(3, task.length, task.vocab_size, torch.Generator().manual_seed(args.seed + 1))
    for source, output in zip(src.tolist(), greedy_decode(model, src, max_len=task.length + 1).tolist(), strict=True):
        output = output[: output.index(2) + 1] if 2 in output else output  # up to and with EOS (id 2)
        print(f"  {' '.join(map(str, (x for x in source if x)))}  ->  {' '.join(map(str, output))}")
    if args.out:
        model.save_pretrained(args.out)
        print(f"saved to {args.out}")
    return 0


def _data_ding(args: argparse.Namespace) -> int:
    from .data.ding import prepare_ding

    counts = prepare_ding(args.out, path=args.ding_path, cache_dir=args.cache_dir)
    for key, value in counts.items():
        print(f"{key:>12}: {value:,}" if isinstance(value, int) else f"{key:>12}: {value}")
    print(f"written to {args.out}")
    return 0


def _train(args: argparse.Namespace, overrides: list[str]) -> int:
    from .train.config import RunConfig, parse_overrides
    from .train.trainer import train

    run = RunConfig.from_yaml(args.config, parse_overrides(overrides))
    train(run, args.out, resume=args.resume, device=args.device)
    return 0


def _load_model(directory: str, architecture: str = "Transformer"):
    """(model in eval mode, tokenizer) from a model directory; the wrong architecture is an error."""
    from . import model as models
    from .data.tokenizer import load_tokenizer

    model = getattr(models, architecture).from_pretrained(directory).eval()
    return model, load_tokenizer(directory, model.config.vocab_size, model.config.tgt_vocab_size)


def _read_lines(path: str) -> list[str]:
    """The lines of a UTF-8 file, split on ``\\n`` only (``aiayn.data.corpus.read_lines``)."""
    from .data.corpus import read_lines

    return list(read_lines(path))


def _one_line(text: str) -> str:
    """A translation as one output line (a model can produce line-break characters)."""
    return " ".join(text.splitlines())


def _translator(args: argparse.Namespace):
    from .engine import EngineOptions
    from .translator import Translator

    # the engine's choices: defaults, or what the AIAYN_* variables ask for (aiayn/engine/options.py)
    options = EngineOptions.from_environ()
    device = args.device or "cpu"
    return Translator.from_pretrained(
        args.model, device, args.quantize, options, alone=args.alone, knn=not args.no_knn, retrieval=_retrieval(args)
    )


def _retrieval(args: argparse.Namespace) -> dict[str, float]:
    """The kNN-MT settings given on the command line, over the datastore's own."""
    if args.knn_lambda is not None and args.no_knn:
        raise ValueError("--knn-lambda sets the datastore's weight, --no-knn decodes without it: give one")
    return {"lam": args.knn_lambda} if args.knn_lambda is not None else {}


def _knn_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-knn", action="store_true", help="decode without the model directory's kNN-MT datastore (train.knn)"
    )
    parser.add_argument(
        "--knn-lambda", type=_fraction, metavar="λ", help="the weight of the datastore's neighbours (its own: 0.3)"
    )


def _alone(directory: str, command: str) -> None:
    """Say so when ``command``, which takes one model, is given one of a train.members ensemble."""
    from .translator import ENSEMBLE_NAME

    if (Path(directory) / ENSEMBLE_NAME).exists():
        print(f"{directory} is the first model of an ensemble ({ENSEMBLE_NAME}); {command} takes it alone")


def _search(args: argparse.Namespace) -> dict:
    return dict(
        beam=args.beam,
        alpha=args.alpha,
        max_tokens=args.max_tokens,
        max_len_a=args.max_len_a,
        no_repeat_ngram_size=args.no_repeat_ngram_size,
    )


def _evaluate(args: argparse.Namespace) -> int:
    from .decode import Ensemble
    from .evaluate import score_translations

    if (args.src is None) != (args.ref is None):
        raise ValueError("give both --src and --ref, or --split")
    if args.src is None:
        args.src = str(Path(args.data) / f"{args.split}.{args.src_lang}")
        args.ref = str(Path(args.data) / f"{args.split}.{args.tgt_lang}")
    translator = _translator(args)
    sources, references = _read_lines(args.src), _read_lines(args.ref)
    if len(sources) != len(references):
        raise ValueError(f"{args.src} has {len(sources)} lines but {args.ref} has {len(references)}")
    if not sources:
        raise ValueError(f"{args.src} and {args.ref} are empty: nothing to translate and score")
    start = time.perf_counter()
    hypotheses = [_one_line(h) for h in translator.translate(sources, progress=True, **_search(args))]
    seconds = time.perf_counter() - start
    scores = score_translations(hypotheses, references)
    search = "greedy" if args.beam == 1 else f"beam {args.beam}, alpha {args.alpha}"
    if isinstance(translator.model, Ensemble):
        search += f", an ensemble of {len(translator.model.members)} models"
    int8 = ", int8" if args.quantize else ""
    ngram = f", no n-gram of {args.no_repeat_ngram_size} twice" if args.no_repeat_ngram_size else ""
    print(f"{len(sources)} sentences of {args.src} translated ({search}{int8}{ngram}) in {seconds:.1f} s")
    print(scores)
    if args.output:  # before the perplexity, so that a failure there loses no translations
        Path(args.output).write_text("".join(h + "\n" for h in hypotheses), encoding="utf-8")
    print(f"perplexity of the references: {translator.perplexity(sources, references, args.max_tokens):.2f}")
    for source, hypothesis, reference in list(zip(sources, hypotheses, references, strict=True))[: args.samples]:
        print(f"\n  source:      {source}\n  translation: {hypothesis}\n  reference:   {reference}")
    return 0


def _translate(args: argparse.Namespace) -> int:
    from .data.corpus import count_lines, read_lines

    if args.sentences and args.input:
        raise ValueError("give sentences as arguments or --input FILE, not both")
    translator = _translator(args)
    with contextlib.ExitStack() as stack:
        interactive = False
        if args.sentences:
            sources, total = args.sentences, len(args.sentences)
        elif args.input:  # opened now: a missing file or a directory fails before any output
            stream = stack.enter_context(open(args.input, "rb"))
            # lines counted for the progress bar only where the file can be read twice (not a pipe)
            total = count_lines(args.input) if os.path.isfile(args.input) else None
            sources = read_lines(stream, args.input)
        else:  # read as it comes: a pipe is translated while it is being written
            if sys.stdin is None:
                raise ValueError("no input: give sentences as arguments, --input FILE, or lines on stdin (closed)")
            stdin = getattr(sys.stdin, "buffer", None) or (line.encode("utf-8") for line in sys.stdin)
            sources, total, interactive = read_lines(stdin, "<stdin>"), None, sys.stdin.isatty()
        return _print_translations(translator, sources, total, interactive, args)


def _print_translations(translator, sources: Iterable[str], total: int | None, interactive: bool, args) -> int:
    """Print the translations of ``sources`` as each buffer is done (``Translator.translate_stream``)."""
    buffer_size = args.buffer_size if args.buffer_size is not None else (1 if interactive else 1000)
    # a bar only for files and pipes, and not on the terminal the translations are printed to
    progress = not (args.sentences or interactive or total == 0 or getattr(sys.stdout, "isatty", bool)())
    results = translator.translate_stream(
        sources, buffer_size, progress=progress, total=total, nbest=args.nbest, **_search(args)
    )
    for i, result in enumerate(results):
        if args.nbest > 1:
            rows = [f"{i}\t{score:.4f}\t{_one_line(text).replace(chr(9), ' ')}" for text, score in result]
        else:
            rows = [_one_line(result)]
        try:
            print("\n".join(rows), flush=True)
        except BrokenPipeError:  # stdout's reader went away (``aiayn translate ... | head``): stop quietly
            devnull = os.open(os.devnull, os.O_WRONLY)  # Python flushes stdout at exit, which would fail again
            with contextlib.suppress(OSError, ValueError, AttributeError):
                os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            return 1
    return 0


def _generate(args: argparse.Namespace) -> int:
    from .decode import generate_ids

    model, tokenizer = _load_model(args.model, "DecoderOnly")
    for prompt in args.prompts:
        ids = tokenizer.encode(prompt)
        samples = generate_ids(
            model, ids, args.num_samples, args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed
        )
        for sample in samples:
            print(tokenizer.decode(ids + sample))
    return 0


def _fill_mask(args: argparse.Namespace) -> int:
    from .decode import fill_mask

    model, tokenizer = _load_model(args.model, "EncoderOnly")
    for text in args.texts:
        ids = tokenizer.encode(text)
        if tokenizer.mask_id not in ids:
            raise ValueError(f"no <mask> in {text!r}")
        masks = [i for i, token in enumerate(ids) if token == tokenizer.mask_id]
        print(text)
        results = fill_mask(model, ids, tokenizer.mask_id, args.top_k)
        for n, (position, candidates) in enumerate(zip(masks, results, strict=True), start=1):
            if len(masks) > 1:
                print(f"  <mask> {n}:")
            for token, p in candidates:
                filler = tokenizer.decode([token]) or tokenizer.hf.id_to_token(token)  # a special token by name
                sentence = tokenizer.decode([*ids[:position], token, *ids[position + 1 :]]) if len(masks) == 1 else ""
                print(f"  {p:6.1%}  {filler:<16} {sentence}".rstrip())
    return 0


def _plot(args: argparse.Namespace) -> int:
    from . import viz

    if len(args.what) > 1:
        out = args.out or "runs.png"
        viz.plot_runs(args.what, out)
        print(f"written {out}")
        return 0
    args.what = args.what[0]
    what = args.what if args.what in ("pe", "lr") else "run"
    for owner, names in {"pe": ("length", "d_model"), "lr": ("config", "steps")}.items():
        for name in names:
            if owner != what and getattr(args, name) is not None:
                raise ValueError(f"--{name.replace('_', '-')} belongs to `aiayn plot {owner}`")
    if what == "run":
        out = viz.plot_run(args.what, args.out)
    elif what == "pe":
        out = args.out or "pe.png"
        options = {"length": args.length, "d_model": args.d_model}
        viz.plot_positional_encoding(**{k: v for k, v in options.items() if v is not None}, out=out)
    else:
        from .train.config import RunConfig

        run = RunConfig.from_yaml(args.config) if args.config else RunConfig()  # no config: the paper's base
        out = args.out or "lr.png"
        d_model = run.model_config(run.train.vocab_size).d_model
        steps = args.steps if args.steps is not None else run.train.max_steps
        train = run.train
        budget = "" if steps is not None or not train.cooldown else "standing for the run's max_time or max_epochs"
        viz.plot_schedule(
            d_model, train.warmup, train.lr_scale, steps=steps, out=out, cooldown=train.cooldown, budget=budget
        )  # fmt: skip
    print(f"written {out}")
    return 0


def _attention(args: argparse.Namespace) -> int:
    from .viz import plot_attention, translation_attention

    _alone(args.model, "attention")
    model, tokenizer = _load_model(args.model)
    maps = translation_attention(
        model, tokenizer, args.sentence, max_len=args.max_len, beam=args.beam, alpha=args.alpha
    )
    plot_attention(maps, kinds=args.kind, layers=args.layers, heads=args.heads, out=args.out)
    print(f"{maps.sentence}  ->  {maps.translation}")
    print(f"written {args.out}")
    return 0


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, e.g. 0,2") from None


def _int_at_least(minimum: int, words: str):
    """An argparse type: an integer >= ``minimum``; ``words`` name it in the error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is not {words}")
        return value

    return parse


_positive_int = _int_at_least(1, "a positive integer")
_nonnegative_int = _int_at_least(0, "an integer >= 0")


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def _fraction(text: str) -> float:
    value = _finite_float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number from 0 to 1")
    return value


def _attention_kinds(text: str) -> list[str]:
    from .viz import ATTENTION_KINDS

    kinds = text.split(",")
    if not all(k in ATTENTION_KINDS for k in kinds):
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {','.join(ATTENTION_KINDS)}, comma-separated")
    return kinds


def _average(args: argparse.Namespace) -> int:
    from .average import average_checkpoints
    from .data.tokenizer import load_tokenizer, save_tokenizer, tokenizer_contents, tokenizer_files

    model = average_checkpoints(args.checkpoints)
    # the checkpoints' tokenizers must agree: the averaged model reads ids the same way
    tokenizer, first, files = None, None, None
    for path in args.checkpoints:
        names = tokenizer_files(path)
        if all((Path(path) / name).is_file() for name in names):
            contents = tokenizer_contents(path)
            if tokenizer is None:
                tokenizer, first, files = load_tokenizer(path), Path(path) / names[0], contents
            elif contents != files:
                raise ValueError(f"{Path(path) / names[0]}: another tokenizer than {first}")
    model.save_pretrained(args.out, averaged=[str(p) for p in args.checkpoints])
    if tokenizer is not None:
        save_tokenizer(tokenizer, args.out)
    print(f"averaged {len(args.checkpoints)} checkpoints into {args.out}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    if len(args.model) > 1:  # the explorer shows one model's attention
        raise ValueError("serve takes one --model (a run of train.members serves its ensemble.json's members too)")
    args.model = args.model[0]
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise ValueError("aiayn serve needs starlette and uvicorn: pip install 'aiayn[serve]'") from None
    from .decode import Ensemble
    from .engine import EngineOptions
    from .serve import ServeOptions, load, model_thread, serve

    options = EngineOptions.from_environ()
    executor = model_thread()  # torch runs on this thread only (serve.model_thread)
    device = args.device or "cpu"
    loading = executor.submit(
        load, args.model, device, args.quantize, options, args.alone, not args.no_knn, _retrieval(args)
    )
    translator, model = loading.result()
    if isinstance(translator.model, Ensemble):
        count = len(translator.model.members)
        print(
            f"{args.model}: an ensemble of {count} (ensemble.json): /translate decodes them together, as aiayn "
            "translate does; the explorer's attention is this model's (--alone: this model only)"
        )
    options = ServeOptions(max_texts=args.max_texts, max_chars=args.max_chars, max_queue=args.max_queue)
    serve(translator, model, args.host, args.port, options, executor)
    return 0


def _convert(args: argparse.Namespace) -> int:
    from .interop import convert_marian

    out = convert_marian(args.src, args.out)
    print(f"converted {args.src} into {out}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from .interop import export_marian

    out = export_marian(args.model, args.out)
    print(f"exported {args.model} into {out}")
    return 0


def _add_search_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--beam", type=_positive_int, default=4, help="beam size, 1 = greedy (default %(default)s, §6.1)"
    )
    parser.add_argument("--alpha", type=_finite_float, default=0.6, help="length penalty alpha (default %(default)s)")
    parser.add_argument(
        "--max-len-a",
        type=_nonnegative_int,
        default=50,
        help="outputs may be this many tokens longer than the source (%(default)s)",
    )
    parser.add_argument(
        "--max-tokens", type=_positive_int, default=4096, help="source tokens per batch (default %(default)s)"
    )
    parser.add_argument(
        "--no-repeat-ngram-size",
        type=_nonnegative_int,
        default=0,
        metavar="N",
        help="no n-gram of N tokens twice in an output (default 0: off; not in the paper)",
    )
    parser.add_argument("--quantize", choices=["int8"], help="dynamic int8 quantization of the Linear layers (CPU)")
    parser.add_argument("--device", help="cpu (default) or cuda")
    parser.add_argument(
        "--alone", action="store_true", help="a model of train.members: that model only, not its ensemble.json's"
    )
    _knn_arguments(parser)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .serve import ServeOptions as ServeDefaults
    from .tasks import CopyTask

    parser = argparse.ArgumentParser(prog="aiayn", description="The Transformer of 'Attention Is All You Need'.")
    parser.add_argument("--version", action="version", version=f"aiayn {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    data = sub.add_parser("data", help="prepare a corpus").add_subparsers(dest="corpus", required=True)
    ding = data.add_parser("ding", help="the Ding German-English dictionary's sentence pairs, split train/dev/test")
    ding.add_argument("--out", required=True, help="directory for {train,dev,test,phrases}.{de,en} and nouns.tsv")
    ding.add_argument(
        "--ding-path", help="the Ding de-en file (default: $AIAYN_DING_PATH, /usr/share/trans/de-en, download)"
    )
    ding.add_argument("--cache-dir", help="where a downloaded Ding file is kept (default ~/.cache/aiayn)")
    ding.set_defaults(func=_data_ding)

    train = sub.add_parser(
        "train",
        help="train a model: translation, or a causal or masked language model (train.task)",
        description="Train with a YAML preset; override any field with --SECTION.NAME VALUE, "
        "e.g. --train.max_steps 100 --model.N 3.",
    )
    train.add_argument("--config", required=True, help="YAML preset, e.g. configs/ding.yaml")
    train.add_argument("--out", required=True, help="run directory: checkpoints, metrics.jsonl, model/")
    train.add_argument(
        "--resume", action="store_true", help="continue from the run's latest checkpoint (afresh if it has none)"
    )
    train.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    train.set_defaults(func=_train, takes_overrides=True)

    evaluate = sub.add_parser(
        "evaluate", help="translate a test set; print sacreBLEU BLEU and chrF and the references' perplexity"
    )
    evaluate.add_argument(
        "--model", required=True, action="append", metavar="DIR",
        help="model directory (config.json, model.safetensors, tokenizer.json); given again (--model A --model B): "
        "an ensemble, the mean of their probabilities (their tokenizers identical: train.tokenizer)",
    )  # fmt: skip
    evaluate.add_argument("--split", default="test", help="with --data: the split to score (default %(default)s)")
    evaluate.add_argument("--data", default="data/ding", help="directory of {split}.{lang} files (%(default)s)")
    evaluate.add_argument("--src-lang", default="de", help="source language suffix (default %(default)s)")
    evaluate.add_argument("--tgt-lang", default="en", help="target language suffix (default %(default)s)")
    evaluate.add_argument("--src", help="source sentences, one per line (instead of --split)")
    evaluate.add_argument("--ref", help="reference translations, one per line (with --src)")
    evaluate.add_argument("--output", help="write the translations here")
    evaluate.add_argument("--samples", type=_nonnegative_int, default=0, help="print this many example translations")
    _add_search_arguments(evaluate)
    evaluate.set_defaults(func=_evaluate)

    translate = sub.add_parser(
        "translate", help="translate sentences (arguments, --input FILE, or stdin), one output line per input line"
    )
    translate.add_argument(
        "--model", required=True, action="append", metavar="DIR",
        help="model directory; given again (--model A --model B): an ensemble, as evaluate's",
    )  # fmt: skip
    translate.add_argument("--input", help="a file with one sentence per line")
    translate.add_argument(
        "--nbest",
        type=_positive_int,
        default=1,
        help="print the N best as 'INDEX<TAB>SCORE<TAB>TRANSLATION' (default 1); an empty input line gives "
        "one row, 'INDEX<TAB>0.0000<TAB>'",
    )
    translate.add_argument(
        "--buffer-size",
        type=_positive_int,
        metavar="N",
        help="read and translate N lines at a time, printing each buffer's results before reading on "
        "(default 1000; 1 when reading what is typed at a terminal)",
    )
    translate.add_argument("sentences", nargs="*", help="sentences to translate")
    _add_search_arguments(translate)
    translate.set_defaults(func=_translate)

    generate = sub.add_parser("generate", help="continue prompts with a decoder-only language model (sampling)")
    generate.add_argument("--model", required=True, help="model directory of a DecoderOnly (train.task lm)")
    generate.add_argument("prompts", nargs="+", help='texts to continue ("" for unconditional samples)')
    generate.add_argument("--max-new-tokens", type=int, default=40, help="the most new tokens (default %(default)s)")
    generate.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default %(default)s)")
    generate.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = all (default)")
    generate.add_argument(
        "--top-p", type=float, default=0.9, help="keep the smallest set with this mass; 1 = all (default %(default)s)"
    )
    generate.add_argument("--seed", type=int, help="random seed, for reproducible samples")
    generate.add_argument("--num-samples", type=int, default=1, help="samples per prompt (default %(default)s)")
    generate.set_defaults(func=_generate)

    fill = sub.add_parser("fill-mask", help="the most likely fillers of <mask> with an encoder-only masked LM")
    fill.add_argument("--model", required=True, help="model directory of an EncoderOnly (train.task mlm)")
    fill.add_argument("texts", nargs="+", help='texts with <mask>, e.g. "Das ist ein <mask> Haus."')
    fill.add_argument("--top-k", type=int, default=5, help="fillers per mask (default %(default)s)")
    fill.set_defaults(func=_fill_mask)

    plot = sub.add_parser(
        "plot",
        help="draw a run's curves, the positional encodings or a learning-rate schedule to PNG",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="aiayn plot RUN_DIR                          a run's loss, learning rate, perplexity and BLEU\n"
        "aiayn plot RUN_DIR RUN_DIR ... [--out PNG]  several runs' dev perplexity side by side (runs.png)\n"
        "aiayn plot pe [--length L] [--d-model D]    the sinusoidal positional encodings (§3.5)\n"
        "aiayn plot lr [--config FILE] [--steps N]   the learning-rate schedule (§5.3) of a config\n\n"
        "pe and lr are reserved words: write a run directory of that name as ./pe or ./lr.",
    )
    plot.add_argument(
        "what", nargs="+", metavar="RUN_DIR|pe|lr", help="a run directory (with metrics.jsonl), several, pe or lr"
    )
    plot.add_argument("--out", metavar="PNG", help="PNG path (default RUN_DIR/curves.png, runs.png, pe.png, lr.png)")
    pe = plot.add_argument_group("positional encodings (plot pe)")
    pe.add_argument("--length", type=int, metavar="L", help="positions, the rows (default 100)")
    pe.add_argument("--d-model", type=int, metavar="D", help="dimensions, the columns (default 64)")
    lr = plot.add_argument_group("learning-rate schedule (plot lr)")
    lr.add_argument(
        "--config", metavar="FILE", help="YAML preset: its d_model, warmup, lr_scale (default: the paper's)"
    )
    lr.add_argument(
        "--steps",
        type=_positive_int,
        metavar="N",
        help="steps on the x axis (default train.max_steps, else 10 × warmup)",
    )
    plot.set_defaults(func=_plot)

    attention = sub.add_parser(
        "attention",
        help="translate a sentence and draw every head's attention maps to PNG",
        description="Translate SENTENCE (greedily, or with --beam) and draw the attention weights the model used: "
        "a grid with a row per kind and layer and a column per head, the tokens on both axes.",
    )
    attention.add_argument("--model", required=True, metavar="DIR", help="model directory")
    attention.add_argument("sentence", help="the source sentence")
    attention.add_argument("--out", default="attention.png", metavar="PNG", help="PNG path (default %(default)s)")
    attention.add_argument(
        "--kind",
        type=_attention_kinds,
        metavar="KINDS",
        default=["enc", "dec", "cross"],
        help="enc (encoder self-attention), dec (decoder self-attention), cross (encoder-decoder attention); "
        "comma-separated (default: all three)",
    )
    attention.add_argument(
        "--layers", type=_int_list, metavar="LIST", help="layers from 0, comma-separated, e.g. 0,2 (default: all)"
    )
    attention.add_argument(
        "--heads", type=_int_list, metavar="LIST", help="heads from 0, comma-separated, e.g. 0,1 (default: all)"
    )
    attention.add_argument(
        "--max-len",
        type=_positive_int,
        metavar="N",
        help="the most output tokens, EOS included: the rows of the decoder maps (default: source length + 50)",
    )
    attention.add_argument("--beam", type=_positive_int, default=1, help="beam size, 1 = greedy (default %(default)s)")
    attention.add_argument("--alpha", type=float, default=0.6, help="length penalty alpha (default %(default)s)")
    attention.set_defaults(func=_attention)

    average = sub.add_parser("average", help="average the parameters of checkpoints (§6.1)")
    average.add_argument("checkpoints", nargs="+", help="checkpoint directories")
    average.add_argument("--out", required=True, help="directory for the averaged model")
    average.set_defaults(func=_average)

    server = sub.add_parser(
        "serve", help="an HTTP translation server (POST /translate) and an attention explorer (GET /)"
    )
    server.add_argument(
        "--model",
        required=True,
        action="append",
        metavar="DIR",
        help="model directory (one; of a run of train.members: its ensemble, the explorer showing this model)",
    )
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    server.add_argument("--port", type=int, default=8000, help="port (default %(default)s)")
    defaults = ServeDefaults()
    server.add_argument(
        "--max-texts", type=_positive_int, default=defaults.max_texts, help="texts per request (%(default)s)"
    )
    server.add_argument(
        "--max-chars", type=_positive_int, default=defaults.max_chars, help="characters per text (%(default)s)"
    )
    server.add_argument(
        "--max-queue", type=_positive_int, default=defaults.max_queue, help="texts waiting or decoding (%(default)s)"
    )
    server.add_argument("--quantize", choices=["int8"], help="dynamic int8 products (CPU)")
    server.add_argument(
        "--alone", action="store_true", help="a model of train.members: that model only, not its ensemble.json's"
    )
    _knn_arguments(server)
    server.add_argument("--device", help="cpu (default), cuda, ...")
    server.set_defaults(func=_serve)

    convert = sub.add_parser("convert", help="convert a model of another toolkit into an aiayn model directory")
    kinds = convert.add_subparsers(dest="kind", required=True)
    marian = kinds.add_parser(
        "marian",
        help="a Hugging Face Marian (OPUS-MT) model: config.json, weights, source.spm, target.spm, vocab.json",
    )
    marian.add_argument("src", help="the Hugging Face model directory (downloaded beforehand: aiayn downloads nothing)")
    marian.add_argument("out", help="the aiayn model directory to write")
    marian.set_defaults(func=_convert)

    export = sub.add_parser("export", help="write an aiayn model for another toolkit")
    targets = export.add_subparsers(dest="kind", required=True)
    to_marian = targets.add_parser(
        "marian", help="a Hugging Face Marian directory that transformers reads; post-norm models"
    )
    to_marian.add_argument("model", help="the aiayn model directory")
    to_marian.add_argument("out", help="the Hugging Face model directory to write")
    to_marian.set_defaults(func=_export)

    copy = sub.add_parser("copy-task", help="train a tiny model to copy random sequences and report its accuracy")
    defaults = CopyTask()
    copy.add_argument(
        "--steps", type=_nonnegative_int, default=defaults.steps, help="training steps (default %(default)s)"
    )
    copy.add_argument(
        "--batch-size", type=_positive_int, default=defaults.batch_size, help="sequences per step (%(default)s)"
    )
    copy.add_argument("--seed", type=int, default=defaults.seed, help="random seed (default %(default)s)")
    copy.add_argument("--out", help="save the trained model to this directory")
    copy.set_defaults(func=_copy_task)
    for command in sub.choices.values():  # so that a usage error names the command, with its usage
        command.set_defaults(command_parser=command)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "takes_overrides", False):
        getattr(args, "command_parser", parser).error(f"unrecognized arguments: {' '.join(rest)}")

    def show_warning(message, category, filename, lineno, file=None, line=None) -> None:
        print(f"aiayn {args.command}: warning: {message}", file=sys.stderr)

    class Notices(logging.Handler):  # the library's notices (a kernel being built, once): one line on stderr
        def emit(self, record: logging.LogRecord) -> None:
            print(f"aiayn {args.command}: {record.getMessage()}", file=sys.stderr)

    log, notices = logging.getLogger("aiayn"), Notices(logging.INFO)
    level = log.level
    log.addHandler(notices)
    log.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = show_warning
            if getattr(args, "takes_overrides", False):
                return args.func(args, rest)
            return args.func(args)
    except (OSError, ValueError) as e:  # a missing or unreadable file, bad input: one line, no traceback
        print(f"aiayn {args.command}: error: {e}", file=sys.stderr)
        return 1
    finally:
        log.removeHandler(notices)
        log.setLevel(level)


if __name__ == "__main__":
    sys.exit(main())
