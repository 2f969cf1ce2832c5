"""The scripted repair agent against real tasks: it repairs what its tracebacks point at, and
it re-runs what it can no longer see."""
from __future__ import annotations

import json

import pytest

from sandbox.suite import AgentView, ToolError
from sandbox.suites.localswe import LocalSWE
from sandbox.suites.localswe.bugs import validate
from sandbox.suites.localswe.hosts import load_hosts
from sandbox.suites.localswe.mutate import Mutation
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


@pytest.fixture(scope="module")
def task(suite: LocalSWE):
    host = next(h for h in load_hosts() if h.name == "isodate")
    bug = validate(host, suite._root() / "trees" / host.key, OFF_BY_ONE)
    assert bug is not None and len(bug.fail_to_pass) >= 1
    return make_task(host, bug, "train")


def run(suite: LocalSWE, task, hide=lambda messages, step: set(), max_steps: int = 60):
    """A minimal agent loop: the agent acts on what is visible, tools run for real."""
    env, agent = suite.open(task), suite.scripted_agent(task)
    messages, calls = task.initial_messages(), []
    try:
        for step in range(max_steps):
            hidden = hide(messages, step)
            view = AgentView(task, list(messages), [i not in hidden for i in range(len(messages))], None, step)
            action = agent.act(view)
            messages.append(action.message)
            if action.final_answer is not None:
                return env.grade(action.final_answer), calls, action.final_answer
            for call in action.message["tool_calls"]:
                name, args = call["function"]["name"], json.loads(call["function"]["arguments"])
                calls.append(name)
                try:
                    content = env.call_tool(name, args)
                except ToolError as error:
                    content = f"error: {error}"
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": content})
        raise AssertionError("the agent never finished")
    finally:
        env.close()


def test_the_agent_repairs_a_bug_and_reruns_what_it_can_no_longer_see(suite: LocalSWE, task) -> None:
    def hide_first_test_output(messages, step):
        return {3} if step == 1 else set()  # the first run_tests result, dropped once

    grade, calls, answer = run(suite, task, hide=hide_first_test_output)
    assert calls[:2] == ["run_tests", "run_tests"]  # it saw nothing, so it asked again
    assert "edit" in calls and calls[-1] == "submit"
    assert answer.startswith("Fixed src/isodate/isodates.py line 179")
    assert grade.score == 1.0, grade.detail


def test_when_no_tool_output_stays_visible_it_gives_up_and_submits(task) -> None:
    # Nothing the tools say is ever visible, so no tool needs to run.
    agent = LocalSWE().scripted_agent(task)
    messages, visible, names = task.initial_messages(), [True, True], []
    for step in range(10):
        action = agent.act(AgentView(task, list(messages), list(visible), None, step))
        messages.append(action.message)
        visible.append(True)
        if action.final_answer is not None:
            break
        call = action.message["tool_calls"][0]
        names.append(call["function"]["name"])
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": "(dropped)"})
        visible.append(False)
    assert names == ["run_tests"] * 3 + ["submit"]
    assert action.final_answer.startswith("No repair found")


def test_a_visible_placeholder_counts_as_dropped(task) -> None:
    # Text-mode policies keep messages visible but replace their text: the agent must ask again.
    agent = LocalSWE().scripted_agent(task)
    messages = task.initial_messages()
    first = agent.act(AgentView(task, list(messages), [True, True], None, 0)).message
    messages += [first, {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"],
                         "content": "[tool output omitted]"}]
    second = agent.act(AgentView(task, list(messages), [True] * 4, None, 1)).message
    assert second["tool_calls"][0]["function"] == first["tool_calls"][0]["function"]
