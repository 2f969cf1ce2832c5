"""No free lunch on localcomp: forgetting everything must cost score or money, and doing
nothing (`full`) is never beaten on score. Run on a train split with the scripted agent, whose
facts come only from what the policy leaves visible."""
from __future__ import annotations

import pytest

from policy_dsl import builtin_names, compile_policy, parse
from sandbox.backends.replay import ReplayBackend
from sandbox.runs.harness import run_tasks
from test_sandbox_support import small_localcomp

# Every message that may be dropped is dropped, at every boundary.
DROP_EVERYTHING = "mode kv\non history_tokens > 1: drop all\n"


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory):
    built = small_localcomp(tmp_path_factory.getbasetemp() / "localcomp-home")
    yield built
    built.close()


@pytest.mark.slow
def test_dropping_everything_is_no_free_lunch_and_full_scores_highest(suite) -> None:
    backend = ReplayBackend()

    def summary(policy):
        return run_tasks(suite, "train", policy, backend=backend, build=False).summary

    full = summary("full")
    forget = summary(compile_policy(parse(DROP_EVERYTHING), name="drop-everything"))
    assert full["mean_score"] == 1.0 and full["n_tasks"] == len(suite.tasks("train"))
    assert forget["mean_score"] < full["mean_score"] or forget["mean_cost_usd"] > full["mean_cost_usd"]
    assert forget["statuses"]["gave_up"] == forget["n_tasks"]  # it can never finish, and says so
    for name in builtin_names():
        assert summary(name)["mean_score"] <= full["mean_score"], name
