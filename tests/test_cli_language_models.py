"""The command line of the language models on tiny runs: train (train.task lm / mlm), generate,
fill-mask, and their errors."""

import re

import pytest
import yaml

from aiayn.cli import main

SENTENCES = [
    "The weather is fine today.",
    "The house is big and red.",
    "The cat is asleep.",
    "It was sheer coincidence.",
    "The dog barks loudly.",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A 4-step causal LM and a 4-step masked LM trained through `aiayn train`."""
    root = tmp_path_factory.mktemp("lm")
    for split in ("train", "dev"):
        (root / f"{split}.en").write_text("\n".join(SENTENCES * 4) + "\n")
    out = {}
    for task in ("lm", "mlm"):
        config = root / f"{task}.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "data": {"format": "text", "dir": str(root), "lang": "en", "max_len": 32},
                    "model": {"N": 1, "d_model": 16, "d_ff": 32, "h": 2, "P_drop": 0.0},
                    "train": {"task": task, "vocab_size": 300, "max_tokens": 128, "warmup": 5, "max_steps": 4},
                }
            )
        )
        assert main(["train", "--config", str(config), "--out", str(root / task)]) == 0
        out[task] = root / task / "model"
    return out


def test_generate_prints_seeded_continuations_of_each_prompt(runs, capsys):
    capsys.readouterr()
    args = ["generate", "--model", str(runs["lm"]), "The weather", "It was", "--num-samples", "3", "--seed", "1",
            "--max-new-tokens", "6", "--temperature", "1.0", "--top-k", "20", "--top-p", "0.95"]  # fmt: skip
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 6
    assert all(line.startswith("The weather") for line in lines[:3])
    assert all(line.startswith("It was") for line in lines[3:])
    assert main(args) == 0
    assert capsys.readouterr().out.splitlines() == lines  # the seed fixes the samples
    assert main(["generate", "--model", str(runs["lm"]), "The", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("The")


def test_fill_mask_prints_the_top_k_fillers_with_probabilities(runs, capsys):
    capsys.readouterr()
    assert main(["fill-mask", "--model", str(runs["mlm"]), "The house is <mask>.", "--top-k", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "The house is <mask>."
    rows = [re.match(r"\s+(\d+\.\d)%\s+(\S+)\s+(.*)$", line) for line in lines[1:]]
    assert len(rows) == 4 and all(rows)
    probabilities = [float(row[1]) for row in rows]
    assert probabilities == sorted(probabilities, reverse=True) and 0 < sum(probabilities) <= 100.05
    for row in rows:  # the filler, and the sentence with it in place of <mask>
        assert row[3].startswith("The house is") and row[3].endswith(".")
    assert main(["fill-mask", "--model", str(runs["mlm"]), "The <mask> is <mask>."]) == 0
    out = capsys.readouterr().out
    assert "<mask> 1:" in out and "<mask> 2:" in out


def test_wrong_model_or_missing_mask_is_a_one_line_error(runs, capsys):
    capsys.readouterr()
    assert main(["generate", "--model", str(runs["mlm"]), "The weather"]) == 1
    err = capsys.readouterr().err
    assert "aiayn generate: error:" in err and "EncoderOnly" in err and "Traceback" not in err
    assert main(["fill-mask", "--model", str(runs["lm"]), "The <mask>."]) == 1
    assert "DecoderOnly" in capsys.readouterr().err
    assert main(["fill-mask", "--model", str(runs["mlm"]), "No mask here."]) == 1
    assert "no <mask>" in capsys.readouterr().err
