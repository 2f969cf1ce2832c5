"""The readers of agents' own logs (OpenHands, Anthropic Messages, Claude Code, the Agent Data
Protocol, OpenTelemetry GenAI spans) on the example files of `examples/traces/` (README there), and
detection: every example and test file is claimed by exactly its own format's reader."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from sandbox.traces.formats import READERS, detect_format, read_located, read_traces
from sandbox.traces.model import Trace, TraceError
from sandbox.traces.reading import read_source

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "traces"
DATA = ROOT / "tests" / "data" / "traces"

DETECTED = {
    EXAMPLES / "adp.json": "adp", EXAMPLES / "akv-run.jsonl": "akv-run", EXAMPLES / "akv.jsonl": "akv",
    EXAMPLES / "anthropic.jsonl": "anthropic", EXAMPLES / "claude-code.jsonl": "claude-code",
    EXAMPLES / "messages.json": "messages", EXAMPLES / "mini-swe-agent.traj.json": "mini-swe-agent",
    EXAMPLES / "openai.jsonl": "openai", EXAMPLES / "openhands.json": "openhands",
    EXAMPLES / "openhands-output.jsonl": "openhands", EXAMPLES / "otel.json": "otel",
    EXAMPLES / "swe-agent.traj": "swe-agent", EXAMPLES / "tau-bench.json": "tau-bench",
    ROOT / "examples" / "traces.jsonl": "openai", DATA / "openai.jsonl": "openai", DATA / "samples.jsonl": "openai",
    DATA / "sweagent-fc.traj": "swe-agent", DATA / "sweagent-text.traj": "swe-agent",
    DATA / "mswea.traj.json": "mini-swe-agent", DATA / "mswea-v2.traj.json": "mini-swe-agent",
    DATA / "messages.traj.json": "messages", DATA / "taubench.json": "tau-bench",
}


def _roles(trace: Trace) -> list[str]:
    return [m["role"] for m in trace.messages]


def test_every_example_has_its_format_and_is_detected() -> None:
    assert set(EXAMPLES.glob("*.json*")) | set(EXAMPLES.glob("*.traj")) <= set(DETECTED)
    assert {r.name for r in READERS} == set(DETECTED.values())  # an example of every format


@pytest.mark.parametrize("path", sorted(DETECTED), ids=lambda p: p.name)
def test_exactly_one_reader_claims_each_file(path: Path) -> None:
    source = read_source(path)
    assert [r.name for r in READERS if r.claims(source)] == [DETECTED[path]]
    assert detect_format(path) == DETECTED[path]
    assert read_located(path)  # and it reads


def test_openhands_event_stream_one_message_per_model_response() -> None:
    [trace] = read_traces(EXAMPLES / "openhands.json")
    assert trace.id == "openhands" and trace.metadata == {"agent": "openhands", "model": "claude-3-5-sonnet-20241022"}
    assert _roles(trace) == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert [t["function"]["name"] for t in trace.tools] == ["execute_bash", "finish"]
    assert trace.messages[3] == {"role": "tool", "tool_call_id": "toolu_01AbCdE", "name": "execute_bash",
                                 "content": "/workspace/client/http.py:12:TIMEOUT = 30"}
    assert [r.usage["prompt_tokens"] for r in trace.requests] == [2210, 2395, 2588]


def test_openhands_evaluation_output_in_pairs_with_metadata() -> None:
    [trace] = read_traces(EXAMPLES / "openhands-output.jsonl")
    assert trace.id == "client__http-timeout-12"
    assert trace.metadata == {"task": "client__http-timeout-12", "model": "anthropic/claude-3-5-sonnet-20241022",
                              "agent": "CodeActAgent", "resolved": True}
    assert _roles(trace) == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert len(trace.requests) == 3


def test_openhands_output_that_is_not_events_is_refused(tmp_path: Path) -> None:
    record = json.loads((EXAMPLES / "openhands-output.jsonl").read_text())
    good = dict(record, instance_id="second")
    bad = dict(record, instance_id="third", history=[*record["history"][:2], [{"source": "agent", "junk": 1}]])
    path = tmp_path / "output.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (record, good, bad)))
    with pytest.raises(TraceError, match=rf"^{path}:3: event 4 is .*expected an OpenHands event .*read as openhands"):
        read_traces(path)


def test_anthropic_gateway_log_continues_one_trace_per_conversation() -> None:
    first, other = read_traces(EXAMPLES / "anthropic.jsonl")
    assert first.id == "build-2031" and first.provenance["lines"] == [1, 2, 3]
    assert _roles(first) == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert first.messages[2]["tool_calls"][0]["function"] == {"name": "read_file", "arguments": '{"path": "Makefile"}'}
    assert first.messages[3]["tool_call_id"] == "toolu_01Hk2vQpm7"
    assert first.messages[4]["reasoning_content"].startswith("The target needs PYPI_URL")
    assert first.messages[5]["content"].startswith("twine upload")  # a tool_result of text blocks
    assert [t["function"]["name"] for t in first.tools] == ["read_file", "run"]
    assert first.requests[2].usage == {"prompt_tokens": 963, "completion_tokens": 64, "total_tokens": 1027,
                                       "prompt_tokens_details": {"cached_tokens": 708,
                                                                 "cache_creation_input_tokens": 167}}
    assert [r.latency_s for r in first.requests] == pytest.approx([1.84, 2.21, 1.52])
    assert other.id == "anthropic-4" and other.metadata == {"model": "claude-haiku-4-5-20251001"}


def test_anthropic_message_of_another_role_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    path.write_text(json.dumps({"system": "s", "messages": [{"role": "system", "content": "x"}]}) + "\n")
    with pytest.raises(TraceError, match=rf"^{path}:1: message 0 has role 'system': expected user or assistant"):
        read_traces(path)


def test_claude_code_replies_merge_and_sidechains_are_traces_of_their_own() -> None:
    main, sidechain = read_located(EXAMPLES / "claude-code.jsonl")
    trace = main.trace
    assert trace.id == "7c1f3a52-9d0e-4b8a-a6f1-2e5d8c4b9a10" and main.line == 2
    assert _roles(trace) == ["user", "assistant", "tool", "assistant", "tool", "assistant", "tool", "tool",
                             "assistant"]
    assert len(trace.requests) == 4  # four model calls: msg_01Qx (3 events), msg_01Rb, msg_01Tc (3), msg_01Ud
    assert trace.messages[1]["content"] == "Let me look at the test and what it compares."
    assert trace.messages[1]["reasoning_content"].startswith("A daily flake")
    assert [c["function"]["name"] for c in trace.messages[5]["tool_calls"]] == ["Edit", "Bash"]
    assert trace.metadata == {"model": "claude-sonnet-4-5-20250929", "agent": "claude-code", "agent_version": "2.0.61"}
    assert trace.provenance["git_branch"] == "fix/date-test"
    side = sidechain.trace
    assert side.id == f"{trace.id}-sidechain-1" and _roles(side) == ["user", "assistant", "tool", "assistant"]
    assert side.requests[1].usage["prompt_tokens_details"]["cached_tokens"] == 3920


def test_claude_code_compaction_and_subagent_files(tmp_path: Path) -> None:
    events = [json.loads(line) for line in (EXAMPLES / "claude-code.jsonl").read_text().splitlines()]
    main = [e for e in events if e.get("type") != "summary" and not e.get("isSidechain")]
    boundary = {**main[0], "type": "system", "subtype": "compact_boundary", "uuid": "c1", "parentUuid": None,
                "logicalParentUuid": main[-1]["uuid"], "content": "Conversation compacted"}
    summary = {**main[0], "uuid": "c2", "parentUuid": "c1", "isCompactSummary": True,
               "message": {"role": "user", "content": "Summary: the date test was fixed to compare in UTC."}}
    reply = {**main[-1], "uuid": "c3", "parentUuid": "c2",
             "message": {**main[-1]["message"], "id": "msg_02", "content": [{"type": "text", "text": "Done."}]}}
    path = tmp_path / "session.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in [*main, boundary, summary, reply]))
    before, after = read_traces(path)
    assert (before.id, after.id) == (main[0]["sessionId"], f"{main[0]['sessionId']}-2")
    assert len(before.requests) == 4 and _roles(after) == ["user", "assistant"]
    agent = tmp_path / "agent-a1b2c3d.jsonl"
    side = [{**e, "agentId": "a1b2c3d"} for e in events if e.get("isSidechain")]
    agent.write_text("".join(json.dumps(e) + "\n" for e in side))
    [trace] = read_traces(agent)
    assert trace.id == f"{main[0]['sessionId']}-agent-a1b2c3d" and len(trace.requests) == 2


def test_adp_actions_and_observations_as_tool_calls() -> None:
    dateutil, webshop = read_located(EXAMPLES / "adp.json")
    trace = dateutil.trace
    assert (dateutil.line, webshop.line) == (2, 76) and trace.id == "swe-smith-dateutil-0042"
    assert _roles(trace) == ["user", "assistant", "tool", "assistant", "tool", "assistant", "tool", "assistant"]
    calls = [m["tool_calls"][0]["function"] for m in trace.messages if m.get("tool_calls")]
    assert [c["name"] for c in calls] == ["bash", "str_replace_editor", "execute_code"]
    assert json.loads(calls[0]["arguments"]) == {
        "command": "grep -n 'def _build_date' -A 12 /testbed/dateutil/parser.py"}
    assert json.loads(calls[2]["arguments"])["language"] == "python"
    assert trace.messages[3]["reasoning_content"].startswith("Clamping hides")
    assert trace.metadata == {"reward": 1.0} and trace.provenance["details"] == ["dataset", "instance"]
    shop = webshop.trace  # no tool_call_id: each observation answers the oldest open call
    assert [m.get("tool_call_id") for m in shop.messages if m["role"] == "tool"] == ["call_1", "call_2"]


def test_adp_unknown_item_is_refused(tmp_path: Path) -> None:
    doc = json.loads((EXAMPLES / "adp.json").read_text())
    doc[1]["content"].append({"class_": "video_observation", "url": "x"})
    path = tmp_path / "adp.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(TraceError, match=rf"^{path}:1: content item 6 has class_ 'video_observation'"):
        read_traces(path)


def test_otel_chat_spans_of_one_conversation_are_one_trace() -> None:
    [located] = read_located(EXAMPLES / "otel.json")
    trace = located.trace
    assert trace.id == "oncall-7731" and located.format == "otel"
    assert _roles(trace) == ["system", "user", "assistant", "tool", "assistant"]
    assert json.loads(trace.messages[2]["tool_calls"][0]["function"]["arguments"]) == {"team": "payments",
                                                                                      "week": "2025-W48"}
    assert json.loads(trace.messages[3]["content"])["primary"] == "dana.okafor"
    assert [r.usage["prompt_tokens_details"]["cached_tokens"] for r in trace.requests] == [0, 384]
    assert [r.latency_s for r in trace.requests] == pytest.approx([1.4, 2.26])
    assert trace.metadata == {"model": "gpt-4.1-2025-04-14"} and trace.provenance["provider"] == "openai"
    assert [t["function"]["name"] for t in trace.tools] == ["get_rota"]


def test_otel_sdk_span_lines_and_content_capture_off(tmp_path: Path) -> None:
    doc = json.loads((EXAMPLES / "otel.json").read_text())
    spans = doc["resourceSpans"][0]["scopeSpans"][0]["spans"]
    flat = [{"name": s["name"], "context": {"trace_id": "0x" + s["traceId"], "span_id": "0x" + s["spanId"]},
             "start_time": "2025-11-24T16:00:00Z", "attributes": {a["key"]: next(iter(a["value"].values()))
                                                                 for a in s["attributes"]}} for s in spans]
    lines = tmp_path / "spans.jsonl"
    lines.write_text("".join(json.dumps(s) + "\n" for s in flat))
    [trace] = read_traces(lines)
    assert trace.id == "oncall-7731" and len(trace.requests) == 2
    spans[1]["attributes"] = [a for a in spans[1]["attributes"] if a["key"] != "gen_ai.input.messages"]
    off = tmp_path / "off.json"
    off.write_text(json.dumps(doc))
    with pytest.raises(TraceError, match=rf"^{off}:1: span 'chat gpt-4.1' has no gen_ai.input.messages"):
        read_traces(off)


@pytest.mark.parametrize("format", sorted(set(DETECTED.values())))
def test_a_format_forced_on_another_formats_file_is_refused_by_file_and_line(format: str) -> None:
    """Every reader refuses what it cannot read with FILE:LINE, the format it was told and --format."""
    for path, actual in DETECTED.items():
        if actual == format or path.parent != EXAMPLES:
            continue
        try:
            read_traces(path, format)
        except TraceError as error:
            assert str(error).startswith(f"{path}:"), error
            assert f"(read as {format}, as --format says; --format FORMAT reads it as another" in str(error), error
        else:  # a file another reader also reads whole: only where the formats share a shape
            assert (format, actual) in SHARED, (format, actual)


# Formats one of whose files the other reads too, by design: a JSON list of messages is one history
# in a JSON Lines file of histories; a message list of mini-swe-agent's is one of an `openai` line.
SHARED = {("openai", "messages"), ("openai", "akv"), ("openai", "anthropic"), ("anthropic", "openai"),
          ("anthropic", "messages"), ("anthropic", "akv")}


def _mutated(value: object, rng: random.Random) -> object:
    """`value` with one nested field deleted or replaced by a value of another type."""
    paths, stack = [], [((), value)]
    while stack:
        path, node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, child in items:
            paths.append((*path, key))
            stack.append(((*path, key), child))
    if not paths:
        return value
    *parents, key = rng.choice(paths)
    node = value
    for parent in parents:
        node = node[parent]
    if rng.random() < 0.4:
        del node[key]
    else:
        node[key] = rng.choice([None, 3, "s", [], {}, [1], {"a": 1}])
    return value


@pytest.mark.parametrize("path", sorted(p for p in DETECTED if p.parent == EXAMPLES), ids=lambda p: p.name)
def test_a_damaged_file_is_read_or_refused_never_crashes(path: Path, tmp_path: Path) -> None:
    """Each example with one field removed or of another type, 40 times: read, or a TraceError."""
    rng = random.Random(path.name)
    lines = path.name.endswith(".jsonl")
    records = [json.loads(line) for line in path.read_text().splitlines()] if lines else [json.loads(path.read_text())]
    damaged = tmp_path / path.name
    for _ in range(40):
        copy = json.loads(json.dumps(records))
        n = rng.randrange(len(copy))
        copy[n] = _mutated(copy[n], rng)
        damaged.write_text("".join(json.dumps(r) + "\n" for r in copy) if lines else json.dumps(copy[0]))
        for format in (None, DETECTED[path]):
            try:
                read_located(damaged, format)
            except TraceError as error:
                assert str(error).startswith(f"{damaged}:"), error
