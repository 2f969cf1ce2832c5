"""Harness parts that need no suite: the llm agent's reading of replies, the trajectory format,
the extractive summarizer and the text editor (with the real chat tokenizer as counter)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from sandbox.agents.llm import AgentSetupError, LLMAgent
from sandbox.backends import BackendError, BackendRequest, CacheOperations
from sandbox.backends.tokens import shared_tokenizer
from sandbox.runs.cost import ReportedUsage
from sandbox.runs.summarize import extractive_summary
from sandbox.runs.trajectory import Exchange, Trajectory, read_trajectory
from sandbox.suites.base import AgentView, Task

TASK = Task(id="t1", suite="none", split="train", system="You research.", prompt="Find the capital.", tools=())


def _view(response: dict | None) -> AgentView:
    return AgentView(TASK, TASK.initial_messages(), (True, True), response, step=3)


def test_llm_agent_answers_when_the_model_calls_no_tool() -> None:
    action = LLMAgent().act(_view({"role": "assistant", "content": "  Paris \n"}))
    assert action.final_answer == "Paris"


def test_llm_agent_parses_calls_written_as_text_and_gives_them_ids() -> None:
    text = 'Let me look.<tool_call>{"name": "search", "arguments": {"query": "capital"}}</tool_call>'
    action = LLMAgent().act(_view({"role": "assistant", "content": text}))
    assert action.final_answer is None
    (call,) = action.message["tool_calls"]
    assert call["id"] == "call_3_0"
    assert call["function"]["name"] == "search"
    assert json.loads(call["function"]["arguments"]) == {"query": "capital"}
    assert action.message["content"] == "Let me look."


def test_llm_agent_keeps_a_malformed_text_call_for_the_harness_to_report() -> None:
    action = LLMAgent().act(_view({"role": "assistant", "content": "<tool_call>{not json</tool_call>"}))
    (call,) = action.message["tool_calls"]
    assert call["function"]["name"] == ""


def test_llm_agent_refuses_a_backend_without_a_model() -> None:
    with pytest.raises(AgentSetupError, match="needs a model"):
        LLMAgent().act(_view(None))


def test_trajectory_file_rebuilds_every_full_request(tmp_path: Path) -> None:
    trajectory = Trajectory({"task_id": "t1"})
    history = TASK.initial_messages()
    usage = ReportedUsage(10, 1, 4, 0, 0, 6)
    for step in range(3):
        request = BackendRequest(messages=tuple(history), drop_message={"2": [1]} if step == 2 else {},
                                 reposition=(2,) if step == 2 else (), max_tokens=5)
        trajectory.add(Exchange(step, "agent", request, None, usage, 0.0))
        history = history + [{"role": "assistant", "content": f"step {step}"}]
    summary = BackendRequest(messages=({"role": "user", "content": "summarize"},), max_tokens=9)
    trajectory.add(Exchange(2, "summary", summary, {"role": "assistant", "content": "s"}, usage, 0.0))
    path = tmp_path / "t1.jsonl"
    trajectory.write(path)
    header, recorded = read_trajectory(path)
    assert header["task_id"] == "t1"
    assert [r.purpose for r in recorded] == ["agent", "agent", "agent", "summary"]
    assert [len(r.request.messages) for r in recorded] == [2, 3, 4, 1]
    assert recorded[2].request.messages[-1] == {"role": "assistant", "content": "step 1"}
    assert recorded[2].request.api_fields() == {"drop_message": {"2": [1]}, "reposition": [2]}
    assert recorded[3].request.max_tokens == 9 and recorded[0].usage == usage
    # deltas: the third request stores one new message, not the whole history
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[3]["shared"] == 3 and len(lines[3]["messages"]) == 1


def test_extractive_summary_keeps_facts_within_the_budget_deterministically() -> None:
    tokenizer = shared_tokenizer()
    count = lambda text: len(tokenizer.encode(text))  # noqa: E731
    messages = [
        {"role": "tool", "name": "get_document", "content":
            "It is a nice place. The population of Avaland is 4721 people. People like it a lot. "
            "Its capital Borvik was founded in 1312. Many say the weather is pleasant."},
        {"role": "tool", "name": "get_document", "content": "Nothing much here. Doc doc-17 lists Zed at 88 m."},
    ]
    summary = extractive_summary(messages, 40, count)
    assert count(summary) <= 40
    assert "4721" in summary and "1312" in summary
    assert "pleasant" not in summary  # vague sentences go first when the budget is tight
    assert extractive_summary(messages, 40, count) == summary
    assert count(extractive_summary(messages, 12, count)) <= 12


def test_fact_summary_keeps_the_best_facts_whole_under_their_source_within_the_budget() -> None:
    from sandbox.runs.summarize import Fact, fact_summary

    count = lambda text: len(text.split())  # noqa: E731
    facts = [Fact(1.0, 0, "| Founded | 1312 |", head="[d-1] Avaland"), Fact(3.0, 1, "Found X: Avaland"),
             Fact(2.0, 0, "| Capital | Borvik |", head="[d-1] Avaland"), Fact(0.5, 2, "a long plan line " * 9)]
    summary = fact_summary(facts, 20, count)
    # blocks in their original order, the head written once before its kept facts, the plan left out
    assert summary == "[d-1] Avaland\n| Founded | 1312 |\n| Capital | Borvik |\n\nFound X: Avaland"
    assert fact_summary(facts, 14, count) == "[d-1] Avaland\n| Capital | Borvik |\n\nFound X: Avaland"
    assert fact_summary(facts, 2, count) == ""


def _tool_history(n_calls: int) -> list[dict]:
    history = TASK.initial_messages()
    for i in range(n_calls):
        history.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": "get_document",
                                                             "arguments": json.dumps({"docid": f"d{i}"})}}]})
        history.append({"role": "tool", "tool_call_id": f"c{i}", "name": "get_document",
                        "content": f"Document d{i}: the code of door {i} is {1000 + i}. It rained that day."})
    return history


def test_text_editor_summarizes_on_replay_bills_the_call_and_keeps_calls_paired() -> None:
    from policy_dsl import SUMMARY_PREFIX, TextEdit
    from sandbox.backends.replay import ReplayBackend
    from sandbox.runs.summarize import TextEditor

    billed = []
    editor = TextEditor(TASK.prompt, ReplayBackend(), shared_tokenizer(),
                        lambda step, request, reply, usage: billed.append((step, request, reply, usage)))
    history = _tool_history(4)  # 10 messages
    # 2..6 cuts the third call (6) from its result (7): the result must become plain text
    edited = editor.apply(history, [TextEdit("summarize", 2, 6, budget_tokens=60)], step=5)
    assert edited[:2] == history[:2]
    assert edited[2]["role"] == "user" and edited[2]["content"].startswith(SUMMARY_PREFIX)
    assert "1000" in edited[2]["content"]
    assert shared_tokenizer().count(edited[2]) <= 60 + 10  # budget plus the template's glue
    assert edited[3]["role"] == "user" and "[result of get_document]" in edited[3]["content"]
    assert edited[4:] == history[8:] and edited[4] is history[8]
    ((step, request, reply, usage),) = billed
    assert step == 5 and usage.prefilled_tokens == usage.prompt_tokens > 0
    assert usage.completion_tokens == len(shared_tokenizer().encode(reply["content"]))


def test_text_editor_omits_with_the_policy_placeholder() -> None:
    from policy_dsl import TextEdit
    from sandbox.backends.replay import ReplayBackend
    from sandbox.runs.summarize import TextEditor

    editor = TextEditor(TASK.prompt, ReplayBackend(), shared_tokenizer(), lambda *a: None)
    history = _tool_history(2)
    edited = editor.apply(history, [TextEdit("omit", 3, 3, placeholder="[omitted 20 tokens]")], step=2)
    assert edited[3] == {**history[3], "content": "[omitted 20 tokens]"}
    assert [m["role"] for m in edited] == [m["role"] for m in history]


@pytest.mark.parametrize("given, expected", [
    ("http://127.0.0.1:30000", "http://127.0.0.1:30000/v1"),
    ("http://127.0.0.1:30000/", "http://127.0.0.1:30000/v1"),
    ("http://127.0.0.1:30000/v1", "http://127.0.0.1:30000/v1"),
    ("https://api.example.com/v1/chat/completions", "https://api.example.com/v1"),
])
def test_endpoint_urls_are_normalized_to_the_v1_root(given: str, expected: str) -> None:
    from akv_core.client import base_url

    assert base_url(given) == expected


def test_unknown_backend_names_what_is_expected() -> None:
    from sandbox.backends import open_backend

    with pytest.raises(ValueError, match="expected replay, embedded or an http"):
        open_backend("gpu")


def test_a_precision_is_checked_before_any_model_loads_and_only_for_the_embedded_backend() -> None:
    from sandbox.backends import open_backend

    with pytest.raises(ValueError, match="precision: expected one of float32, fp16, mixed, int8, int4, got 'int3'"):
        open_backend("embedded", precision="int3")
    for spec in ("replay", "http://127.0.0.1:9/v1"):
        with pytest.raises(ValueError, match="precision: applies to the embedded backend only"):
            open_backend(spec, precision="int4")


def test_request_fields_leave_empty_operations_out_and_prefer_drop_rule() -> None:
    assert BackendRequest(messages=()).api_fields() == {}
    request = BackendRequest(messages=(), drop_message={"3": [1]}, reposition=(3,),
                             drop_rule={"type": "thinking_drop"})
    assert request.api_fields() == {"drop_rule": {"type": "thinking_drop"}, "reposition": [3]}


def test_request_cache_operations_resolve_the_drop_rule() -> None:
    plain = BackendRequest(messages=(), drop_message={"3": [1]}, reposition=(3,))
    assert plain.cache_operations() == CacheOperations({"3": [1]}, (3,), False)
    thinking = BackendRequest(messages=(), reposition=(3,), drop_rule={"type": "thinking_drop"})
    assert thinking.cache_operations() == CacheOperations(None, (3,), True)
    rule = BackendRequest(messages=(), drop_rule={"type": "message_drop", "drop_messages": {"3": [2]}})
    assert rule.cache_operations() == CacheOperations({"3": [2]}, (), False)
    with pytest.raises(BackendError, match="drop_rule.type: expected message_drop, thinking_drop, text_drop or "
                                           "keep_text_drop"):
        BackendRequest(messages=(), drop_rule={"type": "forget"}).cache_operations()


def test_text_drops_resolve_against_the_history_and_hide_the_cut_text_from_the_agent() -> None:
    from akv_core.cache.text_drop import TextCut, TextDrop
    from sandbox.runs.harness import agent_view

    history = THINKING_HISTORY
    cut = [None, {"role": "user", "content": " the capital"}, {"role": "assistant", "content": "Canberra."}, None]
    request = BackendRequest(messages=history, drop_rule={"type": "text_drop", "drop_messages": cut})
    operations = request.cache_operations()
    assert operations.text_drop == TextDrop(3, (TextCut(1, ((4, 16),)), TextCut(2, ((0, 9),), whole=True)))
    view = agent_view(None, request, None, 0)
    assert view.messages[1]["content"] == "Find." and view.visible == (True, True, False, True)
    kept = (history[0], {"role": "user", "content": "Find"}, history[3])
    keep = BackendRequest(messages=kept, drop_rule={"type": "keep_text_drop", "full_messages": list(history)})
    assert keep.cache_operations().prompt == history   # the full history is what is rendered
    view = agent_view(None, keep, None, 0)
    assert view.messages == kept and all(view.visible)   # the agent sees the kept messages
    for rule in ({"type": "text_drop", "drop_messages": [None]},
                 {"type": "keep_text_drop", "full_messages": [history[3]]}):
        with pytest.raises(BackendError, match="drop_rule"):
            BackendRequest(messages=history, drop_rule=rule).cache_operations()


THINKING_HISTORY = (
    {"role": "system", "content": "You research."},
    {"role": "user", "content": "Find the capital."},
    {"role": "assistant", "content": "Canberra.", "reasoning_content": "Not Sydney; the capital is Canberra."},
    {"role": "user", "content": "And its population?"},
)


def test_replay_accounts_thinking_drop_as_the_simulator_does_memo_or_not() -> None:
    from akv_core.cache.simulator import CacheSimulator
    from sandbox.backends.replay import ReplayBackend, TaskPrefixMemo

    rendered = shared_tokenizer().render(THINKING_HISTORY)
    start, end = rendered.reasoning_spans[2]
    requests = [BackendRequest(messages=THINKING_HISTORY, drop_rule={"type": "thinking_drop"}),
                BackendRequest(messages=THINKING_HISTORY, drop_rule={"type": "thinking_drop"}, reposition=(3,)),
                BackendRequest(messages=THINKING_HISTORY, drop_rule={"type": "message_drop",
                                                                     "drop_messages": {"3": [2]}})]
    simulator = CacheSimulator(1 << 20)
    expected = [ReportedUsage.from_fields(simulator.request(rendered, None, None, max_tokens=64, thinking_drop=True)),
                ReportedUsage.from_fields(simulator.request(rendered, None, [3], max_tokens=64, thinking_drop=True)),
                ReportedUsage.from_fields(simulator.request(rendered, {"3": [2]}, None, max_tokens=64))]
    assert expected[1].drop_skipped_tokens == end - start > 0
    # The thinking requests retained the reasoning's KV, and the repositioned one read the rest of
    # message 2 and message 3 through copies, which retained their birth slots too. Keeping the
    # reasoning visible until message 3 revives them: message 2 is reused whole (and hidden at the
    # end), and only what follows it is computed.
    message_start, message_end = rendered.spans[2]
    assert expected[2].drop_skipped_tokens == message_end - message_start > 0
    assert expected[2].prefilled_tokens == len(rendered.token_ids) - message_end
    replay = ReplayBackend(memo=TaskPrefixMemo())
    for task in range(2):   # the second task is served from the memo
        replay.start_task()
        assert [replay.complete(request).usage for request in requests] == expected
    # The memo keys on the reasoning spans too: the same tokens without reasoning are another request.
    as_text = [dict(m) for m in THINKING_HISTORY]
    as_text[2] = {"role": "assistant", "content": "<think>\n" + THINKING_HISTORY[2]["reasoning_content"]
                  + "\n</think>\n\nCanberra."}
    assert shared_tokenizer().render(as_text).token_ids == rendered.token_ids
    replay.start_task()
    replay.complete(requests[0])
    assert replay.complete(BackendRequest(messages=tuple(as_text), drop_rule={"type": "thinking_drop"})
                           ).usage.drop_skipped_tokens == 0


def test_the_cache_tool_is_offered_only_under_policies_that_act_on_it() -> None:
    from sandbox.runs.harness import reads_drop_context, resolve_policy

    assert reads_drop_context(resolve_policy("model-based"))
    assert not any(reads_drop_context(resolve_policy(p)) for p in ("expert", "full", "standard-8k"))
