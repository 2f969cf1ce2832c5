"""Proposers on real policies and a real optuna storage; the held-out wall of the proposer context."""
from __future__ import annotations

import random
import socket

import optuna
import pytest
from optuna.trial import TrialState

from evolve.candidate import check_policy
from evolve.config import LLMProposerConfig, MutateProposerConfig, OptunaProposerConfig
from evolve.context import Candidate, HeldOutLeak, ProposerContext, build_context
from evolve.library import library_texts, load_checked
from evolve.proposers.base import BudgetExhausted, Outcome, ProposerUnavailable
from evolve.proposers.llm import LLMProposer, extract_policy
from evolve.proposers.prompt import build_prompt
from evolve.proposers.mutate import MutateProposer
from evolve.proposers.optuna_search import OptunaProposer, Structure
from evolve.proposers.tree import get_at, set_at
from policy_dsl import nodes as n
from policy_dsl import parse
from policy_dsl.validator import walk
from store import EvaluationRecord, PolicyInfo, Store, TaskResult


def candidate(pid: int, name: str, score: float = 0.5, cost: float = 0.01) -> Candidate:
    rows = (TaskResult("train-1", "train", "ok", score, cost), TaskResult("train-2", "train", "max_steps", 0.0, cost,
                                                                          error="gave up at the step budget"))
    return Candidate(pid, load_checked(name).text, 0, score, cost, rows)


def context(front, seed=0, known=frozenset()) -> ProposerContext:
    return ProposerContext(tuple(front), tuple(front), frozenset(known), random.Random(seed), seed)


def test_extract_policy_takes_the_last_fenced_block():
    answer = "Idea:\n```\nmode text\n```\nBetter:\n```akvp\nmode kv\nreposition never\n```\nDone."
    assert extract_policy(answer) == "mode kv\nreposition never"
    assert extract_policy("mode kv without a fence") is None


def test_mutate_children_are_valid_new_and_carry_their_lineage():
    front = [candidate(1, "expert-8k"), candidate(2, "token-based")]
    known = {check_policy(c.text).hash for c in front}
    proposer = MutateProposer(MutateProposerConfig(crossover_rate=0.0), library_texts())
    hashes = set()
    for seed in range(6):
        proposal = proposer.ask(context(front, seed, known))
        assert proposal.rejection_reason is None, proposal.rejection_reason
        checked = check_policy(proposal.text)
        assert checked.text == proposal.text and checked.hash == proposal.hash not in known
        assert len(proposal.parent_ids) == 1 and proposal.generation == 1 and proposal.meta["edits"]
        hashes.add(proposal.hash)
    assert len(hashes) > 1


def test_mutate_learns_covered_and_call_contains_from_the_population():
    """Its vocabulary is what the library and the population hold: a parent reading coverage and calls
    lends them to the other parent's children, and its own children tune the share within 1..100."""
    reading = check_policy('mode kv\non each tool_response: drop role tool and covered >= 80 percent\n'
                           'on each turn: drop role tool and call contains "grep " and age >= 2 turns\n'
                           'reposition after each drop\n').text
    front = [candidate(1, "expert-8k"), Candidate(2, reading, 0, 0.5, 0.01, candidate(1, "expert-8k").results)]
    known = {check_policy(c.text).hash for c in front}
    proposer = MutateProposer(MutateProposerConfig(crossover_rate=0.3), library_texts())
    lent, shares = set(), set()
    for seed in range(60):
        proposal = proposer.ask(context(front, seed, known))
        assert proposal.rejection_reason is None, proposal.rejection_reason
        nodes = list(walk(parse(proposal.text)))
        if proposal.parent_ids == (1,):
            lent |= {type(x) for x in nodes if isinstance(x, (n.Covered, n.CallContains))}
        shares |= {x.share.value for x in nodes if isinstance(x, n.Covered)}
    assert lent == {n.Covered, n.CallContains} and len(shares) > 1 and all(1 <= v <= 100 for v in shares)


def test_crossover_has_two_parents():
    front = [candidate(1, "expert-8k"), candidate(2, "token-based")]
    proposer = MutateProposer(MutateProposerConfig(crossover_rate=1.0), library_texts())
    proposal = proposer.ask(context(front, 3))
    assert proposal.rejection_reason is None and sorted(proposal.parent_ids) == [1, 2]
    assert proposal.meta["edits"][0].startswith("crossover")


def test_tree_edits_copy_and_leave_the_parent_intact():
    tree = load_checked("expert-8k").ast
    path = ("rules", 0, "action", "target", "keep_last")
    num = get_at(tree, path)
    edited = set_at(tree, path + ("value",), num.value + 1)
    assert get_at(edited, path).value == num.value + 1 and get_at(tree, path).value == num.value


def test_optuna_searches_the_tunable_ranges_and_resumes_its_study(tmp_path):
    url = f"sqlite:///{tmp_path / 'akv.db'}"
    Store.open(url).close()  # optuna's tables live next to ours
    front = [candidate(1, "expert-8k")]
    first = OptunaProposer(OptunaProposerConfig(), url, "run-a", seed=0)
    proposal = first.ask(context(front, 0))
    assert proposal.rejection_reason is None and proposal.parent_ids == (1,)
    (path, value), = proposal.meta["params"].items()
    assert path == "rules[0].action.target.keep_last" and 1 <= value <= 12
    assert f"keep last {value} in 1..12" in proposal.text
    assert proposal.meta["trial"] == 1 and proposal.meta["population_trials"] == 1  # the parent came first
    first.tell(proposal, 10, Outcome("evaluated", 0.75, 0.004))
    again = OptunaProposer(OptunaProposerConfig(sampler="nsga2"), url, "run-a", seed=0)  # a resumed process
    second = again.ask(context(front, 1))
    assert second.meta["study"] == proposal.meta["study"] and second.meta["trial"] == 2
    study = optuna.load_study(study_name=proposal.meta["study"], storage=url)
    assert study.trials[0].values == [0.5, 0.01] and study.trials[0].user_attrs["policy_id"] == 1
    assert study.trials[1].values == [0.75, 0.004] and study.trials[1].user_attrs["policy_id"] == 10


def test_optuna_shares_one_study_per_structure_across_parents_and_learns_from_the_population(tmp_path):
    url = f"sqlite:///{tmp_path / 'akv.db'}"
    Store.open(url).close()
    # expert-8k (keep last 4 in 1..12) and expert (keep last 12 in 2..48): one structure, two parents.
    pop = [candidate(1, "expert-8k", 1.0, 0.005), candidate(2, "expert", 1.0, 0.009),
           candidate(3, "token-based", 0.4, 0.002)]
    proposer = OptunaProposer(OptunaProposerConfig(startup_trials=2), url, "run-s", seed=0)
    studies, texts = set(), []
    for index in range(8):
        ctx = ProposerContext(tuple(pop[:2]), tuple(pop), frozenset(), random.Random(index), index)
        proposal = proposer.ask(ctx)
        assert proposal.rejection_reason is None
        studies.add(proposal.meta["study"])
        texts.append(proposal.text)
        value = proposal.meta["params"]["rules[0].action.target.keep_last"]
        proposer.tell(proposal, 100 + index, Outcome("evaluated", 1.0 if value >= 3 else 0.5, 0.001 * value))
    assert len(studies) == 1  # both parents' proposals went to one study
    assert all("in 1..12" in t for t in texts)  # the study's space, fixed by the first parent
    study = optuna.load_study(study_name=studies.pop(), storage=url)
    done = [t for t in study.trials if t.state == TrialState.COMPLETE]
    # expert-8k entered as a trial; expert (12 in 2..48) too, its point lies inside 1..12; token-based is another study's.
    assert {t.user_attrs["policy_id"] for t in done} >= {1, 2} and 3 not in {t.user_attrs["policy_id"] for t in done}
    assert len(done) == 10


def test_optuna_tells_pruned_trials_with_their_subset_means(tmp_path):
    url = f"sqlite:///{tmp_path / 'akv.db'}"
    Store.open(url).close()
    proposer = OptunaProposer(OptunaProposerConfig(), url, "run-p", seed=0)
    proposal = proposer.ask(context([candidate(1, "expert-8k")], 0))
    proposer.tell(proposal, 7, Outcome("pruned", 0.5, 0.003, "pruned on the 6-task train subset"))
    trial = optuna.load_study(study_name=proposal.meta["study"], storage=url).trials[proposal.meta["trial"]]
    assert trial.state == TrialState.PRUNED
    assert trial.user_attrs == {"policy_id": 7, "subset_score": 0.5, "subset_cost": 0.003}
    proposer.tell(proposal, 7, Outcome("evaluated", 1.0, 0.001))  # told once only
    assert optuna.load_study(study_name=proposal.meta["study"], storage=url).trials[1].state == TrialState.PRUNED


def test_with_the_expert_known_optuna_searches_the_champion_rules_objective(tmp_path):
    """One number to minimize: cost relative to the expert within the margin of its score, and past
    every such point, how far short a point falls; not score and cost traded against each other."""
    from evolve.proposers.optuna_search import SHORT, rule_objective

    assert rule_objective(0.99, 0.8, (1.0, 1.0), 0.02) == pytest.approx(0.8)
    assert rule_objective(0.97, 0.1, (1.0, 1.0), 0.02) == pytest.approx(SHORT + 0.01)   # cheap but short
    assert rule_objective(0.98, 1.2, (1.0, 1.0), 0.02) < rule_objective(0.979, 0.01, (1.0, 1.0), 0.02)
    url = f"sqlite:///{tmp_path / 'akv.db'}"
    Store.open(url).close()
    expert, parent = candidate(1, "expert", 1.0, 0.010), candidate(2, "expert-8k", 0.99, 0.008)
    ctx = ProposerContext((expert, parent), (expert, parent), frozenset(), random.Random(0), 0, reference_id=1)
    proposer = OptunaProposer(OptunaProposerConfig(), url, "run-r", seed=0, margin=0.02)
    proposal = proposer.ask(ctx)
    assert proposal.meta["study"].endswith("/rule") and proposal.meta["reference"] == [1.0, 0.010]
    proposer.tell(proposal, 9, Outcome("evaluated", 0.995, 0.006))
    study = optuna.load_study(study_name=proposal.meta["study"], storage=url)
    assert len(study.directions) == 1 and study.directions[0] == optuna.study.StudyDirection.MINIMIZE
    told = study.trials[proposal.meta["trial"]]
    assert told.values == [pytest.approx(0.6)] and told.user_attrs["score"] == 0.995
    entered = {t.user_attrs["policy_id"]: t.values[0] for t in study.trials if t.user_attrs.get("source") == "population"}
    assert entered == {1: pytest.approx(1.0), 2: pytest.approx(0.8)}   # both within the margin of the expert


def test_structures_abstract_values_and_ranges_only():
    assert Structure.of(load_checked("expert-8k").ast).key == Structure.of(load_checked("expert").ast).key
    assert Structure.of(load_checked("rolling-3").ast).key == Structure.of(load_checked("expert-8k").ast).key
    assert Structure.of(load_checked("turn-based").ast).key != Structure.of(load_checked("expert-8k").ast).key
    fixed = check_policy("mode kv\non each tool_response: drop role tool keep last 4\nreposition after each drop").ast
    assert Structure.of(fixed).key != Structure.of(load_checked("expert-8k").ast).key  # a fixed number is structure


def test_optuna_rejects_when_no_policy_has_a_range():
    front = [candidate(1, "full")]
    proposal = OptunaProposer(OptunaProposerConfig(), "sqlite://", "run-b", 0).ask(context(front))
    assert proposal.rejection_reason and "tunable" in proposal.rejection_reason


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when we return: connections are refused


def test_unreachable_llm_endpoint_is_retried_with_backoff_then_stops():
    delays = []
    cfg = LLMProposerConfig(endpoint=f"http://127.0.0.1:{_closed_port()}/v1", retries=2, backoff_s=0.01, timeout_s=5)
    proposer = LLMProposer(cfg, library_texts()[:1], sleep=delays.append)
    with pytest.raises(ProposerUnavailable) as err:
        proposer.ask(context([candidate(1, "expert-8k")]))
    assert delays == [0.01, 0.02] and "after 3 attempts" in str(err.value)


def test_llm_budget_is_checked_before_any_request():
    cfg = LLMProposerConfig(endpoint=f"http://127.0.0.1:{_closed_port()}/v1", max_usd=0.5)
    proposer = LLMProposer(cfg, library_texts()[:1], spent_usd=0.5)
    with pytest.raises(BudgetExhausted, match="USD budget"):
        proposer.ask(context([candidate(1, "expert-8k")]))


def test_llm_prompt_holds_the_parent_its_failures_and_inspirations():
    parent, other = candidate(1, "expert-8k", 0.5), candidate(2, "token-based", 0.9)
    prompt = build_prompt(parent, [other])
    assert parent.text.strip() in prompt and other.text.strip() in prompt
    assert "gave up at the step budget" in prompt and "train-2" in prompt


def _policy(pid: int, text: str) -> PolicyInfo:
    return PolicyInfo(pid, 1, f"h{pid}", text, text, None, 0, "seed", "evaluated", None, (), 0, 0, 0.0, {})


def test_proposer_context_refuses_held_out_evaluations():
    text = load_checked("expert-8k").text
    train = [EvaluationRecord(1, TaskResult("t1", "train", "ok", 1.0, 0.01))]
    ctx = build_context([_policy(1, text)], train, ["t1"], random.Random(0))
    assert [c.policy_id for c in ctx.front] == [1]
    leaked = train + [EvaluationRecord(1, TaskResult("h1", "heldout", "ok", 1.0, 0.01))]
    with pytest.raises(HeldOutLeak, match="heldout"):
        build_context([_policy(1, text)], leaked, ["t1"], random.Random(0))


def test_only_policies_with_the_whole_train_split_compete():
    text_a, text_b = load_checked("expert-8k").text, load_checked("full").text
    evals = [EvaluationRecord(1, TaskResult("t1", "train", "ok", 1.0, 0.02)),
             EvaluationRecord(1, TaskResult("t2", "train", "ok", 1.0, 0.02)),
             EvaluationRecord(2, TaskResult("t1", "train", "ok", 1.0, 0.001))]  # t2 missing: pruned early
    ctx = build_context([_policy(1, text_a), _policy(2, text_b)], evals, ["t1", "t2"], random.Random(0))
    assert [c.policy_id for c in ctx.population] == [1]
