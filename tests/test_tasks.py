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


def test_returned_model_is_the_mean_of_the_last_snapshots():
    """§6.1's averaging: with snapshots 2 steps apart, the last 2 of 5 steps are steps 3 and 5;
    the same seeded run stopped at 3 and at 5 (no averaging) gives them independently."""
    small = dict(batch_size=8, warmup=2)
    averaged, _ = train_copy_task(CopyTask(steps=5, average_last=2, average_every=2, **small))
    at_3, _ = train_copy_task(CopyTask(steps=3, average_last=1, **small))
    at_5, _ = train_copy_task(CopyTask(steps=5, average_last=1, **small))
    a3, a5 = at_3.state_dict(), at_5.state_dict()
    for name, tensor in averaged.state_dict().items():
        expected = ((a3[name].double() + a5[name].double()) / 2).to(tensor.dtype)
        torch.testing.assert_close(tensor, expected, rtol=0, atol=0, msg=name)
    weight = "encoder.layers.0.feed_forward.linear1.weight"
    assert not torch.equal(a3[weight], a5[weight])  # the two snapshots differ


def test_copy_task_settings_are_checked():
    for bad in (dict(average_last=0), dict(average_every=0), dict(batch_size=0), dict(steps=-1)):
        try:
            CopyTask(**bad)
        except ValueError as e:
            assert next(iter(bad)) in str(e)
        else:
            raise AssertionError(f"CopyTask({bad}) accepted")
