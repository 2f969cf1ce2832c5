"""The scripted repair agent against real tasks: it decides from what is visible only, fetches
again what was dropped, records exactly what it read, and says when it gives up."""
from __future__ import annotations

import json

import pytest

from sandbox.suites.base import AgentView, ToolError
from sandbox.suites.localswe import LocalSWE
from sandbox.suites.localswe.agent import ScriptedRepairAgent
from sandbox.suites.localswe.bugs import validate
from sandbox.suites.localswe.hosts import load_hosts
from sandbox.suites.localswe.mutate import Mutation
from sandbox.suites.localswe.notes import parse_note
from sandbox.suites.localswe.tasks import make_task

from test_localswe_suite import built_home

# isodate's week-date parser with `isocalendar()[2]` (the weekday) read as index 3.
OFF_BY_ONE = Mutation("src/isodate/isodates.py", 179, "off_by_one",
                      "                        days=-isotuple[2] + days,",
                      "                        days=-isotuple[3] + days,")


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> LocalSWE:
    built = LocalSWE(hosts=["isodate"], bugs_per_host=3, max_tries=12)
    built.build(built_home(tmp_path_factory), seed=0)
    return built


@pytest.fixture(scope="module", params=[2, 1], ids=["edition2", "edition1"])
def task(request, suite: LocalSWE):
    host = next(h for h in load_hosts() if h.name == "isodate")
    bug = validate(host, suite._root() / "trees" / host.key, OFF_BY_ONE)
    assert bug is not None and len(bug.fail_to_pass) >= 1
    return make_task(host, bug, "train", edition=request.param)


def run(suite: LocalSWE, task, hide=lambda messages, step: set(), max_steps: int = 100):
    """A minimal agent loop: the agent acts on what `hide` leaves visible, tools run for real.

    Returns the grade, the final action and, per step, (the messages shown, the action).
    """
    env, agent = suite.open(task), suite.scripted_agent(task)
    messages, steps = task.initial_messages(), []
    try:
        for step in range(max_steps):
            hidden = hide(messages, step)
            view = AgentView(task, list(messages), [i not in hidden for i in range(len(messages))], None, step)
            action = agent.act(view)
            steps.append((view, action))
            messages.append(action.message)
            if action.final_answer is not None:
                return env.grade(action.final_answer), action, steps
            for call in action.message["tool_calls"]:
                name, args = call["function"]["name"], json.loads(call["function"]["arguments"])
                try:
                    content = env.call_tool(name, args)
                except ToolError as error:
                    content = f"error: {error}"
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": content})
        raise AssertionError("the agent never finished")
    finally:
        env.close()


def kinds(steps) -> list[str]:
    return [parse_note(action.message["content"]).kind for _, action in steps[:-1]]


def test_the_agent_repairs_a_frame_line_and_says_so(suite: LocalSWE, task) -> None:
    grade, last, steps = run(suite, task)
    assert grade.score == 1.0, grade.detail
    assert last.final_answer.startswith("Fixed src/isodate/isodates.py line 179") and not last.gave_up
    opening = ["orient", "reproduce", "read"] if task.meta["edition"] == 2 else ["reproduce", "read"]
    assert kinds(steps)[:len(opening)] == opening
    assert kinds(steps)[-3:] == ["attempt", "verify", "submit"]


def test_what_it_used_is_exactly_what_it_needs(suite: LocalSWE, task) -> None:
    # Each step, shown only the messages it says it used, takes the same action; and a whole run
    # that hides every message after the last step using it (the hindsight schedule) is the same run.
    grade, _, steps = run(suite, task)
    for view, action in steps:
        only_used = AgentView(task, view.messages, [i in action.used for i in range(len(view.messages))],
                              None, view.step)
        assert suite.scripted_agent(task).act(only_used).message == action.message, view.step
        assert action.used[-1] == len(view.messages) - 1  # the latest message, at least
    last_use = {i: t for t, (_, action) in enumerate(steps) for i in action.used}
    hindsight_grade, _, again = run(suite, task, hide=lambda messages, step: {
        i for i in range(len(messages)) if last_use.get(i, -1) < step})
    assert [a.message for _, a in again] == [a.message for _, a in steps]
    assert hindsight_grade.score == grade.score == 1.0
    hidden_at_end = sum(not seen for seen in again[-1][0].visible)
    assert hidden_at_end > len(again[-1][0].messages) // 3  # most of the history was not needed any more


def test_a_dropped_test_output_is_run_again(suite: LocalSWE, task) -> None:
    # The first run_tests result, hidden once the agent has read it (edition 2 reads the test first).
    reproduction, seen_until = (5, 2) if task.meta["edition"] == 2 else (3, 1)
    grade, last, steps = run(suite, task, hide=lambda messages, step: {reproduction} if step > seen_until else set())
    runs = [parse_note(a.message["content"]).kind for _, a in steps
            if any(c["function"]["name"] == "run_tests" for c in a.message.get("tool_calls") or ())]
    assert runs.count("reproduce") == 2  # it could not see it, so it ran it again
    assert grade.score == 1.0 and last.final_answer.startswith("Fixed")


def test_with_only_the_latest_tool_output_in_view_it_gives_up(suite: LocalSWE, task) -> None:
    def only_latest_tool_message(messages, step):
        tools = [i for i, m in enumerate(messages) if m["role"] == "tool"]
        return set(tools[:-1])

    grade, last, steps = run(suite, task, hide=only_latest_tool_message)
    assert last.gave_up and last.final_answer == "Giving up: I keep losing sight of what I need; submitted."
    assert "attempt" not in kinds(steps) and len(steps) < 15 and grade.score == 0.0


def test_without_its_own_messages_it_has_lost_track(suite: LocalSWE, task) -> None:
    def only_protected_and_latest(messages, step):
        return set(range(2, len(messages) - 1))

    grade, last, steps = run(suite, task, hide=only_protected_and_latest)
    assert last.gave_up and len(steps) == 3 and grade.score == 0.0
    assert steps[1][1].message["content"].startswith("Giving up: I have lost track of my work")


def test_a_visible_placeholder_counts_as_dropped(task) -> None:
    # Text-mode policies keep messages visible but replace their text: the agent must ask again.
    agent = ScriptedRepairAgent(task, edition=1)
    messages = task.initial_messages()
    first = agent.act(AgentView(task, list(messages), [True, True], None, 0)).message
    messages += [first, {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"],
                         "content": "[omitted tool message of 812 tokens]"}]
    second = agent.act(AgentView(task, list(messages), [True] * 4, None, 1))
    assert second.message["tool_calls"][0]["function"] == first["tool_calls"][0]["function"]
    assert second.used == (1, 2, 3)


def test_when_its_step_budget_is_spent_it_gives_up(suite: LocalSWE, task) -> None:
    agent = ScriptedRepairAgent(task, edition=task.meta["edition"], max_calls=4)
    env, messages = suite.open(task), task.initial_messages()
    try:
        for step in range(6):
            action = agent.act(AgentView(task, list(messages), [True] * len(messages), None, step))
            messages.append(action.message)
            if action.final_answer is not None:
                break
            for call in action.message["tool_calls"]:
                args = json.loads(call["function"]["arguments"])
                messages.append({"role": "tool", "tool_call_id": call["id"],
                                 "content": env.call_tool(call["function"]["name"], args)})
    finally:
        env.close()
    assert action.gave_up and action.final_answer == "Giving up: my step budget is spent; submitted."


def test_a_hidden_newest_result_is_never_read_and_the_call_is_made_again(suite: LocalSWE, task) -> None:
    # The first reproduction's output, hidden at the very step it arrives: the agent may not read
    # it (nor record it), so it behaves as if it had never come and runs the tests again.
    reproduction, arrives = (5, 2) if task.meta["edition"] == 2 else (3, 1)
    grade, last, steps = run(suite, task, hide=lambda messages, step: {reproduction} if step == arrives else set())
    view, action = steps[arrives]
    assert reproduction not in action.used and parse_note(action.message["content"]).kind == "reproduce"
    assert [c["function"]["name"] for c in action.message["tool_calls"]] == ["run_tests"]
    assert all(view.visible[i] for view, action in steps for i in action.used)
    assert grade.score == 1.0 and last.final_answer.startswith("Fixed")


def test_hidden_test_output_after_an_attempt_is_checked_again_not_guessed(suite: LocalSWE, task) -> None:
    # Every attempt's test output is hidden at the step it arrives. The edit went in (its result is
    # visible), so the agent reruns the failing tests instead of assuming they failed.
    def after_attempts(messages, step):
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant") if step else 0
        note = parse_note(messages[last].get("content") or "") if step else None
        return {len(messages) - 1} if note is not None and note.kind == "attempt" else set()

    grade, last, steps = run(suite, task, hide=after_attempts)
    assert all(view.visible[i] for view, action in steps for i in action.used)
    assert "check" in kinds(steps) and kinds(steps)[-3:] == ["check", "verify", "submit"]
    assert grade.score == 1.0 and last.final_answer.startswith("Fixed")


def test_when_its_own_last_message_is_hidden_too_it_has_lost_track(suite: LocalSWE, task) -> None:
    # At step 1 its first message and that call's result are hidden: no older call stands in for it.
    grade, last, steps = run(suite, task, hide=lambda messages, step: {2, 3} if step == 1 else set())
    assert all(view.visible[i] for view, action in steps for i in action.used)
    assert last.gave_up and len(steps) == 3 and grade.score == 0.0
    assert steps[1][1].message["content"].startswith("Giving up: I have lost track of my work")
