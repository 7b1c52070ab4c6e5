"""The README's Python examples run as written (so they cannot rot)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_python_example():
    assert python_blocks(), "README.md should show the Python API"


def test_readme_python_examples_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # examples may write files
    for block in python_blocks():
        exec(compile(block, str(README), "exec"), {"__name__": "__readme__"})
    assert "(2, 4, 3, 5)" in capsys.readouterr().out.replace("torch.Size([", "(").replace("])", ")")
