"""A trace set as a suite: replay under a policy, the fidelity score, the oracle, splits, the store."""
from __future__ import annotations

import json

import pytest

from sandbox.backends.replay import ReplayBackend
from sandbox.runs.harness import resolve_policy, run_task
from sandbox.runs.oracle import run_oracle
from sandbox.traces.model import Trace, with_requests
from sandbox.traces.records import stored_of
from sandbox.traces.suite import TraceSuite, split_of

FILLER = "Nothing else of note in this output; the remaining lines repeat the same pattern. " * 30


def _call(n: int, command: str) -> dict:
    return {"role": "assistant", "content": f"Step {n}.", "tool_calls": [
        {"id": f"call_{n}", "type": "function", "function": {"name": "bash", "arguments": json.dumps({"command": command})}}]}


def _result(n: int, text: str) -> dict:
    return {"role": "tool", "tool_call_id": f"call_{n}", "name": "bash", "content": text + "\n" + FILLER}


def repair_trace(trace_id: str = "repair-1") -> Trace:
    """A repair run: the ticket id found in the first result is quoted again eight results later."""
    messages = [{"role": "system", "content": "You repair code. Use the bash tool."},
                {"role": "user", "content": "The importer crashes on empty files. Fix it."},
                _call(0, "grep -rn 'def load_rows' ."),
                _result(0, "./pkg/importer/reader_core.py:214:def load_rows(path):  # see ticket QX-48213")]
    for n in range(1, 9):
        messages += [_call(n, f"cat notes_{n}.txt"), _result(n, f"note {n}: unrelated observation")]
    messages += [_call(9, "sed -n '200,230p' pkg/importer/reader_core.py  # QX-48213"),
                 _result(9, "def load_rows(path):\n    rows = []"),
                 {"role": "assistant", "content": "Fixed: empty files now return no rows."}]
    return with_requests(Trace(trace_id, tuple(messages), ({"type": "function", "function": {
        "name": "bash", "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}},)))


def _suite(*traces: Trace) -> TraceSuite:
    return TraceSuite("handmade", traces=list(traces))


def _run(suite: TraceSuite, trace: Trace, policy: str):
    task = next(t for split in ("train", "heldout") for t in suite.tasks(split) if t.id == trace.id)
    return run_task(task, suite, resolve_policy(policy), suite.scripted_agent(task), ReplayBackend())


def test_full_replays_every_recorded_request_and_keeps_everything():
    trace = repair_trace()
    suite = _suite(trace)
    result, trajectory = _run(suite, trace, "full")
    assert result.status == "ok" and result.n_requests == len(trace.assistant_indices())
    assert result.score == 1.0 and suite.scored_reuses(trace.id) >= 1
    agent = [e for e in trajectory.exchanges if e.purpose == "agent"]
    assert [list(e.request.messages) for e in agent][-1] == list(trace.messages[:-1])
    assert agent[-1].used is not None and 3 in agent[-2].used  # the ticket's only tool holder, read again
    assert result.answer == "Fixed: empty files now return no rows."
    assert result.tokens.output > 0  # the recorded assistant turns are billed as output


def test_a_small_window_loses_the_reuse_and_costs_less():
    trace = repair_trace()
    suite = _suite(trace)
    full, _ = _run(suite, trace, "full")
    small, _ = _run(suite, trace, "rolling-3")
    assert small.score < 1.0 and small.cost_usd < full.cost_usd


def test_the_oracle_loses_nothing_and_is_cheaper_than_full():
    trace = repair_trace()
    suite = _suite(trace)
    task = suite.tasks(split_of(trace.id))[0]
    recorded = run_oracle(task, suite, ReplayBackend)
    assert recorded.same_actions
    assert recorded.oracle.score == 1.0 and recorded.oracle.cost_usd < recorded.full.cost_usd


def test_a_trace_without_a_system_prompt_and_with_a_user_turn_in_the_middle():
    messages = (
        {"role": "user", "content": "Change my flight, reservation NO6JO3."},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_reservation_details", "arguments": json.dumps({"reservation_id": "NO6JO3"})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": json.dumps({"flights": [{"flight_number": "HAT136"}]})},
        {"role": "assistant", "content": "Your flight is HAT136. Which date would you like?"},
        {"role": "user", "content": "May 22 please."},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c2", "type": "function", "function": {
            "name": "search_direct_flight", "arguments": json.dumps({"date": "2024-05-22"})}}]},
        {"role": "tool", "tool_call_id": "c2", "content": json.dumps([{"flight_number": "HAT290"}])},
        {"role": "assistant", "content": "I can move you to HAT290."},
    )
    trace = with_requests(Trace("tau-1", messages))
    suite = _suite(trace)
    result, trajectory = _run(suite, trace, "full")
    assert result.status == "ok" and result.n_requests == 4 and result.score == 1.0
    sent = [e.request.messages for e in trajectory.exchanges if e.purpose == "agent"]
    assert list(sent[2]) == list(messages[:5])  # the user's turn arrived between two requests


def test_splits_hash_the_id_alone_and_do_not_move_when_traces_are_added():
    ids = [f"trace-{i}" for i in range(200)]
    first = {i: split_of(i) for i in ids[:100]}
    assert all(split_of(i) == s for i, s in first.items())
    assert 60 <= sum(split_of(i) == "heldout" for i in ids) <= 140
    assert any(split_of(i) != split_of(i, seed=1) for i in ids)
    suite = _suite(*(repair_trace(i) for i in ids[:20]))
    before = {t.id for t in suite.tasks("train")}
    bigger = _suite(*(repair_trace(i) for i in ids[:40]))
    assert before <= {t.id for t in bigger.tasks("train")}


def test_a_trace_set_in_the_store_is_a_suite_by_name(tmp_path, monkeypatch):
    from sandbox.suites import get_suite, suite_names
    from store import Store

    url = f"sqlite:///{tmp_path / 'akv.db'}"
    monkeypatch.setenv("AKV_DB", url)
    store = Store.open(url)
    store.traces.add("mytraffic", [stored_of(repair_trace(f"r-{i}")) for i in range(6)])
    store.close()
    assert "mytraffic" in suite_names()
    suite = get_suite("mytraffic")
    suite.build(tmp_path)
    tasks = suite.tasks("train") + suite.tasks("heldout")
    assert sorted(t.id for t in tasks) == [f"r-{i}" for i in range(6)]
    version = suite.version(tmp_path)
    assert version.startswith("mytraffic@e1-") and version == get_suite("mytraffic").version(tmp_path)


def test_an_unknown_split_is_named():
    with pytest.raises(ValueError, match="expected train or heldout"):
        _suite(repair_trace()).tasks("test")


def _policy_file(tmp_path, text: str) -> str:
    path = tmp_path / "p.akvp"
    path.write_text(text)
    return str(path)


def test_hiding_the_agents_own_message_loses_what_only_it_held(tmp_path):
    """Every holder counts, whatever its role: an id only the agent's own message held (it made it up:
    a branch name) is lost when a policy hides that message, and kept when only tool results go."""
    messages = [{"role": "system", "content": "You repair code. Use the bash tool."},
                {"role": "user", "content": "The importer crashes on empty files. Fix it."},
                _call(0, "git checkout -b fix_empty_rows_7731"), _result(0, "Switched to a new branch")]
    for n in range(1, 6):
        messages += [_call(n, f"cat notes_{n}.txt"), _result(n, f"note {n}: unrelated observation")]
    messages += [_call(6, "git push origin fix_empty_rows_7731"), _result(6, "pushed"),
                 {"role": "assistant", "content": "Done."}]
    trace = with_requests(Trace("branch-1", tuple(messages)))
    suite = _suite(trace)
    assert suite.scored_reuses(trace.id) == 1
    hide_agent = _policy_file(tmp_path, "mode kv\non each turn: drop role assistant and age >= 2 turns\n")
    hidden, _ = _run(suite, trace, hide_agent)
    assert hidden.score == 0.0
    tools_only, _ = _run(suite, trace, "rolling-3")
    assert tools_only.score == 1.0


def test_runs_of_one_task_share_a_split():
    """Trials of one task (tau-bench's, a SWE-bench instance run twice) are near copies: all of them go
    to the side their task's key hashes to, so no held-out task was tuned on through a sibling run."""
    from dataclasses import replace

    runs = [replace(repair_trace(f"task-{task}-trial-{trial}"), metadata={"task": task})
            for task in range(12) for trial in range(4)]
    suite = _suite(*runs)
    for split in ("train", "heldout"):
        tasks = {t.id.rsplit("-trial-", 1)[0] for t in suite.tasks(split)}
        other = {t.id.rsplit("-trial-", 1)[0] for t in suite.tasks("heldout" if split == "train" else "train")}
        assert not tasks & other
    assert {len(suite.tasks(s)) % 4 for s in ("train", "heldout")} == {0}
    assert {split_of(str(task)) for task in range(12)} == {"train", "heldout"}
    plain = repair_trace("no-task")  # no task in its metadata: its id decides
    assert _suite(plain).tasks(split_of("no-task"))[0].id == "no-task"
