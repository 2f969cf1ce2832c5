"""The localcomp planner's outcomes as values: the calls it needs, GiveUp, and a plan step it does not know."""
from __future__ import annotations

import pytest

from sandbox.suites.localcomp.context import Context
from sandbox.suites.localcomp.planner import GiveUp, Need, Planner


def _plan(op: str = "find") -> dict:
    step = {"op": op, "var": "A.p", "kind": "person", "where": {"Born": "1900"}, "queries": ["people born 1900"]}
    return {"legs": [{"steps": [step], "payload": {"var": "A.p", "field": "Born"}, "entity": {"var": "A.p"},
                      "label": "A"}], "combine": "earlier"}


def test_a_search_not_in_view_is_the_call_it_needs() -> None:
    outcome = Planner(_plan(), Context()).answer()
    assert outcome == [Need("search", {"query": "people born 1900"}, "Searching for A.p.")]


def test_a_search_with_no_fitting_hit_gives_up_and_says_what_is_missing() -> None:
    ctx = Context(searches={"people born 1900": []}, search_src={"people born 1900": (2,)})
    planner = Planner(_plan(), ctx)
    assert planner.answer() == GiveUp("no document found for A.p") and planner.used == {2}


def test_a_plan_step_it_does_not_know_is_an_error_naming_the_op() -> None:
    with pytest.raises(ValueError, match="plan step op 'guess'"):
        Planner(_plan("guess"), Context()).answer()
