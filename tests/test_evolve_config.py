"""Configuration: YAML with located errors, overrides, documented fields."""
from __future__ import annotations

import pytest
from pydantic import BaseModel

from evolve.config import ConfigError, EvolveConfig, load_config


def test_defaults_are_the_offline_embedded_run():
    cfg = load_config()
    assert cfg.proposers == ["reflect", "optuna", "llm", "mutate"] and cfg.agent == "scripted"
    assert cfg.backend == "replay"
    assert cfg.baselines.standard == "standard-8k" and cfg.llm.model == "MiniMax-M2.7"
    assert cfg.baselines.expert == "expert-8k" and cfg.baselines.full == "full"
    assert cfg.validation.margin == 0.02 and cfg.validation.alpha == 0.05


def test_unknown_field_and_wrong_type_are_located(tmp_path):
    path = tmp_path / "evolve.yaml"
    path.write_text("suite: localcomp\nmax_candidates: lots\nllm:\n  modle: x\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    lines = str(err.value).splitlines()
    assert f"{path}:2: max_candidates:" in lines[0] and "integer" in lines[0]
    assert lines[1] == f"{path}:4: llm.modle: unknown field"


def test_a_precision_is_for_the_embedded_backend_and_is_located(tmp_path):
    assert load_config(None, {"backend": "embedded", "precision": "int4"}).precision == "int4"
    assert load_config().precision is None   # float32, the engine's default
    path = tmp_path / "precision.yaml"
    path.write_text("backend: replay\nprecision: int8\n")
    with pytest.raises(ConfigError, match=rf"^{path}:2: precision: .*embedded only, not 'replay'"):
        load_config(path)
    path.write_text("backend: embedded\nprecision: int3\n")
    with pytest.raises(ConfigError, match=rf"^{path}:2: precision: .*'int8' or 'int4'"):
        load_config(path)


def test_a_negative_margin_and_an_alpha_outside_0_1_are_located(tmp_path):
    path = tmp_path / "rule.yaml"
    path.write_text("seed: 1\nvalidation:\n  alpha: 1.5\n  margin: -0.01\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    lines = str(err.value).splitlines()
    assert lines[0].startswith(f"{path}:3: validation.alpha:") and "less than 1" in lines[0]
    assert lines[1].startswith(f"{path}:4: validation.margin:") and "greater than or equal to 0" in lines[1]
    with pytest.raises(ConfigError, match="validation.alpha: .*greater than 0"):
        load_config(None, {"validation.alpha": 0})
    assert load_config(None, {"validation.margin": 0}).validation.margin == 0.0  # no tolerance is allowed


def test_bad_yaml_and_non_mapping(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("suite: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(path)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")


def test_command_line_overrides_win_over_the_file(tmp_path):
    path = tmp_path / "evolve.yaml"
    path.write_text("max_candidates: 5\nllm:\n  model: a\n")
    cfg = load_config(path, {"max_candidates": 9, "llm.endpoint": "http://127.0.0.1:1/v1", "suite": None})
    assert cfg.max_candidates == 9 and cfg.llm.model == "a" and cfg.llm.endpoint == "http://127.0.0.1:1/v1"
    with pytest.raises(ConfigError, match="proposers.0"):
        load_config(None, {"proposers": ["gpt"]})


def _models(model: type[BaseModel]):
    yield model
    for field in model.model_fields.values():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from _models(field.annotation)


def test_every_field_is_documented():
    for model in _models(EvolveConfig):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"


def test_default_run_names_count_up_so_a_repeated_make_evolve_never_collides():
    from evolve.command import next_run_name

    assert next_run_name(set()) == "evolve-001"
    assert next_run_name({"evolve-001", "evolve-002", "mine"}) == "evolve-003"
