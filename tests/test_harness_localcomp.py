"""The harness on the real localcomp suite with the replay backend (no model needed)."""
from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from sandbox.backends.replay import ReplayBackend
from sandbox.runs.harness import RESULT_FIELDS, RunLimits, resolve_policy, run_task, run_tasks
from sandbox.runs.trajectory import read_trajectory
from sandbox.suites import get_suite
from sandbox.suites.base import AgentAction, AgentView
from test_sandbox_support import Reader


@pytest.fixture(scope="module")
def localcomp():
    from akv_core.home import akv_home

    suite = get_suite("localcomp")
    suite.build(akv_home(), 0)
    return suite


def test_results_have_exactly_the_documented_fields_and_land_on_disk(localcomp, tmp_path: Path) -> None:
    report = run_tasks(localcomp, "train", "expert", limit=2, out_dir=tmp_path)
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [r.to_dict() for r in report.results]
    for result in report.results:
        row = result.to_dict()
        assert tuple(row) == RESULT_FIELDS
        assert set(row["tokens"]) == {"input", "cached", "output", "drop_skipped", "repos"}
        assert row["status"] == "ok" and row["n_requests"] > 1 and row["cost_usd"] > 0
        _, requests = read_trajectory(tmp_path / "trajectories" / f"{result.task_id}.jsonl")
        assert len(requests) == result.n_requests
        assert sum(r.usage.prefilled_tokens for r in requests) == result.tokens.input
    assert report.summary["n_tasks"] == 2 and report.summary["errors"] == {}




def _read(localcomp, policy: str, n_docs: int):
    task = localcomp.tasks("train")[0]
    return run_task(task, localcomp, resolve_policy(policy), Reader(n_docs), ReplayBackend())


def test_on_the_same_trajectory_expert_is_cheaper_than_full(localcomp) -> None:
    (full, _), (expert, _) = _read(localcomp, "full", 20), _read(localcomp, "expert", 20)
    assert full.n_requests == expert.n_requests == 21
    assert expert.tokens.input == full.tokens.input  # drops never cost a prefill
    assert expert.tokens.drop_skipped > 0 and expert.tokens.repos > 0
    assert full.tokens.drop_skipped == full.tokens.repos == 0
    assert expert.cost_usd < full.cost_usd


def test_text_mode_pays_for_its_summaries(localcomp) -> None:
    result, trajectory = _read(localcomp, "standard-8k", 60)
    summaries = [e for e in trajectory.exchanges if e.purpose == "summary"]
    assert summaries and all(e.cost_usd > 0 and e.usage.completion_tokens > 0 for e in summaries)
    assert result.n_requests == 61 + len(summaries)
    assert result.cost_usd == pytest.approx(sum(e.cost_usd for e in trajectory.exchanges))
    # after a summary the history restarts short: the next agent request re-prefills its tail
    after = trajectory.exchanges[trajectory.exchanges.index(summaries[0]) + 1]
    assert after.purpose == "agent" and after.usage.prefilled_tokens > after.usage.cached_tokens


def test_policies_compare_on_the_suite_with_its_scripted_agent(localcomp) -> None:
    summaries = {p: run_tasks(localcomp, "train", p, limit=3).summary for p in ("full", "expert-8k")}
    assert summaries["full"]["statuses"]["ok"] == 3 and summaries["full"]["tokens"]["drop_skipped"] == 0
    assert summaries["expert-8k"]["tokens"]["drop_skipped"] > 0


def test_an_agent_that_gives_up_reports_gave_up_not_ok(localcomp) -> None:
    from policy_dsl import compile_policy, parse

    forget_everything = compile_policy(parse("mode kv\non each tool_response: drop all"), name="forget")
    task = localcomp.tasks("train")[0]
    result, _ = run_task(task, localcomp, forget_everything, localcomp.scripted_agent(task), ReplayBackend())
    assert result.status == "gave_up" and result.answer == "" and result.score == 0.0
    report = run_tasks(localcomp, "train", forget_everything, limit=1)
    assert report.summary["statuses"]["gave_up"] == 1 and report.summary["statuses"]["ok"] == 0


class _Watching:
    """Delegates to the suite's scripted agent and keeps every view it was given."""

    def __init__(self, agent) -> None:
        self.agent, self.name, self.views = agent, agent.name, []
        self.uses_cache_tool = getattr(agent, "uses_cache_tool", False)

    def act(self, view: AgentView) -> AgentAction:
        self.views.append(view)
        return self.agent.act(view)


def test_the_agent_sees_exactly_what_the_policy_left_visible(localcomp) -> None:
    task = localcomp.tasks("train")[0]
    agent = _Watching(localcomp.scripted_agent(task))
    _, trajectory = run_task(task, localcomp, resolve_policy("expert-8k"), agent, ReplayBackend())
    steps = [e for e in trajectory.exchanges if e.purpose == "agent"]
    assert len(steps) == len(agent.views)
    for view, exchange in zip(agent.views, steps):
        dropped = {i for ids in exchange.request.drop_message.values() for i in ids}
        assert list(view.visible) == [i not in dropped for i in range(len(view.messages))]
        assert view.response is None  # replay has no model
    assert not all(agent.views[-1].visible)


class _Clumsy:
    """Makes every kind of tool-call mistake once, then answers."""

    name = "clumsy"
    CALLS = [
        {"id": "a", "type": "function", "function": {"name": "no_such_tool", "arguments": "{}"}},
        {"id": "b", "type": "function", "function": {"name": "get_document", "arguments": "{not json"}},
        {"id": "c", "type": "function", "function": {"name": "get_document", "arguments": '{"docid": "lc-99999"}'}},
        {"id": "d", "type": "function", "function": {"name": "", "arguments": "{}"}},
        {"id": "e", "type": "function", "function": {"name": "search", "arguments": "[1, 2]"}},
    ]

    def act(self, view: AgentView) -> AgentAction:
        if view.step == 0:
            return AgentAction({"role": "assistant", "content": "", "tool_calls": self.CALLS})
        return AgentAction({"role": "assistant", "content": "done"}, final_answer="unknown")


def test_tool_errors_and_malformed_calls_become_tool_messages(localcomp) -> None:
    task = localcomp.tasks("train")[0]
    result, trajectory = run_task(task, localcomp, resolve_policy("full"), _Clumsy(), ReplayBackend())
    assert result.status == "ok" and result.n_requests == 2 and result.score == 0.0
    _, *tool_messages = trajectory.exchanges[-1].request.messages[2:]
    texts = [m["content"] for m in tool_messages]
    assert len(texts) == 5 and all(t.startswith("error:") for t in texts)
    assert "not valid JSON" in texts[1] and "lc-99999" in texts[2] and "JSON object" in texts[4]


class _Tidy(Reader):
    """Reads documents, and after the fourth asks to drop the first two results it read."""

    uses_cache_tool = True

    def act(self, view: AgentView) -> AgentAction:
        if view.step == 4:
            call = {"id": "tidy", "type": "function",
                    "function": {"name": "drop_context", "arguments": json.dumps({"message_ids": [3, 5]})}}
            return AgentAction({"role": "assistant", "content": "", "tool_calls": [call]})
        return super().act(view)


def test_the_model_based_policy_drops_what_the_agent_asked_for(localcomp) -> None:
    agent = _Watching(_Tidy(6))
    agent.uses_cache_tool = True
    task = localcomp.tasks("train")[0]
    _, trajectory = run_task(task, localcomp, resolve_policy("model-based"), agent, ReplayBackend())
    assert any(t["function"]["name"] == "drop_context" for t in trajectory.exchanges[0].request.tools)
    answered = trajectory.exchanges[5].request.messages[-1]
    assert answered["role"] == "tool" and answered["name"] == "drop_context"
    assert not agent.views[5].visible[3] and not agent.views[5].visible[5] and agent.views[5].visible[7]
    assert trajectory.exchanges[-1].usage.drop_skipped_tokens > 0


def test_under_model_based_the_scripted_agent_drops_its_dead_ends_itself(localcomp) -> None:
    task = next(t for t in localcomp.tasks("train") if t.meta.get("reference_dead_ends"))
    agent = _Watching(localcomp.scripted_agent(task))
    result, trajectory = run_task(task, localcomp, resolve_policy("model-based"), agent, ReplayBackend())
    assert result.status == "ok" and result.score == 1.0
    history = trajectory.exchanges[-1].request.messages
    asked = [json.loads(c["function"]["arguments"])["message_ids"] for m in history if m["role"] == "assistant"
             for c in m.get("tool_calls") or () if c["function"]["name"] == "drop_context"]
    dropped = sorted(i for ids in asked for i in ids)
    assert len(dropped) == task.meta["reference_dead_ends"]  # every dead end, once
    for i in dropped:  # each is a document the next assistant message called not relevant
        assert history[i]["role"] == "tool" and "is not relevant" in history[i + 1]["content"]
        assert not agent.views[-1].visible[i]
    assert trajectory.exchanges[-1].usage.drop_skipped_tokens > 0
    # without the cache tool on offer (any other policy) it never calls it
    _, plain = run_task(task, localcomp, resolve_policy("full"), localcomp.scripted_agent(task), ReplayBackend())
    assert not any(c["function"]["name"] == "drop_context" for m in plain.exchanges[-1].request.messages
                   for c in m.get("tool_calls") or ())


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_endpoint_fails_each_task_and_the_run_goes_on(localcomp, tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{_closed_port()}/v1"
    report = run_tasks(localcomp, "train", "expert", agent="llm", backend=url, model="m", limit=2,
                       out_dir=tmp_path)
    assert [r.status for r in report.results] == ["error", "error"]
    assert all("cannot reach" in reason for reason in report.summary["errors"].values())
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize("kwargs, expected", [
    ({"split": "nope"}, "nope"),
    ({"policy": "no-such-policy"}, "no-such-policy"),
    ({"task_ids": ["zz-404"]}, "zz-404"),
    ({"agent": "wizard"}, "expected scripted or llm"),
    ({"agent": "llm"}, "needs a model"),
])
def test_bad_arguments_are_one_line_errors(localcomp, kwargs: dict, expected: str) -> None:
    args = {"split": "train", "policy": "expert", **kwargs}
    with pytest.raises(ValueError, match=expected) as info:
        run_tasks(localcomp, args.pop("split"), args.pop("policy"), limits=RunLimits(max_steps=2), **args)
    assert "\n" not in str(info.value)


def test_a_run_that_crashes_keeps_the_results_already_written(localcomp, tmp_path: Path) -> None:
    def crash(result) -> None:
        raise KeyboardInterrupt  # the user stops the run after the first task

    with pytest.raises(KeyboardInterrupt):
        run_tasks(localcomp, "train", "expert", limit=3, out_dir=tmp_path, progress=crash)
    (line,) = (tmp_path / "results.jsonl").read_text().splitlines()
    assert json.loads(line)["task_id"] == localcomp.tasks("train")[0].id


def test_the_prefix_memo_gives_exactly_the_cold_accounting(localcomp) -> None:
    from sandbox.backends.replay import TaskPrefixMemo

    memo = TaskPrefixMemo()
    # expert-8k warms the memo; rolling-3 shares its prefix, then misses and must catch up
    for policy, expect_hits in (("expert-8k", False), ("rolling-3", True), ("expert-8k", True)):
        hits = memo.hits
        warm = run_tasks(localcomp, "train", policy, limit=2, backend=ReplayBackend(memo=memo))
        cold = run_tasks(localcomp, "train", policy, limit=2, backend=ReplayBackend(memo=None))
        assert [(r.tokens, r.n_requests) for r in warm.results] == [(r.tokens, r.n_requests) for r in cold.results]
        assert (memo.hits > hits) == expect_hits
    assert memo.misses > 0


class _Fields:
    """A kv policy object that sends fixed API fields from step `start` on (what the harness takes)."""

    mode = "kv"

    def __init__(self, name: str, fields: dict, start: int) -> None:
        self.name, self.fields, self.start = name, fields, start

    def decide(self, history, counter):
        fields = self.fields if len(history) > 2 * self.start + 1 else {}
        return type("Fixed", (), {"api_fields": lambda _self: fields})()


class _Recording(Reader):
    """Reads documents, thinks aloud in `reasoning_content`, and records reading the latest result."""

    def act(self, view: AgentView) -> AgentAction:
        action = super().act(view)
        message = {**action.message, "reasoning_content": f"thinking at step {view.step}"}
        used = (len(view.messages) - 1,) if view.step else ()
        return AgentAction(message, action.final_answer, used=used)


@pytest.mark.parametrize("fields, hidden", [
    ({"drop_message": {"5": [3]}}, {3}),
    ({"drop_rule": {"type": "message_drop", "drop_messages": {"5": [3]}}}, {3}),
    ({"drop_rule": {"type": "thinking_drop"}}, set()),
])
def test_the_view_accounts_for_every_drop_the_request_carries(localcomp, fields: dict, hidden: set) -> None:
    agent = _Watching(_Recording(5))
    task = localcomp.tasks("train")[0]
    run_task(task, localcomp, _Fields("fixed", fields, 3), agent, ReplayBackend())
    late = agent.views[4]
    assert [i for i, seen in enumerate(late.visible) if not seen] == sorted(hidden)
    thinking = [m for m in late.messages if m["role"] == "assistant" and "reasoning_content" in m]
    assert len(thinking) == (0 if fields.get("drop_rule", {}).get("type") == "thinking_drop" else 4)
    assert all(agent.views[1].visible) and "reasoning_content" in agent.views[1].messages[2]


def test_use_records_reach_the_trajectory_file_and_come_back(localcomp, tmp_path: Path) -> None:
    task = localcomp.tasks("train")[0]
    _, trajectory = run_task(task, localcomp, resolve_policy("full"), _Recording(3), ReplayBackend())
    trajectory.write(tmp_path / "t.jsonl")
    _, recorded = read_trajectory(tmp_path / "t.jsonl")
    assert [r.used for r in recorded] == [(), (3,), (5,), (7,)]
    assert [r.step for r in recorded] == [0, 1, 2, 3]
    # An agent that keeps no record gets one inferred from what its messages reuse (policy_dsl/reuse.py).
    _, plain = run_task(task, localcomp, resolve_policy("full"), Reader(2), ReplayBackend())
    plain.write(tmp_path / "plain.jsonl")
    inferred = [e.used for e in plain.exchanges if e.purpose == "agent"]
    assert all(used is not None for used in inferred)
    assert [r.used for r in read_trajectory(tmp_path / "plain.jsonl")[1]] == inferred


class _Overreaching(Reader):
    def act(self, view: AgentView) -> AgentAction:
        return AgentAction(super().act(view).message, used=(len(view.messages),))


def test_a_use_record_naming_no_message_fails_the_task_with_the_field_named(localcomp) -> None:
    task = localcomp.tasks("train")[0]
    result, _ = run_task(task, localcomp, resolve_policy("full"), _Overreaching(3), ReplayBackend())
    assert result.status == "error" and "AgentAction.used" in result.reason and "0..1" in result.reason


class _Peeking(Reader):
    """Records reading message 3 at every step, whether or not the policy left it visible."""

    def act(self, view: AgentView) -> AgentAction:
        action = super().act(view)
        return AgentAction(action.message, action.final_answer, used=(3,) if len(view.messages) > 3 else ())


def test_a_use_record_naming_a_hidden_message_fails_the_task_with_the_step_named(localcomp) -> None:
    task = localcomp.tasks("train")[0]
    result, _ = run_task(task, localcomp, resolve_policy("full"), _Peeking(5), ReplayBackend())
    assert result.status == "ok"  # message 3 stays visible under full
    dropping = _Fields("fixed", {"drop_message": {"5": [3]}}, 3)  # message 3 hidden from step 3 on
    result, _ = run_task(task, localcomp, dropping, _Peeking(5), ReplayBackend())
    assert result.status == "error" and "AgentAction.used" in result.reason
    assert "step 3" in result.reason and "message 3" in result.reason and "hidden under the policy" in result.reason
