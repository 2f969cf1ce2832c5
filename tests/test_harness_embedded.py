"""The embedded backend end to end on the CPU: the real engine serves a run of 3 tasks.

Kept small on purpose (one request per task): prefill on a 2-core CPU is the cost.
"""
from __future__ import annotations

import pytest

from sandbox.backends import open_backend
from sandbox.harness import RunLimits, run_tasks

pytestmark = pytest.mark.model


def test_scripted_run_of_three_tasks_on_the_embedded_engine() -> None:
    limits = RunLimits(max_steps=1)
    backend = open_backend("embedded")
    try:
        served = run_tasks("localcomp", "train", "expert-8k", backend=backend, limit=3, limits=limits)
    finally:
        backend.close()
    replayed = run_tasks("localcomp", "train", "expert-8k", backend="replay", limit=3, limits=limits)
    assert served.summary["errors"] == {}
    assert [r.status for r in served.results] == ["max_steps"] * 3
    assert [r.n_requests for r in served.results] == [1, 1, 1]
    # The scripted agent ignores model text, so both runs send the same requests. The first
    # task met an empty engine cache, like replay's fresh one: every token class agrees.
    assert served.results[0].tokens == replayed.results[0].tokens
    # Later tasks find the shared system prompt in the engine's cache (replay starts each task fresh).
    for task in (1, 2):
        assert served.results[task].tokens.cached > replayed.results[task].tokens.cached == 0
        assert served.results[task].cost_usd < replayed.results[task].cost_usd


def test_thinking_drop_on_the_embedded_engine_accounts_as_replay() -> None:
    from sandbox.backends import BackendRequest

    history = ({"role": "system", "content": "You research."},
               {"role": "user", "content": "Find the capital."},
               {"role": "assistant", "content": "Canberra.", "reasoning_content": "Not Sydney: Canberra."},
               {"role": "user", "content": "And its population?"})
    rule = {"type": "thinking_drop"}
    requests = [BackendRequest(messages=history[:2], max_tokens=2),
                BackendRequest(messages=history, drop_rule=rule, max_tokens=2),
                BackendRequest(messages=history, drop_rule=rule, reposition=(3,), max_tokens=2)]
    backend, replay = open_backend("embedded"), open_backend("replay")
    replay.start_task()
    fields = ("prompt_tokens", "cached_tokens", "repos_tokens", "drop_skipped_tokens", "prefilled_tokens")
    try:
        for request in requests:
            served, replayed = backend.complete(request), replay.complete(request)
            assert served.message is not None
            assert [getattr(served.usage, f) for f in fields] == [getattr(replayed.usage, f) for f in fields]
        assert served.usage.drop_skipped_tokens > 0 and served.usage.repos_tokens > 0
    finally:
        backend.close()
