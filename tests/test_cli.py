"""The command-line surface."""

import subprocess
import sys

import pytest

from aiayn.cli import main


def test_help_lists_subcommands():
    out = subprocess.run([sys.executable, "-m", "aiayn", "--help"], capture_output=True, text=True, check=True).stdout
    assert "copy-task" in out


def test_unknown_subcommand_fails_with_usage(capsys):
    with pytest.raises(SystemExit) as e:
        main(["no-such-command"])
    assert e.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_copy_task_runs_reports_and_saves(tmp_path, capsys):
    assert main(["copy-task", "--steps", "3", "--batch-size", "8", "--out", str(tmp_path / "m")]) == 0
    out = capsys.readouterr().out
    assert "greedy exact match on 256 new sequences:" in out
    assert (tmp_path / "m" / "config.json").is_file() and (tmp_path / "m" / "model.safetensors").is_file()
