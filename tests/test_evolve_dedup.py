"""Semantic de-duplication on the histories a run records, and in the loop: a duplicate is stored as
such, never evaluated and never validated."""
from __future__ import annotations

from dataclasses import asdict

import pytest

from evolve.candidate import check_policy
from evolve.config import EvolveConfig
from evolve.context import TRAIN, ProposerContext
from evolve.dedup import FINGERPRINT_TASKS, Fingerprints
from evolve.library import load_checked
from evolve.loop import Evolution
from evolve.proposers.base import Proposer
from evolve.scoring import HarnessEvaluator
from policy_dsl import load_policy
from store import Proposal, Store

WINDOW = "mode kv\non each tool_response: drop role tool keep last {n} in 1..{hi}\nreposition {rule}\n"


def window(n: int = 7, hi: int = 16, rule: str = "after each drop") -> str:
    return WINDOW.format(n=n, hi=hi, rule=rule)


@pytest.fixture(scope="module")
def evaluator():
    evaluator = HarnessEvaluator("localcomp", "scripted", "replay", 0)
    yield evaluator
    evaluator.close()


@pytest.fixture(scope="module")
def fingerprints(evaluator) -> Fingerprints:
    tasks = evaluator.task_ids(TRAIN)[:FINGERPRINT_TASKS]
    return Fingerprints([h for name in ("full", "expert-8k")
                         for h in evaluator.request_histories(load_checked(name).text, TRAIN, tasks)])


def test_the_recorded_histories_are_the_same_in_every_process(evaluator, fingerprints):
    tasks = evaluator.task_ids(TRAIN)[:FINGERPRINT_TASKS]
    again = Fingerprints([h for name in ("full", "expert-8k")
                          for h in evaluator.request_histories(load_checked(name).text, TRAIN, tasks)])
    assert again.salt == fingerprints.salt and fingerprints.requests > 4 * FINGERPRINT_TASKS
    assert again.identity(window()) == fingerprints.identity(window())


def test_range_variants_are_one_policy(fingerprints):
    wide, narrow = fingerprints.identity(window(hi=16)), fingerprints.identity(window(hi=12))
    assert wide.hash != narrow.hash  # the canonical texts differ ...
    assert wide.structure == narrow.structure and wide.behaviour == narrow.behaviour  # ... the policy does not
    assert fingerprints.identity(window(n=6)).structure != wide.structure


def test_a_reposition_rule_that_changes_no_decision_is_the_same_candidate(fingerprints):
    each, every_one = fingerprints.identity(window(rule="after each drop")), \
        fingerprints.identity(window(rule="every 1 drops"))
    assert each.structure != every_one.structure and each.behaviour == every_one.behaviour
    # A window that never fills on these histories drops nothing: with or without a reposition rule it is
    # `full`, whatever mode it is written in.
    full = fingerprints.identity(load_checked("full").text).behaviour
    assert fingerprints.identity(window(n=90, hi=100)).behaviour == full
    assert fingerprints.identity(window(n=90, hi=100, rule="never")).behaviour == full
    assert fingerprints.identity("mode text\n").behaviour == full
    # Decisions that differ are different candidates.
    assert fingerprints.identity(window(rule="never")).behaviour != each.behaviour
    assert fingerprints.identity(window(n=3)).behaviour != each.behaviour


@pytest.mark.parametrize("name", ["expert-8k", "turn-based", "token-based", "rolling-3", "standard-8k"])
def test_fingerprints_record_the_decision_of_every_request(fingerprints, name):
    # kv decisions are cut from the last request's (they are cumulative); the result must be exactly
    # what deciding on every request gives.
    policy = load_policy(name)
    for task in fingerprints.histories:
        every = [{**d.api_fields(), "text_edits": [asdict(e) for e in d.text_edits]}
                 for d in (policy.decide(messages, fingerprints.counter) for messages in task)]
        assert fingerprints.decisions(policy, task) == every


def test_a_policy_that_reads_drop_context_has_no_fingerprint(fingerprints):
    assert fingerprints.identity(load_checked("model-based").text).behaviour is None


class Listed(Proposer):
    """Proposes the given texts in order, as a user-written proposer would."""

    name = "mutate"

    def __init__(self, texts: list[str]) -> None:
        self.texts = list(texts)
        self.told: list[str] = []

    def ask(self, context: ProposerContext) -> Proposal:
        checked = check_policy(self.texts.pop(0))
        parent = context.pick_parent()
        return Proposal(self.name, checked.text, (parent.policy_id,), parent.generation + 1, checked.text,
                        checked.hash)

    def tell(self, proposal, policy_id, outcome) -> None:
        self.told.append(outcome.status)


@pytest.mark.slow
def test_duplicates_are_stored_as_such_and_never_evaluated_or_validated(tmp_path, evaluator):
    config = EvolveConfig.model_validate({
        "max_candidates": 4, "proposers": ["mutate"], "cascade": {"subset_size": 1, "train_limit": 2},
        "validation": {"heldout_limit": 3, "top_k": 4}})
    store = Store.open(f"sqlite:///{tmp_path / 'akv.db'}")
    try:
        run = store.create_run("dedup", config.model_dump(mode="json"), 0, "test", evaluator.suite_version)
        proposer = Listed([window(hi=16), window(hi=12), window(rule="every 1 drops"), "mode text\n"])
        result = Evolution(store, run, config, evaluator, {"mutate": proposer}).run_all()
        policies = store.policies(run.id)
        by_status = {p.status for p in policies if p.proposer == "mutate"}
        original = next(p for p in policies if p.proposer == "mutate" and p.status != "duplicate")
        full = store.baselines(run.id)["full"]
        duplicates = [p for p in policies if p.status == "duplicate"]
        assert by_status >= {"duplicate"} and len(duplicates) == 3
        assert [p.duplicate_of for p in duplicates] == [original.id, original.id, full]
        assert "up to tunable ranges" in duplicates[0].rejection_reason
        assert "same decisions" in duplicates[1].rejection_reason and "same decisions" in duplicates[2].rejection_reason
        assert len(proposer.told) == 4 and set(proposer.told[1:]) <= {"duplicate", "pruned"}  # as the originals fared
        ids = {p.id for p in duplicates}
        assert not [e for e in store.evaluations(run.id) if e.policy_id in ids]  # never evaluated ...
        assert not ids & {v.policy_id for v in result.validations}  # ... never validated
        assert {v.label for v in result.validations} >= {"expert-8k", "full", "standard-8k", "text-engineering-8k"}
    finally:
        store.close()


def test_finalists_that_behave_the_same_on_train_and_held_out_count_once(tmp_path, evaluator):
    """Two candidates the fingerprint told apart but whose runs are the same: the earliest is the finalist."""
    from evolve.cascade import Cascade
    from evolve.config import CascadeConfig, ValidationConfig
    from evolve.validation import HELDOUT, outcome_digests, pick_finalists, train_verdicts, twins, validate
    from store import TaskResult

    train, heldout = [f"t{i}" for i in range(8)], [f"h{i}" for i in range(6)]
    store = Store.open(f"sqlite:///{tmp_path / 'akv.db'}")
    try:
        run = store.create_run("twins", {}, 0, "test", evaluator.suite_version)

        def stored(name: str, costs: list[float], held_costs: list[float]) -> int:
            pid, _ = store.add_policy(run.id, Proposal("mutate", name, text=window(), hash=name, name=name),
                                      status="evaluated")
            for split, ids, row in ((TRAIN, train, costs), (HELDOUT, heldout, held_costs)):
                for task, cost in zip(ids, row):
                    store.add_evaluation(run.id, pid, TaskResult(task, split, "ok", 1.0, cost, 9, {"prompt": 90}))
            return pid

        expert = stored("expert", [0.02] * 8, [0.02] * 6)
        first = stored("first", [0.01] * 8, [0.011] * 6)
        other = stored("other", [0.015, 0.012] * 4, [0.013] * 6)
        same = stored("same", [0.01] * 8, [0.011] * 6)     # first's twin on both splits
        apart = stored("apart", [0.01] * 8, [0.012] * 6)   # first's twin on train only
        cascade = Cascade(store, run.id, evaluator, train, CascadeConfig())
        behaviours = outcome_digests(store, run.id, TRAIN, train)
        assert behaviours[first] == behaviours[same] == behaviours[apart] != behaviours[other]
        rows = cascade.train_results()
        verdicts = train_verdicts({pid: rows[pid] for pid in (first, other, same, apart)}, rows[expert],
                                  ValidationConfig(resamples=200, permutations=200), 0)
        finalists = pick_finalists(verdicts, 2, behaviours)
        assert finalists == [first, other]  # the twins take no place of their own on the train front
        found = twins(finalists, [first, other, same, apart], behaviours)
        assert found == {first: [same, apart], other: []}
        records = validate(store, run.id, cascade, heldout, finalists, {"expert": expert},
                           ValidationConfig(resamples=200, permutations=200), 0, "test", "test", found)
        assert [r.policy_id for r in records if r.role == "candidate"] == [first, other, apart]
        twin = store.policy(same)
        assert twin.status == "duplicate" and twin.duplicate_of == first
        assert "every train task and the same results on every held-out task" in twin.rejection_reason
        assert store.policy(apart).status == "evaluated"
    finally:
        store.close()
