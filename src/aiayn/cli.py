"""The ``aiayn`` command line: a thin layer over functions a user can import.

aiayn data ding --out data/ding
aiayn train --config configs/ding.yaml --out runs/ding [--resume] [--train.max_steps 100 ...]
aiayn evaluate --model runs/ding/model --src data/ding/test.de --ref data/ding/test.en
aiayn translate --model runs/ding/model "Es war purer Zufall."
aiayn plot runs/ding
aiayn average runs/ding/checkpoints/step_* --out runs/ding/averaged
aiayn copy-task
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
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


def _load_model(directory: str):
    from .data.tokenizer import TOKENIZER_NAME, Tokenizer
    from .model import Transformer

    model = Transformer.from_pretrained(directory).eval()
    return model, Tokenizer.load(Path(directory) / TOKENIZER_NAME)


def _read_lines(path: str) -> list[str]:
    try:
        return Path(path).read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e})") from None


def _evaluate(args: argparse.Namespace) -> int:
    from .decode import translate_ids
    from .evaluate import score_translations

    model, tokenizer = _load_model(args.model)
    sources, references = _read_lines(args.src), _read_lines(args.ref)
    if len(sources) != len(references):
        raise ValueError(f"{args.src} has {len(sources)} lines but {args.ref} has {len(references)}")
    start = time.perf_counter()
    hypotheses = tokenizer.decode_batch(translate_ids(model, [tokenizer.encode(s) for s in sources]))
    seconds = time.perf_counter() - start
    scores = score_translations(hypotheses, references)
    print(f"{len(sources)} sentences translated (greedy) in {seconds:.1f} s")
    print(scores)
    if args.output:
        Path(args.output).write_text("".join(h + "\n" for h in hypotheses), encoding="utf-8")
    for source, hypothesis, reference in list(zip(sources, hypotheses, references, strict=True))[: args.samples]:
        print(f"\n  source:      {source}\n  translation: {hypothesis}\n  reference:   {reference}")
    return 0


def _translate(args: argparse.Namespace) -> int:
    from .decode import translate_ids

    model, tokenizer = _load_model(args.model)
    if args.sentences:
        sources = args.sentences
    elif args.input:
        sources = _read_lines(args.input)
    else:
        sources = sys.stdin.read().splitlines()
    hypotheses = tokenizer.decode_batch(translate_ids(model, [tokenizer.encode(s) for s in sources]))
    for source, hypothesis in zip(sources, hypotheses, strict=True):
        print(hypothesis if source.strip() else "")
    return 0


def _plot(args: argparse.Namespace) -> int:
    from .viz import plot_run

    print(f"written {plot_run(args.run, args.out)}")
    return 0


def _average(args: argparse.Namespace) -> int:
    from .average import average_checkpoints
    from .data.tokenizer import TOKENIZER_NAME, Tokenizer

    model = average_checkpoints(args.checkpoints)
    model.save_pretrained(args.out, averaged=[str(p) for p in args.checkpoints])
    tokenizer = Path(args.checkpoints[-1]) / TOKENIZER_NAME
    if tokenizer.is_file():
        Tokenizer.load(tokenizer).save(Path(args.out) / TOKENIZER_NAME)
    print(f"averaged {len(args.checkpoints)} checkpoints into {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .tasks import CopyTask

    parser = argparse.ArgumentParser(prog="aiayn", description="The Transformer of 'Attention Is All You Need'.")
    parser.add_argument("--version", action="version", version=f"aiayn {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    data = sub.add_parser("data", help="prepare a corpus").add_subparsers(dest="corpus", required=True)
    ding = data.add_parser("ding", help="the Ding German-English dictionary's sentence pairs, split train/dev/test")
    ding.add_argument("--out", required=True, help="directory for {train,dev,test,phrases}.{de,en}")
    ding.add_argument(
        "--ding-path", help="the Ding de-en file (default: $AIAYN_DING_PATH, /usr/share/trans/de-en, download)"
    )
    ding.add_argument("--cache-dir", help="where a downloaded Ding file is kept (default ~/.cache/aiayn)")
    ding.set_defaults(func=_data_ding)

    train = sub.add_parser(
        "train",
        help="train a translation model",
        description="Train with a YAML preset; override any field with --SECTION.NAME VALUE, "
        "e.g. --train.max_steps 100 --model.N 3.",
    )
    train.add_argument("--config", required=True, help="YAML preset, e.g. configs/ding.yaml")
    train.add_argument("--out", required=True, help="run directory: checkpoints, metrics.jsonl, model/")
    train.add_argument("--resume", action="store_true", help="continue from the run's latest checkpoint")
    train.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    train.set_defaults(func=_train, takes_overrides=True)

    evaluate = sub.add_parser("evaluate", help="translate a test set and score it with sacreBLEU (BLEU, chrF)")
    evaluate.add_argument(
        "--model", required=True, help="model directory (config.json, model.safetensors, tokenizer.json)"
    )
    evaluate.add_argument("--src", required=True, help="source sentences, one per line")
    evaluate.add_argument("--ref", required=True, help="reference translations, one per line")
    evaluate.add_argument("--output", help="write the translations here")
    evaluate.add_argument("--samples", type=int, default=0, help="print this many example translations")
    evaluate.set_defaults(func=_evaluate)

    translate = sub.add_parser("translate", help="translate sentences (arguments, --input FILE, or stdin)")
    translate.add_argument("--model", required=True, help="model directory")
    translate.add_argument("--input", help="a file with one sentence per line")
    translate.add_argument("sentences", nargs="*", help="sentences to translate")
    translate.set_defaults(func=_translate)

    plot = sub.add_parser("plot", help="draw a run's loss, learning rate, perplexity and BLEU curves to PNG")
    plot.add_argument("run", help="run directory (with metrics.jsonl)")
    plot.add_argument("--out", help="PNG path (default RUN/curves.png)")
    plot.set_defaults(func=_plot)

    average = sub.add_parser("average", help="average the parameters of checkpoints (§6.1)")
    average.add_argument("checkpoints", nargs="+", help="checkpoint directories")
    average.add_argument("--out", required=True, help="directory for the averaged model")
    average.set_defaults(func=_average)

    copy = sub.add_parser("copy-task", help="train a tiny model to copy random sequences and report its accuracy")
    defaults = CopyTask()
    copy.add_argument("--steps", type=int, default=defaults.steps, help="training steps (default %(default)s)")
    copy.add_argument("--batch-size", type=int, default=defaults.batch_size, help="sequences per step (%(default)s)")
    copy.add_argument("--seed", type=int, default=defaults.seed, help="random seed (default %(default)s)")
    copy.add_argument("--out", help="save the trained model to this directory")
    copy.set_defaults(func=_copy_task)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "takes_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if getattr(args, "takes_overrides", False):
            return args.func(args, rest)
        return args.func(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"aiayn {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
