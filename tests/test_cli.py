"""The command-line surface."""

import subprocess
import sys

import pytest
import torch

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


DING_FIXTURE = """\
# Version :: test
Zufall {m} | Es war purer Zufall. | Das ist Unsinn. :: coincidence | It was sheer/pure coincidence. | That is nonsense.
Haus {n} | Das Haus ist groß. :: house | The house is big.
Katze {f} | Die Katze schläft. :: cat | The cat is asleep.
Hund {m} | Der Hund bellt laut. :: dog | The dog barks loudly.
"""


def test_data_ding_train_evaluate_translate_plot_average(tmp_path, capsys):
    """The CLI path of the demo on a tiny fixture: every command runs and writes what it says."""
    import safetensors.torch

    ding = tmp_path / "de-en"
    ding.write_text(DING_FIXTURE)
    data = tmp_path / "data"
    assert main(["data", "ding", "--out", str(data), "--ding-path", str(ding)]) == 0
    out = capsys.readouterr().out
    assert "test" in out and (data / "train.de").is_file() and (data / "phrases.en").is_file()
    # with 1000 test and 1000 dev sentences, a 5-sentence fixture leaves nothing to train on: train on all
    sentences = {
        lang: [x for split in ("train", "dev", "test") for x in _lines(data / f"{split}.{lang}")]
        for lang in ("de", "en")
    }
    assert len(sentences["de"]) == 5
    for split in ("train", "dev"):
        for lang in ("de", "en"):
            (data / f"{split}.{lang}").write_text("".join(x + "\n" for x in sentences[lang]))
    config = tmp_path / "config.yaml"
    config.write_text(
        f"data: {{dir: {data}, max_len: 32}}\n"
        "model: {N: 1, d_model: 16, d_ff: 32, h: 2, P_drop: 0.0}\n"
        "train: {vocab_size: 300, max_tokens: 64, warmup: 5, max_steps: 4, checkpoint_every: 2, eval_every: 2}\n"
    )
    run = tmp_path / "run"
    assert main(["train", "--config", str(config), "--out", str(run), "--train.max_steps", "6"]) == 0
    assert len([p for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")]) == 3

    src, ref = data / "train.de", data / "train.en"
    hyp = tmp_path / "hyp.txt"
    capsys.readouterr()
    assert main(["evaluate", "--model", str(run / "model"), "--src", str(src), "--ref", str(ref),
                 "--output", str(hyp), "--samples", "2"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    # a model trained 6 steps scores BLEU 0 here, so the number says little: BLEU and chrF are
    # checked against sacreBLEU's command line in tests/test_translator.py
    assert len(_lines(hyp)) == len(_lines(ref)) and "nrefs:1|case:mixed|eff:no|tok:13a" in out

    (tmp_path / "in.txt").write_text("Das Haus ist groß.\n\nDer Hund.\n")
    assert main(["translate", "--model", str(run / "model"), "--input", str(tmp_path / "in.txt")]) == 0
    lines = capsys.readouterr().out.split("\n")
    assert len(lines) == 4 and lines[1] == "" and lines[3] == ""  # one line per input line, empty stays empty

    assert main(["plot", str(run)]) == 0
    assert (run / "curves.png").stat().st_size > 10_000

    checkpoint = sorted((run / "checkpoints").glob("step_*"))[-1]
    assert main(["average", str(checkpoint), str(checkpoint), str(checkpoint), "--out", str(tmp_path / "avg")]) == 0
    a = safetensors.torch.load_file(str(checkpoint / "model.safetensors"))
    b = safetensors.torch.load_file(str(tmp_path / "avg" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # k copies average to itself


def _lines(path):
    return path.read_text(encoding="utf-8").splitlines()


def test_cli_errors_are_one_line_not_tracebacks(tmp_path, capsys):
    assert main(["evaluate", "--model", str(tmp_path / "nope"), "--src", "a", "--ref", "b"]) == 1
    err = capsys.readouterr().err
    assert "aiayn evaluate: error:" in err and "nope" in err and "Traceback" not in err
    assert main(["train", "--config", str(tmp_path / "missing.yaml"), "--out", str(tmp_path / "r")]) == 1
    assert "missing.yaml" in capsys.readouterr().err
