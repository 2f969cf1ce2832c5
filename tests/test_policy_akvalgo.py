"""Export to upstream akvalgo's AKVPolicy options, and our reader of them.

The reader is checked against upstream's documented behaviour; the exporter by round trips: the
exported options, read back, decide exactly as our policy on recorded histories (localcomp
trajectories with parallel tool batches, and random ones) at every request.
"""
from __future__ import annotations

import json
import random
import re
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
    from sandbox.runs.harness import run_task, select_tasks
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
                          prompts: bool = False) -> tuple[int, int]:
    """Our policy and the reader agree at every request; with `prompts` the harness names each user
    message right after a call as that call's controller prompt (prompt_end_message_ids). Returns how
    many requests were compared and how many of those decisions reposition (to see it is not vacuous)."""
    counter, compared, repositioned = ApproxTokenCounter(), 0, 0
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
        compared, repositioned = compared + 1, repositioned + bool(expected.reposition)
    return compared, repositioned


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


def test_drop_triggers_with_user_observations_decide_while_no_observation_ends_a_call() -> None:
    """Upstream's triggered drops refuse a user message among the call boundaries, not the harness's
    option to name observations: with none among them it decides as from the tool batches."""
    h = history([1, 2, 1, 3], seed=3, nudges=1.0)  # 2: 3, user 4 | 5: 6 7, user 8 | 9: 10, user 11 | 12: 13 14 15
    assert [m["role"] for m in h].count("user") == 5  # a nudge after every batch, none an observation
    options = AkvalgoOptions(keep_tool_responses=1, drop_after_call=2, drop_interval_calls=2)
    got = decide_akvalgo(options, h, user_observations=True)
    assert (got.drop_message, got.reposition) == ({"7": [3, 6], "15": [7, 10, 13, 14]}, [])
    assert got == decide_akvalgo(options, h)
    answered = h[:8] + [{"role": "assistant", "content": "the capital is Paris"}, {"role": "user", "content": "ok"}]
    with pytest.raises(AkvalgoError, match=r"drop_after_call: triggered drops need tool-batch boundaries; upstream "
                       r"refuses user observations among them \(message 9\)"):
        decide_akvalgo(options, answered, user_observations=True)  # 9 is an observation: a call boundary


def recovered(message: dict[str, Any]) -> dict[str, Any]:
    """The assistant message as upstream's client keeps calls it recovered from the text: no
    `tool_calls` on the wire, the calls under contextualize_recovered_tool_calls."""
    calls = message["tool_calls"]
    out = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**out, "contextualize_recovered_tool_calls": {"source": "content", "tool_calls": calls}}


def test_tool_calls_recovered_from_text_count_as_the_messages_calls() -> None:
    """upstream's history_tool_calls: `tool_calls` when there are any, else the recovered calls, so
    the results of recovered parallel calls are one batch, one call boundary."""
    native = history([1, 3, 1, 2])  # batches 2: 3 | 4: 5 6 7 | 8: 9 | 10: 11 12
    text = [recovered(m) if i in (4, 10) else m for i, m in enumerate(native)]
    empty = [{**m, "tool_calls": []} if i in (4, 10) else m for i, m in enumerate(text)]
    options = AkvalgoOptions(keep_tool_responses=2, reposition_after_call=2, reposition_interval_calls=1)
    for h in (text, empty):
        got = decide_akvalgo(options, h)
        assert got == decide_akvalgo(options, native) and got.reposition == [7, 9, 12]
        assert controller_prompt_ids(h + [{"role": "user", "content": "go on"}]) == {12: 13}
    triggered = AkvalgoOptions(keep_tool_responses=1, drop_after_call=2)
    assert decide_akvalgo(triggered, text).drop_message == {"7": [3, 5, 6]}
    both = {**recovered(native[4]), "tool_calls": native[4]["tool_calls"][:1]}  # native calls come first
    assert decide_akvalgo(options, native[:4] + [both] + native[5:6]).reposition == [5]


class CallsCounter:
    """1000 tokens for a message that sends tool calls, 10 for any other."""

    def count(self, message: Any) -> int:
        return 1000 if message.get("tool_calls") else 10


def test_recovered_calls_add_no_tokens_as_upstream_sends_the_message_without_them() -> None:
    text = [recovered(m) if m.get("tool_calls") else m for m in history([1, 2, 1])]
    options = AkvalgoOptions(keep_tool_responses=1, drop_trigger_tokens=500)
    assert decide_akvalgo(options, text, CallsCounter()).drop_message == {}
    assert decide_akvalgo(options, history([1, 2, 1]), CallsCounter()).drop_message != {}


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


@pytest.mark.parametrize("name", ["expert-8k", "expert", "keep last 1", "keep last 7"])
def test_reposition_after_each_drop_exports_as_a_token_threshold_of_one(name: str) -> None:
    """`reposition after each drop` is reposition_trigger_tokens=1: at a call's end, any drop since the
    last reposition. The same at every request upstream decides (a request that ends at its last call),
    on 200 random histories with parallel batches and user nudges; the others upstream refuses."""
    if name.startswith("keep last"):
        ours = compile_policy(parse(f"mode kv\non each tool_response: drop role tool {name}\n"
                                    "reposition after each drop\n"), name=name)
    else:
        ours = load_policy(name)
    keep = ours.ast.rules[0].action.target.keep_last.value
    exported = to_akvalgo(ours.ast).kwargs()
    assert exported == {"keep_tool_responses": keep, "reposition_trigger_tokens": 1, **BASIC}
    options = AkvalgoOptions.from_kwargs(json.loads(json.dumps(exported)))
    compared = [same_at_every_request(ours, options, messages) for messages in random_histories(200)]
    assert sum(c for c, _ in compared) > 2000 and sum(r for _, r in compared) > 0  # not vacuous


@pytest.mark.parametrize("rule", [
    "on every 2 tool_calls: drop role tool keep last 3",
    "on each tool_call and visible_tokens > 300: drop role tool keep last 2",
    "on each tool_call and visible_tool_responses >= 5: drop role tool keep last 2",
    "on each tool_call and visible_tokens > 400: drop role tool until visible_tokens <= 150 trigger included",
    "on each tool_response: drop callers outside last 3",
    "on each tool_response: drop role tool keep last 3\non each tool_response: drop callers outside last 3",
])
def test_reposition_after_each_drop_maps_beside_every_drop_form(rule: str) -> None:
    ours = compile_policy(parse(f"mode kv\n{rule}\nreposition after each drop\n"))
    options = to_akvalgo(ours.ast)
    assert options.reposition_trigger_tokens == 1
    for messages in random_histories(24):
        same_at_every_request(ours, options, messages)


def test_the_conditions_of_token_repositions_are_stated() -> None:
    def said(conditions: list[str], words: str) -> bool:
        return any(words in c for c in conditions)

    each_drop = to_akvalgo(load_policy("expert-8k").ast).conditions()
    assert said(each_drop, "any counter that counts each message as at least one token")
    assert said(each_drop, "ends at its last call") and said(each_drop, "recovered from its text")
    assert not said(each_drop, "must count as the policy's counter did")  # T=1 reads no count but the gap
    threshold = to_akvalgo(parse("mode kv\non each tool_response: drop role tool keep last 3\n"
                                 "reposition when positions > 600\n")).conditions()
    assert said(threshold, "must count as the policy's counter did") and said(threshold, "ends at its last call")
    assert to_akvalgo(load_policy("keep-12").ast).conditions() == []  # a rolling window reads no boundary


def test_counting_drops_is_refused() -> None:
    with pytest.raises(NotExpressible, match=r"reposition every 2 drops: counts drop events.*`reposition after "
                       r"each drop` maps") as err:
        to_akvalgo(parse("mode kv\non each tool_response: drop role tool keep last 3\nreposition every 2 drops\n",
                         filename="p.akvp"), "p.akvp")
    assert err.value.line == 3
    one = to_akvalgo(parse("mode kv\non each tool_response: drop role tool keep last 3\nreposition every 1 drops\n"))
    assert one.reposition_trigger_tokens == 1


def test_a_reflect_champion_is_refused_at_its_first_selector() -> None:
    """The rules `make evolve`'s reflect proposes select by tool name, size, age and milestones."""
    text = ('mode kv\non each turn: drop tool_name "search" and age >= 1 in 1..8 turns with "Found"\n'
            'on each turn: drop tool_name "get_document" and tokens > 800 in 200..2400 and age >= 7 in 1..16 turns\n'
            "reposition after each drop\n")
    with pytest.raises(NotExpressible, match=r'tool_name "search" and age >= 1 in 1..8 turns with "Found": '
                       "akvalgo rolls out tool responses only.*no option selects by tool name") as err:
        to_akvalgo(parse(text, filename="champion.akvp"), "champion.akvp")
    assert (err.value.line, err.value.column) == (2, 20)


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


@pytest.mark.parametrize("text, construct", [
    ("mode kv\non each tool_response: drop role tool and covered keep last 3", "covered"),
    ("mode kv\non each tool_response: drop role tool and not covered >= 80 in 50..100 percent keep last 3",
     "covered >= 80 in 50..100 percent"),
    ('mode kv\non each tool_response: drop role tool and call contains "cat " keep last 3', 'call contains "cat "'),
    ('mode kv\non each tool_response: drop role tool keep last 3\non each turn: drop callers outside last 3 or '
     'call contains "grep"', 'call contains "grep"'),
    ('mode kv\non each turn: drop tool_name "bash" and covered', "covered"),  # named before the tool name
    ("mode text\non each turn: omit thinking where covered >= 90 percent", "covered >= 90 percent"),
    ('mode text\non visible_tool_responses >= 4: remove role tool and not call contains "cat " keep last 3',
     'call contains "cat "'),
])
def test_covered_and_call_contains_are_refused_by_name_wherever_they_stand(text: str, construct: str) -> None:
    """No AKVPolicy option reads what later messages say again, nor the call behind a result."""
    reason = "content coverage" if construct.startswith("covered") else "the call behind a tool response"
    with pytest.raises(NotExpressible, match=f"{re.escape(construct)}: no AKVPolicy option reads .*{reason}") as err:
        to_akvalgo(parse(f"{text}\n", filename="p.akvp"), "p.akvp")
    lines = text.splitlines()
    assert str(err.value).startswith(f"p.akvp:{len(lines)}:{lines[-1].index(construct) + 1}: {construct}: ")
    assert "upstream rolls tool responses out by recency only" in str(err.value)


def test_text_policies_and_full_attention_are_refused() -> None:
    with pytest.raises(NotExpressible, match="mode text"):
        to_akvalgo(load_policy("standard").ast)
    with pytest.raises(NotExpressible, match="a policy with no rule"):
        to_akvalgo(load_policy("full").ast)


# ---- the command line --------------------------------------------------------------------------------

def test_akv_export_format_akvalgo_writes_options_or_names_the_construct(tmp_path) -> None:
    from policy_dsl import canonical_hash, format_policy
    from store import Store
    from store.records import Proposal, ValidationRecord

    url = f"sqlite:///{tmp_path / 'akv.db'}"
    store = Store.open(url)
    try:
        run = store.create_run("r1", {}, 0, "test", "localcomp@unversioned")
        ids = {}
        for name, text in (("rolling", "on each tool_response: drop role tool keep last 5"),
                           ("content", 'on each tool_response: drop role tool and contains "log" keep last 5'),
                           ("covered", "on each tool_response: drop role tool and covered keep last 5"),
                           ("each drop", "on each tool_response: drop role tool keep last 6\n"
                                         "reposition after each drop")):
            ast = parse(f"mode kv\n{text}\n")
            ids[name], _ = store.add_policy(run.id, Proposal("test", format_policy(ast), text=format_policy(ast),
                                                             hash=canonical_hash(ast), name=name))
        best = ValidationRecord(ids["each drop"], "candidate", "each drop", 5, 0.8, 0.01, {}, True, False, "close")
        store.save_validations(run.id, [best], "test", "localcomp@unversioned", {})
    finally:
        store.close()
    runner = CliRunner()
    out = tmp_path / "best.akvalgo.json"
    done = runner.invoke(app, ["export", "r1", "--format", "akvalgo", "--policy", str(ids["rolling"]),
                               "--out", str(out), "--db", url])
    assert done.exit_code == 0, done.output
    assert json.loads(out.read_text()) == {"keep_tool_responses": 5, **BASIC}
    record = json.loads((tmp_path / "best.akvalgo.provenance.json").read_text())
    assert record["policy"]["id"] == ids["rolling"] and record["akvalgo"]["conditions"] == []
    refused = runner.invoke(app, ["export", "r1", "--format", "akvalgo", "--policy", str(ids["content"]),
                                  "--out", str(tmp_path / "c.json"), "--db", url])
    assert refused.exit_code == 2 and not (tmp_path / "c.json").exists()
    assert f"r1#{ids['content']}.akvp:2:" in refused.stderr and "content-based" in refused.stderr
    refused = runner.invoke(app, ["export", "r1", "--format", "akvalgo", "--policy", str(ids["covered"]),
                                  "--out", str(tmp_path / "c.json"), "--db", url])
    assert refused.exit_code == 2 and not (tmp_path / "c.json").exists()
    assert f"r1#{ids['covered']}.akvp:2:43: covered: no AKVPolicy option reads" in refused.stderr
    done = runner.invoke(app, ["export", "r1", "--best", "--format", "akvalgo", "--out", str(out), "--db", url])
    assert done.exit_code == 0, done.output
    exported = {"keep_tool_responses": 6, **BASIC, "reposition_trigger_tokens": 1}
    assert json.loads(out.read_text()) == exported  # AKVPolicy(**json.load(f)): the options alone
    record = json.loads((tmp_path / "best.akvalgo.provenance.json").read_text())
    assert record["policy"]["id"] == ids["each drop"] and not record["champion"]
    assert record["akvalgo"] == {"options": exported, "conditions": AkvalgoOptions(**exported).conditions()}
    assert any("ends at its last call" in c for c in record["akvalgo"]["conditions"])
    shown = runner.invoke(app, ["policy", "akvalgo", "expert-8k"])
    assert shown.exit_code == 0 and json.loads(shown.stdout) == {"keep_tool_responses": 4, **BASIC,
                                                                 "reposition_trigger_tokens": 1}
