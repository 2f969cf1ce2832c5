"""Reflection: message timelines of real task runs, digests within their budget, prompts within the
model's context, and no held-out task in any prompt."""
from __future__ import annotations

import random

import pytest

from evolve.context import Candidate, HeldOutLeak, build_context
from evolve.library import load_checked
from evolve.proposers.llm import language_reference
from evolve.proposers.prompt import PromptTooLong, extract_diagnosis, fit_prompt
from evolve.reflection import digest, pick_tasks, timeline_of
from sandbox.backends.replay import ReplayBackend
from sandbox.backends.tokens import shared_tokenizer
from sandbox.runs.harness import resolve_policy, run_task
from sandbox.suites import get_suite
from sandbox.suites.base import AgentAction, AgentView
from store import TaskResult, TimelineRecord
from test_sandbox_support import Reader

COUNTER = shared_tokenizer()


def count(text: str) -> int:
    return len(COUNTER.encode_text(text))


@pytest.fixture(scope="module")
def localcomp():
    from akv_core.home import akv_home

    suite = get_suite("localcomp")
    suite.build(akv_home(), 0)
    return suite


class _ReadsFirstAtTheEnd(Reader):
    """Reads one document per step (reading the one before); its answer reads the first document."""

    def act(self, view: AgentView) -> AgentAction:
        action = super().act(view)
        latest = len(view.messages) - 1
        used = (3, latest) if action.final_answer is not None else ((latest,) if view.step else ())
        return AgentAction(action.message, action.final_answer, used=used)


def _timeline(suite, policy: str, agent, task: int = 0):
    task_obj = suite.tasks("train")[task]
    _, trajectory = run_task(task_obj, suite, resolve_policy(policy), agent or suite.scripted_agent(task_obj),
                             ReplayBackend())
    return timeline_of(trajectory, COUNTER.count)


def test_a_timeline_names_drops_and_the_refetches_they_caused(localcomp):
    timeline = _timeline(localcomp, "rolling-3", None, task=3)
    messages = {m["i"]: m for m in timeline["messages"]}
    refetches = [m for m in messages.values() if m["refetch_of"] is not None]
    assert refetches and timeline["split"] == "train" and timeline["rewrites"] == []
    for again in refetches:
        origin = messages[again["refetch_of"]]
        assert origin["tool"] == again["tool"] and origin["i"] < again["i"]
        assert origin["dropped"] is not None and origin["dropped"] <= again["arrived"]  # it was gone when fetched
    assert all(m["tokens"] > 0 for m in messages.values())
    assert all(m["dropped"] is None for m in _timeline(localcomp, "full", None, task=3)["messages"])


def test_unused_visible_tokens_follow_the_use_records(localcomp):
    timeline = _timeline(localcomp, "full", _ReadsFirstAtTheEnd(5))
    assert timeline["uses_recorded"] and timeline["steps"] == 6
    by_index = {m["i"]: m for m in timeline["messages"]}
    assert by_index[3]["uses"] == [1, 5] and by_index[3]["idle"] == 0  # read by the answer: never idle
    assert by_index[5]["uses"] == [2] and by_index[5]["idle"] == 3  # visible in steps 3..5 after its last read
    text = digest(timeline, 2000, count).text
    assert "visible tokens paid for after their last use" in text and "#5" in text


def test_a_digest_never_exceeds_its_budget_and_says_when_it_was_cut(localcomp):
    timeline = _timeline(localcomp, "rolling-3", None, task=3)
    whole = digest(timeline, 100_000, count)
    assert not whole.shortened and "re-fetch" in whole.text
    for budget in (40, 120, 400, whole.tokens - 1):
        made = digest(timeline, budget, count)
        assert made.tokens <= budget and made.shortened and count(made.text) <= budget
    assert digest(timeline, 3, count).text == ""  # not even the task line fits: nothing


def _parent(localcomp, policy: str = "rolling-3") -> Candidate:
    timelines, results = {}, []
    for task in range(4):
        timeline = _timeline(localcomp, policy, None, task=task)
        timelines[timeline["task_id"]] = timeline
        results.append(TaskResult(timeline["task_id"], "train", timeline["status"], timeline["score"],
                                  timeline["cost_usd"]))
    return Candidate(1, load_checked(policy).text, 0, sum(r.score for r in results) / 4,
                     sum(r.cost_usd for r in results) / 4, tuple(results), timelines)


def test_the_prompt_fits_the_context_and_its_digests_grow_with_it(localcomp):
    parent = _parent(localcomp)
    system = language_reference([load_checked("expert-8k").text])
    small = fit_prompt(system, parent, [], [parent], 8192, 1024, 2, count)
    assert small.tokens + 1024 <= 8192 and small.digested
    assert count(system) + count(small.text) <= small.tokens
    large = fit_prompt(system, parent, [], [parent], 200_000, 1024, 2, count)
    assert count(large.text) > count(small.text) and not large.shortened
    assert set(large.digested) == set(pick_tasks(parent.timelines, 2, 2))
    tight = fit_prompt(system, parent, [], [parent], small.tokens - count(small.text) + 1024 + 400, 1024, 2, count)
    assert tight.tokens + 1024 <= small.tokens - count(small.text) + 1024 + 400 + 1024 and tight.shortened
    with pytest.raises(PromptTooLong, match="llm.context_tokens"):
        fit_prompt(system, parent, [], [parent], count(system) + 100, 16, 2, count)


def test_the_diagnosis_is_the_text_before_the_policy_block():
    answer = "**Diagnosis:** the window drops documents\nthat are needed again.\n\n```akvp\nmode kv\n```"
    assert extract_diagnosis(answer, 600) == "the window drops documents that are needed again."
    assert extract_diagnosis("```akvp\nmode kv\n```", 600) is None
    assert extract_diagnosis("Diagnosis: " + "x" * 100 + "\n```\nmode kv\n```", 40).endswith("…")


def test_held_out_timelines_never_reach_a_proposer():
    policy = load_checked("expert-8k")
    from store import PolicyInfo

    info = PolicyInfo(1, 1, policy.hash, policy.text, policy.text, None, 0, "seed", "evaluated", None, (), 0, 0,
                      0.0, {})
    leak = TimelineRecord(1, "localcomp-heldout-000", "heldout", {"split": "heldout", "task_id": "x"})
    with pytest.raises(HeldOutLeak, match="timeline of policy #1"):
        build_context([info], [], ["t"], random.Random(0), 0, [leak])


def test_a_result_read_once_and_kept_is_quoted_with_the_agents_next_turn(localcomp):
    timeline = _timeline(localcomp, "full", None)
    once = [m for m in timeline["messages"] if m.get("next_turn") and "is not relevant" in m["next_turn"]]
    assert once and all(m["role"] == "tool" and len(m["uses"]) <= 1 for m in once)   # edition 2's dead ends
    text = digest(timeline, 100_000, count).text
    quoted = [line for line in text.splitlines() if line.startswith(" read once, then idle")]
    assert quoted and any("is not relevant" in line for line in quoted)
    assert all(len(line) < 300 for line in quoted)
