"""`akv run` trajectories as traces (format akv-run): a scripted run imports as it was sent and replays
billed as it ran, an llm run imports with the model's replies and benches as a trace set, and
trajectories whose history is not the one sent (text policies, keep_text_drop) or that are corrupt
are refused with FILE:LINE."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sandbox.backends import BackendRequest, open_backend
from sandbox.runs.cost import ReportedUsage
from sandbox.runs.harness import TaskOutcome, resolve_policy, run_task
from sandbox.runs.trajectory import Exchange, Trajectory, read_trajectory
from sandbox.traces.formats import detect_format, read_traces
from sandbox.traces.model import Trace, TraceError
from sandbox.traces.runs import openai_usage
from sandbox.traces.suite import SPLITS, TraceSuite
from test_cli_support import akv_in_process

AKV = [sys.executable, "-m", "akv_cli.main"]
KV_ONLY = "record under a kv policy (full) to import it"


def data_folder(folder: Path) -> Path:
    """`folder` as a data folder of its own (runs land there) holding the session's localcomp build and caches."""
    from akv_core.home import akv_home

    shared = akv_home().resolve()
    shutil.copytree(shared / "localcomp", folder / "localcomp")
    for cache in ("tokenizers", "kernels"):
        if (shared / cache).is_dir():
            (folder / cache).symlink_to(shared / cache)
    return folder


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """The data folder of the module's tests but the llm one (which has its own: `llm_run`)."""
    return data_folder(tmp_path_factory.mktemp("home"))


def akv_env(home: Path, db: Path) -> dict[str, str]:
    return {**os.environ, "AKV_HOME": str(home), "AKV_DB": f"sqlite:///{db}", "PYTHONUNBUFFERED": "1",
            "COLUMNS": "200"}


def akv(home: Path, db: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*AKV, *args], env=akv_env(home, db), capture_output=True, text=True, timeout=timeout)


def akv_here(home: Path, db: Path, *args: str) -> tuple[int, str, str]:
    """`akv ARGS` in this process (no interpreter to start): exit code, stdout, stderr."""
    return akv_in_process({"AKV_HOME": str(home), "AKV_DB": f"sqlite:///{db}", "COLUMNS": "200"}, *args)


def run_words(*args: str) -> list[str]:
    """`akv run --suite localcomp --split train ARGS --json`."""
    return ["run", "--suite", "localcomp", "--split", "train", *args, "--json"]


def akv_run(home: Path, db: Path, *args: str) -> tuple[Path, dict[str, dict[str, Any]]]:
    """`akv run --suite localcomp --split train ARGS --json`: its folder and its result rows by task."""
    return run_report(akv(home, db, *run_words(*args)))


def run_report(done: subprocess.CompletedProcess) -> tuple[Path, dict[str, dict[str, Any]]]:
    """An `akv run ... --json` that succeeded: its folder and its result rows by task."""
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    out_dir = Path(report["summary"]["out_dir"])
    rows = {json.loads(line)["task_id"]: json.loads(line)
            for line in (out_dir / "results.jsonl").read_text().splitlines()}
    return out_dir, rows


LLM_TEST = "test_an_llm_run_imports_with_the_models_replies_and_benches_as_a_trace_set"
# Two agent requests, each reply cut short after a few tokens: the import needs the model's replies, not good ones.
LLM_RUN = ("--policy", "full", "--agent", "llm", "--backend", "embedded", "--limit", "1", "--max-steps", "2",
           "--max-tokens", "8")


@pytest.fixture(scope="module", autouse=True)
def llm_run(request, tmp_path_factory):
    """The llm run of LLM_TEST (`akv run LLM_RUN`, in a data folder and store of its own), started in the
    background as this module starts when that test is selected, so that loading the model overlaps the
    other tests (LLM_TEST comes last); yields (data folder, store, the running process)."""
    if not any(item.name == LLM_TEST and item.module is request.module for item in request.session.items):
        yield None
        return
    home = data_folder(tmp_path_factory.mktemp("llmhome"))
    db = tmp_path_factory.mktemp("llmdb") / "akv.db"
    with subprocess.Popen([*AKV, *run_words(*LLM_RUN)], env=akv_env(home, db), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as running:
        try:
            yield home, db, running
        finally:
            if running.poll() is None:
                running.kill()
            running.communicate()


def replayed(trace: Trace) -> TaskOutcome:
    """The trace scored under `full` on the replay backend, as `akv run` on its trace set would."""
    suite = TraceSuite("x", traces=[trace])
    task = next(t for split in SPLITS for t in suite.tasks(split))
    backend = open_backend("replay")
    try:
        result, _ = run_task(task, suite, resolve_policy("full"), suite.scripted_agent(task), backend)
    finally:
        backend.close()
    return result


@pytest.fixture(scope="module")
def scripted_run(home, tmp_path_factory) -> tuple[Path, dict[str, dict[str, Any]]]:
    db = tmp_path_factory.mktemp("db") / "akv.db"
    return akv_run(home, db, "--policy", "full", "--agent", "scripted", "--backend", "replay", "--limit", "2")


def test_a_scripted_replay_run_imports_as_sent_and_replays_billed_as_it_ran(scripted_run) -> None:
    out_dir, rows = scripted_run
    files = sorted((out_dir / "trajectories").glob("*.jsonl"))
    assert len(files) == 2
    for path in files:
        assert detect_format(path) == "akv-run"
        (trace,) = read_traces(path)
        row = rows[trace.id]
        agent = [r for r in read_trajectory(path)[1] if r.purpose == "agent"]
        # The final history: the last request's messages, then the agent's last message as it wrote it
        # (the result note keeps it: it was never sent), which ends with the answer.
        assert trace.messages[:-1] == tuple(agent[-1].request.messages)
        assert trace.messages[-1]["role"] == "assistant" and trace.messages[-1]["content"].endswith(row["answer"])
        assert [r.index for r in trace.requests] == trace.assistant_indices()
        for recorded, request in zip(agent, trace.requests, strict=True):
            assert list(trace.messages[:request.index]) == list(recorded.request.messages)
            assert request.usage == openai_usage(recorded.usage)
        assert set(trace.requests[0].usage["prompt_tokens_details"]) == {
            "cached_tokens", "drop_skipped_tokens", "repos_tokens", "prefilled_tokens"}
        assert trace.provenance == {"format": "akv-run", "file": path.name, "line": 1, "suite": "localcomp",
                                    "split": "train", "policy": "full", "agent": "scripted", "backend": "replay",
                                    "task_id": trace.id, "status": "ok", "score": 1.0}

        result = replayed(trace)
        assert result.status == "ok" and result.n_requests == row["n_requests"] == len(trace.requests)
        tokens, original = result.tokens.to_dict(), row["tokens"]
        assert tokens == original  # billed exactly as the run was, its output included


def test_a_text_policy_run_is_refused_where_it_rewrote_the_history(home, tmp_path) -> None:
    db = tmp_path / "akv.db"
    out_dir, _ = akv_run(home, db, "--policy", "standard-8k", "--limit", "1")
    (path,) = (out_dir / "trajectories").glob("*.jsonl")
    records = [json.loads(line) for line in path.read_text().splitlines()]
    summary = next(i for i, r in enumerate(records) if r.get("purpose") == "summary")
    rewritten = next(i for i, r in enumerate(records) if i > summary and r.get("purpose") == "agent") + 1
    with pytest.raises(TraceError) as caught:
        read_traces(path)
    assert re.fullmatch(rf"{re.escape(str(path))}:{rewritten}: recorded under text policy standard-8k: .*; "
                        rf"{re.escape(KV_ONLY)} \(read as akv-run, detected from its content; .*\)", str(caught.value))
    refused = akv(home, db, "traces", "import", str(path), "--name", "summarized")
    assert refused.returncode == 2 and f"{path}:{rewritten}: recorded under text policy" in refused.stderr
    assert "Traceback" not in refused.stderr


@pytest.mark.parametrize(("line", "expected"), [
    ("{not json", "not JSON"),
    ('{"type": "exchange", "step": 1}', "expected an exchange record"),
    ('["a", "list"]', 'expected a trajectory record: a JSON object with a "type"'),
])
def test_a_corrupt_line_is_named_by_file_and_line(scripted_run, tmp_path, line: str, expected: str) -> None:
    out_dir, _ = scripted_run
    source = sorted((out_dir / "trajectories").glob("*.jsonl"))[0].read_text().splitlines()
    path = tmp_path / "corrupt.jsonl"
    path.write_text("\n".join([*source[:2], line, *source[3:]]) + "\n")
    with pytest.raises(TraceError, match=rf"^{re.escape(str(path))}:3: {re.escape(expected)}"):
        read_traces(path, "akv-run")


HEADER = {"task_id": "t1", "suite": "localcomp", "split": "train", "policy": "full", "agent": "llm",
          "backend": "http://127.0.0.1:9/v1", "prices": "gpt-oss-120b"}
SYSTEM, USER = {"role": "system", "content": "You research."}, {"role": "user", "content": "Which year?"}
CALL = {"role": "assistant", "content": "Looking.", "tool_calls": [
    {"id": "call_0_0", "type": "function", "function": {"name": "search", "arguments": '{"q": "year"}'}}]}
RESULT = {"role": "tool", "tool_call_id": "call_0_0", "name": "search", "content": "It was 1911."}
FINAL = {"role": "assistant", "content": "1911", "reasoning_content": "The result says so."}


def _written(path: Path, header: dict, steps: list[tuple[str, list, dict | None, dict | None]],
             answer: str | None) -> Path:
    """A trajectory as the harness writes it: steps of (purpose, messages, reply, drop_rule)."""
    trajectory = Trajectory(dict(header))
    for step, (purpose, messages, reply, rule) in enumerate(steps):
        usage = ReportedUsage(100 * (step + 1), 7, 100 * step, 0, 0, 100)
        trajectory.add(Exchange(step, purpose, BackendRequest(messages, drop_rule=rule), reply, usage, 0.0))
    trajectory.note("result", task_id=header["task_id"], status="ok" if answer is not None else "max_steps",
                    score=0.5, answer=answer)
    trajectory.write(path)
    return path


def test_a_generating_run_ends_with_the_last_reply_and_summary_calls_stay_out(tmp_path) -> None:
    summary = [USER, {"role": "user", "content": "Summarize."}]
    path = _written(tmp_path / "t1.jsonl", HEADER, [("agent", [SYSTEM, USER], CALL, None),
                                                    ("summary", summary, {"role": "assistant", "content": "-"}, None),
                                                    ("agent", [SYSTEM, USER, CALL, RESULT], FINAL, None)], "1911")
    (trace,) = read_traces(path)
    assert trace.id == "t1" and trace.messages == (SYSTEM, USER, CALL, RESULT, FINAL)
    assert [(r.index, r.usage["prompt_tokens"]) for r in trace.requests] == [(2, 100), (4, 300)]
    assert trace.requests[1].usage == {"prompt_tokens": 300, "completion_tokens": 7, "total_tokens": 307,
                                       "prompt_tokens_details": {"cached_tokens": 200, "drop_skipped_tokens": 0,
                                                                 "repos_tokens": 0, "prefilled_tokens": 100}}


def test_a_replayed_run_without_an_answer_ends_with_its_last_request(tmp_path) -> None:
    header = {**HEADER, "agent": "scripted", "backend": "replay"}
    path = _written(tmp_path / "t1.jsonl", header, [("agent", [SYSTEM, USER], None, None),
                                                    ("agent", [SYSTEM, USER, CALL, RESULT], None, None)], None)
    (trace,) = read_traces(path)
    assert trace.messages == (SYSTEM, USER, CALL, RESULT) and [r.index for r in trace.requests] == [2]
    alone = _written(tmp_path / "alone.jsonl", header, [("agent", [SYSTEM, USER], None, None)], None)
    with pytest.raises(TraceError, match=rf"^{re.escape(str(alone))}:1: trace 't1' has no assistant message"):
        read_traces(alone)


def test_keep_text_drop_requests_and_header_only_files_are_refused(tmp_path) -> None:
    rule = {"type": "keep_text_drop", "full_messages": [SYSTEM, USER, CALL, RESULT]}
    kept = _written(tmp_path / "kept.jsonl", {**HEADER, "policy": "cut-tools"},
                    [("agent", [SYSTEM, USER], CALL, None), ("agent", [SYSTEM, USER, CALL, RESULT], FINAL, rule)],
                    "1911")
    with pytest.raises(TraceError, match=rf"^{re.escape(str(kept))}:3: recorded under policy cut-tools, whose "
                                         rf"keep_text_drop .*; {re.escape(KV_ONLY)} \(read as akv-run, detected"):
        read_traces(kept)
    header_only = tmp_path / "header.jsonl"
    header_only.write_text(json.dumps({"type": "task", **HEADER}) + "\n")
    with pytest.raises(TraceError, match=rf"^{re.escape(str(header_only))}:1: cannot tell the trace format"):
        read_traces(header_only)
    with pytest.raises(TraceError, match=rf"^{re.escape(str(header_only))}:1: no agent requests"):
        read_traces(header_only, "akv-run")


@pytest.mark.slow
def test_an_llm_run_imports_with_the_models_replies_and_benches_as_a_trace_set(llm_run) -> None:
    home, db, running = llm_run
    stdout, stderr = running.communicate(timeout=300)
    out_dir, rows = run_report(subprocess.CompletedProcess(running.args, running.returncode, stdout, stderr))
    (path,) = (out_dir / "trajectories").glob("*.jsonl")
    (trace,) = read_traces(path)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    replies = [r["reply"] for r in records if r["type"] == "exchange" and r["purpose"] == "agent"]
    assert replies and all(reply is not None for reply in replies)
    assert len(trace.assistant_indices()) == len(trace.requests) == len(replies) == rows[trace.id]["n_requests"]
    assert trace.messages[-1] == {"role": "assistant", "content": replies[-1]["content"]}
    assert trace.provenance["agent"] == "llm" and trace.provenance["backend"] == "embedded"

    code, out, err = akv_here(home, db, "traces", "import", str(path), "--name", "llmrun")
    assert code == 0, err
    assert "llmrun: 1 traces added" in out
    code, out, err = akv_here(home, db, "bench", "traces", "--suite", "llmrun", "--json")
    assert code == 0, err
    policies = {p["policy"]: p for p in json.loads(out)["policies"]}
    assert policies["oracle"]["score"] == 1.0 and policies["oracle"]["errors"] == 0
    assert policies["full"]["requests"] == len(trace.requests)
