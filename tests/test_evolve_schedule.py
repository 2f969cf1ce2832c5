"""Which proposer the loop asks (`evolve.schedule`) and which policies reach validation (`with_parents`)."""
from __future__ import annotations

import pytest

from evolve.candidate import check_policy
from evolve.config import EvolveConfig, ValidationConfig
from evolve.context import ProposerContext
from evolve.loop import Evolution
from evolve.pareto import Point
from evolve.proposers.base import Proposer
from evolve.schedule import next_proposer, spent_at
from evolve.scoring import HarnessEvaluator
from evolve.validation import left_out, near_finalists, pick_finalists, train_verdicts, with_parents
from store import Proposal, Store, TaskResult

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


def _rows(score: float, costs: list[float]) -> list[TaskResult]:
    return [TaskResult(f"t{i}", "train", "ok", score, cost) for i, cost in enumerate(costs)]


def test_only_points_that_beat_the_expert_on_train_are_finalists_the_safest_cheapest_first():
    """A constructed train front: the dearer points (the highest-scoring ones, which the old choice
    took) are reported, not validated; of those that beat the expert, the ones losing no score come
    first, cheapest first, then the others."""
    config = ValidationConfig(resamples=300, permutations=300)
    expert = _rows(0.95, [1.0] * 10)
    rows = {1: _rows(1.0, [1.19] * 10),                  # full-like: the best score, 19% dearer
            2: _rows(0.97, [1.09] * 10),                 # 9% dearer at a better score
            3: _rows(0.95, [0.90] * 10),                 # 10% cheaper, no score lost
            4: _rows(0.945, [0.80] * 10),                # 20% cheaper, half a point lost (within 2)
            5: _rows(0.96, [0.93] * 10),                 # 7% cheaper, better score
            6: _rows(0.80, [0.50] * 10)}                 # half the cost, 15 points lost
    verdicts = train_verdicts(rows, expert, config, 0)
    assert pick_finalists(verdicts, 2) == [3, 5]
    assert pick_finalists(verdicts, 4) == [3, 5, 4]      # 1, 2 and 6 never
    reasons = {o["policy_id"]: o["why"] for o in left_out(verdicts, [3, 5, 4], config.margin)}
    assert set(reasons) == {1, 2, 6}
    assert "+19.0% vs the expert on train" in reasons[1] and "score -15.0 points" in reasons[6]
    nothing = train_verdicts({1: rows[1], 2: rows[2]}, expert, config, 0)
    assert pick_finalists(nothing, 2) == []


def test_when_none_beats_the_expert_by_the_rule_the_cheaper_at_a_score_within_the_margin_go_on():
    """Three train tasks: the paired cost test cannot reach 5% (one-sided p is at least 1/8), so
    nothing beats the expert by the rule; the cheaper on average at a mean score within the margin go
    to held-out instead, never a dearer one nor one that lost more than the margin."""
    config = ValidationConfig(resamples=300, permutations=300)
    expert = _rows(0.95, [1.0] * 3)
    rows = {1: _rows(0.95, [1.1] * 3),          # dearer
            2: _rows(0.95, [0.9] * 3),          # 10% cheaper, no score lost
            3: _rows(0.94, [0.7] * 3),          # 30% cheaper, a point lost (within 2)
            4: _rows(0.80, [0.5] * 3)}          # half the cost, 15 points lost
    verdicts = train_verdicts(rows, expert, config, 0)
    assert pick_finalists(verdicts, 2) == []
    assert near_finalists(verdicts, 2, config.margin) == [2, 3]
    assert near_finalists(verdicts, 1, config.margin) == [2]
    assert near_finalists({1: verdicts[1], 4: verdicts[4]}, 2, config.margin) == []


def test_of_those_beating_the_expert_the_ones_never_dearer_on_a_task_come_first():
    """The paired cost test is surest of a policy that costs no more than the expert on any task: a
    cheaper mean carried by a few tasks, dearer on others, comes after a steady one."""
    config = ValidationConfig(resamples=300, permutations=300)
    expert = _rows(0.95, [1.0] * 10)
    rows = {1: _rows(0.95, [0.6] * 9 + [1.4]),   # 32% cheaper on the mean, dearer on one task
            2: _rows(0.95, [0.9] * 10)}          # 10% cheaper everywhere
    verdicts = train_verdicts(rows, expert, config, 0)
    assert all(v.eligible for v in verdicts.values())
    assert pick_finalists(verdicts, 2) == [1, 2]                      # cheapest first without the counts
    assert pick_finalists(verdicts, 2, dearer={1: 1, 2: 0}) == [2, 1]


def test_a_finalists_parent_scored_on_train_is_validated_too():
    """The child beats its parent on train, so only the child is a finalist; the parent joins it."""
    points = [Point(5, 1.0, 0.70), Point(12, 1.0, 0.65), Point(8, 0.9, 0.60), Point(9, 0.5, 0.9)]
    expert = _rows(1.0, [1.0] * 8)
    verdicts = train_verdicts({p.policy_id: _rows(p.score, [p.cost] * 8) for p in points}, expert,
                              ValidationConfig(resamples=300, permutations=300), 0)
    finalists = pick_finalists(verdicts, 1)
    assert finalists == [12]
    beating = [p for p in points if verdicts[p.policy_id].eligible]   # 8 loses 10 points, 9 is dearer
    parents = {12: (5,)}
    assert with_parents(finalists, beating, parents) == [12, 5]
    behaviours = {5: "x", 12: "x", 8: "y", 9: "z"}   # a parent that behaved as its child did adds nothing
    assert with_parents(finalists, beating, parents, behaviours) == [12]
    assert with_parents(finalists, [p for p in beating if p.policy_id != 5], parents) == [12]  # not beating
    assert with_parents(pick_finalists(verdicts, 1), beating, {12: (8,)}) == [12]   # 8 never beat it


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
