"""No free lunch on localswe: a policy's score and cost are honest to what it leaves visible.

Every policy runs the same train tasks with the scripted agent on the replay backend (tools run
for real). Dropping what the agent needs costs score or money, never neither; `full`, which
drops nothing, scores at least as high as every built-in.
"""
from __future__ import annotations

import pytest

from policy_dsl import builtin_names, compile_policy, parse
from sandbox.runs.harness import run_tasks
from sandbox.suites.localswe import LocalSWE

from test_localswe_suite import built_home

DROPPERS = {
    "drop-every-tool-message": "mode kv\non each tool_response: drop role tool\nreposition after each drop\n",
    "drop-everything-droppable": "mode kv\non each tool_response: drop all\nreposition after each drop\n",
}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    suite = LocalSWE(hosts=["isodate"], bugs_per_host=3, max_tries=12)
    suite.build(built_home(tmp_path_factory), seed=0)
    policies = {name: name for name in builtin_names()}
    policies.update({name: compile_policy(parse(source), name) for name, source in DROPPERS.items()})
    out = {}
    for name, policy in policies.items():
        report = run_tasks(suite, "train", policy, build=False)
        out[name] = {"summary": report.summary, "scores": [r.score for r in report.results]}
    return out


def test_full_resolves_some_train_task(results) -> None:
    assert results["full"]["summary"]["mean_score"] > 0  # else no policy could score lower


@pytest.mark.parametrize("dropper", sorted(DROPPERS))
def test_dropping_what_the_agent_needs_is_no_free_lunch(results, dropper: str) -> None:
    full, dropped = results["full"]["summary"], results[dropper]["summary"]
    assert dropped["mean_score"] < full["mean_score"] or dropped["mean_cost_usd"] > full["mean_cost_usd"]
    assert dropped["statuses"]["gave_up"] >= 1  # it says it could not finish


def test_full_scores_at_least_as_high_as_every_builtin(results) -> None:
    full = results["full"]["scores"]
    for name in builtin_names():
        assert all(s <= f for s, f in zip(results[name]["scores"], full)), name
