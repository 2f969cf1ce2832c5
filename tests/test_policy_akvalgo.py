"""Export to upstream akvalgo's AKVPolicy options, and our reader of them.

The reader is checked against upstream's documented behaviour; the exporter by round trips: the
exported options, read back, decide exactly as our policy on recorded histories (localcomp
trajectories with parallel tool batches, and random ones) at every request.
"""
from __future__ import annotations

import json
import random
from typing import Any

import pytest
from typer.testing import CliRunner

from akv_cli.main import app
from policy_dsl import ApproxTokenCounter, compile_policy, load_policy, parse
from policy_dsl.akvalgo import (AkvalgoError, AkvalgoOptions, NotExpressible, controller_prompt_ids, decide_akvalgo,
                                to_akvalgo)

ROUND_TRIPS = {
    "rolling": ("on each tool_response: drop role tool keep last 3 in 1..12", {"keep_tool_responses": 3}),
    "every calls": ("on every 2 tool_calls: drop role tool keep last 4",
                    {"keep_tool_responses": 4, "drop_after_call": 2, "drop_interval_calls": 2}),
    "after call": ("on after 3 tool_calls: drop role tool keep last 1",
                   {"keep_tool_responses": 1, "drop_after_call": 3}),
    "tokens": ("on each tool_call and visible_tokens > 900: drop role tool keep last 2",
               {"keep_tool_responses": 2, "drop_trigger_tokens": 900}),
}
BASIC = {"mode": "kv_drop", "rolling_drop_target": "tool"}


# ---- histories -------------------------------------------------------------------------------------

def batch(calls: int, step: int, size: int = 40) -> list[dict[str, Any]]:
    """One assistant message with `calls` parallel tool calls, then their answers."""
    ids = [f"c{step}_{k}" for k in range(calls)]
    out: list[dict[str, Any]] = [{"role": "assistant", "content": f"step {step}", "tool_calls": [
        {"id": i, "type": "function", "function": {"name": "search", "arguments": "{}"}} for i in ids]}]
    out += [{"role": "tool", "tool_call_id": i, "name": "search", "content": "x" * size} for i in ids]
    return out


def history(batches: list[int], seed: int = 0, nudges: float = 0.0) -> list[dict[str, Any]]:
    """System, task, then one batch per entry (its number of calls); a user nudge after a batch at rate `nudges`."""
    rng = random.Random(seed)
    out = [{"role": "system", "content": "research"}, {"role": "user", "content": "find it"}]
    for step, calls in enumerate(batches):
        out += batch(calls, step, rng.randint(10, 400))
        if rng.random() < nudges:
            out.append({"role": "user", "content": "keep going"})
    return out


def random_histories(n: int) -> list[list[dict[str, Any]]]:
    rng = random.Random(7)
    return [history([rng.choice((1, 1, 2, 3, 4)) for _ in range(rng.randint(3, 18))], seed, 0.15)
            for seed in range(n)]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict[str, Any]]]:
    """Histories the harness recorded: localcomp's scripted agent under full attention, replay backend.
    Edition 1's agent, which batches the independent calls of a leg (edition 2 makes one per step)."""
    from sandbox.backends import open_backend
    from sandbox.harness import run_task, select_tasks
    from test_sandbox_support import small_localcomp

    suite, replay = small_localcomp(tmp_path_factory.getbasetemp() / "localcomp-e1", edition=1), open_backend("replay")
    out = []
    try:
        for task in select_tasks(suite, "train", limit=6):
            _, trajectory = run_task(task, suite, load_policy("full"), suite.scripted_agent(task), replay)
            out.append(list(trajectory.exchanges[-1].request.messages))
    finally:
        replay.close()
        suite.close()
    return out


def parallel_batches(messages: list[dict[str, Any]]) -> int:
    return sum(len(m.get("tool_calls") or ()) > 1 for m in messages)


def ends_a_call(messages: list[dict[str, Any]], observations: bool = False) -> bool:
    """The last message ends a call: it answers the last call of its assistant message, or is an observation."""
    last = messages[-1]
    if last["role"] == "tool":
        start = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        return len(messages) - 1 - start == len(messages[start].get("tool_calls") or ())
    before = messages[-2]
    return observations and last["role"] == "user" and before["role"] == "assistant" and \
        not before.get("tool_calls") and any(m["role"] == "user" for m in messages[:-1])


def at_current_call(messages: list[dict[str, Any]], observations: bool = False, prompts: bool = False) -> bool:
    """Where upstream decides token repositions: no call has ended yet, or the history ends with a call
    (or, with named controller prompts, with the prompt right after one)."""
    return not any(ends_a_call(messages[:k], observations) for k in range(2, len(messages) + 1)) or \
        ends_a_call(messages, observations) or \
        (prompts and messages[-1]["role"] == "user" and ends_a_call(messages[:-1], observations))


def same_at_every_request(ours: Any, options: AkvalgoOptions, messages: list[dict[str, Any]],
                          prompts: bool = False) -> None:
    """Our policy and the reader agree at every request; with `prompts` the harness names each user
    message right after a call as that call's controller prompt (prompt_end_message_ids)."""
    counter = ApproxTokenCounter()
    for end in range(2, len(messages) + 1):
        if messages[end - 1]["role"] == "assistant":
            continue  # a request ends with a user or tool message
        prefix = messages[:end]
        named = controller_prompt_ids(prefix) if prompts else None
        if options.reposition_trigger_tokens is not None and not at_current_call(prefix, prompts=prompts):
            with pytest.raises(AkvalgoError, match="need the current generation boundary"):
                decide_akvalgo(options, prefix, counter, prompt_end_message_ids=named)  # e.g. an unnamed nudge
            continue
        expected = ours.decide(prefix, counter)
        got = decide_akvalgo(options, prefix, counter, prompt_end_message_ids=named)
        assert (got.drop_message, got.reposition) == (expected.drop_message, expected.reposition), end


# ---- the reader: upstream's documented behaviour ------------------------------------------------------

def test_the_window_rolls_on_each_tool_message_even_inside_a_parallel_batch() -> None:
    h = history([1, 1, 3])  # tool messages 3, 5 and 7, 8, 9 (one batch)
    got = decide_akvalgo(AkvalgoOptions(keep_tool_responses=2), h)
    assert got.drop_message == {"7": [3], "8": [5], "9": [7]}  # the (K+1)-th drops the oldest
    assert got.reposition == []  # no reposition option: never


def test_scheduled_repositions_fall_on_batch_ends_even_with_nothing_new_dropped() -> None:
    h = history([1, 3, 1, 2, 1, 1, 1, 2, 1])  # the README example: after call 4 and every 4 calls
    got = decide_akvalgo(AkvalgoOptions(keep_tool_responses=50, reposition_after_call=4,
                                        reposition_interval_calls=4), h)
    assert got.drop_message == {}
    ends = [i for i, m in enumerate(h) if m["role"] == "tool" and (i + 1 == len(h) or h[i + 1]["role"] != "tool")]
    assert got.reposition == [ends[3], ends[7]]
    for i in got.reposition:
        assert i + 1 == len(h) or h[i + 1]["role"] != "tool"  # never followed by a tool message


def test_a_triggered_drop_keeps_the_last_k_at_the_end_of_its_call() -> None:
    h = history([2, 3])  # tool messages 3, 4 (call 1) and 6, 7, 8 (call 2)
    got = decide_akvalgo(AkvalgoOptions(keep_tool_responses=2, drop_after_call=2), h)
    assert got.drop_message == {"8": [3, 4, 6]}


@pytest.mark.parametrize("kwargs, named", [
    ({}, "keep_tool_responses: required"),
    ({"keep_tool_responses": 0}, "keep_tool_responses: expected an integer > 0"),
    ({"keep_tool_responses": True}, "keep_tool_responses"),
    ({"keep_tool_responses": 2, "mode": "kv"}, "mode: expected one of kv_drop, text_drop"),
    ({"keep_tool_responses": 2, "drop_after_call": 2, "drop_trigger_tokens": 10}, "drop_trigger_tokens: mutually"),
    ({"keep_tool_responses": 2, "drop_interval_calls": 2}, "drop_interval_calls: needs drop_after_call"),
    ({"keep_tool_responses": 2, "drop_after_call": 2, "rolling_drop_target": "both"}, "need mode kv_drop and "
     "rolling_drop_target tool"),
    ({"keep_tool_responses": 2, "mode": "text_drop", "reposition_after_call": 2}, "reposition needs mode kv_drop"),
    ({"keep_tool_responses": 2, "keep_last": 3}, "keep_last: not an AKVPolicy option"),
    ({"keep_tool_responses": 2, "token_counter": "approx"}, "token_counter: a counter object"),
])
def test_options_upstream_refuses_name_the_option(kwargs: dict[str, Any], named: str) -> None:
    with pytest.raises(AkvalgoError, match=named):
        AkvalgoOptions.from_kwargs(kwargs)


def test_token_thresholds_need_a_counter() -> None:
    h = history([1, 1])
    with pytest.raises(AkvalgoError, match="drop_trigger_tokens: token thresholds need a token_counter"):
        decide_akvalgo(AkvalgoOptions(keep_tool_responses=1, drop_trigger_tokens=10), h)
    with pytest.raises(AkvalgoError, match="reposition_trigger_tokens: token thresholds need a token_counter"):
        decide_akvalgo(AkvalgoOptions(keep_tool_responses=1, reposition_trigger_tokens=10), h)


# ---- the exporter: round trips and refusals --------------------------------------------------------

@pytest.mark.parametrize("name", sorted(ROUND_TRIPS))
def test_exported_options_decide_as_the_policy_on_recorded_and_random_histories(name: str, recorded) -> None:
    rule, expected = ROUND_TRIPS[name]
    ours = compile_policy(parse(f"mode kv\n{rule}\nreposition never\n"), name=name)
    exported = to_akvalgo(ours.ast).kwargs()
    assert exported == {**expected, **BASIC}
    options = AkvalgoOptions.from_kwargs(json.loads(json.dumps(exported)))  # through the JSON file format
    assert sum(parallel_batches(h) for h in recorded) > 0  # the recorded agent batches its calls
    for messages in recorded + random_histories(12):
        same_at_every_request(ours, options, messages)
        final = ours.decide(messages, ApproxTokenCounter())
        if name == "rolling":
            assert final.drop_message  # the round trip is not vacuous


def test_the_expert_is_refused_and_its_nearest_options_differ_only_with_parallel_batches() -> None:
    for name in ("expert", "expert-8k"):
        with pytest.raises(NotExpressible, match=r"reposition after each drop: repositions at the end of a tool "
                           "batch that dropped something") as err:
            to_akvalgo(load_policy(name).ast, f"{name}.akvp")
        assert (err.value.filename, err.value.line) == (f"{name}.akvp", 6)
    expert = load_policy("rolling-3")
    nearest = AkvalgoOptions(keep_tool_responses=3, reposition_after_call=4, reposition_interval_calls=1)
    same_at_every_request(expert, nearest, history([1] * 9))  # one call per batch: the same decisions
    parallel = history([1, 2, 3, 1, 2])
    ours, upstream = expert.decide(parallel), decide_akvalgo(nearest, parallel)
    assert ours.drop_message == upstream.drop_message and ours.reposition != upstream.reposition


@pytest.mark.parametrize("text, construct", [
    ('on each tool_response: drop role tool and not contains "error" keep last 3',
     'contains "error": a content-based selector'),
    ("on each tool_response: drop role tool keep last 3\nreposition every 2 tool_calls",
     "reposition every 2 tool_calls: skips a scheduled reposition when no drop left a gap"),
    ("on every 4 turns: drop role tool keep last 3", "every 4 turns: akvalgo drops on"),
    ("on each tool_response: drop role tool until visible_tokens <= 500", "until visible_tokens"),
    ("on each tool_response: drop role tool", "AKVPolicy keeps keep_tool_responses > 0"),
    ("on each tool_response: drop role assistant keep last 3", "role assistant: akvalgo rolls out tool"),
    ("on each tool_response: drop role tool keep last 3\non drop_context: drop requested", "a second rule"),
    ("on visible_tokens > 900: drop role tool keep last 2", "checked after every message"),
])
def test_the_first_inexpressible_construct_is_named_and_located(text: str, construct: str) -> None:
    with pytest.raises(NotExpressible, match=construct) as err:
        to_akvalgo(parse(f"mode kv\n{text}\n", filename="p.akvp"), "p.akvp")
    assert err.value.line >= 2 and str(err.value).startswith("p.akvp:")


def test_text_policies_and_full_attention_are_refused() -> None:
    with pytest.raises(NotExpressible, match="mode text"):
        to_akvalgo(load_policy("standard").ast)
    with pytest.raises(NotExpressible, match="a policy with no rule"):
        to_akvalgo(load_policy("full").ast)


# ---- the command line --------------------------------------------------------------------------------

def test_akv_export_format_akvalgo_writes_options_or_names_the_construct(tmp_path) -> None:
    from policy_dsl import canonical_hash, format_policy
    from store import Store
    from store.records import Proposal

    url = f"sqlite:///{tmp_path / 'akv.db'}"
    store = Store.open(url)
    try:
        run = store.create_run("r1", {}, 0, "test", "localcomp@unversioned")
        ids = {}
        for name, text in (("rolling", "on each tool_response: drop role tool keep last 5"),
                           ("content", 'on each tool_response: drop role tool and contains "log" keep last 5')):
            ast = parse(f"mode kv\n{text}\n")
            ids[name], _ = store.add_policy(run.id, Proposal("test", format_policy(ast), text=format_policy(ast),
                                                             hash=canonical_hash(ast), name=name))
    finally:
        store.close()
    runner = CliRunner()
    out = tmp_path / "best.akvalgo.json"
    done = runner.invoke(app, ["export", "r1", "--format", "akvalgo", "--policy", str(ids["rolling"]),
                               "--out", str(out), "--db", url])
    assert done.exit_code == 0, done.output
    assert json.loads(out.read_text()) == {"keep_tool_responses": 5, **BASIC}
    assert json.loads((tmp_path / "best.akvalgo.provenance.json").read_text())["policy"]["id"] == ids["rolling"]
    refused = runner.invoke(app, ["export", "r1", "--format", "akvalgo", "--policy", str(ids["content"]),
                                  "--out", str(tmp_path / "c.json"), "--db", url])
    assert refused.exit_code == 2 and not (tmp_path / "c.json").exists()
    assert f"r1#{ids['content']}.akvp:2:" in refused.stderr and "content-based" in refused.stderr
    shown = runner.invoke(app, ["policy", "akvalgo", "expert-8k"])
    assert shown.exit_code == 1 and "reposition after each drop" in shown.stderr
