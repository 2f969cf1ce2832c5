"""Decisions of the built-in library and of each trigger, selector and reposition rule."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from test_policy_support import CharCounter, agent_history, call, tool_indices

from policy_dsl import (
    SUMMARY_PREFIX, ApproxTokenCounter, HistoryError, apply_text_edits, builtin_names, load_policy, parse,
    compile_policy,
)

DATA = Path(__file__).parent / "data" / "traces"


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


# ---- covered and call contains: what a result says again, and the call behind it ---------------

def bash(call_id: str, command: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [call(call_id, "bash", {"command": command})]}


def answer(call_id: str, content: str, name: str = "bash") -> dict:
    return {"role": "tool", "tool_call_id": call_id, "name": name, "content": content}


FILE_VIEW = "def add_numbers(a, b):\n    return a - b\n\n\ndef mul_numbers(a, b):\n    return a * b\n"
FAILURE = "FAILED tests/test_ops.py::test_add - assert -1 == 3"


def coding_session() -> list[dict]:
    """A coding agent with native tool calls: it reads a file, runs the failing test, re-reads part
    of the file, then all of it, re-runs the test, edits, and runs the tests twice."""
    edit = {"path": "src/calc/ops.py", "old_str": "a - b", "new_str": "a + b"}
    return [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "The test tests/test_ops.py fails; fix src/calc/ops.py."},
        bash("c1", "cat src/calc/ops.py"), answer("c1", FILE_VIEW),                  # 2, 3: add_numbers, mul_numbers
        bash("c2", "pytest -q tests/test_ops.py"), answer("c2", FAILURE),            # 4, 5: 3 of 4 items in the task
        bash("c3", "sed -n 1,2p src/calc/ops.py"), answer("c3", FILE_VIEW[:41]),    # 6, 7: add_numbers again
        bash("c4", "cat src/calc/ops.py"), answer("c4", FILE_VIEW),                  # 8, 9: all of 3 again
        bash("c5", "pytest -q tests/test_ops.py"), answer("c5", FAILURE),            # 10, 11: all of 5 again
        {"role": "assistant", "content": None, "tool_calls": [call("c6", "str_replace_editor", edit)]},
        answer("c6", "The file was edited.", "str_replace_editor"),                  # 12, 13: no distinctive item
        bash("c7", "pytest -q"), answer("c7", "1 passed"),                           # 14, 15: none either
        bash("c8", "pytest -q"), answer("c8", "1 passed"),                           # 16, 17
    ]


@pytest.mark.parametrize("selector, expected", [
    ("covered", {"9": [3, 7], "11": [5]}),                      # all: once the whole file and the test are back
    ("covered >= 75 percent", {"7": [5], "9": [3, 7], "13": [11]}),  # 5, 11: three of four items in the task
    ("covered >= 50 percent", {"7": [3, 5], "9": [7], "13": [11]}),  # 3: half of it read again at 7
    ("covered >= 1 percent", {"7": [3, 5], "9": [7], "13": [11]}),   # 13, 15: no item, never covered, however low
    # 7 stays while 9 says it again, and goes at 13, once 9 itself is gone (at 11)
    ("not covered", {"5": [3], "7": [5], "11": [9], "13": [7, 11], "15": [13], "17": [15]}),
])
def test_covered_picks_what_later_visible_messages_or_the_prompt_say_again(selector: str, expected: dict) -> None:
    history = coding_session()
    source = f"mode kv\non each tool_response: drop role tool and {selector}\nreposition never\n"
    assert decide(source, history).drop_message == expected
    for k in range(1, len(history)):  # decisions are cumulative: a prefix decides what the whole did there
        assert decide(source, history[:k]).drop_message == {i: v for i, v in expected.items() if int(i) < k}


def test_a_covering_message_dropped_by_an_earlier_rule_covers_nothing() -> None:
    history = coding_session()
    covered = "on each turn: drop role tool and covered >= 50 percent\n"
    partial = 'on each turn: drop role tool and call contains "sed -n"\n'
    assert decide(f"mode kv\n{covered}", history).drop_message == {"6": [5], "8": [3], "10": [7], "12": [11]}
    # the partial re-read goes first at 8: file view 3 waits for the whole one, visible at 10
    assert decide(f"mode kv\n{partial}{covered}", history).drop_message == {"6": [5], "8": [7], "10": [3], "12": [11]}
    # the other way round, 7 still covers 3 when the coverage rule runs
    assert decide(f"mode kv\n{covered}{partial}", history).drop_message == {"6": [5], "8": [3, 7], "12": [11]}


def test_only_messages_no_policy_hides_count_as_the_prompt_and_none_covers_itself() -> None:
    history = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "The test tests/test_ops.py fails; fix src/calc/ops.py."},
        {"role": "user", "content": "Hint: the helper add_numbers is wrong."},  # not protected: a policy may drop it
        bash("c1", "ls tests"), answer("c1", "tests/test_ops.py"),              # 3, 4: all of it in the task
        bash("c2", "grep -n add_numbers src/calc/ops.py"), answer("c2", "1:def add_numbers(a, b):"),
        {"role": "assistant", "content": "Found it."},
    ]
    source = "mode kv\non each turn: drop covered\nreposition never\n"
    assert decide(source, history[:5]).drop_message == {}  # the hint holds its own items only
    # at 5 the agent's call says the hint again and the listing is the task's; at 7 the call is in its result
    assert decide(source, history).drop_message == {"5": [2, 4], "7": [5]}
    # the result 6 is not covered by the hint: an earlier message that is no prompt, and dropped by then
    assert decide("mode kv\non each turn: drop role tool and covered\nreposition never\n",
                  history).drop_message == {"5": [4]}


@pytest.mark.parametrize("selector, expected", [
    ('role tool and call contains "cat "', {"4": [3], "10": [9]}),
    ('call contains "pytest"', {"6": [4, 5], "12": [10, 11], "16": [14, 15]}),  # an assistant on its own calls
    ('role tool and call contains "src/calc/ops.py"', {"4": [3], "8": [7], "10": [9], "14": [13]}),
    ('role tool and call contains "str_replace_editor"', {"14": [13]}),        # the tool's name is in the call
    ('role tool and not call contains "pytest"', {"4": [3], "8": [7], "10": [9], "14": [13]}),
    ('role tool and call contains "Cat "', {}),  # case-sensitive
])
def test_call_contains_reads_the_call_behind_a_result(selector: str, expected: dict) -> None:
    source = f"mode kv\non each turn: drop {selector}\nreposition never\n"
    assert decide(source, coding_session()).drop_message == expected


def test_call_contains_reads_decoded_arguments_and_raw_text_when_they_do_not_parse() -> None:
    truncated = call("c1", "bash")
    truncated["function"]["arguments"] = '{"command": "cat a.py'  # not JSON: read as recorded
    as_object = call("c2", "bash")
    as_object["function"]["arguments"] = {"command": "grep -n \"TODO\" a.py", "lines": 120}  # not a string
    huge = call("c3", "bash")
    huge["function"]["arguments"] = json.dumps({"command": "cat big.txt", "pad": "x" * 70_000})  # too long to parse
    history = [{"role": "user", "content": "Tidy a.py."}]
    for n, c in enumerate((truncated, as_object, huge)):
        history += [{"role": "assistant", "content": None, "tool_calls": [c]}, answer(c["id"], f"out {n}")]
    history += [bash("c4", "ls"), answer("nobody", "a.py")]  # 7, 8: an answer to no call of its assistant
    history.append({"role": "assistant", "content": "Done."})

    def picked(text: str) -> list[int]:
        source = f"mode kv\non each turn: drop role tool and call contains {json.dumps(text)}\nreposition never\n"
        return sorted(j for v in decide(source, history).drop_message.values() for j in v)

    assert picked("cat a.py") == [2] and picked('"command"') == [2, 6]  # raw text keeps the keys
    assert picked('grep -n "TODO"') == [4] and picked("120") == [4]    # values decoded, keys left out
    assert picked("lines") == [] and picked("bash") == [2, 4, 6]      # the orphan answer has no call
    assert picked("cat big.txt") == [6]


def test_call_contains_tells_the_results_of_a_text_action_agent_apart_once_converted() -> None:
    """mini-swe-agent acts in text: every result answers `bash`, only the command says what it is."""
    from sandbox.traces.formats import as_tool_calls, read_traces

    [text] = read_traces(DATA / "mswea.traj.json")
    trace = as_tool_calls(text)
    history = [dict(m) for m in trace.messages]
    source = 'mode kv\non each turn: drop role tool and call contains "{}"\nreposition never\n'
    assert decide(source.format("grep -n"), history).drop_message == {"4": [3]}
    assert decide(source.format("sed -i"), history).drop_message == {"8": [7]}  # 9's call edits too, but is last
    assert decide(source.format("bash"), history).drop_message == {"4": [3], "8": [7]}
    assert decide('mode kv\non each turn: drop call contains "sed -n 84,95p"\nreposition never\n',
                  history).drop_message == {"8": [6, 7]}  # the assistant message on its own call, and its result
    # the same run in text, observations as user messages: no call is behind them
    raw = [dict(m) for m in text.messages]
    assert decide("mode kv\ncalls include user_observations\n" + source.format("grep -n").split("\n", 1)[1],
                  raw).drop_message == {}


def recorded_runs() -> list[list[dict]]:
    """Real runs: a mini-swe-agent run converted to tool calls, a SWE-agent run, a tau-bench run."""
    from sandbox.traces.formats import read_traces

    return [[dict(m) for m in trace.messages] for trace in read_traces(DATA / "samples.jsonl")]


@pytest.mark.parametrize("share", [100, 50])
def test_covered_on_recorded_runs_matches_its_definition(share: int) -> None:
    """At every boundary the rule fires, a visible tool result is picked exactly when `share` percent
    of its distinctive items are held by the prompt or by a later message still visible."""
    from policy_dsl.reuse import distinctive_items, message_text

    picks = 0
    for history in recorded_runs():
        items = [distinctive_items(message_text(m, names=False)) for m in history]
        prompt = {0, 1} if history[0]["role"] == "system" else {0}
        source = f"mode kv\non each tool_response: drop role tool and covered >= {share} percent\n"
        decision = decide(source, history)
        gone: set[int] = set()
        for i in (i for i, m in enumerate(history) if m["role"] == "tool"):
            def held(item: str, j: int) -> bool:
                return any(item in items[p] for p in prompt) or \
                    any(item in items[k] for k in range(j + 1, i + 1) if k not in gone)
            visible = [j for j in range(i) if history[j]["role"] == "tool" and j not in gone]
            expected = [j for j in visible if items[j] and sum(held(x, j) for x in items[j]) * 100 >= share * len(items[j])]
            assert decision.drop_message.get(str(i), []) == expected, i
            gone |= set(expected)
        picks += len(gone)
    assert picks > 20  # not vacuous


def test_call_contains_on_recorded_runs_picks_the_results_of_matching_calls() -> None:
    found: dict[str, int] = {}
    for history in recorded_runs():
        called, calls = {}, {}
        for j, m in enumerate(history):  # ids repeat across a tau-bench run: a result answers its own turn's call
            calls = {c["id"]: c["function"] for c in m.get("tool_calls") or ()} if m["role"] == "assistant" else calls
            if m["role"] == "tool":
                called[j] = calls[m["tool_call_id"]]
        last_turn = max(i for i, m in enumerate(history) if m["role"] == "assistant")
        for text in ("grep", "python ", "edit ", "IAH", "get_reservation_details"):
            decision = decide(f"mode kv\non each turn: drop role tool and call contains {json.dumps(text)}\n", history)
            picked = sorted(j for v in decision.drop_message.values() for j in v)
            expected = [j for j, f in called.items() if j < last_turn and text in
                        f["name"] + json.dumps(json.loads(f["arguments"]), ensure_ascii=False)]
            assert picked == expected, text
            found[text] = found.get(text, 0) + len(picked)
    assert all(found.values()), found  # each text picks something somewhere


# ---- the kv walk: a conversation decided request by request -------------------------------------

def test_a_conversation_decided_request_by_request_walks_each_boundary_once(monkeypatch) -> None:
    from policy_dsl.kv_walk import KvWalk

    walked = 0
    real = KvWalk._boundary

    def counted(self, *args):
        nonlocal walked
        walked += 1
        return real(self, *args)

    monkeypatch.setattr(KvWalk, "_boundary", counted)
    history = coding_session()
    source = "mode kv\non each tool_response: drop role tool and covered >= 50 percent\nreposition after each drop\n"
    for counter in (CharCounter(), None):  # None: the default counter, one object for every request
        policy, walked = compile_policy(parse(source)), 0
        decisions = [policy.decide(history[:k], counter) for k in range(1, len(history) + 1)]
        assert walked == len(history)  # each request walks only its new messages
        assert decisions == [compile_policy(parse(source)).decide(history[:k], counter)
                             for k in range(1, len(history) + 1)]
        assert walked == len(history) + sum(range(1, len(history) + 1))  # a fresh policy walks from the start
    prompts = ("mode kv\ncalls include controller_prompts\non each tool_response: drop role tool keep last 2\n"
               "reposition when positions > 100\n")
    policy, walked = compile_policy(parse(prompts)), 0
    for k in range(1, len(history) + 1):
        policy.decide(history[:k])
    assert walked == sum(range(1, len(history) + 1))  # the last boundary reads the next message: never resumed


def test_a_compiled_policy_travels_to_another_process_without_its_walks() -> None:
    import pickle
    from dataclasses import replace

    policy = load_policy("expert")
    history = agent_history(20)
    decided = policy.decide(history)
    copy = pickle.loads(pickle.dumps(policy))  # process lanes send the policy with each task
    assert copy == policy and copy.decide(history) == decided
    assert replace(policy, name="other")._walks is not policy._walks  # another policy object, its own walks


def reading_session(seed: int) -> list[dict]:
    """A coding agent reading and grepping files of its own project, often the same ones again."""
    rng = random.Random(seed)
    history = [{"role": "system", "content": "You are a coding agent."},
               {"role": "user", "content": f"Fix src/pkg/mod_{seed}.py."}]
    for step in range(30):
        path = f"src/pkg/file_{seed}_{rng.randint(0, 8)}.py"
        history += [bash(f"c{step}", f"cat {path}"),
                    answer(f"c{step}", f"{path}: def func_{seed}_{rng.randint(0, 5)}(): return HAT{rng.randint(100, 999)}")]
        history.append({"role": "assistant", "content": f"Now func_{seed}_{rng.randint(0, 5)}."})
    return history


@pytest.mark.parametrize("selector", ["covered >= 50 percent", "role tool and idle >= 6 turns"])
def test_decisions_made_in_threads_at_once_equal_those_made_one_at_a_time(selector: str, monkeypatch) -> None:
    """A proxy decides its clients' requests in threads; the process's one reuse finder serves them all."""
    import sys
    import threading

    from policy_dsl import history as history_module
    from policy_dsl.reuse import ReuseFinder

    sessions = [reading_session(seed) for seed in range(8)]
    source = f"mode kv\non each tool_response: drop {selector}\nreposition never\n"
    alone = [decide(source, session) for session in sessions]
    assert all(d.drop_message for d in alone)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, so that they meet in the finder
    try:
        for _ in range(5):
            monkeypatch.setattr(history_module, "REUSE_FINDER", ReuseFinder())  # its memo empty: filled at once
            policy, start, decided = compile_policy(parse(source)), threading.Barrier(len(sessions)), {}

            def run(k: int) -> None:
                start.wait()
                decided[k] = policy.decide(sessions[k], CharCounter())

            threads = [threading.Thread(target=run, args=(k,)) for k in range(len(sessions))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert [decided[k] for k in range(len(sessions))] == alone
    finally:
        sys.setswitchinterval(interval)
