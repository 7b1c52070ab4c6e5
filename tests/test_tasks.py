"""End to end: a tiny Transformer learns the copy task (training, masks, cache, greedy decoding)."""

import time

import torch

from aiayn.tasks import CopyTask, copy_task_accuracy, copy_task_batch, train_copy_task


def test_copy_task_batch_layout():
    src, tgt = copy_task_batch(50, 6, 16, torch.Generator().manual_seed(0))
    for s, t in zip(src.tolist(), tgt.tolist(), strict=True):
        symbols = [x for x in s if x != 0]
        assert s == symbols + [0] * (6 - len(symbols))  # right-padded
        assert all(3 <= x < 16 for x in symbols) and 1 <= len(symbols) <= 6
        assert t == [1, *symbols, 2] + [0] * (6 - len(symbols))  # bos + symbols + eos, padded


def test_tiny_model_learns_copy_task_to_full_exact_match():
    task = CopyTask()  # fixed step budget and seed
    start = time.perf_counter()
    model, losses = train_copy_task(task)
    seconds = time.perf_counter() - start
    accuracy = copy_task_accuracy(model, task, n=512)
    print(f"copy task: {task.steps} steps in {seconds:.1f} s, exact match {accuracy:.2%}")
    assert losses[-1] < losses[0] / 4
    assert accuracy == 1.0


def test_untrained_model_does_not_copy():
    """The accuracy measure can fail: an untrained model scores (close to) zero."""
    task = CopyTask(steps=0)
    model, _ = train_copy_task(task)
    assert copy_task_accuracy(model, task) < 0.05
