"""The embedded backend end to end on the CPU: the real engine serves localcomp tasks.

Kept small on purpose (few requests per task): prefill on a 2-core CPU is the cost. Loading the
models is the other cost: the int4 backend loads on a thread beside the float32 engine (loading is
mostly single-threaded work), and its test takes it when its turn comes.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from sandbox.backends import open_backend
from sandbox.backends.embedded import EmbeddedBackend
from sandbox.backends.replay import ReplayBackend
from sandbox.runs.harness import RunLimits, resolve_policy, run_task, run_tasks
from sandbox.suites import get_suite

pytestmark = pytest.mark.model

USAGE_FIELDS = ("prompt_tokens", "cached_tokens", "repos_tokens", "drop_skipped_tokens", "prefilled_tokens")
# Both backends. The first six steps of a task hold about 5.6K slots (re-rotated keys and retained KV
# included): they fit without eviction, and a smaller pool is less memory to allocate and clear.
PARITY_POOL = 8192


def _usage_rows(trajectory) -> list[list[int]]:
    return [[getattr(e.usage, f) for f in USAGE_FIELDS] for e in trajectory.exchanges]


@pytest.fixture(scope="module")
def int4_opening():
    """`open_backend("embedded", precision="int4")`, started on a thread at once: the int4 test waits for
    it (and fails with its error, if it raised) while the tests before it run on the float32 engine."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="int4-load") as pool:
        opening = pool.submit(open_backend, "embedded", precision="int4")
        yield opening
        if opening.exception() is None:
            opening.result().close()


@pytest.fixture(scope="module")
def embedded(int4_opening: Future):
    """One float32 engine for the tests below (loading the model is their main cost); its pool is the
    parity test's, which the replay backends take too. The int4 backend starts loading first, beside it."""
    backend = EmbeddedBackend(kv_tokens=PARITY_POOL)
    yield backend
    backend.close()


def test_scripted_run_of_three_tasks_on_the_embedded_engine(embedded: EmbeddedBackend) -> None:
    limits = RunLimits(max_steps=1)
    runs = {}
    embedded.start_task()  # an empty cache: fresh_cache_per_task is the default of both backends
    try:
        for fresh in (False, True):
            embedded.fresh_cache_per_task = fresh
            replay = ReplayBackend(kv_tokens=embedded.kv_tokens, fresh_cache_per_task=fresh)
            runs[fresh] = [run_tasks("localcomp", "train", "expert-8k", backend=b, limit=3, limits=limits)
                           for b in (embedded, replay)]
    finally:
        embedded.fresh_cache_per_task = True
    (served_fresh, fresh), (served, shared) = runs[True], runs[False]
    assert served.summary["errors"] == {} and served_fresh.summary["errors"] == {}
    assert [r.status for r in served.results] == ["max_steps"] * 3
    assert [r.n_requests for r in served.results] == [1, 1, 1]
    # One cache across tasks: later tasks find the system prompt and tools cached, on both backends.
    assert [r.tokens for r in served.results] == [r.tokens for r in shared.results]
    assert all(r.tokens.cached > 0 for r in served.results[1:])
    # A fresh cache per task: every token class agrees, none is cached.
    assert [r.tokens for r in served_fresh.results] == [r.tokens for r in fresh.results]
    assert all(r.tokens.cached == 0 for r in served_fresh.results)


@pytest.mark.slow
def test_replay_equals_the_embedded_engine_request_for_request_on_two_localcomp_tasks(
        embedded: EmbeddedBackend) -> None:
    suite = get_suite("localcomp")
    tasks = suite.tasks("train")[:2]
    policy = resolve_policy("expert-8k")
    # The first task runs to step 6 (step 6 is the first to drop and reposition); the second one needs only
    # its first two steps to show that it does not see the first task's cache (prefill is the cost here).
    steps = {tasks[0].id: 6, tasks[1].id: 2}
    replay = ReplayBackend(kv_tokens=PARITY_POOL, memo=None)
    for task in tasks:  # in turn on one engine: the second task must not see the first one's cache
        limits = RunLimits(max_steps=steps[task.id])
        _, served = run_task(task, suite, policy, suite.scripted_agent(task), embedded, limits=limits)
        _, replayed = run_task(task, suite, policy, suite.scripted_agent(task), replay, limits=limits)
        assert [e.request for e in served.exchanges] == [e.request for e in replayed.exchanges]
        assert _usage_rows(served) == _usage_rows(replayed), task.id
        assert len(served.exchanges) == limits.max_steps
        assert served.exchanges[0].usage.cached_tokens == 0, task.id  # a fresh cache per task
        if task is tasks[0]:
            last = served.exchanges[-1].usage
            assert last.repos_tokens > 0 and last.drop_skipped_tokens > 0


def test_thinking_drop_on_the_embedded_engine_accounts_as_replay(embedded: EmbeddedBackend) -> None:
    from sandbox.backends import BackendRequest

    history = ({"role": "system", "content": "You research."},
               {"role": "user", "content": "Find the capital."},
               {"role": "assistant", "content": "Canberra.", "reasoning_content": "Not Sydney: Canberra."},
               {"role": "user", "content": "And its population?"})
    rule = {"type": "thinking_drop"}
    requests = [BackendRequest(messages=history[:2], max_tokens=2),
                BackendRequest(messages=history, drop_rule=rule, max_tokens=2),
                BackendRequest(messages=history, drop_rule=rule, reposition=(3,), max_tokens=2)]
    replay = open_backend("replay")
    embedded.start_task()
    replay.start_task()
    fields = ("prompt_tokens", "cached_tokens", "repos_tokens", "drop_skipped_tokens", "prefilled_tokens")
    for request in requests:
        served, replayed = embedded.complete(request), replay.complete(request)
        assert served.message is not None
        assert [getattr(served.usage, f) for f in fields] == [getattr(replayed.usage, f) for f in fields]
    assert served.usage.drop_skipped_tokens > 0 and served.usage.repos_tokens > 0


def test_an_int4_embedded_backend_serves_a_task_on_int4_weights_and_accounts_as_replay(
        int4_opening: Future) -> None:
    from akv_core.model.quantized import Int4Linear

    backend = int4_opening.result()  # open_backend("embedded", precision="int4"); the fixture closes it
    replay = ReplayBackend(kv_tokens=backend.kv_tokens)
    assert isinstance(backend._engine.model.layers[0].gate_up, Int4Linear)
    served, replayed = (run_tasks("localcomp", "train", "expert-8k", backend=b, limit=1,
                                  limits=RunLimits(max_steps=1)) for b in (backend, replay))
    assert served.summary["errors"] == {} and [r.status for r in served.results] == ["max_steps"]
    assert [r.tokens for r in served.results] == [r.tokens for r in replayed.results]
