"""Progress bars that a log file can afford.

On a terminal a tqdm bar redraws in place up to ten times a second. Sent to a file or a pipe
(``aiayn train ... 2> train.log``, a batch job) every redraw is appended instead, so such a bar
redraws at most once every ``LOG_INTERVAL`` seconds, the way fairseq switches to periodic log
lines when stderr is not a terminal.
"""

from __future__ import annotations

import sys
from typing import Any

from tqdm.auto import tqdm

__all__ = ["LOG_INTERVAL", "progress_bar"]

LOG_INTERVAL = 30.0  # seconds between redraws of a bar that does not go to a terminal


def progress_bar(*args: Any, **kwargs: Any) -> tqdm:
    """``tqdm(*args, **kwargs)``, redrawn at most every ``LOG_INTERVAL`` seconds when its stream
    (``file``, default stderr) is not a terminal. To keep to that, update the postfix with
    ``set_postfix(..., refresh=False)``: a refresh redraws whatever the interval."""
    stream = kwargs.get("file") or sys.stderr
    isatty = getattr(stream, "isatty", None)
    if not (isatty is not None and isatty()):
        kwargs.setdefault("mininterval", LOG_INTERVAL)
        kwargs.setdefault("maxinterval", LOG_INTERVAL)  # tqdm's monitor would force one every 10 s
    return tqdm(*args, **kwargs)
