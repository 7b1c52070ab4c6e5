"""Puts this directory on ``sys.path`` so that test modules can ``from helpers import ...``
(the tests import in importlib mode, which adds no test directory to the path)."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
