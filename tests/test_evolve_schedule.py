"""Which proposer the loop asks (`evolve.schedule`) and which policies reach validation (`with_parents`)."""
from __future__ import annotations

import pytest

from evolve.candidate import check_policy
from evolve.config import EvolveConfig
from evolve.context import ProposerContext
from evolve.loop import Evolution
from evolve.pareto import Point
from evolve.proposers.base import Proposer
from evolve.schedule import next_proposer, spent_at
from evolve.scoring import HarnessEvaluator
from evolve.validation import pick_finalists, with_parents
from store import Proposal, Store

WINDOW = "mode kv\non each tool_response: drop role tool keep last {n} in 1..16\nreposition after each drop\n"


def test_round_robin_asks_the_proposers_in_turn():
    history = [("a", "pruned"), ("b", "evaluated")]
    history.append(("c", "pruned"))
    assert [next_proposer(["a", "b", "c"], history[:n], "round-robin") for n in range(4)] == ["a", "b", "c", "a"]


def test_the_lead_proposer_is_asked_until_it_fails_patience_times_in_a_row():
    history = [("a", "evaluated"), ("a", "pruned"), ("a", "duplicate"), ("a", "evaluated"), ("a", "rejected"),
               ("a", "pruned")]
    assert next_proposer(["a", "b", "c"], history, "lead", patience=3) == "a"   # two failures in a row so far
    assert spent_at("a", history, 3) is None
    history.append(("a", "pruned"))                                              # the third
    assert spent_at("a", history, 3) == 7
    asked = []
    for _ in range(4):
        asked.append(next_proposer(["a", "b", "c"], history, "lead", patience=3))
        history.append((asked[-1], "pruned"))
    assert asked == ["b", "c", "b", "c"]   # the others in turn, the spent leader not again


def test_a_single_proposer_is_always_asked_and_bad_input_names_the_field():
    assert next_proposer(["reflect"], [("reflect", "rejected")] * 9, "lead") == "reflect"
    with pytest.raises(ValueError, match="schedule: expected one of lead, round-robin, got 'zigzag'"):
        next_proposer(["a", "b"], [], "zigzag")
    with pytest.raises(ValueError, match="proposers"):
        next_proposer([], [], "lead")


def test_the_schedule_is_a_checked_config_field():
    assert EvolveConfig.model_validate({}).schedule == "lead"
    with pytest.raises(ValueError, match="schedule"):
        EvolveConfig.model_validate({"schedule": "zigzag"})
    with pytest.raises(ValueError, match="lead_patience"):
        EvolveConfig.model_validate({"lead_patience": 0})


def test_a_finalists_parent_scored_on_train_is_validated_too():
    """The child dominates its parent on train, so only the child is a finalist; the parent joins it."""
    points = [Point(5, 1.0, 0.70), Point(12, 1.0, 0.65), Point(8, 0.9, 0.60), Point(9, 0.5, 0.9)]
    finalists = pick_finalists(points, set(), 2)
    assert finalists == [12, 8]
    parents = {12: (5,), 8: (7,)}   # 7 never reached the whole train split (pruned): not a finalist
    assert with_parents(finalists, points, parents) == [12, 8, 5]
    behaviours = {5: "x", 12: "x", 8: "y", 9: "z"}   # a parent that behaved as its child did adds nothing
    assert with_parents(finalists, points, parents, behaviours) == [12, 8]
    assert with_parents(finalists, [p for p in points if p.policy_id != 5], parents) == [12, 8]  # a baseline


class Listed(Proposer):
    """Proposes the given texts in order, under the proposer name it is given."""

    def __init__(self, name: str, texts: list[str]) -> None:
        self.name, self.texts = name, list(texts)

    def ask(self, context: ProposerContext) -> Proposal:
        checked = check_policy(self.texts.pop(0))
        parent = context.pick_parent()
        return Proposal(self.name, checked.text, (parent.policy_id,), parent.generation + 1, checked.text,
                        checked.hash)


@pytest.mark.slow
def test_the_loop_hands_over_when_the_lead_proposer_is_spent(tmp_path):
    """mutate leads with one policy, then the same text again and again: duplicates; after three failures
    in a row (the first counts if it was pruned) optuna is asked, and mutate not again."""
    config = EvolveConfig.model_validate({
        "max_candidates": 6, "proposers": ["mutate", "optuna"], "lead_patience": 3,
        "cascade": {"subset_size": 1, "train_limit": 2}, "validation": {"heldout_limit": 3}})
    evaluator = HarnessEvaluator("localcomp", "scripted", "replay", 0)
    store = Store.open(f"sqlite:///{tmp_path / 'akv.db'}")
    try:
        run = store.create_run("lead", config.model_dump(mode="json"), 0, "test", evaluator.suite_version)
        proposers = {"mutate": Listed("mutate", [WINDOW.format(n=7)] * 6),
                     "optuna": Listed("optuna", [WINDOW.format(n=n) for n in (3, 11, 5, 9)])}
        Evolution(store, run, config, evaluator, proposers).run_all()
        made = [(p.proposer, p.status) for p in store.policies(run.id) if p.proposer in ("mutate", "optuna")]
        led = 4 if made[0][1] == "evaluated" else 3
        assert [name for name, _ in made] == ["mutate"] * led + ["optuna"] * (6 - led)
        assert [status for _, status in made[1:led]] == ["duplicate"] * (led - 1)
    finally:
        store.close()
        evaluator.close()


def test_a_run_stored_before_schedules_keeps_asking_in_turn_and_validating_the_top_k():
    from evolve.config import stored_config

    old = stored_config({"proposers": ["reflect", "optuna"], "validation": {"top_k": 2}})
    assert old.schedule == "round-robin" and old.validation.parents is False
    new = stored_config(EvolveConfig.model_validate({}).model_dump(mode="json"))
    assert new.schedule == "lead" and new.validation.parents is True
