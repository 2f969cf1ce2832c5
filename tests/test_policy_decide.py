"""Decisions of the built-in library and of each trigger, selector and reposition rule."""
from __future__ import annotations

import pytest
from test_policy_support import CharCounter, agent_history, call, tool_indices

from policy_dsl import (
    SUMMARY_PREFIX, ApproxTokenCounter, HistoryError, apply_text_edits, builtin_names, load_policy, parse,
    compile_policy,
)


def decide(source: str, history, counter=None):
    return compile_policy(parse(source)).decide(history, counter or CharCounter())


def rolling_schedule(tools: list[int], keep: int, batch: int = 1) -> tuple[dict[str, list[int]], list[int]]:
    """Upstream akvalgo's rolling window (the (keep+k)-th tool response drops the k-th), with our
    expert's repositions: at the end of each tool batch (of `batch` calls) in which something was dropped."""
    drops = {str(tools[k + keep]): [tools[k]] for k in range(len(tools) - keep)}
    ends = tools[batch - 1::batch]
    return drops, [e for e in ends if any(int(t) <= e and int(t) > e - 2 * batch for t in drops)]


@pytest.mark.parametrize("rounds", [1, 12, 13, 14, 30])
def test_expert_reproduces_the_keep_12_rolling_schedule(rounds: int) -> None:
    history = agent_history(rounds)
    drops, repos = rolling_schedule(tool_indices(history), 12)
    decision = load_policy("expert").decide(history, ApproxTokenCounter())
    assert decision.drop_message == drops
    assert decision.reposition == repos
    expected = ({"drop_message": drops, "reposition": repos} if drops else {})
    assert decision.api_fields() == expected


def test_expert_counts_each_tool_message_of_a_parallel_batch_and_repositions_at_its_end() -> None:
    history = agent_history(10, tools_per_round=2)
    drops, repos = rolling_schedule(tool_indices(history), 12, batch=2)
    decision = load_policy("expert").decide(history)
    assert (decision.drop_message, decision.reposition) == (drops, repos)
    assert len(drops) == 8 and len(repos) == 4
    assert all(history[i + 1]["role"] != "tool" for i in repos if i + 1 < len(history))


@pytest.mark.parametrize("name,keep", [("expert-8k", 4), ("rolling-3", 3)])
def test_small_context_windows_roll_with_their_keep_count(name: str, keep: int) -> None:
    history = agent_history(9)
    drops, repos = rolling_schedule(tool_indices(history), keep)
    decision = load_policy(name).decide(history)
    assert (decision.drop_message, decision.reposition) == (drops, repos)


def test_full_never_drops() -> None:
    assert load_policy("full").decide(agent_history(40)).api_fields() == {}


def test_every_builtin_decides_on_a_long_history() -> None:
    history = agent_history(60, response="r" * 8000)
    for name in builtin_names():
        decision = load_policy(name).decide(history)
        assert all(int(k) < len(history) for k in decision.drop_message), name


def test_token_based_drops_oldest_tool_responses_down_to_the_target() -> None:
    source = ("mode kv\non visible_tokens > 1000: drop role tool until visible_tokens <= 500\n"
              "reposition after each drop\n")
    history = agent_history(8, response="r" * 200, system=False)  # user 17, tool messages 200 each
    decision = decide(source, history)
    tools = tool_indices(history)
    # After tool 5 visible = 17 + 5*200 = 1017 > 1000: drop tools 1..3 -> 417 <= 500.
    assert decision.drop_message[str(tools[4])] == tools[:3]
    assert decision.reposition[0] == tools[4]


def test_trigger_included_drops_the_trigger_last_when_the_older_picks_do_not_reach_the_target() -> None:
    source = ("mode kv\non visible_tokens > 1000: drop role tool until visible_tokens <= {} trigger included\n"
              "reposition never\n")
    history = agent_history(8, response="r" * 200, system=False)
    tools = tool_indices(history)
    # After tool 5 visible = 1017: the four older tools leave 217; a target of 100 takes tool 5 itself too.
    assert decide(source.format(100), history).drop_message[str(tools[4])] == tools[:5]
    # A target the older picks reach spares the trigger, as without the clause.
    assert decide(source.format(500), history).drop_message[str(tools[4])] == tools[:3]


def test_turn_based_drops_by_age_in_turns() -> None:
    source = "mode kv\non every 2 turns: drop role tool and age >= 3 turns\nreposition never\n"
    history = agent_history(6, system=False)  # user 0, then assistant 1,3,5,... tool 2,4,6,...
    decision = decide(source, history)
    # Turn 4 is message 7: tool 2 has age 3 turns (assistants 3,5,7). Turn 6 (message 11): tools 4,6.
    assert decision.drop_message == {"7": [2], "11": [4, 6]}
    assert decision.reposition == []


def test_every_n_tool_calls_fires_at_the_last_message_of_each_batch() -> None:
    source = "mode kv\non every 2 tool_calls: drop role tool keep last 2\nreposition never\n"
    history = agent_history(4, tools_per_round=3, system=False)
    # Batches end at messages 4, 8, 12, 16; every 2nd batch -> 8 and 16.
    decision = decide(source, history)
    assert decision.drop_message == {"8": [2, 3, 4, 6], "16": [7, 8, 10, 11, 12, 14]}


def test_after_n_fires_once() -> None:
    source = "mode kv\non after 3 tool_calls: drop role tool\nreposition after each drop\n"
    decision = decide(source, agent_history(6, system=False))
    assert decision.drop_message == {"6": [2, 4]}
    assert decision.reposition == [6]


def test_model_based_drops_requested_ids_once_the_tool_has_answered() -> None:
    history = agent_history(3)
    history.append({"role": "assistant", "content": None,
                    "tool_calls": [call("d1", "drop_context", {"message_ids": [3, 5, 1, 99, 5, -1, "x"]})]})
    history.append({"role": "tool", "tool_call_id": "d1", "name": "drop_context", "content": "ok"})
    decision = load_policy("model-based").decide(history)
    # 1 is the first user message (protected); 99 is not before the trigger; -1 and "x" are no ids.
    assert decision.drop_message == {"9": [3, 5]}
    assert decision.reposition == [9]


def test_model_based_ignores_malformed_arguments() -> None:
    history = agent_history(2)
    bad = call("d1", "drop_context")
    bad["function"]["arguments"] = "{not json" + "[" * 5000
    history += [{"role": "assistant", "content": None, "tool_calls": [bad]},
                {"role": "tool", "tool_call_id": "d1", "name": "drop_context", "content": "ok"}]
    assert load_policy("model-based").decide(history).api_fields() == {}


def test_protected_messages_survive_drop_all() -> None:
    decision = decide("mode kv\non each tool_response: drop all\nreposition never\n", agent_history(3))
    dropped = sorted(j for v in decision.drop_message.values() for j in v)
    assert dropped == [2, 3, 4, 5, 6]  # never 0 (system), 1 (first user) or 7 (latest)


def test_selectors_by_tool_name_content_and_size() -> None:
    source = ('mode kv\non after 2 tool_calls: drop (tool_name "open" and contains "error") '
              'or (role tool and tokens > 100)\nreposition never\n')
    history = agent_history(2, system=False)
    history[2]["content"] = "error: timeout"
    assert decide(source, history).drop_message == {}  # tool "search", 14 tokens
    history[2]["name"] = "open"
    assert decide(source, history).drop_message == {"4": [2]}
    history[2]["name"], history[2]["content"] = "search", "fine" * 26
    assert decide(source, history).drop_message == {"4": [2]}


def test_superseded_picks_older_answers_to_a_call_made_again() -> None:
    source = "mode kv\non each tool_response: drop superseded\nreposition never\n"
    history = [{"role": "user", "content": "Fix it."}]
    for n, (name, arguments) in enumerate([("run", {"s": "a"}), ("run", {"s": "b"}), ("open", {"s": "b"}),
                                           ("run", {"s": "b"}), ("run", {"s": "a"}), ("run", {"s": "b"})]):
        history += [{"role": "assistant", "content": None, "tool_calls": [call(f"c{n}", name, arguments)]},
                    {"role": "tool", "tool_call_id": f"c{n}", "name": name, "content": "out"}]
    # run(b) at 4 is answered again at 8, run(a) at 2 at 10, run(b) at 8 at 12; open(b) never.
    assert decide(source, history).drop_message == {"8": [4], "10": [2], "12": [8]}
    assert decide(source, history[:9]).drop_message == {"8": [4]}  # a prefix decides the same


def test_next_turn_contains_picks_what_the_following_turn_said_about_it() -> None:
    source = 'mode kv\non each turn: drop role tool and next_turn contains "not relevant"\nreposition never\n'
    history = agent_history(3, tools_per_round=2, system=False)  # user, then (assistant, tool, tool) x 3
    history[4]["content"] = "lc-1 is not relevant: wrong group."  # the turn after the first batch
    # the whole batch it followed is picked, at the boundary of that turn and never before
    assert decide(source, history[:4]).drop_message == {}
    assert decide(source, history).drop_message == {"4": [2, 3]}
    history[7]["content"] = "the second batch is not relevant either"
    assert decide(source, history).drop_message == {"4": [2, 3], "7": [5, 6]}
    # only the first assistant message after a message speaks for it; the last turn has none yet
    history[4]["content"] = "fine"
    assert decide(source, history).drop_message == {"7": [5, 6]}


def test_age_with_a_text_counts_only_the_turns_that_say_it() -> None:
    source = 'mode kv\non each turn: drop role tool and age >= 2 turns with "Found"\nreposition never\n'
    history = agent_history(4, tools_per_round=1, system=False)  # user, then (assistant, tool) x 4
    history[3]["content"] = "Found A: x"     # the turn after result 2
    history[5]["content"] = "Checking y"     # no milestone
    history[7]["content"] = "Found B: y"     # the second milestone after result 2, the first after 4 and 6
    assert decide(source, history[:7]).drop_message == {}
    assert decide(source, history).drop_message == {"7": [2]}
    assert decide('mode kv\non each turn: drop role tool and age >= 2 turns\nreposition never\n',
                  history).drop_message == {"5": [2], "7": [4]}  # every turn counts without the text


def test_research_drops_dead_ends_at_the_verdict_pages_and_long_articles_by_age() -> None:
    history: list = [{"role": "user", "content": "Find the year."}]
    for step in range(20):  # one call per turn, as a ReAct research agent makes them: turn 1+2s, result 2+2s
        name = "search" if step % 3 == 0 else "get_document"
        history.append({"role": "assistant", "content": "ok", "tool_calls": [call(f"c{step}", name)]})
        size = 300 if step == 2 else 700  # the document of step 2 is a short lookup
        history.append({"role": "tool", "tool_call_id": f"c{step}", "name": name, "content": "d" * size})
    history[5]["content"] = "X [lc-00001] is not relevant to A.e: its group is 2, not 1."  # on result 4
    decision = load_policy("research").decide(history, CharCounter())
    when = {j: int(k) for k, ids in decision.drop_message.items() for j in ids}
    assert when[4] == 5  # the document the next turn called not relevant: at that turn
    assert when[2] == 9  # the first search page: at the turn 4 turns after it
    assert 6 not in when  # the short lookup stays
    assert when[10] == 29  # a long article: at the turn 10 turns after it
    # repositions wait for the end of the tool batch the drop's turn opened (one call per turn here)
    assert decision.reposition == sorted(int(k) + 1 for k in decision.drop_message)


def test_reposition_every_n_drops_and_by_gap() -> None:
    history = agent_history(8, response="r" * 100, system=False)
    rolling = "mode kv\non each tool_response: drop role tool keep last 2\n"
    tools = tool_indices(history)
    every2 = decide(rolling + "reposition every 2 drops\n", history)
    assert every2.reposition == [tools[3], tools[5], tools[7]]
    gap = decide(rolling + "reposition when gap > 250\n", history)
    assert gap.reposition == [tools[4], tools[7]]  # gaps of 300 tokens, after 3 drops of 100


def test_reposition_when_positions_pass_a_threshold() -> None:
    history = agent_history(8, response="r" * 100, system=False)  # user 17 tokens, tools 100, assistants 0
    rolling = "mode kv\non each tool_response: drop role tool keep last 2\n"
    tools = tool_indices(history)
    decision = decide(rolling + "reposition when positions > 450\n", history)
    # Positions reach 517 at tool 5 (tools 1-3 dropped) -> compact to 217; 517 again at tool 8.
    assert decision.reposition == [tools[4], tools[7]]


def test_reposition_every_n_tool_calls_needs_a_gap() -> None:
    history = agent_history(6, system=False)
    quiet = decide("mode kv\non after 5 tool_calls: drop role tool keep last 1\nreposition every 2 tool_calls\n",
                   history)
    assert quiet.reposition == [12]  # calls 2 and 4 had nothing to compact


def test_kv_thinking_drop_uses_the_drop_rule_field() -> None:
    decision = decide("mode kv\non visible_tokens > 100: drop thinking\n", agent_history(4))
    assert decision.api_fields() == {"drop_rule": {"type": "thinking_drop"}}
    assert decide("mode kv\non visible_tokens > 100000: drop thinking\n", agent_history(4)).api_fields() == {}


def test_standard_summarizes_all_but_protected_keeping_tool_batches_whole() -> None:
    history = agent_history(5, response="r" * 30_000)
    decision = load_policy("standard").decide(history, CharCounter())
    assert decision.api_fields() == {}
    [edit] = decision.text_edits
    assert (edit.kind, edit.start, edit.end, edit.budget_tokens) == ("summarize", 2, 9, 4000)
    edited = apply_text_edits(history, decision.text_edits, lambda msgs, budget: f"{len(msgs)} messages")
    assert edited[2] == {"role": "user", "content": SUMMARY_PREFIX + "8 messages"}
    assert [m["role"] for m in edited] == ["system", "user", "user", "assistant", "tool"]
    assert load_policy("standard").decide(edited, CharCounter()).text_edits == ()


def test_text_engineering_summarizes_earlier_than_standard() -> None:
    history = agent_history(3, response="r" * 20_000)
    assert load_policy("standard").decide(history, CharCounter()).text_edits == ()
    assert load_policy("text-engineering").decide(history, CharCounter()).text_edits != ()
    small = agent_history(5, response="r" * 900)
    assert load_policy("standard-8k").decide(small, CharCounter()).text_edits == ()
    assert load_policy("text-engineering-8k").decide(small, CharCounter()).text_edits != ()


def test_text_omit_keeps_last_n_and_is_idempotent() -> None:
    source = "mode text\non each tool_response: omit role tool keep last 2\n"
    history = agent_history(5, system=False)
    decision = decide(source, history)
    assert [(e.kind, e.start) for e in decision.text_edits] == [("omit", 2), ("omit", 4), ("omit", 6)]
    edited = apply_text_edits(history, decision.text_edits, lambda m, b: "")
    assert edited[2]["content"].startswith("[omitted tool message")
    assert decide(source, edited).text_edits == ()


def test_text_strips_thinking_of_old_assistant_messages() -> None:
    history = agent_history(4, system=False)
    for m in history:
        if m["role"] == "assistant":
            m["reasoning_content"] = "because"
    decision = decide("mode text\non each tool_response: omit thinking where age >= 2 turns\n", history)
    assert [(e.kind, e.start) for e in decision.text_edits] == [("strip_thinking", 1), ("strip_thinking", 3)]


def test_malformed_history_gets_a_clear_error() -> None:
    with pytest.raises(HistoryError, match="message 1: expected an object"):
        load_policy("expert").decide([{"role": "user", "content": "x"}, "oops"])
    with pytest.raises(HistoryError, match="list of messages"):
        load_policy("expert").decide("not a list")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["expert", "turn-based", "token-based"])
def test_builtin_evaluation_work_grows_linearly_with_the_history(name: str, monkeypatch) -> None:
    import policy_dsl.evaluate as evaluate

    calls = 0
    real = evaluate.matches

    def counted(selector, j, b):
        nonlocal calls
        calls += 1
        return real(selector, j, b)

    monkeypatch.setattr(evaluate, "matches", counted)
    work = []
    for rounds in (100, 400):
        calls = 0
        load_policy(name).decide(agent_history(rounds, response="r" * 8000))  # ~2000 tokens each
        work.append(calls)
    assert work[1] <= 5 * work[0], work  # 4x the history: linear work is ~4x, quadratic ~16x
