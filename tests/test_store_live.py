"""The store's live policies (`store/live.py`): a refining proxy's start, promotions checked against the live
entry they were judged on, rollbacks, rounds and conversation costs, on SQLite and PostgreSQL."""
from __future__ import annotations

import pytest

from store import ConversationCost, LiveChanged, NoSuchEntry, Store

FULL, WINDOW, TIGHT = "mode kv\n", "mode kv\non each tool_response: drop role tool keep last 2\n", "mode kv\nX\n"


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    url = f"sqlite:///{tmp_path / 'live.db'}" if request.param == "sqlite" else request.getfixturevalue("postgres_url")
    opened = Store.open(url)
    yield opened
    opened.close()


def test_a_restart_with_the_same_policy_goes_on_and_another_policy_is_a_new_start(store) -> None:
    live = store.live
    first, new = live.start("traffic", "best", FULL)
    assert new and (first.kind, first.name) == ("start", "best")
    promoted = live.promote("traffic", first.id, "traffic.r1#5", WINDOW, "traffic.r1", 5, {"heldout": 9}, "crowned")
    again, new = live.start("traffic", "best", FULL)  # the same command line: the promoted policy stays live
    assert not new and again == promoted == live.live("traffic")
    other, new = live.start("traffic", "best", TIGHT)  # `best` edited between the two starts: a new start
    assert new and other.name == "best-v2" and live.live("traffic") == other
    assert [e.kind for e in live.lineage("traffic")] == ["start", "promotion", "start"]
    assert live.live("other") is None and live.lineage("other") == []


def test_a_promotion_judged_against_a_policy_no_longer_live_is_refused_whole(store) -> None:
    live = store.live
    start, _ = live.start("traffic", "full", FULL)
    first = live.promote("traffic", start.id, "traffic.r1#5", WINDOW, "traffic.r1", 5, {}, "crowned")
    with pytest.raises(LiveChanged, match="judged against entry #1, live is #2"):
        live.promote("traffic", start.id, "traffic.r2#9", TIGHT, "traffic.r2", 9, {}, "crowned")
    assert live.lineage("traffic")[-1] == first


def test_a_rollback_restores_the_policy_live_before_the_current_one_first_went_live(store) -> None:
    live = store.live
    start, _ = live.start("traffic", "full", FULL)
    one = live.promote("traffic", start.id, "traffic.r1#5", WINDOW, "traffic.r1", 5, {}, "crowned")
    two = live.promote("traffic", one.id, "traffic.r2#3", TIGHT, "traffic.r2", 3, {}, "crowned")
    back = live.rollback("traffic")
    assert (back.kind, back.name, back.text, back.restores) == ("rollback", one.name, WINDOW, one.id)
    assert live.rollback("traffic").restores == start.id  # the next one goes past the first's origin
    with pytest.raises(NoSuchEntry, match="nothing to roll back to"):
        live.rollback("traffic")
    assert live.rollback("traffic", to=two.id).text == TIGHT
    with pytest.raises(NoSuchEntry, match="already live"):
        live.rollback("traffic", to=two.id)
    with pytest.raises(NoSuchEntry, match="no entry #99"):
        live.rollback("traffic", to=99)
    assert live.rolled_back("traffic") == {TIGHT, WINDOW, FULL}  # every policy a rollback replaced
    with pytest.raises(NoSuchEntry, match="has no live policy"):
        live.rollback("nothing")


def test_rounds_and_conversation_costs(store) -> None:
    live = store.live
    first = live.begin_round("traffic", lambda n: f"traffic.r{n}", 20, None, None)
    second = live.begin_round("traffic", lambda n: f"traffic.r{n}", 20, None, None)
    assert (first.number, first.run_name, second.run_name) == (1, "traffic.r1", "traffic.r2")
    live.finish_round(first.id, "promoted", "traffic.r1#5 is live", {"heldout": 9})
    assert [(r.number, r.status) for r in live.interrupt_running("traffic", "its refiner ended")] == [
        (2, "interrupted")]
    assert live.round_outcomes("traffic") == {"promoted": 1, "interrupted": 1}
    with pytest.raises(ValueError, match="a round ends as one of"):
        live.finish_round(first.id, "running", "")
    live.save_costs("traffic", [ConversationCost("a", "d1", "full", 7, 0.4, 0.4, 0.4, 0, 6),
                                ConversationCost("b", "d2", "full", skipped="bad content: no assistant message"),
                                ConversationCost("c", "d3", "traffic.r1#5", 7, 0.3, 0.4, 0.4, 1, 6, 5, 5)])
    live.save_costs("traffic", [ConversationCost("a", "d9", "full", 9, 0.5, 0.5, 0.5, 0, 6)])  # it went on
    assert live.measured("traffic") == {"a": "d9", "b": "d2", "c": "d3"}
    full, refined = live.totals("traffic")
    assert (full.policy, full.conversations, full.skipped, full.requests, full.cost_usd) == ("full", 1, 1, 9, 0.5)
    assert (refined.conversations, refined.cost_usd, refined.expert_cost_usd, refined.drops) == (1, 0.3, 0.4, 5)
    assert [(c.trace_id, c.skipped) for c in live.skipped("traffic")] == [("b", "bad content: no assistant message")]
