"""The outer loop, ask/tell style: propose, de-duplicate, cascade, tell; then validate.

Every step is committed before the next begins. On resume the loop first finishes the
candidates that were proposed but not fully evaluated, then proposes until the run's
candidate budget (counted in the store, rejected and duplicate proposals included) is reached.
De-duplication is semantic (evolve/dedup.py): a proposal that shares its canonical text, its
text without tunable ranges, or its decisions on the recorded train histories with a stored
policy is stored as a duplicate of it and never evaluated.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

from evolve.candidate import Outcome
from evolve.cascade import Cascade
from evolve.config import EvolveConfig, ValidationConfig
from evolve.context import TRAIN, ProposerContext, build_context
from evolve.dedup import FINGERPRINT_TASKS, Fingerprints, Identity
from evolve.fidelity import open_judge
from evolve.library import load_checked
from evolve.pareto import Point
from evolve.proposers.base import BudgetExhausted, Proposer
from evolve.schedule import next_proposer
from evolve.scoring import Evaluator, code_version
from evolve.validation import (HELDOUT, REFERENCE, left_out, near_finalists, outcome_digests, pick_finalists,
                               train_verdicts, twins, validate, with_parents)
from evolve.workers import SharedEvaluation, Worker
from sandbox.runs.cost import cents
from sandbox.runs.progress import TaskDisplay
from store import PolicyInfo, Proposal, RunInfo, Store, ValidationRecord

PROPOSED_BY = ("llm", "optuna", "mutate", "reflect", "random")
SHOWN_LEFT_OUT = 10  # policies left out of validation that a round records, cheapest first
Progress = Callable[[str, Sequence[Point]], None]  # (what just happened, current train front)


@dataclass(frozen=True)
class EvolutionResult:
    validations: list[ValidationRecord]
    stop_reason: str | None

    @property
    def champion(self) -> ValidationRecord | None:
        return next((v for v in self.validations if v.champion), None)


class Evolution:
    def __init__(self, store: Store, run: RunInfo, config: EvolveConfig, evaluator: Evaluator,
                 proposers: Mapping[str, Proposer], progress: Progress | None = None,
                 display: TaskDisplay | None = None) -> None:
        self.store, self.run, self.config = store, run, config
        self.evaluator, self.proposers = evaluator, proposers
        self.progress = progress or (lambda _msg, _front: None)
        train = evaluator.task_ids(TRAIN)
        self.train_ids = train[: config.cascade.train_limit] if config.cascade.train_limit else train
        heldout = evaluator.task_ids(HELDOUT)
        limit = config.validation.heldout_limit
        self.heldout_ids = heldout[:limit] if limit else heldout
        evaluation = config.evaluation
        # Every task goes through the run's work queue, which `akv worker` processes may share (evolve/workers.py).
        self.shared = SharedEvaluation(lambda: Worker(store, run, evaluator, "evolve", evaluation.concurrency,
                                                      evaluation.lease_s, config.backend), display)
        self.cascade = Cascade(store, run.id, evaluator, self.train_ids, config.cascade, self.shared)
        self._fingerprints: Fingerprints | None = None

    def fingerprints(self) -> Fingerprints:
        """The run's recorded histories: `full` and the expert on the first train tasks (made once per process)."""
        if self._fingerprints is None:
            tasks = self.train_ids[:FINGERPRINT_TASKS]
            names = (self.config.baselines.full, self.config.baselines.expert)
            self._fingerprints = Fingerprints([h for name in dict.fromkeys(names) for h in
                                               self.evaluator.request_histories(load_checked(name).text, TRAIN,
                                                                                tasks)])
        return self._fingerprints

    def n_proposed(self) -> int:
        return sum(1 for p in self.store.policies(self.run.id) if p.proposer in PROPOSED_BY)

    def run_all(self) -> EvolutionResult:
        try:
            return self._run_all()
        finally:
            self.shared.close()

    def _run_all(self) -> EvolutionResult:
        baselines = self.seed_population()
        stop_reason = self.propose()
        self.progress("validating the front and the baselines on the held-out split", self.cascade.front())
        points, excluded = self.cascade.train_points(), set(baselines.values())
        behaviours = outcome_digests(self.store, self.run.id, TRAIN, self.train_ids)
        finalists, selection = self.finalists(points, excluded, baselines[REFERENCE], behaviours)
        candidates = sorted(p.policy_id for p in points if p.policy_id not in excluded)
        config = self.config
        judge = open_judge(config.validation, self.evaluator, config.backend,
                           load_checked(config.baselines.full).text, config.seed, config.precision)
        try:
            records = validate(self.store, self.run.id, self.cascade, self.heldout_ids, finalists, baselines,
                               config.validation, config.seed, code_version(), self.evaluator.suite_version,
                               twins(finalists, candidates, behaviours), judge, selection)
        finally:
            if judge is not None:
                judge.close()
        if judge is not None and judge.note:
            self.progress(f"note: {judge.note}", self.cascade.front())
        self.store.set_run_status(self.run.id, "finished", stop_reason)
        return EvolutionResult(records, stop_reason)

    def finalists(self, points: Sequence[Point], excluded: set[int], expert: int,
                  behaviours: Mapping[int, str]) -> tuple[list[int], dict[str, Any]]:
        """The policies validated on held-out: those that beat the expert on train, the most promising
        first (`validation.pick_finalists`), with their parents that beat it too; and what the round
        records of the choice (how many beat it, why the others were left out)."""
        rows = self.cascade.train_results()
        judged = self.config.validation
        if judged.fidelity == "likelihood":   # train scores are the model-free fidelity: its margin, not nats
            judged = judged.model_copy(update={"margin": ValidationConfig.model_fields["margin"].default})
        verdicts = train_verdicts({p.policy_id: rows[p.policy_id] for p in points if p.policy_id not in excluded},
                                  rows[expert], judged, self.config.seed)
        expert_rows = rows[expert]
        dearer = {pid: sum(a.cost_usd > b.cost_usd for a, b in zip(rows[pid], expert_rows)) for pid in verdicts}
        finalists = pick_finalists(verdicts, judged.top_k, behaviours, dearer)
        near = not finalists
        if near:
            finalists = near_finalists(verdicts, judged.top_k, judged.margin, behaviours, dearer)
        if judged.parents:
            beating = [p for p in points if p.policy_id in verdicts and verdicts[p.policy_id].eligible]
            parents = {pid: self.store.policy(pid).parent_ids for pid in finalists}
            finalists = with_parents(finalists, beating, parents, behaviours)
        outside = left_out(verdicts, finalists, judged.margin)
        selection = {"candidates": len(verdicts), "beat_expert": sum(v.eligible for v in verdicts.values()),
                     "finalists": finalists, "left_out": outside[:SHOWN_LEFT_OUT], "left_out_total": len(outside),
                     "near": near and bool(finalists)}
        if near and finalists:
            self.progress(f"no candidate beat the expert on train by the rule ({len(verdicts)} scored on the whole "
                          "split): validating the cheaper there at a mean score within the margin",
                          self.cascade.front())
        elif not finalists:
            self.progress(f"no candidate beat the expert on train ({len(verdicts)} scored on the whole split): "
                          "only the baselines are validated", self.cascade.front())
        return finalists, selection

    def propose(self) -> str | None:
        """Finish pending candidates, then ask the proposers (`evolve.schedule`: the first until it is spent,
        or in turn) until the run's candidate budget is reached; returns why proposing stopped early (a
        proposer's budget), or None."""
        self.finish_pending()
        while (n := self.n_proposed()) < self.config.max_candidates:
            history = [(p.proposer, p.status) for p in self.store.policies(self.run.id) if p.proposer in PROPOSED_BY]
            name = next_proposer(self.config.proposers, history, self.config.schedule, self.config.lead_patience)
            try:
                self.step(self.proposers[name], n)
            except BudgetExhausted as err:
                return str(err)
        return None

    def seed_population(self) -> dict[str, int]:
        """Store and evaluate the seed policies and the baselines (idempotent on resume)."""
        roles = self.config.baselines.model_dump()
        entries = [(name, "seed", None) for name in self.config.seed_policies]
        entries += [(name, "baseline", role) for role, name in roles.items()]
        baselines: dict[str, int] = {}
        pending: dict[int, tuple[str, str, str]] = {}  # policy id -> (kind, name, text), in order
        for name, kind, role in entries:
            checked = load_checked(name)
            identity = self.fingerprints().identity(checked.text)
            pid, _ = self.store.add_policy(self.run.id, Proposal(kind, checked.text, text=checked.text,
                                                                 hash=checked.hash, name=name,
                                                                 structure_hash=identity.structure,
                                                                 behaviour_hash=identity.behaviour))
            if role is not None:
                self.store.set_baseline(self.run.id, role, pid)
                baselines[role] = pid
            if self.store.policy(pid).status == "proposed":
                pending.setdefault(pid, (kind, name, checked.text))
        for pid in pending:  # all queued first: workers of a shared run take them side by side
            self.cascade.enqueue(pid, self.train_ids)
        for pid, (kind, name, text) in pending.items():
            self.progress(f"evaluating {kind} {name} on the train split", self.cascade.front())
            self.cascade.evaluate(pid, text, name, gate=False)
        self.backfill_identities()
        return baselines

    def backfill_identities(self) -> None:
        """Policies stored before identities existed (an older run, resumed) get theirs, so they count as known."""
        for info in self.store.policies(self.run.id):
            if info.structure_hash is None and info.text is not None and info.status not in ("rejected", "duplicate"):
                identity = self.fingerprints().identity(info.text)
                self.store.set_identity(info.id, identity.structure, identity.behaviour)

    def finish_pending(self) -> None:
        """Candidates a killed run proposed but did not finish: evaluate them and tell their proposer."""
        for info in self.store.policies(self.run.id, status="proposed"):
            outcome = self.cascade.evaluate(info.id, info.text or "", info.label)
            proposer = self.proposers.get(info.proposer)
            if proposer is not None:
                proposer.tell(_as_proposal(info), info.id, outcome)

    def proposer_context(self, index: int, timelines: bool = False) -> ProposerContext:
        """What the `index`-th proposal may see: train results only (build_context enforces it), with the
        population's message timelines if asked for."""
        rng = random.Random(self.config.seed * 1_000_003 + index)  # resume-stable per proposal
        # Every stored policy with a text: pruned and duplicate ones count as known; only policies evaluated on
        # the whole train split enter the population (build_context checks their results).
        known = [p for p in self.store.policies(self.run.id) if p.text is not None]
        lines = self.store.timelines(self.run.id, [p.id for p in known if p.status == "evaluated"]) if timelines else ()
        reference = self.store.baselines(self.run.id).get(REFERENCE)
        return build_context(known, self.store.evaluations(self.run.id, TRAIN), self.train_ids, rng, index, lines,
                             reference)

    def step(self, proposer: Proposer, index: int) -> None:
        proposal = proposer.ask(self.proposer_context(index, proposer.reads_timelines))
        if proposal.text is not None and proposal.rejection_reason is None:
            identity = self.fingerprints().identity(proposal.text)
            proposal = replace(proposal, hash=identity.hash, structure_hash=identity.structure,
                               behaviour_hash=identity.behaviour)
            known = self.store.known_policy(self.run.id, identity.hash, identity.structure, identity.behaviour)
            if known is not None:
                self._duplicate(proposer, proposal, known, self._sameness(identity, known))
                return
        pid, _ = self.store.add_policy(self.run.id, proposal)
        if proposal.rejection_reason is not None:
            proposer.tell(proposal, pid, Outcome("rejected", reason=proposal.rejection_reason))
            self.progress(f"{self._count(index)} #{pid} {proposer.name}: rejected ({proposal.rejection_reason[:80]})",
                          self.cascade.front())
            return
        outcome = self.cascade.evaluate(pid, proposal.text or "", f"#{pid}")
        proposer.tell(proposal, pid, outcome)
        where = "on the train subset" if outcome.status == "pruned" else "on train"
        self.progress(f"{self._count(index)} #{pid} {proposer.name}: {outcome.status}, {where} score "
                      f"{outcome.score:.3f} cost {cents(outcome.cost)}¢/task", self.cascade.front())

    def _count(self, index: int) -> str:
        return f"[{index + 1}/{self.config.max_candidates}]"

    def _sameness(self, identity: Identity, known: PolicyInfo) -> str:
        if identity.hash == known.hash:
            return "the same canonical text"
        if identity.structure == known.structure_hash:
            return "the same policy up to tunable ranges"
        return f"the same decisions on the {self.fingerprints().requests} recorded train requests"

    def _duplicate(self, proposer: Proposer, proposal: Proposal, known: PolicyInfo, sameness: str) -> None:
        # Stored (without a hash, which is unique per run) so the lineage shows the attempt and the
        # budget counts it; never evaluated, so never validated.
        reason = f"duplicate of {known.label}: {sameness}"
        pid, _ = self.store.add_policy(self.run.id, replace(proposal, hash=None, rejection_reason=reason,
                                                            duplicate_of=known.id))
        proposer.tell(proposal, pid, self._fate_of(known, reason))
        self.progress(f"{self._count(self.n_proposed() - 1)} #{pid} {proposer.name}: {reason}", self.cascade.front())

    def _fate_of(self, known: PolicyInfo, reason: str) -> Outcome:
        """A duplicate fares as its original did: its train means, or pruned on the subset like it."""
        stored = self.cascade.stored(known.id)
        ids = self.train_ids if known.status == "evaluated" else self.cascade.subset_ids
        if known.status not in ("evaluated", "pruned") or any(t not in stored for t in ids):
            return Outcome("rejected", reason=reason)
        rows = [stored[t] for t in ids]
        return Outcome("duplicate" if known.status == "evaluated" else "pruned",
                       sum(r.score for r in rows) / len(rows), sum(r.cost_usd for r in rows) / len(rows), reason)


def _as_proposal(info: PolicyInfo) -> Proposal:
    return Proposal(info.proposer, info.raw_text, info.parent_ids, info.generation, info.text, info.hash,
                    info.name, info.rejection_reason, meta=info.meta)
