"""Progress bars: live on a terminal, a redraw every LOG_INTERVAL seconds into a file or pipe.

A fake clock runs 600 one-second steps; the redraws are counted in what the bar wrote (each
redraw repeats the description)."""

import io

import pytest
from tqdm import tqdm

from aiayn.progress import LOG_INTERVAL, progress_bar

STEPS = 600


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def clock(monkeypatch):
    """tqdm reads the time through ``tqdm.std.time``: one second per ``tick``."""
    now = [0.0]
    monkeypatch.setattr("tqdm.std.time", lambda: now[0])

    def tick() -> None:
        now[0] += 1.0

    return tick


def redraws(make_bar, stream: io.StringIO, tick) -> int:
    bar = make_bar(total=STEPS, desc="train", file=stream)
    for step in range(STEPS):
        tick()
        bar.set_postfix(loss=f"{1 / (step + 1):.3f}", refresh=False)
        bar.update(1)
    bar.close()
    return stream.getvalue().count("train:")


def test_into_a_file_a_redraw_every_log_interval(clock):
    assert redraws(tqdm, io.StringIO(), clock) >= STEPS  # plain tqdm: every step, into the file too
    count = redraws(progress_bar, io.StringIO(), clock)
    assert STEPS / LOG_INTERVAL <= count <= STEPS / LOG_INTERVAL + 2  # and the first and last


def test_on_a_terminal_every_step_as_tqdm(clock):
    assert redraws(progress_bar, Terminal(), clock) == redraws(tqdm, Terminal(), clock) >= STEPS


def test_into_a_file_each_redraw_and_message_is_a_line(clock):
    """No carriage returns in a log file: each redraw on its own line, and a message printed
    through ``tqdm.write`` (the trainer's dev scores) on its own line between them."""
    stream = io.StringIO()
    bar = progress_bar(total=STEPS, desc="train", file=stream)
    for step in range(STEPS):
        clock()
        bar.set_postfix(loss=f"{1 / (step + 1):.3f}", refresh=False)
        bar.update(1)
        if step in (100, 400):
            bar.write(f"step {step}: dev loss 1.000", file=stream)
    bar.close()
    text = stream.getvalue()
    assert "\r" not in text and text.endswith("\n")
    lines = text.splitlines()
    assert all(line.startswith("train:") or line.startswith("step ") for line in lines)
    assert [line for line in lines if line.startswith("step ")] == [
        "step 100: dev loss 1.000",
        "step 400: dev loss 1.000",
    ]
    assert all(line == line.rstrip() for line in lines)  # no padding left
    assert lines[-1].startswith("train: 100%") and f"{STEPS}/{STEPS}" in lines[-1]
    assert STEPS / LOG_INTERVAL <= sum(line.startswith("train:") for line in lines) <= STEPS / LOG_INTERVAL + 4
