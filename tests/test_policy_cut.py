"""Cut rules: a kv form that drops text inside messages, sent as the API's keep_text_drop."""
from __future__ import annotations

import pytest

from akv_core.cache.text_drop import TextCut, project_kept
from policy_dsl import PolicyError, compile_policy, format_policy, parse
from policy_dsl.akvalgo import NotExpressible, to_akvalgo

DETAILS = "mode kv\non each tool_response: cut after \"\\n--\" from role tool keep last 1\n"


def history(results: int) -> list[dict]:
    messages = [{"role": "system", "content": "You research."}, {"role": "user", "content": "Find it."}]
    for k in range(results):
        messages.append({"role": "assistant", "content": "",
                         "tool_calls": [{"id": f"c{k}", "type": "function",
                                         "function": {"name": "search", "arguments": "{}"}}]})
        messages.append({"role": "tool", "tool_call_id": f"c{k}", "name": "search",
                         "content": f"result {k}\n--\nlong details of result {k}"})
    return messages


def test_a_cut_keeps_the_text_up_to_its_marker_and_the_server_drops_the_rest():
    policy = compile_policy(parse(DETAILS))
    full = history(3)
    decision = policy.decide(full)
    assert decision.kept == {3: (0, 11), 5: (0, 11)}   # the latest result is spared (keep last 1)
    fields = decision.api_fields()
    assert fields == {"drop_rule": {"type": "keep_text_drop", "full_messages": full}}
    sent = decision.sent_messages(full)
    assert [m["content"] for m in sent[3::2]] == ["result 0\n--", "result 1\n--", full[7]["content"]]
    # what the server derives from the request: the details of the two older results, after the last message
    drop = project_kept(fields["drop_rule"]["full_messages"], sent).drop
    tail = len(full[3]["content"])
    assert drop.trigger == len(full) - 1
    assert drop.cuts == (TextCut(3, ((11, tail),)), TextCut(5, ((11, tail),)))


def test_cuts_are_cumulative_and_spare_protected_and_unmarked_messages():
    policy = compile_policy(parse("mode kv\non each tool_response: cut before \"long\" from all\n"))
    full = history(3)
    full[1]["content"] = "Find it, long story."   # the first user message is protected
    final = policy.decide(full)
    assert set(final.kept) == {3, 5}   # the trigger itself is never cut; assistants hold no marker
    grown = {}
    for k in range(2, len(full) + 1):   # a cut once decided stays, unchanged, in every longer history
        prefix = policy.decide(full[:k]).kept
        assert grown.items() <= prefix.items() <= final.kept.items()
        grown = prefix
    assert policy.decide(full[:6]).kept == {3: final.kept[3]}   # cut when the next result arrived


@pytest.mark.parametrize("text, message", [
    ("mode text\non each turn: cut after \"x\" from all", "cut needs mode kv"),
    ("mode kv\non each turn: cut after \"x\" from all\non each turn: drop role tool", "cannot be combined"),
    ("mode kv\non each turn: cut after \"x\" from all\nreposition after each drop", "no gap to close"),
    ("mode kv\non each turn: cut after \"x\" from thinking", "cut takes messages"),
    ("mode kv\non each turn: cut after \"\" from all", "empty string"),
    ("mode kv\non each turn: cut inside \"x\" from all", "expected"),
])
def test_malformed_cuts_are_refused_with_a_located_reason(text, message):
    with pytest.raises(PolicyError, match=message):
        compile_policy(parse(text, "cut.akvp"))


def test_cut_round_trips_and_has_no_akvalgo_form():
    ast = parse(DETAILS)
    assert parse(format_policy(ast)) == ast
    with pytest.raises(NotExpressible, match="cut: AKVPolicy drops whole messages only"):
        to_akvalgo(ast)
