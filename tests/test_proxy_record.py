"""`akv proxy --record`: a tool-using agent's conversations through the proxy to a real AKV server (the
embedded SmolLM2) become traces in the store, one per conversation, with the history the agent sent,
its replies, their usage and latency; a restart continues them; recording never fails a request."""
from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest
from typer.testing import CliRunner

from akv_cli.main import app as cli
from akv_core.server import serve_in_thread
from akv_proxy import create_proxy_app
from akv_proxy.recorder import StreamedReply, TraceRecorder
from policy_dsl import load_policy
from sandbox.backends.tokens import shared_tokenizer
from sandbox.traces.model import Trace
from sandbox.traces.recording import TraceSetRecording
from sandbox.traces.records import trace_of
from store.repository import Store
from test_proxy import metric
from test_server_support import MODEL, interrupt, live_server, ready_url

AKV = [sys.executable, "-m", "akv_cli.main"]
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "An archive page.",
                                           "parameters": {"type": "object",
                                                          "properties": {"page": {"type": "integer"}}}}}]
# The 135M model does not call tools on its own: the output is held to a thought and one lookup call.
A_LOOKUP = r'<think>P[1-9]</think><tool_call>\{"name":"lookup","arguments":\{"page":[1-9]\}\}</tool_call>'


@pytest.fixture(scope="module")
def server(pytestconfig):
    return live_server(pytestconfig)


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'traces.db'}"


@contextmanager
def recording_proxy(upstream: str, db_url: str) -> Iterator[str]:
    app = create_proxy_app(load_policy("rolling-3"), upstream, shared_tokenizer(), timeout_s=120.0,
                           recorder=TraceRecorder(TraceSetRecording(db_url, "mytraffic")))
    with serve_in_thread(app) as url:
        yield url


def settled(url: str, recorded: int, errors: int = 0) -> None:
    """Wait until the proxy has recorded (or failed to record) that many requests: recording runs
    after the reply has gone to the agent."""
    deadline = time.monotonic() + 30
    while (metric(url, "akv_proxy_recorded_requests_total"), metric(url, "akv_proxy_record_errors_total")) \
            != (recorded, errors):
        assert time.monotonic() < deadline, httpx.get(url + "/metrics").text
        time.sleep(0.05)


def stored(db_url: str, name: str = "mytraffic") -> list[Trace]:
    store = Store.open(db_url)
    try:
        return [trace_of(t) for t in store.traces.get(name)]
    finally:
        store.close()


def ask(client: openai.OpenAI, messages: list[dict[str, Any]], stream: bool) -> tuple[dict[str, Any], dict]:
    """One turn as the agent receives it: the assistant message (reasoning included) and the usage."""
    args = dict(model=MODEL, messages=messages, tools=TOOLS, max_tokens=40, temperature=0,
                extra_body={"regex": A_LOOKUP})
    if not stream:
        raw = client.chat.completions.with_raw_response.create(**args)
        body = raw.http_response.json()
        return body["choices"][0]["message"], body["usage"]
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    message = {"role": "assistant", "content": "".join(d.content or "" for d in deltas) or None,
               "tool_calls": [{"id": call.id, "type": "function",
                               "function": {"name": call.function.name, "arguments": call.function.arguments}}
                              for d in deltas for call in d.tool_calls or ()],
               "reasoning_content": "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)}
    return message, chunks[-1].usage.model_dump(exclude_unset=True)


def answered(messages: list[dict[str, Any]], reply: dict[str, Any]) -> list[dict[str, Any]]:
    """The agent's next history: its reply as it keeps it (without the reasoning), then the lookup's result."""
    call = reply["tool_calls"][0]
    page = json.loads(call["function"]["arguments"])["page"]
    return [*messages, {"role": "assistant", "content": reply["content"], "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": f"Page {page}: clerk C{page}."}]


def converse(url: str, messages: list[dict[str, Any]], turns: int,
             stream: bool = False) -> tuple[list[dict[str, Any]], list, list]:
    """A tool-calling loop from `messages`; returns the last history sent, the replies and their usages."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    replies, usages = [], []
    for turn in range(turns):
        if turn:
            messages = answered(messages, replies[-1])
        reply, usage = ask(client, messages, stream)
        replies.append(reply)
        usages.append(usage)
    return messages, replies, usages


def task(question: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "You research an archive."}, {"role": "user", "content": question}]


# ---- through a real server ---------------------------------------------------------------------------

@pytest.mark.server
@pytest.mark.model
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_tool_using_conversation_is_one_trace_of_what_the_agent_sent_and_got(server, db_url, stream) -> None:
    with recording_proxy(server.url, db_url) as url:
        history, replies, usages = converse(url, task("Which clerk signed the most entries?"), turns=3,
                                            stream=stream)
        settled(url, recorded=3)
        assert httpx.get(url + "/health").json()["record"] == "mytraffic"
    [trace] = stored(db_url)
    assert trace.id == "mytraffic-00001" and trace.actions == "tools" and list(trace.tools) == TOOLS
    assert list(trace.messages) == [*history, replies[-1]]  # earlier replies as the agent resent them
    last = trace.messages[-1]
    assert last["tool_calls"][0]["function"]["name"] == "lookup" and last["reasoning_content"].startswith("P")
    assert [r.index for r in trace.requests] == [2, 4, 6] == trace.assistant_indices()
    assert [dict(r.usage) for r in trace.requests] == usages  # what the client received, unchanged
    assert all(r.latency_s > 0 for r in trace.requests)
    assert {k: trace.provenance[k] for k in ("format", "policy", "upstream", "model")} == {
        "format": "akv-proxy", "policy": "rolling-3", "upstream": server.url, "model": MODEL}
    assert trace.provenance["recorded_at"].endswith("+00:00")
    server.check_idle_and_intact()


@pytest.mark.server
@pytest.mark.model
def test_another_conversation_is_another_trace_and_a_restarted_proxy_continues_the_first(server, db_url) -> None:
    with recording_proxy(server.url, db_url) as url:
        first, replies, _ = converse(url, task("Which clerk signed the most entries?"), turns=2)
        converse(url, task("Which port shipped the most cargo?"), turns=1)
        settled(url, recorded=3)
    assert [(t.id, len(t.requests)) for t in stored(db_url)] == [("mytraffic-00001", 2), ("mytraffic-00002", 1)]
    with recording_proxy(server.url, db_url) as url:  # a new proxy reads the set back
        resumed, more, _ = converse(url, answered(first, replies[-1]), turns=2)
        settled(url, recorded=2)
    one, two = stored(db_url)
    assert (one.id, two.id) == ("mytraffic-00001", "mytraffic-00002") and len(two.requests) == 1
    assert list(one.messages) == [*resumed, more[-1]]
    assert [r.index for r in one.requests] == [2, 4, 6, 8] == one.assistant_indices()
    server.check_idle_and_intact()


@pytest.mark.server
@pytest.mark.model
def test_akv_proxy_record_names_its_set_and_records_into_the_db_it_was_given(server, db_url) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen([*AKV, "proxy", "--policy", "rolling-3", "--upstream", server.url + "/v1",
                                "--port", "0", "--record", "mytraffic", "--db", db_url],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = ready_url(process)
        assert httpx.get(url + "/health").json()["record"] == "mytraffic"
        history, replies, _ = converse(url, task("Which clerk signed the most entries?"), turns=1)
        settled(url, recorded=1)
    finally:
        interrupt(process)
    [trace] = stored(db_url)
    assert list(trace.messages) == [*history, replies[0]]


@pytest.mark.server
@pytest.mark.model
def test_a_recording_that_fails_leaves_the_request_answered_and_counts_the_error(server, tmp_path, caplog) -> None:
    db_file = tmp_path / "traces.db"
    with recording_proxy(server.url, f"sqlite:///{db_file}") as url:
        converse(url, task("Which clerk signed the most entries?"), turns=1)
        settled(url, recorded=1)
        with sqlite3.connect(db_file) as broken:  # the store's table goes away under the running proxy
            broken.execute("DROP TABLE akv_traces")
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        reply = client.chat.completions.with_raw_response.create(
            model=MODEL, max_tokens=2, temperature=0, messages=[{"role": "user", "content": "Say hi."}])
        assert reply.http_response.status_code == 200 and reply.parse().choices[0].message is not None
        settled(url, recorded=1, errors=1)
        assert httpx.get(url + "/health").json()["status"] == "ok"
    [warning] = [r for r in caplog.records if r.name == "akv.proxy"]
    assert warning.levelname == "WARNING"
    assert warning.getMessage() == ("recording to trace set 'mytraffic' failed: OperationalError: "
                                    "no such table: akv_traces")  # one line
    server.check_idle_and_intact()


# ---- refused at start --------------------------------------------------------------------------------

@pytest.mark.parametrize(("args", "message"), [
    (["--record", "mytraffic", "--db", "sqlite:////nonexistent-folder/akv.db"],
     "error: --db: cannot open 'sqlite:////nonexistent-folder/akv.db': folder /nonexistent-folder does not exist"),
    (["--record", "My Traffic"], "error: --record: 'My Traffic' is not a trace set name"),
    (["--record", "localcomp"], "error: --record: 'localcomp' is already the name of a suite"),
], ids=["bad-db", "bad-name", "suite-name"])
def test_a_store_or_set_name_that_cannot_be_used_keeps_the_proxy_from_starting(args, message, tmp_path) -> None:
    db = tmp_path / "traces.db"
    command = ["proxy", "--policy", "rolling-3", "--upstream", "http://127.0.0.1:9", "--port", "0", *args]
    result = CliRunner().invoke(cli, command if "--db" in args else [*command, "--db", f"sqlite:///{db}"])
    assert result.exit_code == 2 and result.output.startswith(message), result.output
    assert "Traceback" not in result.output and "ready at" not in result.output
    assert not db.exists() or "localcomp" in args  # a bad name is refused before the store is created


# ---- the parts, without a server ---------------------------------------------------------------------

def test_a_stream_s_tool_call_deltas_merge_by_index_and_an_unfinished_stream_is_no_reply() -> None:
    """OpenAI streams a call's name first and its arguments in pieces, calls side by side by index."""
    def line(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return b"data: " + json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}).encode()

    chunks = [line({"role": "assistant", "content": ""}), line({"reasoning_content": "Two pages."}),
              line({"content": "Looking"}), line({"content": " them up."}),
              line({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                    "function": {"name": "lookup", "arguments": ""}}]}),
              line({"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                                    "function": {"name": "lookup", "arguments": '{"pa'}}]}),
              line({"tool_calls": [{"index": 0, "function": {"arguments": '{"page": 1}'}}]}),
              line({"tool_calls": [{"index": 1, "function": {"arguments": 'ge": 2}'}}]}),
              line({}, finish="tool_calls"), b'data: {"choices": [], "usage": {"prompt_tokens": 9}}', b"",
              b"data: [DONE]"]
    reply = StreamedReply()
    for chunk in chunks[:-4]:
        reply.feed(chunk)
    assert reply.message() is None  # no finish reason yet: the client left, or the upstream failed
    for chunk in chunks[-4:]:
        reply.feed(chunk)
    calls = [{"id": f"call_{c}", "type": "function", "function": {"name": "lookup", "arguments": f'{{"page": {n}}}'}}
             for c, n in (("a", 1), ("b", 2))]
    assert reply.message() == {"role": "assistant", "content": "Looking them up.",
                               "reasoning_content": "Two pages.", "tool_calls": calls}
    assert reply.usage == {"prompt_tokens": 9}
    reply.feed(b'data: {"error": {"message": "upstream failed"}}')
    assert reply.message() is None


def test_a_history_continues_the_longest_trace_it_extends_with_an_assistant_message_after_it(db_url) -> None:
    recorder = TraceRecorder(TraceSetRecording(db_url, "mytraffic"))
    ask_, again = task("Which clerk?"), task("Which port?")
    reply = {"role": "assistant", "content": "I will look.", "reasoning_content": "Think."}
    resent = {"role": "assistant", "content": [{"type": "text", "text": "I will look."}]}  # the agent's own form
    go_on, done = {"role": "user", "content": "Go on."}, {"role": "assistant", "content": "Done."}

    async def run() -> None:
        await recorder.record(ask_, TOOLS, reply, {"prompt_tokens": 5}, 0.1, model=MODEL)
        await recorder.record(again, TOOLS, reply, None, 0.1, model=MODEL)       # another task: a new trace
        await recorder.record(ask_, TOOLS, reply, None, 0.1, model=MODEL)        # a retry: nothing to continue
        await recorder.record([*ask_, resent, go_on], TOOLS, done, None, 0.2)  # continues the newest of 1 and 3
        await recorder.record([*ask_, go_on], TOOLS, reply, None, 0.1)  # no assistant message after 1's: new
        # extends both 1 (its first request) and 3 (its second): the longer, 3, goes on
        await recorder.record([*ask_, resent, go_on, done, go_on], TOOLS, done, None, 0.3)
    asyncio.run(run())
    recorder.close()
    traces = stored(db_url)
    assert [(t.id, [r.index for r in t.requests]) for t in traces] == [
        ("mytraffic-00001", [2]), ("mytraffic-00002", [2]), ("mytraffic-00003", [2, 4, 6]), ("mytraffic-00004", [3])]
    assert list(traces[2].messages) == [*ask_, resent, go_on, done, go_on, done]
    assert traces[0].requests[0].usage == {"prompt_tokens": 5} and traces[0].messages[-1] == reply
