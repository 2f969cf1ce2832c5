"""The llm agent's tools mode: every step a tool call under `tool_choice`, `final_answer` ends the run.

The agent's reading of replies and its choices need no model; two runs on the embedded model
(marked `model`) check what the mode is for: a localcomp task becomes a trajectory of several
requests whose tool calls run, and a `final_answer` call ends the run with its argument.
"""
from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from akv_cli.main import app
from evolve.config import ConfigError, load_config, stored_config
from sandbox.agents.llm import FINAL_ANSWER, FINAL_ANSWER_TOOL, LLMAgent
from sandbox.backends import BackendError
from sandbox.backends.embedded import forced_call
from sandbox.runs.harness import RunLimits, resolve_policy, run_task, run_tasks
from sandbox.suites import get_suite
from sandbox.suites.base import AgentView, Grade, Task

SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
TASK = Task(id="t1", suite="none", split="train", system="You research.", prompt="Find the capital.", tools=(SEARCH,))


def _call(name: str, arguments: dict[str, Any], call_id: str = "") -> dict[str, Any]:
    call = {"type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
    return {**call, "id": call_id} if call_id else call


def _view(reply: dict[str, Any], earlier: list[dict[str, Any]] = (), visible: tuple[bool, ...] | None = None,
          step: int = 1) -> AgentView:
    messages = TASK.initial_messages() + list(earlier)
    shown = visible if visible is not None else tuple(True for _ in messages)
    return AgentView(TASK, messages, shown, reply, step, (SEARCH, FINAL_ANSWER_TOOL))


def test_a_final_answer_call_ends_the_run_with_its_argument() -> None:
    reply = {"role": "assistant", "content": "", "tool_calls": [_call(FINAL_ANSWER, {"answer": " Paris "})]}
    action = LLMAgent("tools").act(_view(reply))
    assert action.final_answer == "Paris" and not action.gave_up
    assert action.message["tool_calls"][0]["id"] == "call_1_0"  # the agent names the call; the harness runs none


def test_free_mode_offers_no_final_answer_and_answers_with_text() -> None:
    agent = LLMAgent("free")
    assert agent.offered_tools == () and agent.tool_choice(0, (SEARCH,)) is None
    assert LLMAgent("free").act(_view({"role": "assistant", "content": "Paris"})).final_answer == "Paris"
    called = LLMAgent("free").act(_view({"role": "assistant", "content": "", "tool_calls": [
        _call(FINAL_ANSWER, {"answer": "Paris"})]}))
    assert called.final_answer is None  # not offered in free mode: an unknown tool, which the task reports


def test_tools_mode_looks_first_then_requires_a_call_at_every_step() -> None:
    agent = LLMAgent()  # tools is the default
    tools = (SEARCH, FINAL_ANSWER_TOOL)
    assert agent.offered_tools == (FINAL_ANSWER_TOOL,)
    assert agent.tool_choice(0, tools) == {"type": "function", "function": {"name": "search"}}
    assert agent.tool_choice(1, tools) == "required" and agent.tool_choice(7, tools) == "required"
    assert agent.tool_choice(0, (FINAL_ANSWER_TOOL,)) == "required"  # a task without tools may answer at once


def test_the_agent_gives_up_when_the_model_repeats_the_calls_it_can_see() -> None:
    search = _call("search", {"query": "capital"}, "call_0_0")
    earlier = [{"role": "assistant", "content": "", "tool_calls": [search]},
               {"role": "tool", "tool_call_id": "call_0_0", "name": "search", "content": "no hits"},
               {"role": "assistant", "content": "", "tool_calls": [{**search, "id": "call_1_0"}]},
               {"role": "tool", "tool_call_id": "call_1_0", "name": "search", "content": "no hits"}]
    reply = {"role": "assistant", "content": "", "tool_calls": [_call("search", {"query": "capital"})]}
    stuck = LLMAgent().act(_view(reply, earlier, step=2))
    assert stuck.gave_up and stuck.final_answer == ""
    assert stuck.used == (2, 4)  # the check read both earlier calls: the oracle must keep them in view
    hidden = (True, True, False, True, True, True)  # the first search was dropped: the model cannot see it
    assert LLMAgent().act(_view(reply, earlier, hidden, step=2)).final_answer is None
    other = {"role": "assistant", "content": "", "tool_calls": [_call("search", {"query": "capital city"})]}
    assert LLMAgent().act(_view(other, earlier, step=2)).final_answer is None


def test_the_embedded_backend_keeps_tool_choice_as_the_server_does() -> None:
    tools = [SEARCH, FINAL_ANSWER_TOOL]
    assert forced_call(tools, None) == (tools, None) and forced_call(tools, "auto") == (tools, None)
    assert forced_call(tools, "none") == (None, None)
    _, any_call = forced_call(tools, "required")
    assert '"search"' in any_call.text and '"final_answer"' in any_call.text
    _, named = forced_call(tools, {"type": "function", "function": {"name": "search"}})
    assert '"search"' in named.text and "final_answer" not in named.text
    with pytest.raises(BackendError, match="not_a_tool"):
        forced_call(tools, {"type": "function", "function": {"name": "not_a_tool"}})
    with pytest.raises(BackendError, match="only allowed when tools are specified"):
        forced_call([], "required")


def test_an_unknown_agent_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="agent mode 'chatty': expected tools or free"):
        LLMAgent("chatty")
    with pytest.raises(ValueError, match="expected tools or free"):
        run_tasks("localcomp", "train", "expert", agent="llm", agent_mode="chatty", limit=1)
    result = CliRunner().invoke(app, ["run", "--suite", "localcomp", "--policy", "expert", "--agent", "llm",
                                      "--agent-mode", "chatty"])
    assert result.exit_code == 2 and "--agent-mode" in result.output


def test_use_records_must_name_one_of_the_three_sources(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("max_candidates: 3\nevaluation:\n  use_records: attn\n")
    with pytest.raises(ConfigError) as err:
        load_config(config)
    assert str(err.value) == (f"{config}:3: evaluation.use_records: Input should be 'references', 'attention' "
                              "or 'both'")
    assert load_config(None).evaluation.use_records == "references"
    with pytest.raises(ConfigError, match="agent_mode: Input should be 'tools' or 'free'"):
        load_config(None, {"agent_mode": "chatty"})


def test_attention_use_records_need_the_llm_agent_and_a_backend_with_attribution(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'attention' is for the llm agent; the scripted agent keeps its own"):
        run_tasks("localcomp", "train", "expert", use_records="attention", limit=1)
    # A server URL is asked for its model card first: one that does not answer (or does not list
    # return_attribution) is refused before a task runs
    with pytest.raises(ValueError, match="'both' needs a backend with attribution .* cannot read the model card of "
                                         "http://127.0.0.1:9/v1"):
        run_tasks("localcomp", "train", "expert", agent="llm", backend="http://127.0.0.1:9/v1", use_records="both",
                  limit=1)
    config = tmp_path / "attention.yaml"
    config.write_text("agent: llm\nevaluation:\n  use_records: attention\n")
    db = tmp_path / "akv.db"
    result = CliRunner().invoke(app, ["evolve", "--config", str(config), "--db", f"sqlite:///{db}"])
    assert result.exit_code == 2
    assert "evaluation.use_records: 'attention' needs a backend with attribution" in result.output
    assert len(result.output.strip().splitlines()) == 1
    with sqlite3.connect(db) as conn:  # refused before a run was made
        assert conn.execute("SELECT count(*) FROM akv_runs").fetchone() == (0,)


def test_a_run_stored_before_agent_modes_keeps_the_free_agent() -> None:
    assert stored_config({"agent": "llm"}).agent_mode == "free"
    assert stored_config({"agent": "llm", "agent_mode": "tools"}).agent_mode == "tools"
    assert stored_config({"agent": "scripted"}).agent_mode == "tools"


# -- on the embedded model -------------------------------------------------------------------------

class _Answers:
    """A suite of one task without tools: grading keeps what it was given."""

    name = "answers"

    def __init__(self) -> None:
        self.graded: list[str | None] = []

    def open(self, task: Task) -> _Answers:
        return self

    def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        raise AssertionError(f"no tool runs after a final answer, got {name}")

    def grade(self, answer: str | None) -> Grade:
        self.graded.append(answer)
        return Grade(float(answer == "Paris"), f"{answer!r}")

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def embedded():
    from sandbox.backends.embedded import EmbeddedBackend

    backend = EmbeddedBackend()
    yield backend
    backend.close()


# Each test below pays the model's load (about 30 s on two cores) when it runs alone: all are slow.
@pytest.mark.model
@pytest.mark.slow
def test_a_final_answer_call_ends_a_run_on_the_embedded_model(embedded) -> None:
    task = Task(id="capital", suite="answers", split="train", system="You answer questions.",
                prompt="What is the capital of France?", tools=())
    suite = _Answers()
    result, trajectory = run_task(task, suite, resolve_policy("full"), LLMAgent(), embedded,
                                  limits=RunLimits(max_steps=3))
    (exchange,) = trajectory.exchanges
    assert exchange.request.tool_choice == "required"  # final_answer is the only tool: no first look
    (call,) = exchange.reply_message["tool_calls"]
    assert call["function"]["name"] == FINAL_ANSWER
    answer = json.loads(call["function"]["arguments"])["answer"].strip()
    assert result.status == "ok" and result.n_requests == 1
    assert result.answer == answer and suite.graded == [answer]


@pytest.mark.model
@pytest.mark.slow
def test_tools_mode_makes_a_multi_step_trajectory_on_a_localcomp_task(embedded) -> None:
    from akv_core.home import akv_home

    localcomp = get_suite("localcomp")
    localcomp.build(akv_home(), 0)
    task = localcomp.tasks("train")[0]
    result, trajectory = run_task(task, localcomp, resolve_policy("expert-8k"), LLMAgent("tools"), embedded,
                                  limits=RunLimits(max_steps=4))
    exchanges = trajectory.exchanges
    assert result.status in ("ok", "gave_up", "max_steps") and result.n_requests == len(exchanges) >= 2
    assert exchanges[0].request.tool_choice == {"type": "function", "function": {"name": "search"}}
    assert all(e.request.tool_choice == "required" for e in exchanges[1:])
    assert all(e.reply_message.get("tool_calls") for e in exchanges)  # every step a call, none a text answer
    ran = [m for m in exchanges[-1].request.messages if m["role"] == "tool"]
    assert ran and all(m["name"] in ("search", "get_document") for m in ran)
    assert all(not m["content"].startswith("error:") for m in ran)  # the calls ran, none was malformed
    ids = [c["id"] for m in exchanges[-1].request.messages for c in m.get("tool_calls") or ()]
    assert len(ids) == len(set(ids))  # each call's result names its own call
    assert all(e.used is not None for e in exchanges)  # inferred use records on every step, for the oracle


@pytest.mark.model
@pytest.mark.slow
def test_attention_use_records_name_the_messages_the_reply_attended_to(embedded) -> None:
    from akv_core.home import akv_home

    localcomp = get_suite("localcomp")
    localcomp.build(akv_home(), 0)
    task = localcomp.tasks("train")[0]
    _, trajectory = run_task(task, localcomp, resolve_policy("expert-8k"), LLMAgent(), embedded,
                             limits=RunLimits(max_steps=2), use_records="attention")
    assert trajectory.header["use_records"] == "attention"
    first = trajectory.exchanges[0]
    assert first.request.attribution
    # The first call reuses no string of the task (references would record nothing); the reply's
    # attention rests on the system prompt and the question.
    assert first.used is not None and {0, 1} <= set(first.used)
    assert all(e.used is not None and set(e.used) <= set(range(len(e.request.messages)))
               for e in trajectory.exchanges)
