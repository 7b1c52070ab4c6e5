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


def test_the_demo_transcript_shows_the_makefiles_commands():
    """Every ``aiayn`` command of ``make demo``'s transcript in the README is the Makefile's,
    flags included (``--alpha`` of the test score among them)."""
    makefile = (README.parent / "Makefile").read_text()
    recipe = makefile.split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    commands = [line.strip().replace("$(AIAYN)", ".venv/bin/aiayn") for line in recipe.splitlines()[1:]]
    commands = [c for c in commands if c.startswith(".venv/bin/aiayn")]
    transcript = README.read_text().split("$ make demo", 1)[1].split("```", 1)[0]
    shown = [line for line in transcript.splitlines() if line.startswith(".venv/bin/aiayn")]
    assert shown and all(line in commands for line in shown), (shown, commands)
