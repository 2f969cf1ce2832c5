"""The embedded backend end to end on the CPU: the real engine serves a short run of 3 tasks."""
from __future__ import annotations

import pytest

from sandbox.backends import open_backend
from sandbox.harness import RunLimits, run_tasks

pytestmark = pytest.mark.model

STEPS = 8  # enough for expert-8k to drop and reposition; short enough for a 2-core CPU


@pytest.fixture(scope="module")
def embedded():
    backend = open_backend("embedded")
    yield backend
    backend.close()


def test_scripted_run_of_three_tasks_matches_replay_accounting(embedded) -> None:
    limits = RunLimits(max_steps=STEPS)
    served = run_tasks("localcomp", "train", "expert-8k", backend=embedded, limit=3, limits=limits)
    replayed = run_tasks("localcomp", "train", "expert-8k", backend="replay", limit=3, limits=limits)
    assert served.summary["errors"] == {}
    assert [r.n_requests for r in served.results] == [r.n_requests for r in replayed.results]
    # the scripted agent ignores model text, so the trajectories are the same; the first task
    # met an empty engine cache, like replay's fresh one, so every token class agrees
    assert served.results[0].tokens == replayed.results[0].tokens
    assert served.results[0].tokens.drop_skipped > 0 and served.results[0].tokens.repos > 0
    # later tasks find the shared system prompt cached in the engine, and pay less for it
    assert served.results[1].tokens.cached > replayed.results[1].tokens.cached


def test_llm_agent_runs_a_real_tool_loop_on_the_embedded_model(embedded) -> None:
    report = run_tasks("localcomp", "train", "model-based", agent="llm", backend=embedded, limit=1,
                       limits=RunLimits(max_steps=2, max_tokens=24))
    (result,) = report.results
    assert result.status in ("ok", "max_steps"), report.summary["errors"]
    assert 1 <= result.n_requests <= 2 and result.tokens.output > 0
