"""Progress bars that a log file can afford.

On a terminal a tqdm bar redraws in place up to ten times a second. Sent to a file or a pipe
(``aiayn train ... 2> train.log``, a batch job) every redraw is appended instead, so such a bar
redraws at most once every ``LOG_INTERVAL`` seconds, each redraw on a line of its own, the way
fairseq switches to periodic log lines when stderr is not a terminal.
"""

from __future__ import annotations

import sys
from typing import IO, Any

from tqdm.auto import tqdm

__all__ = ["LOG_INTERVAL", "progress_bar"]

LOG_INTERVAL = 30.0  # seconds between redraws of a bar that does not go to a terminal


class _Lines:
    """A file or pipe as a bar's stream, each redraw a line of its own. tqdm starts a redraw with
    a carriage return, which a terminal obeys and a log file keeps (one ever-growing line to grep
    and page through): here it ends the line before instead, and the spaces that blank out a
    longer earlier redraw (or the whole bar, before ``tqdm.write`` prints) are dropped."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream, self.open = stream, False  # open: the last line written has no newline yet

    def write(self, text: str) -> int:
        for i, part in enumerate(text.split("\r")):
            if i and self.open:
                self.stream.write("\n")
                self.open = False
            part = part.rstrip(" ")
            if part:
                self.stream.write(part)
                self.open = not part.endswith("\n")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def __eq__(self, other: object) -> bool:  # tqdm.write(file=...) clears the bars on its stream
        return self.stream == getattr(other, "stream", other)

    def __hash__(self) -> int:
        return hash(self.stream)

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding ...: the stream's
        if name == "stream":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.stream, name)


def progress_bar(*args: Any, **kwargs: Any) -> tqdm:
    """``tqdm(*args, **kwargs)``, redrawn at most every ``LOG_INTERVAL`` seconds, each redraw a
    line, when its stream (``file``, default stderr) is not a terminal. To keep to that, update
    the postfix with ``set_postfix(..., refresh=False)``: a refresh redraws whatever the interval."""
    stream = kwargs.get("file") or sys.stderr
    isatty = getattr(stream, "isatty", None)
    if not (isatty is not None and isatty()):
        kwargs.setdefault("mininterval", LOG_INTERVAL)
        kwargs.setdefault("maxinterval", LOG_INTERVAL)  # tqdm's monitor would force one every 10 s
        kwargs["file"] = _Lines(stream)
    return tqdm(*args, **kwargs)
