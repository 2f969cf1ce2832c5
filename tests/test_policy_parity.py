"""Upstream akvalgo parity, option by option, on a history with parallel tool batches.

Each row is one AKVPolicy option (or combination) with the policy-language form that means the
same, and the decision upstream documents for it, worked out by hand on HISTORY. Three things
must agree with that decision: our policy, our reader of the options, and the options our
exporter writes for the policy; and they must agree at every request of the history.
"""
from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from test_policy_akvalgo import at_current_call, batch, history, random_histories, same_at_every_request
from test_policy_support import histories

from policy_dsl import apply_text_edits, builtin_names, compile_policy, format_policy, load_policy, parse
from policy_dsl.akvalgo import (AkvalgoError, AkvalgoOptions, NotExpressible, controller_prompt_ids, decide_akvalgo,
                                to_akvalgo)

# system 0, user 1; batches (assistant: tools) 2: 3 | 4: 5 6 7 | 8: 9 10 | 11: 12 | 13: 14 15 |
# 16: 17 18 19 | 20: 21. Calls end at 3, 7, 10, 12, 15, 19, 21.
HISTORY = history([1, 3, 2, 1, 2, 3, 1])
ROLLING_3 = {"7": [3], "9": [5], "10": [6], "12": [7], "14": [9], "15": [10], "17": [12], "18": [14],
             "19": [15], "21": [17]}


class ParityCounter:
    """100 tokens per tool response, 10 per other message."""

    def count(self, message: Any) -> int:
        return 100 if message.get("role") == "tool" else 10


ROWS: dict[str, tuple[str, dict[str, Any], dict[str, list[int]], list[int]]] = {
    # name: (policy body, AKVPolicy options, drop_message, reposition)
    "keep_tool_responses alone: a rolling window, never a reposition": (
        "on each tool_response: drop role tool keep last 3 in 1..12\nreposition never",
        {"keep_tool_responses": 3}, ROLLING_3, []),
    "reposition_after_call alone: one reposition, at call 4": (
        "on each tool_response: drop role tool keep last 3\nreposition after 4 tool_calls",
        {"keep_tool_responses": 3, "reposition_after_call": 4}, ROLLING_3, [12]),
    "an offset reposition schedule: call 2, then every 3 calls": (
        "on each tool_response: drop role tool keep last 3\nreposition after 2 tool_calls then every 3",
        {"keep_tool_responses": 3, "reposition_after_call": 2, "reposition_interval_calls": 3}, ROLLING_3, [7, 15]),
    "scheduled repositions with nothing dropped": (
        "on each tool_response: drop role tool keep last 50\nreposition after 1 tool_calls then every 2",
        {"keep_tool_responses": 50, "reposition_after_call": 1, "reposition_interval_calls": 2}, {},
        [3, 10, 15, 21]),
    "reposition_trigger_tokens: at batch ends, once a drop left a gap": (
        "on each tool_response: drop role tool keep last 3\nreposition when positions > 600",
        {"keep_tool_responses": 3, "reposition_trigger_tokens": 600}, ROLLING_3, [10, 15, 19]),
    "an offset drop schedule: call 2, then every 3 calls": (
        "on after 2 tool_calls then every 3: drop role tool keep last 2\nreposition never",
        {"keep_tool_responses": 2, "drop_after_call": 2, "drop_interval_calls": 3},
        {"7": [3, 5], "15": [6, 7, 9, 10, 12]}, []),
    "drop_trigger_responses: at least 5 visible at a batch end": (
        "on each tool_call and visible_tool_responses >= 5: drop role tool keep last 2\nreposition never",
        {"keep_tool_responses": 2, "drop_trigger_responses": 5},
        {"10": [3, 5, 6, 7], "15": [9, 10, 12], "19": [14, 15, 17]}, []),
    "drop_target_tokens: oldest first down to the target, the triggering response included": (
        "on each tool_call and visible_tokens > 500: drop role tool until visible_tokens <= 50 trigger included\n"
        "reposition never",
        {"keep_tool_responses": 1, "drop_trigger_tokens": 500, "drop_target_tokens": 50},
        {"10": [3, 5, 6, 7, 9, 10], "19": [12, 14, 15, 17, 18, 19]}, []),
    "rolling_drop_target assistant: callers retire when their batch leaves the window": (
        "on each tool_response: drop callers outside last 3\nreposition never",
        {"keep_tool_responses": 3, "rolling_drop_target": "assistant"},
        {"7": [2], "12": [4], "15": [8], "17": [11], "19": [13]}, []),
    "rolling_drop_target both: the window and its retired callers": (
        "on each tool_response: drop role tool keep last 3\non each tool_response: drop callers outside last 3\n"
        "reposition after 3 tool_calls then every 2",
        {"keep_tool_responses": 3, "rolling_drop_target": "both", "reposition_after_call": 3,
         "reposition_interval_calls": 2},
        {"7": [2, 3], "9": [5], "10": [6], "12": [4, 7], "14": [9], "15": [8, 10], "17": [11, 12], "18": [14],
         "19": [13, 15], "21": [17]}, [10, 15, 21]),
}


@pytest.mark.parametrize("name", sorted(ROWS))
def test_each_upstream_option_has_a_policy_form_that_decides_as_upstream(name: str) -> None:
    body, kwargs, drops, repos = ROWS[name]
    ours = compile_policy(parse(f"mode kv\n{body}\n"), name="row")
    options = AkvalgoOptions.from_kwargs(kwargs)
    assert to_akvalgo(ours.ast) == options
    counter = ParityCounter()
    for end in range(2, len(HISTORY) + 1):
        prefix = HISTORY[:end]
        if options.reposition_trigger_tokens is not None and not at_current_call(prefix):
            with pytest.raises(AkvalgoError, match="need the current generation boundary"):
                decide_akvalgo(options, prefix, counter)  # upstream decides token repositions at a call's end
            continue
        mine, upstream = ours.decide(prefix, counter), decide_akvalgo(options, prefix, counter)
        assert (mine.drop_message, mine.reposition) == (upstream.drop_message, upstream.reposition), end
    for messages in random_histories(12):  # and on random histories, parallel batches and user nudges
        same_at_every_request(ours, options, messages)
    final = ours.decide(HISTORY, counter)
    assert (final.drop_message, final.reposition) == (drops, repos)
    for r in final.reposition:
        assert r + 1 == len(HISTORY) or HISTORY[r + 1]["role"] != "tool"


def test_text_drop_removes_what_upstream_leaves_out_of_each_request() -> None:
    """mode text_drop: upstream filters the full history it keeps; we rewrite the history we send."""
    ours = compile_policy(parse("mode text\non visible_tool_responses >= 4: remove role tool keep last 3\n"))
    options = to_akvalgo(ours.ast)
    assert options.kwargs() == {"keep_tool_responses": 3, "mode": "text_drop", "rolling_drop_target": "tool"}
    sent: list[dict[str, Any]] = []
    ends = [3, 7, 10, 12, 15, 19, 21]
    for previous, end in zip([-1] + ends, ends):
        sent += HISTORY[previous + 1: end + 1]  # the new batch joins the history as we last sent it
        sent = apply_text_edits(sent, ours.decide(sent).text_edits, summarize=lambda *_: "")
        removed = {e.start for e in decide_akvalgo(options, HISTORY[: end + 1]).text_edits}
        assert sent == [m for j, m in enumerate(HISTORY[: end + 1]) if j not in removed], end
    assert sum(m["role"] == "tool" for m in sent) == 3


@pytest.mark.parametrize("kwargs, named", [
    ({"keep_tool_responses": 2, "reposition_interval_calls": 2}, "reposition_interval_calls: needs "
     "reposition_after_call"),
    ({"keep_tool_responses": 2, "reposition_after_call": 2, "reposition_trigger_tokens": 9}, "either token or call"),
    ({"keep_tool_responses": 2, "drop_trigger_responses": 2}, "drop_trigger_responses: must exceed"),
    ({"keep_tool_responses": 2, "drop_target_tokens": 9}, "drop_target_tokens: needs a drop trigger"),
    ({"keep_tool_responses": 2, "drop_trigger_tokens": 9, "drop_target_tokens": 9}, "must be below"),
])
def test_upstream_constraints_on_the_new_options_name_the_option(kwargs: dict[str, Any], named: str) -> None:
    with pytest.raises(AkvalgoError, match=named):
        AkvalgoOptions.from_kwargs(kwargs)


@pytest.mark.parametrize("body, construct", [
    ("on each tool_response: drop role tool keep last 3\nreposition every 2 tool_calls",
     "write `reposition after 2 tool_calls then every 2`"),
    ("on each tool_call and visible_tool_responses >= 3: drop role tool keep last 3", "above keep_tool_responses"),
    ("on each tool_call and visible_tokens > 90: drop role tool until visible_tokens <= 50",
     "write `until visible_tokens <= 50 trigger included`"),
    ("on each tool_response: drop role tool until visible_tokens <= 50 trigger included",
     "drop_target_tokens only on a drop trigger"),
    ("on each tool_call and visible_tokens > 90: drop role tool keep last 2 until visible_tokens <= 50 trigger included",
     "upstream keeps no window"),
    ("on each tool_call and visible_tokens > 90: drop role tool until visible_tokens <= 90 trigger included",
     "below drop_trigger_tokens"),
    ("on each tool_response: drop callers outside last 3\non each tool_response: drop role tool keep last 3",
     "rules beside callers outside"),
])
def test_near_misses_are_refused_with_the_form_that_would_map(body: str, construct: str) -> None:
    with pytest.raises(NotExpressible, match=construct):
        to_akvalgo(parse(f"mode kv\n{body}\n"))


def test_keep_12_is_upstream_keep_tool_responses_12() -> None:
    assert to_akvalgo(load_policy("keep-12").ast).kwargs() == {
        "keep_tool_responses": 12, "mode": "kv_drop", "rolling_drop_target": "tool"}


@pytest.mark.parametrize("name", [b for b in builtin_names() if load_policy(b).mode == "kv"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages=histories())
def test_no_builtin_repositions_inside_a_tool_batch(name: str, messages) -> None:
    decision = load_policy(name).decide(messages, ParityCounter())
    for r in decision.reposition:
        assert r + 1 == len(messages) or messages[r + 1]["role"] != "tool", r


def observed_history() -> list[dict[str, Any]]:
    """Calls that come back as user text (observations) between native tool batches."""
    def call(i: str) -> dict[str, Any]:
        return {"id": i, "type": "function", "function": {"name": "search", "arguments": "{}"}}
    return [{"role": "system", "content": "research"}, {"role": "user", "content": "find it"},
            {"role": "assistant", "content": "search: capital"}, {"role": "user", "content": "[observation] A"},
            {"role": "assistant", "content": None, "tool_calls": [call("c1")]},
            {"role": "tool", "tool_call_id": "c1", "content": "x" * 40},
            {"role": "assistant", "content": "open: page"}, {"role": "user", "content": "[observation] B"},
            {"role": "assistant", "content": None, "tool_calls": [call("c2"), call("c3")]},
            {"role": "tool", "tool_call_id": "c2", "content": "y" * 40},
            {"role": "tool", "tool_call_id": "c3", "content": "z" * 40},
            {"role": "assistant", "content": "read: page"}, {"role": "user", "content": "[observation] C"}]


def test_user_observations_end_calls_as_upstream_boundaries_do() -> None:
    body = "on each tool_response: drop role tool keep last 1\nreposition after 2 tool_calls then every 2\n"
    observed = compile_policy(parse(f"mode kv\ncalls include user_observations\n{body}"))
    plain = compile_policy(parse(f"mode kv\n{body}"))
    options = AkvalgoOptions(keep_tool_responses=1, reposition_after_call=2, reposition_interval_calls=2)
    h = observed_history()  # calls end at 3, 5, 7, 10, 12 with observations; at 5 and 10 without
    for end in range(2, len(h) + 1):
        got = decide_akvalgo(options, h[:end], user_observations=True)
        mine = observed.decide(h[:end])
        assert (mine.drop_message, mine.reposition) == (got.drop_message, got.reposition), end
    assert observed.decide(h).api_fields() == {"drop_message": {"9": [5], "10": [9]}, "reposition": [5, 10]}
    assert plain.decide(h).reposition == [10]
    with pytest.raises(NotExpressible, match="calls include user_observations: not an AKVPolicy option"):
        to_akvalgo(observed.ast)
    with pytest.raises(AkvalgoError, match="drop_after_call: triggered drops need tool-batch boundaries"):
        decide_akvalgo(AkvalgoOptions(keep_tool_responses=1, drop_after_call=2), h, user_observations=True)


# ---- controller prompts: upstream's prompt_end_message_ids --------------------------------------------

class PromptCounter:
    """100 tokens per tool response, 50 per controller prompt, 10 per other message."""

    def count(self, message: Any) -> int:
        if message.get("role") == "tool":
            return 100
        return 50 if str(message.get("content")).startswith("controller:") else 10


def prompted(batches: list[int], prompts_after: set[int]) -> list[dict[str, Any]]:
    """System, task, one batch per entry (its number of calls), a controller prompt after the calls named."""
    out = history([])
    for step, calls in enumerate(batches, 1):
        out += batch(calls, step)
        if step in prompts_after:
            out.append({"role": "user", "content": "controller: 3 steps left"})
    return out


def observed_with_prompts() -> list[dict[str, Any]]:
    """A user observation and a parallel batch, each followed by a controller prompt."""
    h = observed_history()  # without its second observation (6, 7)
    return h[:4] + [{"role": "user", "content": "controller: 5 steps left"}] + h[4:6] + h[8:11] + \
        [{"role": "user", "content": "controller: 3 steps left"}] + h[11:]


# 0 system, 1 user | 2: 3 | 4: 5 6, prompt 7 | 8: 9 10, prompt 11 | 12: 13. Calls end at 3, 6, 10, 13.
# keep last 2 drops {6: [3], 9: [5], 10: [6], 13: [9]}. Positions at the calls' ends (next free position,
# less what earlier repositions compacted): 130, 340 (390 with prompt 7), 600, ...
PROMPTED = prompted([1, 2, 2, 1], {2, 3})
# 0 system, 1 user, 2 assistant, 3 observation, prompt 4 | 5: 6 | 7: 8 9, prompt 10 | 11 assistant,
# 12 observation. keep last 1 drops {8: [6], 9: [8]}. Calls end at 3, 6, 9, 12 (6, 9 without observations).
OBSERVED = observed_with_prompts()
PROMPT_ROWS: dict[str, tuple[list[dict[str, Any]], str, int, list[int]]] = {
    # name: (history, policy lines before the rule, keep last, T, reposition)
    "without the line the call ends its request: 340 is not above 350": (PROMPTED, "", 2, 350, [10, 13]),
    "the controller prompt pushes call 2 over the threshold: 390 > 350": (
        PROMPTED, "calls include controller_prompts\n", 2, 350, [6, 10, 13]),
    "the prompt counts but crosses no threshold: 390 is not above 400": (
        PROMPTED, "calls include controller_prompts\n", 2, 400, [10, 13]),
    "a threshold met only after the prompt waits for the next call": (
        OBSERVED, "calls include user_observations\n", 1, 420, [12]),
    "prompts after an observation and a parallel batch: call 9 is 460 with its prompt": (
        OBSERVED, "calls include user_observations\ncalls include controller_prompts\n", 1, 420, [9]),
    "controller prompts without observations: the user after an observation is no prompt": (
        OBSERVED, "calls include controller_prompts\n", 1, 420, [9]),
}
PROMPT_DROPS = {id(PROMPTED): {"6": [3], "9": [5], "10": [6], "13": [9]}, id(OBSERVED): {"8": [6], "9": [8]}}


@pytest.mark.parametrize("name", sorted(PROMPT_ROWS))
def test_controller_prompts_count_toward_the_position_threshold_as_upstream(name: str) -> None:
    h, lines, keep, threshold, repos = PROMPT_ROWS[name]
    observations, prompts = "user_observations" in lines, "controller_prompts" in lines
    ours = compile_policy(parse(f"mode kv\n{lines}on each tool_response: drop role tool keep last {keep}\n"
                                f"reposition when positions > {threshold}\n"))
    options, counter = AkvalgoOptions(keep_tool_responses=keep, reposition_trigger_tokens=threshold), PromptCounter()
    final = ours.decide(h, counter)
    assert (final.drop_message, final.reposition) == (PROMPT_DROPS[id(h)], repos)
    for end in range(3, len(h) + 1):  # every request upstream decides agrees; the others it refuses
        prefix = h[:end]
        named = controller_prompt_ids(prefix, observations) if prompts else None
        if not at_current_call(prefix, observations, prompts):
            with pytest.raises(AkvalgoError, match="need the current generation boundary"):
                decide_akvalgo(options, prefix, counter, observations, named)
            continue
        mine, upstream = ours.decide(prefix, counter), decide_akvalgo(options, prefix, counter, observations, named)
        assert (mine.drop_message, mine.reposition) == (upstream.drop_message, upstream.reposition), end


def test_controller_prompts_agree_with_upstream_at_every_request_of_random_histories() -> None:
    ours = compile_policy(parse("mode kv\ncalls include controller_prompts\n"
                                "on each tool_response: drop role tool keep last 3\nreposition when positions > 600\n"))
    options = AkvalgoOptions(keep_tool_responses=3, reposition_trigger_tokens=600)
    messages = random_histories(12)  # parallel batches; a user nudge after a call is its controller prompt
    assert sum(len(controller_prompt_ids(h)) for h in messages) > 5
    for h in messages:
        same_at_every_request(ours, options, h, prompts=True)


def test_a_call_decides_its_reposition_only_once_its_controller_prompt_is_there() -> None:
    """The one decision that reads the message after its boundary: call 2 ends at 6, its prompt is 7."""
    ours = compile_policy(parse("mode kv\ncalls include controller_prompts\n"
                                "on each tool_response: drop role tool keep last 2\nreposition when positions > 350\n"))
    counter = PromptCounter()
    assert ours.decide(PROMPTED[:7], counter).reposition == []      # no request ends here
    assert ours.decide(PROMPTED[:8], counter).reposition == [6]     # the request that carries the prompt
    assert controller_prompt_ids(PROMPTED) == {6: 7, 10: 11}
    assert controller_prompt_ids(OBSERVED) == {9: 10} and controller_prompt_ids(OBSERVED, True) == {3: 4, 9: 10}
    with pytest.raises(NotExpressible, match="calls include controller_prompts: not an AKVPolicy option") as err:
        to_akvalgo(ours.ast)
    assert (err.value.line, err.value.column) == (2, 1)
    assert to_akvalgo(parse(format_policy(ours.ast).replace("calls include controller_prompts\n", ""))).kwargs() \
        == {"keep_tool_responses": 2, "mode": "kv_drop", "rolling_drop_target": "tool",
            "reposition_trigger_tokens": 350}


@pytest.mark.parametrize("history_end, named, words", [
    (8, {6: 8}, "6 -> 8: expected 7, a user message right after the call"),
    (8, {5: 6}, "5: not the end of a call"),
    (8, {7: 8}, "7: not the end of a call"),
    (8, None, "message 7 (user) follows the end of the last call (message 6) (a controller prompt? name it"),
    (9, {6: 7}, "message 8 (assistant) follows the end of the last call (message 7)"),
])
def test_upstream_refuses_bad_prompt_ends_and_requests_past_the_current_call(history_end: int, named, words: str) -> None:
    options = AkvalgoOptions(keep_tool_responses=2, reposition_trigger_tokens=350)
    with pytest.raises(AkvalgoError, match=re.escape(words)):
        decide_akvalgo(options, PROMPTED[:history_end], PromptCounter(), prompt_end_message_ids=named)
    thinking = {"role": "assistant", "content": None, "reasoning_content": "the next step"}
    got = decide_akvalgo(options, PROMPTED[:8] + [thinking], PromptCounter(), prompt_end_message_ids={6: 7})
    assert got.reposition == [6]  # reasoning of the current generation may follow the request
