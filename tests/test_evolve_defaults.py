"""What a new run uses where the user named nothing (`evolve/defaults.py`): make evolve's mix on any
suite, and on a trace set the reflect-led mix, every trace, a budget that fits it and a half-point
margin, said in one line; a trace set too small to split is refused before anything is stored."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

from akv_cli.main import app
from evolve.config import load_config
from evolve.defaults import (EMBEDDED_LLM, MAKE_EVOLVE_PROPOSERS, TRACE_MARGIN, TRACE_PROPOSERS, DefaultsError,
                             chosen_defaults)
from sandbox.traces.records import stored_of
from sandbox.traces.suite import TraceSuite, split_key, split_of
from store import Store

from test_traces_suite import repair_trace


@pytest.fixture
def no_endpoint(monkeypatch):
    monkeypatch.delenv("AKV_PROPOSER_ENDPOINT", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)


def test_bare_akv_evolve_runs_make_evolves_mix_on_the_embedded_model(no_endpoint):
    chosen = chosen_defaults(load_config())
    config = chosen.config
    assert config.proposers == MAKE_EVOLVE_PROPOSERS and config.llm.endpoint == "embedded"
    assert {k: getattr(config.llm, k) for k in EMBEDDED_LLM} == EMBEDDED_LLM
    assert config.baselines.expert == "expert-8k" and config.validation.margin == 0.02
    assert any("the embedded model" in note for note in chosen.notes)
    told = chosen_defaults(load_config(None, {"llm.context_tokens": 2048}))   # a named setting stays
    assert told.config.llm.context_tokens == 2048 and told.config.llm.max_tokens == EMBEDDED_LLM["max_tokens"]


def test_an_endpoint_given_is_asked_as_it_is(no_endpoint, monkeypatch):
    monkeypatch.setenv("AKV_PROPOSER_ENDPOINT", "http://127.0.0.1:9/v1")
    config = chosen_defaults(load_config()).config
    assert config.llm.endpoint is None and config.llm.context_tokens == 8192   # the env's endpoint, its defaults
    assert chosen_defaults(load_config(None, {"proposers": ["mutate"]})).config.llm.endpoint is None


def _trace_set(monkeypatch, tmp_path, name: str, n: int) -> str:
    url = f"sqlite:///{tmp_path / 'traces.db'}"
    store = Store.open(url)
    try:
        store.traces.add(name, [stored_of(repair_trace(f"{name}-{i}")) for i in range(n)])
    finally:
        store.close()
    monkeypatch.setenv("AKV_DB", url)
    return url


def test_a_trace_set_gets_the_trace_defaults_and_says_so(no_endpoint, monkeypatch, tmp_path):
    _trace_set(monkeypatch, tmp_path, "mine", 16)
    chosen = chosen_defaults(load_config(None, {"suite": "mine"}))
    config = chosen.config
    assert config.proposers == TRACE_PROPOSERS and config.cascade.train_limit is None
    assert config.validation.heldout_limit is None and config.validation.margin == TRACE_MARGIN
    assert config.baselines.expert == "expert" and config.seed_policies == ["expert"]
    traces = TraceSuite("mine").traces()
    train = [t for t in traces if split_of(split_key(t)) == "train"]
    requests = sum(len(t.requests) for t in train)
    assert config.max_candidates == 100 and requests < 600   # a small set: the most a default run proposes
    [note] = chosen.notes
    assert f"{len(train)} train traces ({requests} requests)" in note and "reflect, optuna, mutate" in note
    assert "every train and every held-out trace" in note and "margin 0.5 points" in note
    named = chosen_defaults(load_config(None, {"suite": "mine", "max_candidates": 7, "proposers": ["mutate"],
                                               "validation.margin": 0.02, "cascade.train_limit": 5}))
    assert named.config.max_candidates == 7 and named.config.proposers == ["mutate"]
    assert named.config.validation.margin == 0.02 and named.config.cascade.train_limit == 5
    monkeypatch.setenv("AKV_PROPOSER_ENDPOINT", "http://127.0.0.1:9/v1")   # a model to ask: it joins the mix
    assert chosen_defaults(load_config(None, {"suite": "mine"})).config.proposers == [*TRACE_PROPOSERS, "llm"]


def test_a_trace_set_too_small_to_split_is_refused_and_nothing_is_stored(no_endpoint, monkeypatch, tmp_path):
    url = _trace_set(monkeypatch, tmp_path, "tiny", 2)
    with pytest.raises(DefaultsError, match="evolution needs at least 2 on each side"):
        chosen_defaults(load_config(None, {"suite": "tiny"}))
    result = CliRunner().invoke(app, ["evolve", "--suite", "tiny", "--db", url, "--run-name", "never"])
    assert result.exit_code == 2 and "--suite tiny:" in result.output and "akv traces import" in result.output
    store = Store.open(url)
    try:
        assert "never" not in store.run_names()
    finally:
        store.close()
    zero = CliRunner().invoke(app, ["evolve", "--suite", "tiny", "--max-candidates", "0", "--db", url])
    assert zero.exit_code == 2 and "max_candidates" in zero.output
