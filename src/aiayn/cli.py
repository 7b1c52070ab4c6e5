"""The ``aiayn`` command line: a thin layer over functions a user can import."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

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


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="aiayn", description="The Transformer of 'Attention Is All You Need'.")
    parser.add_argument("--version", action="version", version=f"aiayn {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    copy = sub.add_parser("copy-task", help="train a tiny model to copy random sequences and report its accuracy")
    defaults = _copy_defaults()
    copy.add_argument("--steps", type=int, default=defaults.steps, help="training steps (default %(default)s)")
    copy.add_argument(
        "--batch-size", type=int, default=defaults.batch_size, help="sequences per step (default %(default)s)"
    )
    copy.add_argument("--seed", type=int, default=defaults.seed, help="random seed (default %(default)s)")
    copy.add_argument("--out", help="save the trained model to this directory")
    copy.set_defaults(func=_copy_task)
    return parser


def _copy_defaults():
    from .tasks import CopyTask

    return CopyTask()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
