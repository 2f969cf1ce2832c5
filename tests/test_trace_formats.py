"""Trace formats: reading and detecting each format, gateway continuation, text actions as tool calls,
the akv round trip, and `FILE:LINE:` errors for bad input (data in tests/data/traces, README there)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from sandbox.traces.formats import BASH_TOOL, FORMATS, as_tool_calls, detect_format, extends, read_located, read_traces
from sandbox.traces.model import Trace, TraceError, TraceRequest

DATA = Path(__file__).parent / "data" / "traces"


def _roles(trace: Trace) -> list[str]:
    return [m["role"] for m in trace.messages]


def _write_lines(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize(("name", "expected"), [
    ("openai.jsonl", "openai"),
    ("samples.jsonl", "openai"),
    ("sweagent-fc.traj", "swe-agent"),
    ("sweagent-text.traj", "swe-agent"),
    ("mswea.traj.json", "mini-swe-agent"),
    ("mswea-v2.traj.json", "mini-swe-agent"),
    ("messages.traj.json", "messages"),
    ("taubench.json", "tau-bench"),
])
def test_each_file_is_detected(name: str, expected: str) -> None:
    assert detect_format(DATA / name) == expected


def test_openai_ids_system_prompts_tools_and_provenance() -> None:
    traces = read_traces(DATA / "openai.jsonl")
    assert [t.id for t in traces] == ["fix-readme-typo", "openai-2", "trip-lisbon", "chatcmpl-9f1c2a"]
    first, bare = traces[0], traces[1]
    assert _roles(first)[0] == "system" and _roles(bare)[0] == "user"
    assert first.provenance == {"source": "hand-made example", "agent": "tool-calling coding assistant",
                                "format": "openai", "file": "openai.jsonl", "line": 1}
    assert bare.provenance == {"format": "openai", "file": "openai.jsonl", "line": 2}
    assert [t["function"]["name"] for t in first.tools] == ["read_file", "write_file"]
    assert first.messages[2]["content"] is None  # kept as given
    assert isinstance(bare.messages[0]["content"], list)  # content parts kept as given
    assert all(t.actions == "tools" for t in traces)
    assert [r.index for r in first.requests] == first.assistant_indices() == [2, 4, 6]
    assert all(r.usage is None and r.latency_s is None for r in first.requests)


def test_openai_mid_run_user_turn_and_parallel_calls() -> None:
    trip = read_traces(DATA / "openai.jsonl")[2]
    assert _roles(trip) == ["system", "user", "assistant", "tool", "tool", "assistant", "user", "assistant", "tool",
                            "assistant"]
    assert [c["id"] for c in trip.messages[2]["tool_calls"]] == ["call_fl01", "call_wx02"]
    assert [r.index for r in trip.requests] == [2, 5, 7, 9]


def test_gateway_lines_continue_one_trace_with_usage_per_request() -> None:
    session = read_traces(DATA / "openai.jsonl")[3]
    assert session.provenance["line"] == 4 and session.provenance["lines"] == [4, 5, 6]
    assert session.metadata == {"model": "gpt-4o-mini-2024-07-18"}
    assert _roles(session) == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert session.messages[-1]["content"].startswith("/var/log/builder-debug.log is 29 GB")
    assert isinstance(session.messages[1]["content"], list)  # the longer, later history replaced the first
    assert [r.index for r in session.requests] == [2, 4, 6]
    assert [r.usage["prompt_tokens"] for r in session.requests] == [143, 221, 310]
    assert [r.latency_s for r in session.requests] == pytest.approx([0.812, 0.64, 1.07])
    assert [t["function"]["name"] for t in session.tools] == ["run"]


def test_extends_compares_as_a_client_resends() -> None:
    reply = {"role": "assistant", "content": None, "refusal": None, "reasoning_content": "hidden",
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "run", "arguments": '{"cmd": "ls"}'}}]}
    resent = {"role": "assistant", "content": "",
              "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "run", "arguments": '{"cmd":"ls"}'}}]}
    task = {"role": "user", "content": "list files"}
    task_parts = {"role": "user", "content": [{"type": "text", "text": "list "}, {"type": "text", "text": "files"}]}
    assert extends([task, reply], [task_parts, resent, {"role": "tool", "tool_call_id": "c1", "content": "a"}])
    assert extends([task], [task])
    assert not extends([task, reply], [task])
    assert not extends([task], [{"role": "user", "content": "list files!"}])
    other_call = {**resent, "tool_calls": [{"id": "c2", "function": {"name": "run", "arguments": '{"cmd": "ls"}'}}]}
    assert not extends([task, reply], [task, other_call])


def test_a_new_conversation_may_not_reuse_an_id(tmp_path: Path) -> None:
    path = _write_lines(tmp_path / "dup.jsonl", [
        {"id": "run-1", "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
        {"id": "run-1", "messages": [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]},
    ])
    with pytest.raises(TraceError, match=r"dup\.jsonl:2: id 'run-1' already names the trace of line 1"):
        read_traces(path)


def test_usage_without_a_reply_is_an_error(tmp_path: Path) -> None:
    path = _write_lines(tmp_path / "log.jsonl", [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                      {"role": "user", "content": "and?"}], "usage": {"prompt_tokens": 9}},
    ])
    with pytest.raises(TraceError, match=r"log\.jsonl:1: usage or latency without a reply"):
        read_traces(path)


def test_swe_agent_function_calling() -> None:
    [trace] = read_traces(DATA / "sweagent-fc.traj")
    assert trace.id == "sweagent-fc" and trace.actions == "tools"
    assert _roles(trace) == ["system", "user"] + ["assistant", "tool"] * 4
    for call_message, answer in zip(trace.messages[2::2], trace.messages[3::2]):
        assert answer["tool_call_id"] == call_message["tool_calls"][0]["id"]
    assert all(set(m) <= {"role", "content", "tool_calls", "tool_call_id"} for m in trace.messages)
    assert isinstance(trace.messages[1]["content"], list)
    assert trace.provenance == {
        "format": "swe-agent", "file": "sweagent-fc.traj", "line": 1, "environment": "main",
        "model_stats": {"instance_cost": 0.0581, "tokens_sent": 14820, "tokens_received": 411, "api_calls": 4},
        "demonstration_messages": 0}
    assert {k: trace.metadata[k] for k in ("model", "agent", "agent_version", "exit_status")} == {
        "model": "claude-3-5-sonnet-20241022", "agent": "swe-agent", "agent_version": "1.0.1",
        "exit_status": "submitted"}
    assert [r.index for r in trace.requests] == [2, 4, 6, 8] and all(r.usage is None for r in trace.requests)
    assert as_tool_calls(trace) is trace


def test_swe_agent_text_actions_keep_the_demonstration() -> None:
    [trace] = read_traces(DATA / "sweagent-text.traj")
    assert trace.id == "sweagent-text" and trace.actions == "text" and trace.tools == ()
    assert _roles(trace) == ["system", "user", "user"] + ["assistant", "user"] * 3 + ["assistant"]
    assert trace.messages[1]["content"].startswith("Here is a demonstration")
    assert trace.provenance["demonstration_messages"] == 1 and trace.provenance["environment"] == "swe_main"


def test_swe_agent_text_actions_as_tool_calls() -> None:
    [text] = read_traces(DATA / "sweagent-text.traj")
    trace = as_tool_calls(text)
    assert trace.actions == "tools" and trace.tools == (BASH_TOOL,)
    assert trace.provenance == {**text.provenance, "converted_from": "text"}
    assert _roles(trace) == ["system", "user", "user"] + ["assistant", "tool"] * 3 + ["assistant"]
    assert trace.requests == text.requests and trace.assistant_indices() == text.assistant_indices()
    calls = [m["tool_calls"][0] for m in trace.messages if m["role"] == "assistant"]
    assert [c["id"] for c in calls] == ["call_1", "call_2", "call_3", "call_4"]
    commands = [json.loads(c["function"]["arguments"])["command"] for c in calls]
    assert commands[0] == 'search_dir "def parse_duration"' and commands[3] == "submit"
    assert commands[2].startswith("edit 3:9\n_PATTERN") and commands[2].endswith("\nend_of_edit")
    assert trace.messages[3]["content"] == "DISCUSSION\nLet's find where parse_duration is defined."
    for i, message in enumerate(trace.messages):
        if message["role"] == "tool":
            assert message["tool_call_id"] == trace.messages[i - 1]["tool_calls"][0]["id"]
            assert message["name"] == "bash" and message["content"] == text.messages[i]["content"]


def test_mini_swe_agent_reads_usage_from_extra() -> None:
    [trace] = read_traces(DATA / "mswea.traj.json")
    assert trace.id == "psf__requests-1963" and trace.actions == "text"
    assert _roles(trace) == ["system", "user"] + ["assistant", "user"] * 4
    assert all(set(m) == {"role", "content"} for m in trace.messages)  # `extra` stripped
    assert [r.usage["prompt_tokens"] for r in trace.requests] == [1420, 1530, 1618, 1861]
    assert trace.requests[1].usage["prompt_tokens_details"] == {"cached_tokens": 1420}
    assert trace.provenance == {
        "format": "mini-swe-agent", "file": "mswea.traj.json", "line": 1, "trajectory_format": "mini-swe-agent-1",
        "model_stats": {"instance_cost": 0.0241, "api_calls": 4}}
    assert {k: v for k, v in trace.metadata.items() if k != "submission"} == {
        "task": "psf__requests-1963", "model": "anthropic/claude-sonnet-4-20250514", "agent": "mini-swe-agent",
        "agent_version": "1.9.1", "exit_status": "Submitted"}
    assert trace.metadata["submission"].startswith("diff --git a/requests/sessions.py")


def test_mini_swe_agent_as_tool_calls_keeps_the_format_error_a_user_message() -> None:
    [text] = read_traces(DATA / "mswea.traj.json")
    trace = as_tool_calls(text)
    assert _roles(trace) == ["system", "user", "assistant", "tool", "assistant", "user", "assistant", "tool",
                             "assistant", "tool"]
    assert trace.messages[4] == text.messages[4]  # no action: unchanged
    assert trace.messages[5]["content"].startswith("Please always provide EXACTLY ONE action")
    assert trace.messages[2]["content"] == "THOUGHT: Let me find resolve_redirects in the sessions module."
    assert [m["tool_call_id"] for m in trace.messages if m["role"] == "tool"] == ["call_1", "call_2", "call_3"]
    assert [r.usage for r in trace.requests] == [r.usage for r in text.requests]


def test_as_tool_calls_tells_an_observation_from_a_human_turn() -> None:
    messages = (
        {"role": "user", "content": "Count the Python files."},
        {"role": "assistant", "content": "Listing them.\n```bash\nfind . -name '*.py' | wc -l\n```"},
        {"role": "user", "content": "<returncode>0</returncode>\n<output>\n12\n</output>"},
        {"role": "user", "content": "Only under src/, please."},
        {"role": "assistant", "content": "```\nfind src -name '*.py' | wc -l\n```\nThat narrows it to src."},
        {"role": "user", "content": "<returncode>0</returncode>\n<output>\n7\n</output>"},
        {"role": "assistant", "content": "There are 7 Python files under src/. ```python\nprint(7)\n```"},
    )
    text = Trace("human-turn", messages, requests=(TraceRequest(1, {"prompt_tokens": 50}),), actions="text")
    trace = as_tool_calls(text)
    assert _roles(trace) == ["user", "assistant", "tool", "user", "assistant", "tool", "assistant"]
    assert trace.messages[3] == messages[3]
    assert trace.messages[4]["content"] == "That narrows it to src."
    assert json.loads(trace.messages[4]["tool_calls"][0]["function"]["arguments"]) == {
        "command": "find src -name '*.py' | wc -l"}
    assert trace.messages[6] == messages[6]  # an inline python block is not an action
    assert [r.index for r in trace.requests] == [1, 4, 6] and trace.requests[0].usage == {"prompt_tokens": 50}
    interrupted = Trace("interrupted", (
        messages[0], messages[1],
        {"role": "system", "content": "The time limit was reached; the command was not run."},
        {"role": "user", "content": "Just tell me what you found so far."},
        {"role": "assistant", "content": "Nothing yet: the count did not run."},
    ), actions="text")
    assert _roles(as_tool_calls(interrupted)) == ["user", "assistant", "system", "user", "assistant"]


def test_akv_round_trip(tmp_path: Path) -> None:
    traces = [*read_traces(DATA / "openai.jsonl"), *read_traces(DATA / "mswea.traj.json"),
              as_tool_calls(read_traces(DATA / "sweagent-text.traj")[0])]
    path = _write_lines(tmp_path / "export.jsonl", [t.to_dict() for t in traces])
    assert detect_format(path) == "akv"
    assert read_traces(path) == traces
    assert read_traces(path, "akv") == traces


def test_akv_request_must_name_an_assistant_message(tmp_path: Path) -> None:
    record = read_traces(DATA / "openai.jsonl")[1].to_dict()
    record["requests"].append({"index": 0})
    path = _write_lines(tmp_path / "export.jsonl", [record])
    with pytest.raises(TraceError, match=r"export\.jsonl:1: requests at \[0\] name no assistant message"):
        read_traces(path)


@pytest.mark.parametrize(("name", "line", "wording"), [
    ("bad-notjson.jsonl", 2, "not JSON"),
    ("bad-norole.jsonl", 2, "message 1 has role None; expected one of system"),
    ("bad-orphan-tool.jsonl", 1, "message 3 is a tool message that answers no call"),
    ("bad-noassistant.jsonl", 1, "has no assistant message"),
])
def test_bad_files_name_file_and_line(name: str, line: int, wording: str) -> None:
    path = DATA / name
    with pytest.raises(TraceError) as caught:
        read_traces(path)
    assert str(caught.value).startswith(f"{path}:{line}: ")
    assert wording in str(caught.value)


def test_the_path_is_named_as_the_caller_gave_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "x.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TraceError, match=r"^sub/x\.jsonl:1: "):
        read_traces(Path("sub/x.jsonl"))


def test_empty_file_and_unknown_format(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(TraceError, match=rf"^{empty}:1: empty file"):
        read_traces(empty)
    with pytest.raises(TraceError) as caught:
        read_traces(DATA / "openai.jsonl", "langchain")
    assert "'langchain'" in str(caught.value) and all(name in str(caught.value) for name in FORMATS)


def test_undetectable_and_broken_documents(tmp_path: Path) -> None:
    numbers = tmp_path / "numbers.jsonl"
    numbers.write_text("1\n2\n")
    with pytest.raises(TraceError, match=rf"^{numbers}:1: cannot tell the trace format"):
        detect_format(numbers)
    broken = tmp_path / "run.traj"
    broken.write_text('{\n  "history": [\n    {"role": "system" "content": "x"}\n  ]\n}\n')
    with pytest.raises(TraceError, match=rf"^{broken}:3: not JSON"):
        read_traces(broken)


def test_real_samples_read_as_openai() -> None:
    traces = read_traces(DATA / "samples.jsonl")
    assert {t.id: len(t.messages) for t in traces} == {
        "mswea-gemini3pro-11": 124, "sweagent-gpt4-01": 26, "taubench-gpt4o-05": 42}
    assert all(t.provenance["license"].startswith("MIT") and t.provenance["file"] == "samples.jsonl" for t in traces)
    assert [len(t.requests) for t in traces] == [len(t.assistant_indices()) for t in traces]
    tau = traces[2]
    last_assistant = tau.assistant_indices()[-1]
    assert any(m["role"] == "user" for m in tau.messages[tau.assistant_indices()[0]:last_assistant])


def test_older_function_calling_reads_as_tool_calls(tmp_path) -> None:
    line = {"id": "legacy", "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "function_call": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}},
        {"role": "function", "name": "weather", "content": "Oslo: 4C, wind 7 m/s"},
        {"role": "assistant", "content": "It is 4C in Oslo."}]}
    path = tmp_path / "legacy.jsonl"
    path.write_text(json.dumps(line) + "\n")
    (trace,) = read_traces(path)
    call = trace.messages[1]["tool_calls"][0]
    assert call["function"]["name"] == "weather" and "function_call" not in trace.messages[1]
    assert trace.messages[2]["role"] == "tool" and trace.messages[2]["tool_call_id"] == call["id"]


def test_tau_bench_runs_keep_task_trial_and_reward_as_metadata() -> None:
    located = read_located(DATA / "taubench.json")
    assert [(x.line, x.format) for x in located] == [(2, "tau-bench"), (3, "tau-bench")]
    first, second = (x.trace for x in located)
    assert [first.id, second.id] == ["taubench-task-38-trial-2", "taubench-task-35-trial-3"]
    assert first.metadata == {"task": 38, "trial": 2, "reward": 1.0, "agent": "tau-bench"}
    assert first.provenance == {"format": "tau-bench", "file": "taubench.json", "line": 2, "run": 0}
    assert _roles(second) == ["system", "user", "assistant", "user", "assistant", "user", "assistant", "tool"]
    assert second.messages[-1]["tool_call_id"] == second.messages[-2]["tool_calls"][0]["id"]
    assert first.actions == "tools" and len(first.requests) == 4 and len(second.requests) == 3


def test_tau_bench_refuses_a_repeated_run_and_a_stray_element(tmp_path: Path) -> None:
    runs = json.loads((DATA / "taubench.json").read_text())
    twice = tmp_path / "twice.json"
    twice.write_text("[\n" + ",\n".join(json.dumps(r) for r in [runs[0], runs[1], runs[0]]) + "\n]\n")
    with pytest.raises(TraceError, match=rf"^{twice}:4: run 2 repeats task 38, trial 2 of the run at line 2.*"
                                         r"\(read as tau-bench, detected"):
        read_traces(twice)
    stray = tmp_path / "stray.json"
    stray.write_text(json.dumps([runs[0], {"task_id": 1}]))
    with pytest.raises(TraceError, match=rf"^{stray}:1: run 1 is not a tau-bench run"):
        read_traces(stray)


def test_mini_swe_agent_2_keeps_its_exit_as_the_end_and_calls_tools_natively() -> None:
    [trace] = read_traces(DATA / "mswea-v2.traj.json")
    doc = json.loads((DATA / "mswea-v2.traj.json").read_text())
    assert trace.id == "astropy__astropy-12907" and trace.actions == "tools" and trace.tools == (BASH_TOOL,)
    assert _roles(trace) == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert trace.metadata["exit_status"] == "Submitted" and trace.metadata["agent_version"] == "2.2.7"
    assert trace.metadata["submission"] == doc["messages"][-1]["content"]
    assert len(trace.requests) == doc["info"]["model_stats"]["api_calls"] == 3
    assert [r.usage["prompt_tokens"] for r in trace.requests] == [
        m["extra"]["response"]["usage"]["prompt_tokens"] for m in doc["messages"] if m["role"] == "assistant"]
    assert all(set(m) <= {"role", "content", "tool_calls", "tool_call_id"} for m in trace.messages)


def test_mini_swe_agent_exit_before_the_end_is_refused(tmp_path: Path) -> None:
    doc = json.loads((DATA / "mswea-v2.traj.json").read_text())
    doc["messages"].insert(3, doc["messages"][-1])
    path = tmp_path / "early.traj.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(TraceError, match=r"early\.traj\.json:1: message 3 has role 'exit' before the end of the run.*"
                                         r"read as mini-swe-agent"):
        read_traces(path)


def test_mini_swe_agent_2_responses_api_items(tmp_path: Path) -> None:
    """mini-swe-agent 2.x with a Responses API model keeps response objects and function_call_output items."""
    call = {"type": "function_call", "call_id": "fc_1", "name": "bash", "arguments": '{"command": "ls"}'}
    doc = {"trajectory_format": "mini-swe-agent-1.1", "info": {"mini_version": "2.2.7", "exit_status": "Submitted"},
           "messages": [
               {"role": "system", "content": "You can run bash."},
               {"role": "user", "content": "List the files."},
               {"object": "response", "id": "resp_1", "output": [
                   {"type": "reasoning", "summary": []},
                   {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Listing."}]},
                   call], "usage": {"input_tokens": 40, "output_tokens": 9,
                                    "input_tokens_details": {"cached_tokens": 32}}, "extra": {"cost": 0.001}},
               {"type": "function_call_output", "call_id": "fc_1", "output": "a.py\nb.py", "extra": {}},
               {"object": "response", "id": "resp_2", "output": [
                   {"type": "function_call", "call_id": "fc_2", "name": "bash",
                    "arguments": '{"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}'}],
                "usage": {"input_tokens": 60, "output_tokens": 12}},
               {"role": "exit", "content": "", "extra": {"exit_status": "Submitted", "submission": ""}}]}
    path = tmp_path / "resp.traj.json"
    path.write_text(json.dumps(doc))
    [trace] = read_traces(path)
    assert _roles(trace) == ["system", "user", "assistant", "tool", "assistant"]
    assert trace.messages[2]["content"] == "Listing." and trace.messages[2]["tool_calls"][0]["id"] == "fc_1"
    assert trace.messages[3] == {"role": "tool", "tool_call_id": "fc_1", "content": "a.py\nb.py"}
    assert [r.usage for r in trace.requests] == [
        {"prompt_tokens": 40, "completion_tokens": 9, "total_tokens": 49,
         "prompt_tokens_details": {"cached_tokens": 32}},
        {"prompt_tokens": 60, "completion_tokens": 12, "total_tokens": 72}]


def test_a_bare_message_list_is_one_trace_in_text_actions() -> None:
    [trace] = read_traces(DATA / "messages.traj.json")
    assert trace.id == "messages" and trace.actions == "text" and len(trace.requests) == 2
    assert trace.provenance == {"format": "messages", "file": "messages.traj.json", "line": 1}
    assert _roles(as_tool_calls(trace)) == ["system", "user", "assistant", "tool", "assistant", "tool"]


def test_swe_agent_last_step_from_the_trajectory_when_the_history_lacks_it(tmp_path: Path) -> None:
    [whole] = read_traces(DATA / "sweagent-text.traj")
    doc = json.loads((DATA / "sweagent-text.traj").read_text())
    doc["history"] = doc["history"][:-1]  # saved before the submitting step reached it
    path = tmp_path / "short.traj"
    path.write_text(json.dumps(doc))
    [trace] = read_traces(path)
    assert len(trace.requests) == len(whole.requests) == len(doc["trajectory"])
    assert trace.messages[-1] == {"role": "assistant", "content": doc["trajectory"][-1]["response"]}
    assert trace.provenance["last_step_from_trajectory"] is True and "last_step_from_trajectory" not in whole.provenance
    assert as_tool_calls(trace).messages[-1]["tool_calls"][0]["function"]["arguments"] == '{"command": "submit"}'


def test_text_actions_are_detected_in_any_format_but_not_in_a_chat_with_a_snippet(tmp_path: Path) -> None:
    [log] = read_traces(Path(__file__).resolve().parents[1] / "examples" / "traces" / "openai.jsonl")
    assert log.actions == "text" and log.provenance["lines"] == [1, 2, 3]
    assert _roles(as_tool_calls(log)) == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    chat = [{"role": "user", "content": "How do I list hidden files?"},
            {"role": "assistant", "content": "Use:\n```bash\nls -a\n```"},
            {"role": "user", "content": "Thanks! And how do I count them?"},
            {"role": "assistant", "content": "Pipe it to wc: `ls -A | wc -l`."},
            {"role": "user", "content": "Great."},
            {"role": "assistant", "content": "Glad to help."}]
    path = _write_lines(tmp_path / "chat.jsonl", [{"id": "chat", "messages": chat}])
    assert read_traces(path)[0].actions == "tools"  # one snippet in three replies is advice, not an agent's action
    assert read_traces(path, actions="text")[0].actions == "text"
    assert read_traces(DATA / "mswea.traj.json", actions="tools")[0].actions == "tools"
