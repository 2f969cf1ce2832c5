"""Use records without a model (policy_dsl/reuse.py): what counts as distinctive, who holds it,
what is excluded, at risk, used and lost; on hand-made histories and on excerpts of real runs."""
from __future__ import annotations

import json

import pytest

from policy_dsl.reuse import (Reuse, ReuseFinder, _fingerprint, common_items, distinctive_items, lost_reuses,
                              message_text, used_indices)


def system(text: str) -> dict:
    return {"role": "system", "content": text}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str = "", *calls: tuple[str, dict], reasoning: str | None = None) -> dict:
    message: dict = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [{"id": f"call_{n}", "type": "function",
                                  "function": {"name": name, "arguments": json.dumps(args)}}
                                 for n, (name, args) in enumerate(calls)]
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message


def tool(text: str) -> dict:
    return {"role": "tool", "tool_call_id": "call_0", "content": text}


def found(history: list[dict], index: int | None = None, **finder) -> list[Reuse]:
    """The reuses of the history's last message (or of `index`)."""
    return ReuseFinder(**finder).reuses(history, len(history) - 1 if index is None else index)


def items(history: list[dict], **finder) -> dict[str, tuple[int, ...]]:
    return {r.item: r.holders for r in found(history, **finder)}


START = [system("You are a helpful agent."), user("Please help me."), assistant("Looking.", ("bash", {"c": "ls"}))]


# ---- what is distinctive ---------------------------------------------------------------------------


def test_paths_identifiers_ids_and_long_numbers_are_candidates() -> None:
    assert distinctive_items("open ./src/pkg/util.py:42 then grep -n tensor_product_simp") == {
        "src/pkg/util.py", "pkg/util.py", "util.py", "tensor_product_simp"}
    assert distinctive_items("flight HAT136, reservation NO6JO3 (or 4NQLHD), user mia_li_3668") == {
        "HAT136", "NO6JO3", "4NQLHD", "mia_li_3668"}
    assert distinctive_items("total $1,818 from 1818.0; ids AJVCTQ and 7434610") == {
        "1818", "1818.0", "AJVCTQ", "7434610"}
    text = ('see https://example.org/docs/api.html, call ds.file_meta.TransferSyntaxUID on 2024-05-23; '
            'it said "object has no attribute expand" for "LAS"')
    assert {"https://example.org/docs/api.html", "ds.file_meta.TransferSyntaxUID", "TransferSyntaxUID",
            "file_meta", "2024-05-23", "object has no attribute expand", "LAS"} <= distinctive_items(text)


@pytest.mark.parametrize("text", [
    "In 2024, as in 1999 and 2099, nothing changed",  # years standing alone
    "sed -n '380,400p' and nl -ba | sed -n '1,200p'",  # sed line ranges
    "lines 10-20 and 380-400, then edit 287:295",  # ranges
    "at :12 and :380, col 7:45, time 15:30:00",  # line and column suffixes, times
    "ls cat grep sed awk python python3 pip3 bash",  # shell words
    "/dev/null /tmp /usr/bin/env /bin/bash /etc/hosts",  # generic paths
    "42 7 100 2000 10000 1.5 3.10 0.001",  # small and round numbers, short decimals
    "The Reader said Hello to everyone, and/or I/O on 05/23/2024",  # words, word pairs, dates with slashes
    "ERROR WARNING FAILED PASSED README",  # shouted words
    "__init__ __name__ sha256 x86_64 utf8 int64 sigma3 test1",  # Python's and the platform's names
])
def test_false_friends_are_not_candidates(text: str) -> None:
    assert distinctive_items(text) == frozenset()


def test_every_candidate_of_a_text_is_held_by_that_text() -> None:
    # The consistency that makes holders trustworthy: extraction and holding agree on every string.
    for history in (TAU, SWE):
        for message in history:
            for item in distinctive_items(message_text(message)):
                reuses = found([*START, tool(message_text(message)), assistant(f'"{item}"')])
                assert Reuse(item, (3,), True) in reuses, item


# ---- who holds it -----------------------------------------------------------------------------------


def test_an_item_is_held_only_as_a_whole_token() -> None:
    history = [*START, tool("ids 123456 and 99887, file ./src/a.py:12 and lib/src/b.pyc"),
               assistant("so 1234 and 9988 and src/a.py and src/b.py")]
    assert items(history) == {"src/a.py": (3,)}


def test_the_arguments_of_tool_calls_are_what_the_step_says() -> None:
    history = [*START, tool("./src/pkg/util.py\n./src/pkg/io.py"),
               assistant("", ("read_file", {"path": "src/pkg/util.py", "max_lines": 2500}))]
    assert found(history) == [Reuse("src/pkg/util.py", (3,), True)]
    # argument keys are the schema's words: a key of the result reused as a key is no reuse
    history = [*START, tool('{"reservation_id": "AJVCTQ", "user_id": "mia_li_3668"}'),
               assistant("", ("get_reservation_details", {"reservation_id": "AJVCTQ"}))]
    assert items(history) == {"AJVCTQ": (3,)}


def test_reasoning_is_not_what_the_step_says() -> None:
    history = [*START, tool("flight HAT136"), assistant("Let me check.", reasoning="HAT136 looks right")]
    assert found(history) == []


def test_one_run_reports_its_longest_held_form_and_shorter_ones_only_for_new_holders() -> None:
    history = [*START, tool("src/pkg/util.py:10: def load()"), tool("util.py  io.py"),
               assistant("I will edit /testbed/src/pkg/util.py")]
    assert found(history) == [Reuse("src/pkg/util.py", (3,), True), Reuse("util.py", (3, 4), True)]


# ---- what is excluded ---------------------------------------------------------------------------------


def test_strings_of_the_system_prompt_and_the_task_are_not_reuse() -> None:
    history = [system("Work in /workspace/app/main.py."), user("Rebook flight HAT136."),
               user("A demonstration: reservation ZZ9ZZ9."), assistant("On it.", ("bash", {"c": "ls"})),
               tool("/workspace/app/main.py HAT136 ZZ9ZZ9 NO6JO3"),
               assistant("HAT136 is on NO6JO3 and ZZ9ZZ9, see /workspace/app/main.py")]
    assert items(history) == {"NO6JO3": (4,)}


def test_tool_names_and_schema_words_are_not_reuse() -> None:
    tools = [{"type": "function", "function": {
        "name": "get_reservation_details", "description": "Look up a reservation by reservation_id.",
        "parameters": {"type": "object", "properties": {"reservation_id": {"type": "string"},
                                                        "cabin": {"enum": ["basic_economy", "business"]}}}}}]
    history = [*START, assistant("", ("get_reservation_details", {"reservation_id": "AJVCTQ"})),
               tool('{"reservation_id": "AJVCTQ", "cabin": "basic_economy"}'),
               assistant("get_reservation_details says reservation_id AJVCTQ is basic_economy")]
    assert items(history, tools=tools) == {"AJVCTQ": (3, 4)}
    # without the schema its words are content, but a name the history called is still a tool name
    assert items(history) == {"reservation_id": (4,), "AJVCTQ": (3, 4), "basic_economy": (4,)}


def test_common_items_are_those_of_more_than_the_share_of_histories() -> None:
    histories = [[*START, tool(f"/testbed/setup.py run_tests.sh {extra}")] for extra in
                 ("CASE1234", "CASE1234", "CASE1234", "OTHER5678")]
    boilerplate = {"/testbed/setup.py", "testbed/setup.py", "setup.py", "run_tests.sh", "run_tests"}
    assert common_items(histories) == boilerplate | {"CASE1234"}
    assert common_items(histories, share=0.75) == boilerplate
    assert common_items(histories[:3]) == frozenset()  # too few histories to tell
    assert common_items(histories[:3], min_histories=3) == boilerplate | {"CASE1234"}
    step = [*histories[3], assistant("ran /testbed/setup.py for OTHER5678")]
    assert items(step, common=common_items(histories)) == {"OTHER5678": (3,)}


# ---- at risk, used, lost ----------------------------------------------------------------------------


def test_a_string_the_agent_or_the_user_also_wrote_is_not_at_risk() -> None:
    agent_too = [*START, tool("reservations: NO6JO3, KHIK97"), assistant("You have NO6JO3 and KHIK97."),
                 user("Thanks"), assistant("", ("get_reservation_details", {"reservation_id": "KHIK97"}))]
    assert found(agent_too) == [Reuse("KHIK97", (3, 4), False)]
    user_said = [*START, tool("no results"), user("My id is mia_li_3668."), assistant("Got mia_li_3668.")]
    assert found(user_said) == [Reuse("mia_li_3668", (4,), False)]
    only_tool = [*START, tool("reservations: NO6JO3"), user("Which one?"), assistant("It is NO6JO3.")]
    assert found(only_tool) == [Reuse("NO6JO3", (3,), True)]


def test_the_use_record_names_the_latest_visible_holder() -> None:
    reuses = [Reuse("HAT136", (3, 5, 7), True), Reuse("NO6JO3", (4,), True), Reuse("KHIK97", (5,), False)]
    visible = [True] * 8
    assert used_indices(reuses, visible) == (4, 5, 7)
    visible[7] = False
    assert used_indices(reuses, visible) == (4, 5)
    visible[4] = visible[5] = False
    assert used_indices(reuses, visible) == (3,)


def test_a_reuse_is_lost_when_every_holder_is_hidden_whatever_its_role() -> None:
    reuses = [Reuse("HAT136", (3, 5), True), Reuse("KHIK97", (4,), False)]
    assert lost_reuses(reuses, [True] * 6) == []
    assert lost_reuses(reuses, [True, True, True, True, True, False]) == []  # 3 still shows it
    assert lost_reuses(reuses, [True, True, True, False, True, False]) == [reuses[0]]
    # 4 (the agent's or the user's words) held KHIK97 alone: hiding it loses it too
    assert lost_reuses(reuses, [True, True, True, False, False, False]) == reuses


def test_only_assistant_messages_have_reuses() -> None:
    with pytest.raises(ValueError, match="message 3 is not an assistant message"):
        ReuseFinder().reuses([*START, tool("x")], 3)


# ---- growing histories, changed views, speed ---------------------------------------------------------------


def _all(finder: ReuseFinder, history: list[dict]) -> dict[int, list[Reuse]]:
    return {i: finder.reuses(history, i) for i, m in enumerate(history) if m["role"] == "assistant"}


def test_a_growing_history_and_a_fixed_trace_give_the_same_reuses_reading_each_message_once() -> None:
    fresh = {i: ReuseFinder().reuses(TAU, i) for i, m in enumerate(TAU) if m["role"] == "assistant"}
    finder = ReuseFinder()
    assert _all(finder, TAU) == fresh
    distinct = len({_fingerprint(m) for m in TAU})
    assert len(finder._entries) == distinct  # each message read once (a repeated one once in all)
    finder, growing, steps = ReuseFinder(), [], {}
    for message in TAU:
        growing.append(dict(message))   # copies, as a harness makes them: read once too
        if message["role"] == "assistant":
            steps[len(growing) - 1] = finder.reuses(growing, len(growing) - 1)
    assert steps == fresh and len(finder._entries) == distinct


def test_a_view_that_changed_a_message_is_read_again() -> None:
    finder = ReuseFinder()
    assert [r.item for r in finder.reuses(TAU, 22)] == ["404", "202"]
    view = [*TAU[:19], {**TAU[19], "content": "[search results dropped]"}, *TAU[20:23]]
    assert finder.reuses(view, 22) == []
    view[19] = TAU[19]
    assert [r.item for r in finder.reuses(view, 22)] == ["404", "202"]
    changed = [dict(m) for m in TAU[:23]]
    changed[19]["content"] = "nothing"  # changed in place: a new content object
    assert finder.reuses(changed, 22) == []


def test_a_200k_character_trace_of_70_steps_finds_each_steps_reuses() -> None:
    history = [system("You fix bugs."), user("Fix the parser.")]
    for step in range(70):
        path = f"src/module_{step}/parser_{step}.py"
        history.append(assistant(f"Reading {path} near line {300 + step}; earlier HAT{step:03d}.",
                                 ("bash", {"command": f"sed -n '{300 + step},{340 + step}p' {path}"})))
        lines = [f"{300 + step + k}    value_{step}_{k} = compute(HAT{step:03d}, {1000 + k})  # {path}"
                 for k in range(40)]
        history.append(tool("\n".join(lines)[:2850]))
    history.append(assistant("Done with " + " ".join(f"value_{s}_3" for s in range(70))))
    assert sum(len(message_text(m)) for m in history) > 200_000
    reuses = _all(ReuseFinder(), history)
    assert len(reuses[len(history) - 1]) == 70 and all(r.at_risk for r in reuses[len(history) - 1])


# ---- real runs --------------------------------------------------------------------------------------------


def test_tau_bench_agent_reuses_ids_and_prices_from_tool_results() -> None:
    reuses = _all(ReuseFinder(), TAU)
    for index, found_here in reuses.items():
        for r in found_here:
            print(index, r)
    # the user named the user id in a mid-run turn: used, not at risk
    assert reuses[4] == [Reuse("liam_khan_2521", (3,), False)]
    # the agent lists the reservation ids only the profile lookup returned
    assert reuses[6] == [Reuse(i, (5,), True) for i in ("4NQLHD", "KHIK97", "NO6SVK", "AJVCTQ", "ZB7LBX")]
    # the user repeated KHIK97 and the agent had written it: not at risk
    assert reuses[8] == [Reuse("KHIK97", (5, 6, 7), False)]
    # business fares of the first option (404 + 202) from the flight search; `$1,818` is `1818.0`
    assert reuses[22] == [Reuse("404", (19,), True), Reuse("202", (19,), True)]
    assert Reuse("1818", (23,), True) in reuses[24] and Reuse("HAT286", (19,), True) in reuses[24]
    # the trip IAH to SEA came with the task: not reuse, wherever else it appears
    assert not any(r.item in ("IAH", "SEA") for found_here in reuses.values() for r in found_here)
    hide_search = [i != 19 for i in range(22)]
    assert [r.item for r in lost_reuses(reuses[22], hide_search)] == ["404", "202"]
    assert used_indices(reuses[24], [True] * 24) == (5, 19, 23)


def test_coding_agent_reuses_a_path_from_its_search_result() -> None:
    reuses = _all(ReuseFinder(), SWE)
    for index, found_here in reuses.items():
        for r in found_here:
            print(index, r)
    # grep found the file; its full path appears in no earlier agent message
    assert Reuse("sympy/physics/quantum/tensorproduct.py", (5,), True) in reuses[6]
    # the agent's own `ls` and its output also hold the directory and the file name
    assert Reuse("tensorproduct.py", (2, 3, 5), False) in reuses[6]
    # tensor_product_simp and TensorProduct come with the task
    assert not any(r.item in ("tensor_product_simp", "TensorProduct") for rs in reuses.values() for r in rs)


# ---- excerpts of real runs (MIT licensed, as their projects published them) ------------------------------
# tau-bench (sierra-research/tau-bench, historical_trajectories/gpt-4o-airline.json, task 17): gpt-4o as
# the airline agent with a simulated user; messages 0-24, the system prompt cut at [...].
TAU = json.loads(r"""[
{"role": "system", "content": "# Airline Agent Policy\n\nThe current time is 2024-05-15 15:00:00 EST.\n\nAs an airline agent, you can help users book, modify, or cancel flight reservations.\n\n- Before taking any actions that update the booking database (booking, modifying flights, editing baggage, upgrading cabin class, or updating passenger information), you must list the action details and obtain explicit user confirmation (yes) to proceed.\n\n[...]"},
{"role": "user", "content": "Hi there! I need to reschedule my upcoming flight from IAH to SEA from May 23 to May 24 and upgrade to business class for all passengers. Can you help with that?"},
{"role": "assistant", "content": "I can assist you with rescheduling your flight and upgrading to business class. To proceed, I'll need your user ID and the reservation ID for the flight you want to modify. Could you please provide those details?"},
{"role": "user", "content": "I'm sorry, I don't have my reservation ID handy at the moment, but my user ID is liam_khan_2521. Can we proceed with that?"},
{"role": "assistant", "content": "", "tool_calls": [{"id": "call_oajpGropRRpNB45Z0SZMkwlY", "type": "function", "function": {"name": "get_user_details", "arguments": "{\"user_id\":\"liam_khan_2521\"}"}}]},
{"role": "tool", "content": "{\"name\": {\"first_name\": \"Liam\", \"last_name\": \"Khan\"}, \"address\": {\"address1\": \"626 Willow Lane\", \"address2\": \"Suite 707\", \"city\": \"New York\", \"country\": \"USA\", \"province\": \"NY\", \"zip\": \"10148\"}, \"email\": \"liam.khan7273@example.com\", \"dob\": \"1979-09-27\", \"payment_methods\": {\"certificate_9254323\": {\"source\": \"certificate\", \"amount\": 500, \"id\": \"certificate_9254323\"}, \"gift_card_7194529\": {\"source\": \"gift_card\", \"amount\": 62, \"id\": \"gift_card_7194529\"}, \"credit_card_7434610\": {\"source\": \"credit_card\", \"brand\": \"mastercard\", \"last_four\": \"9448\", \"id\": \"credit_card_7434610\"}, \"credit_card_7231150\": {\"source\": \"credit_card\", \"brand\": \"visa\", \"last_four\": \"3422\", \"id\": \"credit_card_7231150\"}, \"certificate_1849235\": {\"source\": \"certificate\", \"amount\": 250, \"id\": \"certificate_1849235\"}}, \"saved_passengers\": [{\"first_name\": \"Fatima\", \"last_name\": \"Ito\", \"dob\": \"1983-03-27\"}], \"membership\": \"gold\", \"reservations\": [\"4NQLHD\", \"KHIK97\", \"NO6SVK\", \"AJVCTQ\", \"ZB7LBX\"]}", "tool_call_id": "call_oajpGropRRpNB45Z0SZMkwlY"},
{"role": "assistant", "content": "I have retrieved your user details. You have several reservations under your profile. Could you please check and let me know which reservation ID corresponds to your flight from IAH to SEA? Here are your reservation IDs for reference: 4NQLHD, KHIK97, NO6SVK, AJVCTQ, ZB7LBX."},
{"role": "user", "content": "I think it's reservation ID KHIK97. Can you confirm if that's correct?"},
{"role": "assistant", "content": "", "tool_calls": [{"id": "call_D2zYj9KB0nNdJvLTTOcopGjr", "type": "function", "function": {"name": "get_reservation_details", "arguments": "{\"reservation_id\":\"KHIK97\"}"}}]},
{"role": "tool", "content": "{\"reservation_id\": \"KHIK97\", \"user_id\": \"liam_khan_2521\", \"origin\": \"ORD\", \"destination\": \"MSP\", \"flight_type\": \"one_way\", \"cabin\": \"basic_economy\", \"flights\": [{\"origin\": \"ORD\", \"destination\": \"DTW\", \"flight_number\": \"HAT230\", \"date\": \"2024-05-18\", \"price\": 92}, {\"origin\": \"DTW\", \"destination\": \"MSP\", \"flight_number\": \"HAT125\", \"date\": \"2024-05-18\", \"price\": 82}], \"passengers\": [{\"first_name\": \"Liam\", \"last_name\": \"Khan\", \"dob\": \"1979-09-27\"}], \"payment_history\": [{\"payment_id\": \"credit_card_7231150\", \"amount\": 204}], \"created_at\": \"2024-05-11T15:45:54\", \"total_baggages\": 0, \"nonfree_baggages\": 0, \"insurance\": \"yes\"}", "tool_call_id": "call_D2zYj9KB0nNdJvLTTOcopGjr"},
{"role": "assistant", "content": "The reservation ID \"KHIK97\" is for a flight from ORD (Chicago O'Hare) to MSP (Minneapolis) on May 18, not from IAH to SEA. Could you please check again or provide another reservation ID?"},
{"role": "user", "content": "I'm really sorry, but I can't remember the correct reservation ID for my IAH to SEA flight at the moment. Could you help me find it using some other details?"},
{"role": "assistant", "content": "", "tool_calls": [{"id": "call_GDP9uRp1LTGyOSpZA8kzwiII", "type": "function", "function": {"name": "think", "arguments": "{\"thought\":\"The user is unable to recall the reservation ID for the IAH to SEA flight. I will need to check each reservation under the user's profile to identify the correct one.\"}"}}]},
{"role": "tool", "content": "", "tool_call_id": "call_GDP9uRp1LTGyOSpZA8kzwiII"},
{"role": "assistant", "content": "", "tool_calls": [{"id": "call_FApEDaUHdL2hx8FNbu5UCMb8", "type": "function", "function": {"name": "get_reservation_details", "arguments": "{\"reservation_id\": \"4NQLHD\"}"}}]},
{"role": "tool", "content": "{\"reservation_id\": \"4NQLHD\", \"user_id\": \"liam_khan_2521\", \"origin\": \"IAH\", \"destination\": \"SEA\", \"flight_type\": \"round_trip\", \"cabin\": \"economy\", \"flights\": [{\"origin\": \"IAH\", \"destination\": \"LAS\", \"flight_number\": \"HAT190\", \"date\": \"2024-05-23\", \"price\": 126}, {\"origin\": \"LAS\", \"destination\": \"SEA\", \"flight_number\": \"HAT047\", \"date\": \"2024-05-23\", \"price\": 139}, {\"origin\": \"SEA\", \"destination\": \"JFK\", \"flight_number\": \"HAT021\", \"date\": \"2024-05-26\", \"price\": 148}, {\"origin\": \"JFK\", \"destination\": \"IAH\", \"flight_number\": \"HAT279\", \"date\": \"2024-05-27\", \"price\": 114}], \"passengers\": [{\"first_name\": \"Liam\", \"last_name\": \"Khan\", \"dob\": \"1979-09-27\"}, {\"first_name\": \"James\", \"last_name\": \"Kim\", \"dob\": \"1956-07-08\"}, {\"first_name\": \"Aarav\", \"last_name\": \"Lee\", \"dob\": \"1972-06-13\"}], \"payment_history\": [{\"payment_id\": \"credit_card_7434610\", \"amount\": 1671}], \"created_at\": \"2024-05-08T11:24:52\", \"total_baggages\": 1, \"nonfree_baggages\": 0, \"insurance\": \"yes\"}", "tool_call_id": "call_FApEDaUHdL2hx8FNbu5UCMb8"},
{"role": "assistant", "content": "I have found your reservation for the flight from IAH to SEA. The reservation ID is \"4NQLHD.\" Here are the details:\n\n- **Trip Type:** Round Trip\n- **Cabin:** Economy\n- **Flights:**\n  - IAH to LAS on May 23\n  - LAS to SEA on May 23\n  - SEA to JFK on May 26\n  - JFK to IAH on May 27\n- **Passengers:** Liam Khan, James Kim, Aarav Lee\n\nYou want to reschedule the IAH to SEA segment from May 23 to May 24 and upgrade to business class for all passengers. Please confirm if this is correct, and I'll proceed with the changes."},
{"role": "user", "content": "Yes, that's correct. Please go ahead with the rescheduling and upgrading to business class for all of us."},
{"role": "assistant", "content": "", "tool_calls": [{"id": "call_QCD2TymKvAvRYZa95ZLcta8r", "type": "function", "function": {"name": "search_onestop_flight", "arguments": "{\"origin\":\"IAH\",\"destination\":\"SEA\",\"date\":\"2024-05-24\"}"}}]},
{"role": "tool", "content": "[[{\"flight_number\": \"HAT112\", \"origin\": \"IAH\", \"destination\": \"LAS\", \"scheduled_departure_time_est\": \"22:00:00\", \"scheduled_arrival_time_est\": \"01:00:00+1\", \"status\": \"available\", \"available_seats\": {\"basic_economy\": 10, \"economy\": 11, \"business\": 19}, \"prices\": {\"basic_economy\": 54, \"economy\": 135, \"business\": 404}, \"date\": \"2024-05-24\"}, {\"flight_number\": \"HAT047\", \"origin\": \"LAS\", \"destination\": \"SEA\", \"scheduled_departure_time_est\": \"13:00:00\", \"scheduled_arrival_time_est\": \"15:30:00\", \"status\": \"available\", \"available_seats\": {\"basic_economy\": 15, \"economy\": 12, \"business\": 13}, \"prices\": {\"basic_economy\": 56, \"economy\": 165, \"business\": 202}, \"date\": \"2024-05-25\"}], [{\"flight_number\": \"HAT190\", \"origin\": \"IAH\", \"destination\": \"LAS\", \"scheduled_departure_time_est\": \"01:00:00\", \"scheduled_arrival_time_est\": \"04:00:00\", \"status\": \"available\", \"available_seats\": {\"basic_economy\": 9, \"economy\": 3, \"business\": 3}, \"prices\": {\"basic_economy\": 95, \"economy\": 113, \"business\": 464}, \"date\": \"2024-05-24\"}, {\"flight_number\": \"HAT047\", \"origin\": \"LAS\", \"destination\": \"SEA\", \"scheduled_departure_time_est\": \"13:00:00\", \"scheduled_arrival_time_est\": \"15:30:00\", \"status\": \"available\", \"available_seats\": {\"basic_economy\": 15, \"economy\": 12, \"business\": 13}, \"prices\": {\"basic_economy\": 56, \"economy\": 165, \"business\": 202}, \"date\": \"2024-05-24\"}], [{\"flight_number\": \"HAT286\", \"origin\": \"IAH\", \"destination\": \"LAS\", \"scheduled_departure_time_est\": \"22:00:00\", \"scheduled_arrival_time_est\": \"01:00:00+1\", \"status\": \"available\", \"available_seats\": {\"basic_economy\": 3, \"economy\": 6, \"business\": 11}, \"prices\": {\"basic_economy\": 60, \"economy\": 114, \"business\": 399}, \"date\": \"2024-05-24\"}, {\"flight_number\": \"HAT047\", \"origin\": \"LAS\", \"destination\": \"SEA\", \"scheduled_departure_time_est\": \"13:00:00\", \"scheduled_arrival_time_est\": \"15:30:00\", \"status\": \"available\", \"available_seats\": {\"basic_economy\": 15, \"economy\": 12, \"business\": 13}, \"prices\": {\"basic_economy\": 56, \"economy\": 165, \"business\": 202}, \"date\": \"2024-05-25\"}]]", "tool_call_id": "call_QCD2TymKvAvRYZa95ZLcta8r"},
{"role": "assistant", "content": "", "tool_calls": [{"id": "call_oKEfpgJJ0VyPyMynP0g3IKRc", "type": "function", "function": {"name": "think", "arguments": "{\"thought\":\"The user wants to reschedule the IAH to SEA flight from May 23 to May 24 and upgrade to business class. I found several available one-stop flights for May 24. I need to calculate the total cost for upgrading all passengers to business class and ensure the payment method is ready for the additional cost.\"}"}}]},
{"role": "tool", "content": "", "tool_call_id": "call_oKEfpgJJ0VyPyMynP0g3IKRc"},
{"role": "assistant", "content": "", "tool_calls": [{"id": "call_MS60qsjtf94tP7pv3hJP8qVK", "type": "function", "function": {"name": "calculate", "arguments": "{\"expression\":\"(404 + 202) * 3\"}"}}]},
{"role": "tool", "content": "1818.0", "tool_call_id": "call_MS60qsjtf94tP7pv3hJP8qVK"},
{"role": "assistant", "content": "Here are the available one-stop flights from IAH to SEA on May 24, with an upgrade to business class:\n\n1. **Option 1:**\n   - IAH to LAS: Flight HAT112, departing at 22:00 EST, arriving at 01:00 EST (+1 day)\n   - LAS to SEA: Flight HAT047, departing at 13:00 EST, arriving at 15:30 EST on May 25\n   - Total cost for business class upgrade for all passengers: $1,818\n\n2. **Option 2:**\n   - IAH to LAS: Flight HAT190, departing at 01:00 EST, arriving at 04:00 EST\n   - LAS to SEA: Flight HAT047, departing at 13:00 EST, arriving at 15:30 EST\n   - Total cost for business class upgrade for all passengers: $1,818\n\n3. **Option 3:**\n   - IAH to LAS: Flight HAT286, departing at 22:00 EST, arriving at 01:00 EST (+1 day)\n   - LAS to SEA: Flight HAT047, departing at 13:00 EST, arriving at 15:30 EST on May 25\n   - Total cost for business class upgrade for all passengers: $1,818\n\nPlease confirm which option you'd like to proceed with and the payment method you'd like to use for the additional cost. You have the following payment methods available: \n- Certificate: $500\n- Gift Card: $62\n- Credit Card (Mastercard ending in 9448)\n- Credit Card (Visa ending in 3422)"}
]""")
# mini-swe-agent on SWE-bench Verified sympy__sympy-13974 (gemini-3-pro-preview; gruckion/mini-swe-agent,
# swebench_results/20251118_gemini-3-pro-74pct): messages 0-6, text actions as tool calls, the task cut at [...].
SWE = json.loads(r"""[
{"role": "system", "content": "You are a helpful assistant that can interact multiple times with a computer shell to solve programming tasks.\nYour response must contain exactly ONE bash code block with ONE command (or commands connected with && or ||).\n\nInclude a THOUGHT section before your command where you explain your reasoning process.\nFormat your response as shown in <format_example>.\n\n<format_example>\nTHOUGHT: Your reasoning and analysis here\n\n```bash\nyour_command_here\n```\n</format_example>\n\nFailure to follow these rules will cause your response to be rejected."},
{"role": "user", "content": "<pr_description>\nConsider the following PR description:\nEvaluating powers of `TensorProduct`\nPowers of tensor product expressions are not possible to evaluate with either `expand(tensorproduct=True)` method nor the `tensor_product_simp`function.\r\n\r\nThis is an example session showing the issue\r\n```\r\nIn [1]: from sympy import *\r\n        from sympy.physics.quantum import TensorProduct as tp\r\n        from sympy.physics.quantum import tensor_product_simp as tps\r\n        from sympy.physics.paulialgebra import Pauli\r\n        a = Symbol('a', commutative=False)\r\n\r\nIn [2]: t1 = tp(1,1)*tp(1,1)\r\n        t1\r\nOut[2]: 1x1**2\r\n\r\nIn [3]: tps(t1)\r\nOut[3]: 1x1**2\r\n\r\nIn [4]: t1.expand(tensorproduct=True)\r\nOut[4]: 1x1**2\r\n\r\nIn [5]: tps(tp(1,1)*tp(1,a)).subs(a, 1)\r\nOut[5]: 1x1\r\n\r\nIn [6]: t2 = tp(1,Pauli(3))*tp(1,Pauli(3))\r\n        t2\r\nOut[6]: 1xsigma3**2\r\n\r\nIn [7]: tps(t2)\r\nOut[7]: 1xsigma3**2\r\n\r\nIn [8]: t2.expand(tensorproduct=True)\r\nOut[8]: 1xsigma3**2\r\n\r\nIn [9]: tps(tp(1,Pauli(3))*tp(1,a)).subs(a, Pauli(3))\r\nOut[9]: 1x1\r\n```\r\nwhere `[5]` and `[9]` shows expected result for `t1` and `t2` respectively.\n\n</pr_description>\n[...]"},
{"role": "assistant", "content": "THOUGHT: I need to explore the codebase to locate `TensorProduct` and `tensor_product_simp`. I'll start by listing the files in the current directory.", "tool_calls": [{"id": "call_001", "type": "function", "function": {"name": "bash", "arguments": "{\"command\": \"ls -R sympy/physics/quantum | grep -E \\\"tensorproduct.py|paulialgebra.py\\\"\"}"}}]},
{"role": "tool", "tool_call_id": "call_001", "content": "<returncode>0</returncode>\n<output>\ntensorproduct.py\ntest_tensorproduct.py\n</output>"},
{"role": "assistant", "content": "THOUGHT: I will search for `tensor_product_simp` in the `sympy/physics/quantum` directory to locate its definition.", "tool_calls": [{"id": "call_002", "type": "function", "function": {"name": "bash", "arguments": "{\"command\": \"grep -r \\\"tensor_product_simp\\\" sympy/physics/quantum\"}"}}]},
{"role": "tool", "tool_call_id": "call_002", "content": "<returncode>0</returncode>\n<output>\nsympy/physics/quantum/density.py:from sympy.physics.quantum.tensorproduct import TensorProduct, tensor_product_simp\nsympy/physics/quantum/density.py:            op = tensor_product_simp(nc_part1[0] * Dagger(nc_part2[0]))\nsympy/physics/quantum/tests/test_tensorproduct.py:from sympy.physics.quantum.tensorproduct import tensor_product_simp\nsympy/physics/quantum/tests/test_tensorproduct.py:def test_tensor_product_simp():\nsympy/physics/quantum/tests/test_tensorproduct.py:    assert tensor_product_simp(TP(A, B)*TP(B, C)) == TP(A*B, B*C)\nsympy/physics/quantum/tensorproduct.py:    'tensor_product_simp'\nsympy/physics/quantum/tensorproduct.py:        exp = tensor_product_simp(self)\nsympy/physics/quantum/tensorproduct.py:def tensor_product_simp_Mul(e):\nsympy/physics/quantum/tensorproduct.py:                    tensor_product_simp_Mul, TensorProduct\nsympy/physics/quantum/tensorproduct.py:        >>> tensor_product_simp_Mul(e)\nsympy/physics/quantum/tensorproduct.py:def tensor_product_simp(e, **hints):\nsympy/physics/quantum/tensorproduct.py:    >>> from sympy.physics.quantum import tensor_product_simp\nsympy/physics/quantum/tensorproduct.py:    >>> tensor_product_simp(e)\nsympy/physics/quantum/tensorproduct.py:    >>> tensor_product_simp(e**2)\nsympy/physics/quantum/tensorproduct.py:        return Add(*[tensor_product_simp(arg) for arg in e.args])\nsympy/physics/quantum/tensorproduct.py:        return tensor_product_simp(e.base) ** e.exp\nsympy/physics/quantum/tensorproduct.py:        return tensor_product_simp_Mul(e)\nsympy/physics/quantum/tensorproduct.py:        return Commutator(*[tensor_product_simp(arg) for arg in e.args])\nsympy/physics/quantum/tensorproduct.py:        return AntiCommutator(*[tensor_product_simp(arg) for arg in e.args])\n</output>"},
{"role": "assistant", "content": "THOUGHT: It seems `tensor_product_simp` is defined in `sympy/physics/quantum/tensorproduct.py`.\n\nNow I will create a reproduction script `reproduce_issue.py` based on the PR description to confirm the issue.", "tool_calls": [{"id": "call_003", "type": "function", "function": {"name": "bash", "arguments": "{\"command\": \"cat <<'EOF' > reproduce_issue.py\\nfrom sympy import *\\nfrom sympy.physics.quantum import TensorProduct as tp\\nfrom sympy.physics.quantum import tensor_product_simp as tps\\nfrom sympy.physics.paulialgebra import Pauli\\n\\na = Symbol('a', commutative=False)\\n\\nt1 = tp(1,1)*tp(1,1)\\nprint(f\\\"t1: {t1}\\\")\\nprint(f\\\"tps(t1): {tps(t1)}\\\")\\nprint(f\\\"t1.expand(tensorproduct=True): {t1.expand(tensorproduct=True)}\\\")\\n\\nt2 = tp(1,Pauli(3))*tp(1,Pauli(3))\\nprint(f\\\"t2: {t2}\\\")\\nprint(f\\\"tps(t2): {tps(t2)}\\\")\\nprint(f\\\"t2.expand(tensorproduct=True): {t2.expand(tensorproduct=True)}\\\")\\n\\n# Expected results based on PR description\\n# tps(t1) should be 1x1 (or equivalent simplified form)\\n# tps(t2) should be 1x1 (since Pauli(3)**2 is 1)\\n\\n# Check if tps(t1) is simplified\\nif tps(t1) == tp(1, 1):\\n    print(\\\"tps(t1) is simplified correctly.\\\")\\nelse:\\n    print(\\\"tps(t1) is NOT simplified correctly.\\\")\\n\\n# Check if tps(t2) is simplified\\n# Pauli(3)**2 is 1, so tp(1, Pauli(3)) * tp(1, Pauli(3)) should be tp(1*1, Pauli(3)*Pauli(3)) = tp(1, 1)\\nif tps(t2) == tp(1, 1):\\n    print(\\\"tps(t2) is simplified correctly.\\\")\\nelse:\\n    print(\\\"tps(t2) is NOT simplified correctly.\\\")\\nEOF\"}"}}]}
]""")
