"""`akv proxy --refine`: a proxy that records its traffic, evolves on it in a process of its own and promotes
only a candidate the champion rule crowns over the live policy and the expert; its guards and its figures.

The traffic is an archive-search agent's (`benchmarks/archive_agent.py`): sixteen conversations recorded through the
proxy earlier (`tests/data/traces/archive-traffic.jsonl`) and more sent now through the proxy to a real
`akv serve` on loopback (the embedded SmolLM2).
"""
from __future__ import annotations

import io
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import psutil
import pytest
from rich.console import Console
from typer.testing import CliRunner

from akv_cli.main import app as cli
from benchmarks.archive_agent import Agent, drive
from akv_cli.refine_settings import RefineSettings
from akv_cli.refiner import Refiner, RefinerConfig
from akv_cli.refining import StoreLiveSource
from akv_core.server import serve_in_thread
from akv_proxy import create_proxy_app
from akv_proxy.app import Refining
from akv_proxy.live import Policies
from akv_proxy.recorder import TraceRecorder
from policy_dsl import compile_policy, load_policy, parse
from sandbox.backends.tokens import shared_tokenizer
from sandbox.traces.formats import read_traces
from sandbox.traces.model import Trace
from sandbox.traces.recording import TraceSetRecording
from sandbox.traces.records import stored_of, trace_of
from sandbox.traces.savings import conversation_cost
from sandbox.traces.suite import TraceSuite
from store import Store
from test_proxy import metric
from test_proxy_record import settled
from test_server_support import interrupt, live_server, ready_url

AKV = [sys.executable, "-m", "akv_cli.main"]
TRAFFIC = Path(__file__).parent / "data" / "traces" / "archive-traffic.jsonl"
LATEST = "mode kv\non each turn: drop tool_name \"lookup\" and age >= 1 in 1..16 turns\nreposition after each drop\n"


@pytest.fixture(scope="module")
def server(pytestconfig):
    return live_server(pytestconfig)


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    """A store holding the trace set `archive`: the sixteen recorded conversations, as `--record archive` left them."""
    url = f"sqlite:///{tmp_path / 'archive.db'}"
    store = Store.open(url)
    store.traces.add("archive", [stored_of(t) for t in read_traces(TRAFFIC)])
    store.close()
    return url


def until(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll `condition` until it is truthy; its value."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"waited {timeout:g} s for {what}"
        time.sleep(0.1)
    return value


def ended(process: psutil.Process) -> bool:
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def in_store(url: str, read: Callable[[Store], Any]) -> Any:
    store = Store.open(url)
    try:
        return read(store)
    finally:
        store.close()


# ---- the request path ----------------------------------------------------------------------------------

def test_a_conversation_keeps_the_policy_it_started_with_and_a_new_one_takes_the_live_one() -> None:
    full, latest = load_policy("full"), compile_policy(parse(LATEST), name="archive.r1#5")
    policies = Policies(full, shared_tokenizer(), summarizer=None, entry=1, pinned=True)
    task = [{"role": "system", "content": "You search an archive."}, {"role": "user", "content": "Who signed it?"}]
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"ref": "REF-1"}'}}
    first = policies.apply({"messages": task})
    policies.swap(policies.serving(latest.name, latest, entry=2))
    went_on = [*task, {"role": "assistant", "content": "The", "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "c1", "content": "Record REF-1. Next: REF-2."}]
    assert (first.policy, policies.apply({"messages": went_on}).policy) == ("full", "full")
    assert policies.apply({"messages": task}).policy == "archive.r1#5"  # the same opening again: a new conversation
    assert policies.apply({"messages": [*task, {"role": "user", "content": "More?"}]}).policy == "archive.r1#5"
    longer = [*went_on, {"role": "assistant", "content": "The", "tool_calls": [{**call, "id": "c2"}]},
              {"role": "tool", "tool_call_id": "c2", "content": "Record REF-2."}]
    assert policies.apply({"messages": longer}).policy == "full"  # still the conversation that started on full
    unpinned = Policies(full, shared_tokenizer(), None)  # a proxy whose policy never changes tracks nothing
    assert unpinned.choose(went_on) == (unpinned.live, None)


# ---- settings, refused before the proxy starts ---------------------------------------------------------

@pytest.mark.parametrize(("args", "message"), [
    (["--refine-window", "0"], "error: --refine-window: expected at least 4, got 0"),
    (["--refine-period", "0"], "error: --refine-period: expected more than 0, got 0"),
    (["--refine-every", "0"], "error: --refine-every: expected at least 1, got 0"),
    (["--refine-proposers", "reflect,evolutionary"], "error: --refine-proposers: unknown proposer 'evolutionary': "
                                                     "expected llm, optuna, mutate, reflect, random"),
], ids=["window", "period", "every", "proposer"])
def test_a_refine_setting_out_of_range_exits_2_before_the_proxy_starts(args, message, tmp_path) -> None:
    db = tmp_path / "never.db"
    result = CliRunner().invoke(cli, ["proxy", "--policy", "full", "--upstream", "http://127.0.0.1:9", "--port", "0",
                                      "--record", "archive", "--db", f"sqlite:///{db}", "--refine", *args])
    assert result.exit_code == 2 and result.output.startswith(message), result.output
    assert "Traceback" not in result.output and "ready at" not in result.output and not db.exists()


def test_a_config_file_s_refine_block_is_checked_with_its_lines_and_flags_win(tmp_path) -> None:
    from akv_cli.refine_settings import SettingsError, refine_settings

    config = tmp_path / "proxy.yaml"
    config.write_text("refine:\n  every: 20\n  window: 0\n  proposer: reflect\n")
    result = CliRunner().invoke(cli, ["proxy", "--policy", "full", "--upstream", "http://127.0.0.1:9", "--record",
                                      "archive", "--db", f"sqlite:///{tmp_path / 'never.db'}", "--config", str(config)])
    assert result.exit_code == 2, result.output
    assert result.output.splitlines()[:2] == [f"error: {config}:3: refine.window: expected at least 4, got 0",
                                              f"{config}:4: refine.proposer: unknown setting; expected one of every, "
                                              "period, window, idle, timeout, budget, proposers, dry_run"]
    config.write_text("refine:\n  every: 20\n  window: 8\n  dry_run: true\n")
    settings = refine_settings({"window": 30, "every": None}, config)
    assert (settings.every, settings.window, settings.dry_run, settings.idle) == (20, 30, True, 300.0)
    with pytest.raises(SettingsError, match="expected a mapping with one key, refine; 'listen' is not"):
        config.write_text("listen: 1\n")
        refine_settings({}, config)
    needs_record = CliRunner().invoke(cli, ["proxy", "--policy", "full", "--upstream", "http://127.0.0.1:9",
                                            "--refine"])
    assert needs_record.exit_code == 2 and needs_record.output.startswith("error: --refine: needs --record NAME")


@pytest.mark.parametrize("command", [["policies", "archive"], ["status", "archive"], ["rollback", "archive"],
                                     ["rollback", "archive", "--to", "7"]], ids=" ".join)
def test_lineage_commands_on_a_set_no_refining_proxy_served_exit_2_naming_it(command, db_url) -> None:
    result = CliRunner().invoke(cli, ["proxy", *command, "--db", db_url])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert result.output.startswith("error: NAME: trace set 'archive' has no live policy in sqlite:///")


# ---- the refiner's parts -------------------------------------------------------------------------------

def test_a_conversation_is_measured_under_its_policy_the_expert_and_full_and_bad_content_is_skipped(db_url) -> None:
    traces = [trace_of(t) for t in in_store(db_url, lambda s: s.traces.get("archive"))]
    suite = TraceSuite("archive", db_url, traces=traces)
    cost = conversation_cost(suite, traces[0], "archive.r1#5", compile_policy(parse(LATEST), name="archive.r1#5"))
    assert cost.skipped is None and cost.requests == 7 and cost.full_cost_usd == cost.expert_cost_usd
    assert cost.cost_usd < cost.full_cost_usd and (cost.drops, cost.repositions) == (5, 5)
    assert (cost.lost_reuses, cost.reuses) == (0, 5)  # each later lookup repeats the latest record's reference
    untouched = conversation_cost(suite, traces[0], "full", load_policy("full"))
    assert untouched.cost_usd == untouched.full_cost_usd and untouched.drops == 0
    orphan = Trace("archive-99999", ({"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "x",
                                                                          "content": "stray"},
                                     {"role": "assistant", "content": "hello"}))
    skipped = conversation_cost(suite, orphan, "full", load_policy("full"))
    assert skipped.skipped.startswith("bad content: trace archive-99999: message 1 is a tool message that answers no")


def test_an_evolution_that_times_out_changes_nothing_and_bad_content_is_left_out_with_its_reason(db_url) -> None:
    orphan = Trace("archive-00099", ({"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "x",
                                                                         "content": "stray"},
                                     {"role": "assistant", "content": "hello"}))
    start = in_store(db_url, lambda s: (s.traces.put("archive", stored_of(orphan)), s.live.start("archive", "full",
                                                                                                    "mode kv\n"))[1][0])
    settings = RefineSettings(every=16, idle=0.001, timeout=0.5, budget=2, proposers=("reflect",))
    refiner = Refiner(RefinerConfig("archive", db_url, settings, os.getpid()))
    try:
        refiner.cycle()
    finally:
        refiner._close_store()
    [round_] = in_store(db_url, lambda s: s.live.rounds("archive"))
    assert (round_.status, round_.run_name, round_.traces) == ("timed_out", "archive.r1", 17)
    assert "ran past 0.5 s and was stopped" in round_.detail
    assert in_store(db_url, lambda s: s.live.lineage("archive")) == [start]  # nothing promoted
    window = in_store(db_url, lambda s: [t.trace_id for t in s.traces.get("archive.r1")])
    assert len(window) == 16 and "archive-00099" not in window
    [bad] = in_store(db_url, lambda s: s.live.skipped("archive"))
    assert bad.trace_id == "archive-00099" and "answers no call" in bad.skipped
    totals = {t.policy: t for t in in_store(db_url, lambda s: s.live.totals("archive"))}
    assert (totals["full"].conversations, totals["full"].skipped) == (16, 0)
    assert totals["full"].cost_usd == totals["full"].full_cost_usd == totals["full"].expert_cost_usd > 0
    assert (totals["unknown"].conversations, totals["unknown"].skipped) == (0, 1)  # it named no policy


def test_conversations_of_one_task_share_a_split_and_the_refiner_waits_for_the_other_side(tmp_path) -> None:
    from dataclasses import replace

    from sandbox.traces.suite import split_of
    from sandbox.traces.window import freeze_window

    url = f"sqlite:///{tmp_path / 'tasks.db'}"
    traces = [replace(t, metadata={"task": "archive-search"}) for t in read_traces(TRAFFIC)]
    in_store(url, lambda s: (s.traces.add("archive", [stored_of(t) for t in traces]),
                             s.live.start("archive", "full", "mode kv\n")))
    side = split_of("archive-search")  # the task decides, not each id (whose hashes split them 11 / 5)
    settings = RefineSettings(every=16, idle=0.001, timeout=60, budget=2, proposers=("reflect",))
    refiner = Refiner(RefinerConfig("archive", url, settings, os.getpid()))
    try:
        refiner.cycle()
    finally:
        refiner._close_store()
    counts = (16, 0) if side == "train" else (0, 16)
    assert refiner.said == (f"waiting for traffic: the latest 16 finished conversations hold {counts[0]} train and "
                            f"{counts[1]} held-out ones (2 of each needed)")
    assert in_store(url, lambda s: s.live.rounds("archive")) == []
    window = in_store(url, lambda s: freeze_window(s, "archive", "archive.w", s.traces.index("archive")))
    assert len(window.train if side == "train" else window.heldout) == 16


def test_a_champion_is_promotable_only_when_the_rule_crowns_it_over_the_live_policy_too(db_url, monkeypatch) -> None:
    from evolve.command import run_command
    from evolve.promotion import judge_against_live

    monkeypatch.setenv("AKV_DB", db_url)  # the evolution's trace suite is in this store (run_command sets it too)
    run_command(None, {"suite": "archive", "db": db_url, "run_name": "archive.r1", "max_candidates": 2,
                       "proposers": ["reflect"]}, False, console=Console(file=io.StringIO()))
    store = Store.open(db_url)
    try:
        over_full = judge_against_live(store, "archive.r1", "full", "mode kv\n")
        assert over_full.promotable and over_full.label.startswith("archive.r1#")
        assert over_full.figures["vs_live"]["champion"] and over_full.figures["vs_expert"]["champion"]
        assert over_full.figures["vs_live"]["cost_percent"] < 0 and over_full.figures["heldout"] == 5
        over_itself = judge_against_live(store, "archive.r1", over_full.label, over_full.text)
        assert not over_itself.promotable
        assert "is not crowned against the live policy" in over_itself.reason
        assert "not significantly cheaper than the live policy: cost +0.0% vs the live policy" in over_itself.reason
    finally:
        store.close()


# ---- through a real server -----------------------------------------------------------------------------

@pytest.mark.server
@pytest.mark.model
def test_an_unreachable_store_leaves_the_proxy_serving_its_live_policy_and_a_promotion_reaches_new_conversations(
        server, db_url, caplog) -> None:
    source = StoreLiveSource(db_url, "archive")
    start, _ = source.start("full", "mode kv\n")
    app = create_proxy_app(load_policy("full"), server.url, shared_tokenizer(), timeout_s=120.0,
                           recorder=TraceRecorder(TraceSetRecording(db_url, "archive")),
                           live=Refining(source, start.id, poll_s=0.1))
    db_file = db_url.removeprefix("sqlite:///")
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=120) as client:
        until(lambda: metric(url, "akv_proxy_store_reachable") == 1, 10, "a first poll")
        with sqlite3.connect(db_file) as db:  # the store stops answering the proxy's polls
            db.execute("ALTER TABLE akv_live_policies RENAME TO akv_live_policies_away")
        until(lambda: metric(url, "akv_proxy_store_reachable") == 0, 10, "the proxy to notice")
        under_way = Agent(client, 40)
        assert under_way.step().headers["x-akv-policy"] == "full"  # served all the same
        assert httpx.get(url + "/health").json()["refine"]["store"] == "unreachable"
        with sqlite3.connect(db_file) as db:
            db.execute("ALTER TABLE akv_live_policies_away RENAME TO akv_live_policies")
        until(lambda: metric(url, "akv_proxy_store_reachable") == 1, 10, "the store to answer again")
        in_store(db_url, lambda s: s.live.promote("archive", start.id, "archive.r1#5", LATEST, "archive.r1", 5, {},
                                                  "crowned"))
        until(lambda: httpx.get(url + "/health").json()["policy"] == "archive.r1#5", 10, "the promotion")
        assert under_way.step().headers["x-akv-policy"] == "full"  # a conversation keeps its policy
        fresh = Agent(client, 41)
        assert [fresh.step().headers["x-akv-policy"] for _ in range(3)] == ["archive.r1#5"] * 3
        assert metric(url, 'akv_proxy_live_policy{policy="archive.r1#5",entry="2"}') == 1
        assert metric(url, "akv_proxy_live_policy_changes_total") == 1
        settled(url, recorded=5)
    warnings = [r.getMessage() for r in caplog.records if r.name == "akv.proxy"]
    assert any(w.startswith("the store does not answer (OperationalError: no such table: akv_live_policies") and
               w.endswith("serving the live policy full until it does") for w in warnings), warnings
    recorded = {t.id: t for t in map(trace_of, in_store(db_url, lambda s: s.traces.get("archive")))}
    assert [r.policy for r in recorded["archive-00017"].requests] == ["full", "full"]
    assert [r.policy for r in recorded["archive-00018"].requests] == ["archive.r1#5"] * 3
    server.check_idle_and_intact()


@pytest.mark.server
@pytest.mark.model
def test_a_restarted_proxy_keeps_the_policy_of_a_conversation_under_way_and_gives_new_ones_the_live_one(
        server, db_url) -> None:
    start = in_store(db_url, lambda s: s.live.start("archive", "full", "mode kv\n")[0])
    promoted = in_store(db_url, lambda s: s.live.promote("archive", start.id, "archive.r1#5", LATEST, "archive.r1",
                                                         5, {}, "crowned"))

    def refining_proxy() -> Any:
        source = StoreLiveSource(db_url, "archive")
        entry, _ = source.start("full", "mode kv\n")  # the same command line: the live policy goes on
        policy = compile_policy(parse(entry.text), name=entry.name)
        return serve_in_thread(create_proxy_app(policy, server.url, shared_tokenizer(), timeout_s=120.0,
                                                recorder=TraceRecorder(TraceSetRecording(db_url, "archive")),
                                                live=Refining(source, entry.id, poll_s=0.1)))

    with refining_proxy() as url, httpx.Client(base_url=url, timeout=120) as client:
        under_way = Agent(client, 50)
        assert [under_way.step().headers["x-akv-policy"] for _ in range(2)] == [promoted.name] * 2
        settled(url, recorded=2)
    in_store(db_url, lambda s: s.live.rollback("archive"))
    with refining_proxy() as url, httpx.Client(base_url=url, timeout=120) as client:
        under_way.client = client
        assert under_way.step().headers["x-akv-policy"] == promoted.name  # it started on it
        assert Agent(client, 51).step().headers["x-akv-policy"] == "full"  # the live one after the rollback
    server.check_idle_and_intact()


@pytest.mark.server
@pytest.mark.model
@pytest.mark.slow
def test_the_refining_proxy_promotes_a_proven_winner_outlives_a_killed_refiner_and_rolls_back(
        server, db_url, tmp_path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "AKV_HOME": str(tmp_path / "home")}
    proxy = subprocess.Popen([*AKV, "proxy", "--policy", "full", "--upstream", server.url, "--port", "0",
                              "--record", "archive", "--db", db_url, "--refine", "--refine-every", "20",
                              "--refine-idle", "1", "--refine-budget", "4", "--refine-proposers", "reflect,mutate"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = ready_url(proxy)
        # four conversations more through the proxy: twenty finished ones start the first round
        live = drive(url, range(17, 21))
        assert {r.headers["x-akv-policy"] for replies in live for r in replies} == {"full"}
        refiner = psutil.Process(httpx.get(url + "/health").json()["refine"]["refiner_pid"])
        evolution = until(lambda: [p for p in refiner.children() if "spawn_main" in " ".join(p.cmdline())], 60,
                          "the first round's evolution")
        refiner.send_signal(signal.SIGKILL)  # mid-evolution
        refiner.wait(10)
        until(lambda: all(map(ended, evolution)), 15, "the evolution to end with its refiner")
        assert [e.kind for e in in_store(db_url, lambda s: s.live.lineage("archive"))] == ["start"]
        kept = in_store(db_url, lambda s: {t.trace_id: len(t.requests) for t in s.traces.get("archive")})
        assert len(kept) == 20 and all(n == 7 for n in kept.values())  # no recorded conversation lost
        assert httpx.get(url + "/health").json()["policy"] == "full"
        # the proxy starts the refiner again; it ends the interrupted round and runs the next
        promoted = until(lambda: next((e for e in in_store(db_url, lambda s: s.live.lineage("archive"))
                                       if e.kind == "promotion"), None), 150, "a promotion")
        rounds = in_store(db_url, lambda s: s.live.rounds("archive"))
        assert [(r.number, r.status) for r in rounds] == [(1, "interrupted"), (2, "promoted")]
        assert promoted.name.startswith("archive.r2#") and promoted.figures["vs_live"]["champion"]
        assert promoted.figures["vs_expert"]["champion"] and promoted.figures["vs_live"]["cost_percent"] < 0
        until(lambda: httpx.get(url + "/health").json()["policy"] == promoted.name, 10, "the proxy to take it up")
        with httpx.Client(base_url=url, timeout=120) as client:
            before = Agent(client, 21)
            assert before.step().headers["x-akv-policy"] == promoted.name
            rolled = CliRunner().invoke(cli, ["proxy", "rollback", "archive", "--db", db_url])
            assert rolled.exit_code == 0 and "the live policy is now full" in rolled.output, rolled.output
            until(lambda: httpx.get(url + "/health").json()["policy"] == "full", 10, "the rollback")
            assert before.step().headers["x-akv-policy"] == promoted.name  # under way: keeps its policy
            after = Agent(client, 22)
            assert after.step().headers["x-akv-policy"] == "full"  # the next new conversation
        shown = CliRunner().invoke(cli, ["proxy", "status", "archive", "--db", db_url], env={"COLUMNS": "160"})
        assert shown.exit_code == 0 and "live policy full" in shown.output and "1 interrupted" in shown.output
        listed = CliRunner().invoke(cli, ["proxy", "policies", "archive", "--db", db_url, "--json"])
        assert [e["kind"] for e in json.loads(listed.output)["entries"]] == [
            "start", "promotion", "rollback"]
        assert "akv_proxy_policy_cost_usd" in httpx.get(url + "/metrics").text
    finally:
        interrupt(proxy)
    stderr = proxy.stderr.read()
    assert "ended (killed by signal 9); starting it again" in stderr, stderr
    assert (tmp_path / "home" / "reports" / "archive.r2" / "refinement.txt").read_text().startswith(
        "refinement round 2 of trace set archive: promoted")
