"""Run configs: YAML presets load, overrides make new configs, mistakes are clear errors."""

from pathlib import Path

import pytest

from aiayn.model import ModelConfig
from aiayn.train.config import RunConfig, parse_overrides

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name", ["ding", "wmt14-base", "wmt14-big"])
def test_presets_load(name):
    run = RunConfig.from_yaml(CONFIGS / f"{name}.yaml")
    assert isinstance(run.model_config(8000), ModelConfig)


def test_wmt_presets_are_the_paper_models():
    base = RunConfig.from_yaml(CONFIGS / "wmt14-base.yaml")
    big = RunConfig.from_yaml(CONFIGS / "wmt14-big.yaml")
    assert base.model_config(37000) == ModelConfig.base(37000)
    assert big.model_config(37000) == ModelConfig.big(37000)
    assert (base.train.max_steps, big.train.max_steps) == (100_000, 300_000)
    assert (base.train.average_last, big.train.average_last) == (5, 20)
    assert base.train.warmup == 4000 and base.train.betas == (0.9, 0.98) and base.train.adam_eps == 1e-9
    assert base.train.eps_ls == 0.1 and base.train.checkpoint_minutes == 10
    # 25,000 source tokens per step on 8 processes
    assert base.train.max_tokens * base.train.accumulate * 8 == 25_000


def test_overrides_parse_yaml_scalars_and_apply():
    overrides = parse_overrides(["--train.max_steps", "100", "--model.d_model=128", "--train.compile", "true"])
    assert overrides == {"train.max_steps": 100, "model.d_model": 128, "train.compile": True}
    run = RunConfig.from_yaml(CONFIGS / "ding.yaml", overrides)
    assert run.train.max_steps == 100 and run.model["d_model"] == 128 and run.train.compile is True


def test_overrides_read_scientific_notation_as_numbers():
    """YAML 1.1 (PyYAML) reads 1e-4 without a dot as text; an override means the number."""
    overrides = parse_overrides(["--train.lr_scale", "1e-4", "--train.adam_eps=-2.5E+3", "--data.dir", "1e4x"])
    assert overrides == {"train.lr_scale": 1e-4, "train.adam_eps": -2500.0, "data.dir": "1e4x"}
    assert isinstance(overrides["train.lr_scale"], float)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"train.no_such_field": 1}, "no_such_field"),
        ({"model.d_model": 100, "model.h": 3}, "divisible"),
        ({"nosection": 1}, "SECTION.NAME"),
        ({"data.format": "xml"}, "data.format"),
        ({"train.max_tokens": 0}, "max_tokens"),
    ],
)
def test_bad_values_are_clear_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        RunConfig.from_yaml(CONFIGS / "ding.yaml", overrides)


def test_yaml_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing"):
        RunConfig.from_yaml(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ValueError, match="bad"):
        RunConfig.from_yaml(bad)
    stray = tmp_path / "stray.yaml"
    stray.write_text("trian:\n  max_steps: 3\n")
    with pytest.raises(ValueError, match="trian"):
        RunConfig.from_yaml(stray)


@pytest.mark.parametrize(
    ("text", "message"),
    [("data: 5\ntrain: {max_steps: 1}\n", "section data must be a mapping of field: value, got int 5"),
     ("model: [1, 2]\ntrain: {max_steps: 1}\n", r"section model must be a mapping of field: value, got list \[1, 2\]"),
     ("- 1\n- 2\n", "expected sections data, model, train \\(a mapping\\), got list")],
)  # fmt: skip
def test_a_section_that_is_not_a_mapping_is_an_error_naming_file_and_section(tmp_path, text, message):
    path = tmp_path / "shape.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"^{path}: {message}$"):
        RunConfig.from_yaml(path)


def test_override_needs_a_value():
    with pytest.raises(ValueError, match="needs a value"):
        parse_overrides(["--train.max_steps"])


def test_a_config_that_is_not_utf8_is_an_error_naming_the_file(tmp_path):
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfetrain:\n")
    with pytest.raises(ValueError, match=rf"{binary}: not UTF-8 text"):
        RunConfig.from_yaml(binary)
