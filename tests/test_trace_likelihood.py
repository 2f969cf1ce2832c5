"""Likelihood fidelity of a trace set (sandbox/traces/likelihood.py, evolve/fidelity.py): the recorded
replies scored teacher-forced by the embedded SmolLM2 under a policy and under `full`, on traces cut from
tests/data/traces/samples.jsonl and imported into a throwaway store; `validation.fidelity` and its
errors, and an `akv evolve` whose champion rule judges nats per token."""
from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from typer.testing import CliRunner

from akv_cli.main import app
from evolve.config import ConfigError, ValidationConfig, load_config
from evolve.fidelity import FidelityUnavailable, check_fidelity
from sandbox.suites import get_suite
from sandbox.traces.suite import TraceSuite
from test_cli_support import akv_in_process as akv

DATA = Path(__file__).parent / "data" / "traces"
TAU = "taubench-gpt4o-05"     # held out under seed 0; 15 messages of it: 7 replies, all within SmolLM2's context
SWE = "sweagent-gpt4-01"      # every request of it is past the 8,192-token context
DROP_TOOL_RESULTS = "mode kv\non each turn: drop role tool\n"   # each result hidden once the agent answered it


def tau_window(messages: list[dict]) -> list[dict]:
    """The tau-bench sample's first 15 messages (7 replies, through the lookup of reservation 4NQLHD, listed in
    the profile), its system prompt (the airline policy) cut before its "## Domain Basic" section: less history
    to score each reply after."""
    system, *rest = messages[:15]
    policy, heading, _ = system["content"].partition("\n\n## Domain Basic")
    assert system["role"] == "system" and heading
    return [{**system, "content": policy}, *rest]


@pytest.fixture(scope="module")
def store_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A throwaway store holding `cut`: the window of the tau-bench sample (`tau_window`) and the whole SWE-agent
    one."""
    folder = tmp_path_factory.mktemp("likelihood")
    rows = [json.loads(line) for line in (DATA / "samples.jsonl").open()]
    cut = [{**r, "messages": tau_window(r["messages"])} if r["id"] == TAU else r
           for r in rows if r["id"] in (TAU, SWE)]
    (folder / "cut.jsonl").write_text("".join(json.dumps(r) + "\n" for r in cut))
    env = {"AKV_DB": f"sqlite:///{folder / 'akv.db'}", "COLUMNS": "160"}
    code, _, err = akv(env, "traces", "import", str(folder / "cut.jsonl"), "--name", "cut")
    assert code == 0, err
    # An evolution needs two traces on each side of the split: `cut` and a second run of each (its
    # system prompt one line longer, as the same agent's next run might be) under an id that falls on
    # the other side (split seed 0).
    copies = {SWE: f"{SWE}-copy-0", TAU: f"{TAU}-copy-0"}   # held out, train
    again = [{**r, "id": copies[r["id"]],
              "messages": [{**r["messages"][0], "content": r["messages"][0]["content"] + "\n"}, *r["messages"][1:]]}
             for r in cut]
    (folder / "cut4.jsonl").write_text("".join(json.dumps(r) + "\n" for r in cut + again))
    code, _, err = akv(env, "traces", "import", str(folder / "cut4.jsonl"), "--name", "cut4")
    assert code == 0, err
    return env


@pytest.mark.model
@pytest.mark.slow
def test_full_changes_nothing_and_hiding_answered_tool_results_loses_likelihood(store_env) -> None:
    from policy_dsl import compile_policy, parse
    from sandbox.backends import open_backend
    from sandbox.traces.likelihood import LikelihoodFidelity

    suite = TraceSuite("cut", store_env["AKV_DB"])
    scorer = open_backend("embedded")
    fidelity = LikelihoodFidelity(suite, scorer)
    try:
        full = {t.trace_id: t for t in fidelity.score("full", [TAU, SWE])}
        expert = {t.trace_id: t for t in fidelity.score("expert", [TAU, SWE])}
        dropping = {t.trace_id: t for t in fidelity.score(compile_policy(parse(DROP_TOOL_RESULTS), name="drop"),
                                                          [TAU, SWE])}
    finally:
        fidelity.close()
        scorer.close()
    tau = full[TAU]
    assert (tau.change, tau.requests, tau.scored) == (0.0, 7, 7) and tau.tokens > 100
    # The expert keeps the last 12 tool results: on this trace's 3 it sends what full sends, scored once, exactly 0.
    assert expert[TAU] == tau
    # With each tool result hidden once answered, the replies are less likely per token: the last one, the lookup
    # of reservation 4NQLHD (listed in the profile, message 5), loses the most.
    assert dropping[TAU].change < -0.005 and dropping[TAU].tokens == tau.tokens and dropping[TAU].scored == 7
    # Past the model's context nothing is scored, on either side: no change, and the record says so.
    for scored in (full[SWE], dropping[SWE]):
        assert (scored.change, scored.tokens, scored.requests, scored.scored) == (0.0, 0, 12, 0)


def test_fidelity_settings_are_checked_and_name_the_field(tmp_path: Path) -> None:
    assert ValidationConfig().fidelity == "references" and ValidationConfig().fidelity_fallback is None
    config = tmp_path / "bad.yaml"
    config.write_text("validation:\n  fidelity: logits\n  likelihood_backend: replay\n")
    with pytest.raises(ConfigError) as err:
        load_config(config)
    assert str(err.value).splitlines() == [
        f"{config}:2: validation.fidelity: Input should be 'references' or 'likelihood'",
        f"{config}:3: validation.likelihood_backend: Value error, expected embedded or one http(s):// server URL "
        "(akv serve), got 'replay'"]
    with pytest.raises(ConfigError, match="validation.fidelity_fallback: Input should be 'references'"):
        load_config(None, {"validation.fidelity_fallback": "none"})


def test_likelihood_of_a_suite_without_recorded_replies_is_refused_before_a_run(tmp_path: Path) -> None:
    likelihood = ValidationConfig(fidelity="likelihood")
    assert check_fidelity(ValidationConfig(), get_suite("localcomp"), "replay") is None
    with pytest.raises(FidelityUnavailable, match="^validation.fidelity: 'likelihood' scores the recorded assistant "
                                                  "replies of a trace set; suite 'localcomp' has none"):
        check_fidelity(likelihood, get_suite("localcomp"), "replay")
    config = tmp_path / "likelihood.yaml"
    config.write_text("validation:\n  fidelity: likelihood\n")
    db = tmp_path / "akv.db"
    result = CliRunner().invoke(app, ["evolve", "--config", str(config), "--db", f"sqlite:///{db}"])
    assert result.exit_code == 2 and "validation.fidelity: 'likelihood' scores the recorded" in result.output
    with sqlite3.connect(db) as conn:   # refused before a run was made
        assert conn.execute("SELECT count(*) FROM akv_runs").fetchone() == (0,)


def test_a_scoring_server_that_cannot_score_stops_the_run_unless_the_fallback_is_allowed() -> None:
    suite = TraceSuite("none-needed", traces=[])   # the check reads no trace
    nobody = "http://127.0.0.1:9"                   # the discard port: no server answers there
    asked = ValidationConfig(fidelity="likelihood", likelihood_backend=nobody)
    with pytest.raises(FidelityUnavailable) as err:
        check_fidelity(asked, suite, "replay")
    assert str(err.value).startswith("validation.fidelity: 'likelihood' needs a model that scores a recorded reply "
                                     f"teacher-forced (AKV's continue_final_message with prompt_logprobs); cannot "
                                     f"read the model card of {nobody}")
    assert "validation.fidelity_fallback: references" in str(err.value)
    note = check_fidelity(asked.model_copy(update={"fidelity_fallback": "references"}), suite, "replay")
    assert note is not None and note.endswith("judged on the model-free fidelity instead "
                                              "(validation.fidelity_fallback: references)")
    # The run's own server is the default scorer; the embedded engine always can (nothing is loaded to check).
    assert check_fidelity(ValidationConfig(fidelity="likelihood"), suite, "embedded") is None
    with pytest.raises(FidelityUnavailable, match=f"cannot read the model card of {nobody}"):
        check_fidelity(ValidationConfig(fidelity="likelihood"), suite, nobody)


@pytest.mark.model
@pytest.mark.slow
def test_evolve_judges_the_finalists_in_nats_per_token(store_env, tmp_path: Path) -> None:
    from store import Store

    dropping = tmp_path / "drop-answered.akvp"
    dropping.write_text(DROP_TOOL_RESULTS)
    config = tmp_path / "likelihood.yaml"
    config.write_text(f"max_candidates: 1\nproposers: [random]\nseed_policies: [expert, {dropping}]\n"
                      "validation:\n  fidelity: likelihood\n  margin: 0.01\n")
    code, out, err = akv(store_env, "evolve", "--config", str(config), "--suite", "cut4", "--run-name", "lk")
    assert code == 0, err
    assert "fidelity: likelihood, the mean change in log-likelihood per reply token against full" in out
    store = Store.open(store_env["AKV_DB"])
    try:
        run = store.run("lk")
        records = store.validations(run.id)
        held_out = {(e.policy_id, e.result.task_id): e.result.score for e in store.evaluations(run.id, "heldout")}
    finally:
        store.close()
    by_label = {v.label: v for v in records}
    assert by_label["full"].stats["fidelity"]["traces"][TAU] == {"change": 0.0, "tokens": 358, "scored": 7,
                                                                 "requests": 7}
    assert by_label["expert"].stats["fidelity"]["change"] == 0.0   # sends what full sends on this trace
    assert by_label["standard"].stats["fidelity"]["change"] is None   # the rule does not judge it: not scored
    [dropped] = [v for v in records if v.role == "candidate" and v.stats["policy_name"] == str(dropping)]
    rule, judged = dropped.stats["rule"], dropped.stats["fidelity"]
    assert judged["measure"] == "likelihood" and judged["change"] < -0.005 and judged["scored"] == 7
    assert rule["score_unit"] == "nats/token" and rule["margin"] == 0.01
    assert rule["score_delta"] == pytest.approx(judged["change"])   # against the expert's 0
    assert f"log-likelihood {judged['change']:+.4f} nats/token" in dropped.verdict
    # The model-free fidelity, kept next to it, sees no loss on the tau-bench trace: every id the replies copy
    # from a hidden result was also in a message of the agent's own (it listed the reservations in message 6).
    assert held_out[(dropped.policy_id, TAU)] == 1.0
