"""The Store: every read and write of an evolution run, each write in its own transaction.

A run killed with SIGKILL therefore loses at most the evaluation being written; every
committed row survives and `--resume` continues from them.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Sequence

from sqlalchemy import Engine, func, or_, select
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session, selectinload, sessionmaker

from store.database import default_url, display_url, open_engine
from store.errors import DuplicateRunName, RunNotFound, StoreError
from store.live import LivePolicies
from store.migrations import migrate
from store.traces import TraceStore
from store.work import WorkQueue, add_result_rows
from store.records import (
    EvaluationRecord,
    PolicyInfo,
    Proposal,
    RunInfo,
    TaskResult,
    TimelineRecord,
    ValidationRecord,
    ValidationRound,
)
from store.schema import Baseline, Evaluation, Policy, PolicyParent, Run, Timeline, Validation, utcnow
from store.schema import ValidationRound as RoundRow


class Store:
    def __init__(self, engine: Engine, url: str) -> None:
        self.engine = engine
        self.url = url
        self._sessions = sessionmaker(engine, expire_on_commit=False)
        try:
            with engine.begin() as conn:
                self.schema_version = migrate(conn)
        except SQLAlchemyError as err:
            reason = str(getattr(err, "orig", err)).splitlines()[0]
            raise StoreError(f"--db: cannot prepare the schema: {reason}") from None

    @classmethod
    def open(cls, url: str | None = None) -> "Store":
        """Open (and migrate) the database at `url`, `AKV_DB`, or the data folder's SQLite file."""
        url = url or default_url()
        return cls(open_engine(url), url)

    @property
    def traces(self) -> TraceStore:
        """Trace sets: recorded agent runs (`store/traces.py`)."""
        return TraceStore(self._tx, self.display_url)

    @property
    def live(self) -> LivePolicies:
        """Refining proxies: live policies and their lineage, rounds, conversation costs (`store/live.py`)."""
        return LivePolicies(self._tx, self.display_url)

    @property
    def work(self) -> WorkQueue:
        """The run's shared work queue: leases, workers (`store/work.py`)."""
        return WorkQueue(self)

    @contextmanager
    def _tx(self) -> Iterator[Session]:
        with self._sessions.begin() as session:
            yield session

    # ---- runs -------------------------------------------------------------------------
    def create_run(
        self, name: str, config: Mapping[str, Any], seed: int, code_version: str, suite_version: str
    ) -> RunInfo:
        try:
            with self._tx() as s:
                run = Run(name=name, config=dict(config), seed=seed, code_version=code_version,
                          suite_version=suite_version)
                s.add(run)
                s.flush()
                run_id = run.id
        except IntegrityError:
            raise DuplicateRunName(
                f"--run-name: a run named {name!r} already exists; pass --resume to continue it or choose another name"
            ) from None
        return self.run(run_id)

    def run(self, ref: int | str) -> RunInfo:
        """A run by id or by name."""
        with self._tx() as s:
            run = self._find_run(s, ref)
            return self._run_info(s, run)

    def _find_run(self, s: Session, ref: int | str) -> Run:
        run = s.scalar(select(Run).where(Run.name == str(ref)))
        if run is None and str(ref).isdigit():
            run = s.get(Run, int(ref))
        if run is None:
            raise RunNotFound(f"RUN: no run named {ref!r} in {self.display_url} (see `akv runs list`)")
        return run

    @property
    def display_url(self) -> str:
        return display_url(self.url)

    def _run_info(self, s: Session, run: Run) -> RunInfo:
        n_pol = s.scalar(select(func.count(Policy.id)).where(Policy.run_id == run.id)) or 0
        n_eval = s.scalar(select(func.count(Evaluation.id)).where(Evaluation.run_id == run.id)) or 0
        return RunInfo(run.id, run.name, run.config, run.seed, run.status, run.status_detail,
                       run.code_version, run.suite_version, run.created_at, run.finished_at, n_pol, n_eval)

    def run_status(self, run_id: int) -> str:
        """Just the run's status (running, finished, stopped): what a waiting worker polls."""
        with self._tx() as s:
            return s.scalar(select(Run.status).where(Run.id == run_id)) or "deleted"

    def runs(self) -> list[RunInfo]:
        with self._tx() as s:
            return [self._run_info(s, r) for r in s.scalars(select(Run).order_by(Run.id))]

    def run_names(self) -> set[str]:
        with self._tx() as s:
            return set(s.scalars(select(Run.name)))

    def set_run_status(self, run_id: int, status: str, detail: str | None = None) -> None:
        with self._tx() as s:
            run = s.get(Run, run_id)
            run.status, run.status_detail = status, detail
            run.finished_at = utcnow() if status in ("finished", "stopped") else None

    # ---- policies ---------------------------------------------------------------------
    def add_policy(self, run_id: int, proposal: Proposal, status: str = "proposed") -> tuple[int, bool]:
        """Store a proposal; returns (policy id, created). A known hash returns the existing id."""
        if proposal.hash is not None:
            existing = self.policy_by_hash(run_id, proposal.hash)
            if existing is not None:
                return existing.id, False
        if proposal.duplicate_of is not None:
            status = "duplicate"
        elif proposal.rejection_reason is not None:
            status = "rejected"
        try:
            with self._tx() as s:
                policy = Policy(
                    run_id=run_id, hash=proposal.hash, text=proposal.text, raw_text=proposal.raw_text,
                    name=proposal.name, generation=proposal.generation, proposer=proposal.proposer,
                    status=status, rejection_reason=proposal.rejection_reason, prompt=proposal.prompt,
                    response=proposal.response, prompt_tokens=proposal.prompt_tokens,
                    completion_tokens=proposal.completion_tokens, proposal_cost_usd=proposal.cost_usd,
                    meta=dict(proposal.meta), structure_hash=proposal.structure_hash,
                    behaviour_hash=proposal.behaviour_hash, duplicate_of=proposal.duplicate_of,
                )
                policy.parent_links = [PolicyParent(parent_id=p, rank=i) for i, p in enumerate(proposal.parent_ids)]
                s.add(policy)
                s.flush()
                return policy.id, True
        except IntegrityError:
            # Another writer stored the same hash between our check and insert.
            existing = self.policy_by_hash(run_id, proposal.hash or "")
            if existing is None:
                raise
            return existing.id, False

    def policy_by_hash(self, run_id: int, hash_: str) -> PolicyInfo | None:
        with self._tx() as s:
            row = s.scalar(self._policy_query().where(Policy.run_id == run_id, Policy.hash == hash_))
            return None if row is None else _policy_info(row)

    def known_policy(self, run_id: int, hash_: str, structure: str | None = None,
                     behaviour: str | None = None) -> PolicyInfo | None:
        """The earliest stored policy of the run (duplicates and rejections aside) that shares the
        canonical hash, the structure or the behaviour fingerprint; None if there is none."""
        keys = [Policy.hash == hash_]
        if structure is not None:
            keys.append(Policy.structure_hash == structure)
        if behaviour is not None:
            keys.append(Policy.behaviour_hash == behaviour)
        with self._tx() as s:
            row = s.scalar(self._policy_query().where(Policy.run_id == run_id, or_(*keys),
                                                      Policy.status.not_in(("duplicate", "rejected")))
                           .order_by(Policy.id).limit(1))
            return None if row is None else _policy_info(row)

    def set_identity(self, policy_id: int, structure: str, behaviour: str | None) -> None:
        with self._tx() as s:
            policy = s.get(Policy, policy_id)
            policy.structure_hash, policy.behaviour_hash = structure, behaviour

    def policy(self, policy_id: int) -> PolicyInfo:
        with self._tx() as s:
            row = s.scalar(self._policy_query().where(Policy.id == policy_id))
            if row is None:
                raise StoreError(f"--policy: no policy #{policy_id}")
            return _policy_info(row, with_texts=True)

    def policies(self, run_id: int, status: str | None = None) -> list[PolicyInfo]:
        with self._tx() as s:
            query = self._policy_query().where(Policy.run_id == run_id).order_by(Policy.id)
            if status is not None:
                query = query.where(Policy.status == status)
            return [_policy_info(p) for p in s.scalars(query)]

    @staticmethod
    def _policy_query():
        return select(Policy).options(selectinload(Policy.parent_links))

    def set_policy_status(self, policy_id: int, status: str, reason: str | None = None,
                          meta: Mapping[str, Any] | None = None) -> None:
        with self._tx() as s:
            policy = s.get(Policy, policy_id)
            policy.status = status
            if reason is not None:
                policy.rejection_reason = reason
            if meta:
                policy.meta = {**(policy.meta or {}), **meta}

    def set_duplicate(self, policy_id: int, of: int, reason: str) -> None:
        """An evaluated policy found to behave as `of` does: stored as its duplicate (its results are kept)."""
        with self._tx() as s:
            policy = s.get(Policy, policy_id)
            policy.status, policy.duplicate_of, policy.rejection_reason = "duplicate", of, reason

    # ---- evaluations ------------------------------------------------------------------
    def add_evaluation(self, run_id: int, policy_id: int, result: TaskResult) -> bool:
        """Store one task result; False if that (policy, task, split) was already stored."""
        try:
            with self._tx() as s:
                add_result_rows(s, run_id, policy_id, result)
            return True
        except IntegrityError:
            return False

    def evaluations(self, run_id: int, split: str | None = None,
                    policy_ids: Sequence[int] | None = None) -> list[EvaluationRecord]:
        with self._tx() as s:
            query = select(Evaluation).where(Evaluation.run_id == run_id).order_by(Evaluation.id)
            if split is not None:
                query = query.where(Evaluation.split == split)
            if policy_ids is not None:
                query = query.where(Evaluation.policy_id.in_(list(policy_ids)))
            return [EvaluationRecord(e.policy_id, TaskResult(
                e.task_id, e.split, e.status, e.score, e.cost_usd, e.n_requests, e.tokens or {}, e.wall_s, e.error,
            )) for e in s.scalars(query)]

    def timelines(self, run_id: int, policy_ids: Sequence[int]) -> list[TimelineRecord]:
        """The stored timelines of these policies' evaluations, in evaluation order."""
        with self._tx() as s:
            query = (select(Timeline, Evaluation.task_id, Evaluation.split)
                     .join(Evaluation, Evaluation.id == Timeline.evaluation_id)
                     .where(Timeline.run_id == run_id, Timeline.policy_id.in_(list(policy_ids)))
                     .order_by(Timeline.evaluation_id))
            return [TimelineRecord(t.policy_id, task, split, t.data) for t, task, split in s.execute(query)]

    # ---- baselines and validations ----------------------------------------------------
    def set_baseline(self, run_id: int, role: str, policy_id: int) -> None:
        with self._tx() as s:
            s.merge(Baseline(run_id=run_id, role=role, policy_id=policy_id))

    def baselines(self, run_id: int) -> dict[str, int]:
        with self._tx() as s:
            rows = s.scalars(select(Baseline).where(Baseline.run_id == run_id))
            return {b.role: b.policy_id for b in rows}

    def save_validations(self, run_id: int, records: Sequence[ValidationRecord], code_version: str,
                         suite_version: str, settings: Mapping[str, Any]) -> int:
        """Store a new validation round of the run in one transaction; return its number.

        Earlier rounds stay: validating again adds a round, it never replaces one.
        """
        with self._tx() as s:
            latest = s.scalar(select(func.max(RoundRow.round)).where(RoundRow.run_id == run_id)) or 0
            number = latest + 1
            s.add(RoundRow(run_id=run_id, round=number, code_version=code_version, suite_version=suite_version,
                           settings=dict(settings)))
            for r in records:
                s.add(Validation(run_id=run_id, round=number, policy_id=r.policy_id, role=r.role, label=r.label,
                                 n_tasks=r.n_tasks, score_mean=r.score_mean, cost_mean=r.cost_mean,
                                 stats=dict(r.stats), non_dominated=r.non_dominated, champion=r.champion,
                                 verdict=r.verdict))
        return number

    def validations(self, run_id: int, round: int | None = None) -> list[ValidationRecord]:
        """The records of one validation round: the latest unless `round` is given ([] if none)."""
        with self._tx() as s:
            if round is None:
                round = s.scalar(select(func.max(Validation.round)).where(Validation.run_id == run_id))
            rows = s.scalars(select(Validation).where(Validation.run_id == run_id, Validation.round == round)
                             .order_by(Validation.id))
            return [ValidationRecord(v.policy_id, v.role, v.label, v.n_tasks, v.score_mean, v.cost_mean,
                                     v.stats or {}, v.non_dominated, v.champion, v.verdict) for v in rows]

    def validation_rounds(self, run_id: int) -> list[ValidationRound]:
        """Every validation round of the run, first to latest."""
        with self._tx() as s:
            counts = dict(s.execute(select(Validation.round, func.count(Validation.id))
                                    .where(Validation.run_id == run_id).group_by(Validation.round)).all())
            rows = s.scalars(select(RoundRow).where(RoundRow.run_id == run_id).order_by(RoundRow.round))
            return [ValidationRound(r.round, r.code_version, r.suite_version, r.settings or {}, r.created_at,
                                    counts.get(r.round, 0)) for r in rows]

    def close(self) -> None:
        self.engine.dispose()


def _policy_info(p: Policy, with_texts: bool = False) -> PolicyInfo:
    return PolicyInfo(
        id=p.id, run_id=p.run_id, hash=p.hash, text=p.text, raw_text=p.raw_text, name=p.name,
        generation=p.generation, proposer=p.proposer, status=p.status, rejection_reason=p.rejection_reason,
        parent_ids=tuple(p.parent_ids), prompt_tokens=p.prompt_tokens, completion_tokens=p.completion_tokens,
        proposal_cost_usd=p.proposal_cost_usd, meta=p.meta or {},
        prompt=p.prompt if with_texts else None, response=p.response if with_texts else None,
        structure_hash=p.structure_hash, behaviour_hash=p.behaviour_hash, duplicate_of=p.duplicate_of,
    )
