"""The work queue of a run shared by several processes: tasks leased from the database.

Every task a run needs (a policy on one task of a split) is a row of `akv_work`. A worker leases
rows (`SELECT ... FOR UPDATE SKIP LOCKED` on PostgreSQL, so two workers never take the same row
and neither waits for the other), renews its leases while it works, and commits each result
together with the row's `done` in one transaction, only while it still holds the lease. A worker
that dies stops renewing; once its lease has run out (on the database's clock) another worker
takes the row. So every task is evaluated and stored exactly once: a slow worker whose lease was
taken from it finds its row no longer its own and stores nothing.

SQLite has one writer at a time and no row locks: a SQLite run is shared by no one, and its one
`akv evolve` process uses the same queue alone. The proposer of a run is one process at a time:
on PostgreSQL it holds a session advisory lock, which the server releases if the process dies.
"""
from __future__ import annotations

import os
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Iterator, Sequence

from sqlalchemy import ColumnElement, Connection, and_, func, literal_column, or_, select, text, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from store.errors import StoreError
from store.records import TaskResult
from store.schema import Evaluation, Timeline, WorkItem, Worker, utcnow


@dataclass(frozen=True)
class Lease:
    """A leased task: which policy on which task of which split."""

    id: int
    policy_id: int
    split: str
    task_id: str
    attempts: int


@dataclass(frozen=True)
class WorkerInfo:
    id: int
    name: str
    role: str
    concurrency: int
    backend: str
    started_at: datetime
    last_seen: datetime
    n_evaluations: int


@dataclass(frozen=True)
class BatchCounts:
    total: int
    done: int
    running: int
    failed: int


def add_result_rows(s: Session, run_id: int, policy_id: int, result: TaskResult, worker_id: int | None = None) -> None:
    """One stored result: its evaluation row and, for a train result that has one, its message timeline."""
    row = Evaluation(run_id=run_id, policy_id=policy_id, task_id=result.task_id, split=result.split,
                     status=result.status, score=result.score, cost_usd=result.cost_usd,
                     n_requests=result.n_requests, tokens=dict(result.tokens), wall_s=result.wall_s,
                     error=result.error, worker_id=worker_id)
    s.add(row)
    if result.timeline is not None:
        s.flush()  # the row's id
        s.add(Timeline(evaluation_id=row.id, run_id=run_id, policy_id=policy_id, data=dict(result.timeline)))


def process_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class WorkQueue:
    """The queue's reads and writes, each in its own transaction, through a Store's engine."""

    def __init__(self, store) -> None:
        self.store = store
        self.shared = store.engine.dialect.name == "postgresql"

    def _now(self) -> ColumnElement:
        """The database's clock in epoch seconds: leases compare times of one clock, whoever wrote them."""
        if self.shared:
            return func.extract("epoch", func.clock_timestamp())
        return (func.julianday("now") - 2440587.5) * 86400.0

    # ---- workers ------------------------------------------------------------------------
    def register(self, run_id: int, role: str, concurrency: int, backend: str) -> int:
        with self.store._tx() as s:
            worker = Worker(run_id=run_id, name=process_name(), role=role, concurrency=concurrency, backend=backend)
            s.add(worker)
            s.flush()
            return worker.id

    def heartbeat(self, worker_id: int, lease_s: float) -> None:
        """The worker is alive: its leases run `lease_s` longer from now."""
        with self.store._tx() as s:
            s.execute(update(Worker).where(Worker.id == worker_id).values(last_seen=utcnow()))
            s.execute(update(WorkItem).where(WorkItem.worker_id == worker_id, WorkItem.status == "leased")
                      .values(lease_until=self._now() + lease_s))

    def workers(self, run_id: int) -> list[WorkerInfo]:
        with self.store._tx() as s:
            counts = dict(s.execute(select(Evaluation.worker_id, func.count(Evaluation.id))
                                    .where(Evaluation.run_id == run_id).group_by(Evaluation.worker_id)).all())
            rows = s.scalars(select(Worker).where(Worker.run_id == run_id).order_by(Worker.id))
            return [WorkerInfo(w.id, w.name, w.role, w.concurrency, w.backend, w.started_at, w.last_seen,
                               counts.get(w.id, 0)) for w in rows]

    # ---- the queue ----------------------------------------------------------------------
    def enqueue(self, run_id: int, policy_id: int, split: str, task_ids: Sequence[str]) -> None:
        """Queue the tasks not queued yet (idempotent: a resumed run queues what is missing)."""
        with self.store._tx() as s:
            known = set(s.scalars(select(WorkItem.task_id).where(
                WorkItem.run_id == run_id, WorkItem.policy_id == policy_id, WorkItem.split == split)))
            s.add_all([WorkItem(run_id=run_id, policy_id=policy_id, split=split, task_id=t)
                       for t in dict.fromkeys(task_ids) if t not in known])

    def lease(self, run_id: int, worker_id: int, limit: int, lease_s: float, least: int | None = None) -> list[Lease]:
        """Up to `limit` pending tasks of the run (or ones whose lease ran out), in queue order, now this
        worker's for `lease_s` seconds.

        With `least`, the worker takes its share of what is free instead (the free tasks over the
        workers seen within `lease_s`, this one included), between `least` and `limit`: a worker
        that leases a few tasks at a time leaves the last ones to the others rather than holding them.
        """
        with self.store._tx() as s:
            free = or_(WorkItem.status == "pending",
                       and_(WorkItem.status == "leased", WorkItem.lease_until < self._now()))
            if least is not None and least < limit:
                limit = min(limit, max(least, self._share(s, run_id, worker_id, free, lease_s)))
            query = select(WorkItem).where(WorkItem.run_id == run_id, free).order_by(WorkItem.id).limit(limit)
            rows = list(s.scalars(query.with_for_update(skip_locked=True) if self.shared else query))
            leases = [Lease(r.id, r.policy_id, r.split, r.task_id, r.attempts + 1) for r in rows]
            if leases:
                s.execute(update(WorkItem).where(WorkItem.id.in_([lease.id for lease in leases])).values(
                    status="leased", worker_id=worker_id, lease_until=self._now() + lease_s,
                    attempts=WorkItem.attempts + 1), execution_options={"synchronize_session": False})
            return leases

    def _share(self, s: Session, run_id: int, worker_id: int, free: ColumnElement, lease_s: float) -> int:
        """The free tasks of the run over the workers alive (heard from within `lease_s`), rounded up."""
        n_free = s.scalar(select(func.count(WorkItem.id)).where(WorkItem.run_id == run_id, free)) or 0
        alive = s.scalar(select(func.count(Worker.id)).where(
            Worker.run_id == run_id, Worker.id != worker_id,
            Worker.last_seen > utcnow() - timedelta(seconds=lease_s))) or 0
        return -(-n_free // (alive + 1))

    def complete(self, lease: Lease, worker_id: int, run_id: int, result: TaskResult) -> bool:
        """Store the result and mark the task done, in one transaction, if this worker still holds it.

        False (nothing stored) when the lease ran out and another worker took the task.
        """
        try:
            with self.store._tx() as s:
                taken = s.execute(update(WorkItem).where(
                    WorkItem.id == lease.id, WorkItem.worker_id == worker_id, WorkItem.status == "leased")
                    .values(status="done", lease_until=None))
                if taken.rowcount != 1:
                    return False
                add_result_rows(s, run_id, lease.policy_id, result, worker_id)
            return True
        except IntegrityError:  # stored already (by an older process of this run): the task is done
            with self.store._tx() as s:
                s.execute(update(WorkItem).where(WorkItem.id == lease.id).values(status="done", lease_until=None))
            return False

    def complete_many(self, done: Sequence[tuple[Lease, TaskResult]], worker_id: int, run_id: int) -> int:
        """`complete` for several results in one transaction; how many were stored.

        Each is stored only while this worker still holds its task (one whose lease was taken from
        it stores nothing). If a result was stored already, each is completed on its own instead.
        """
        if not done:
            return 0
        try:
            with self.store._tx() as s:
                taken = set(s.scalars(update(WorkItem).where(
                    WorkItem.id.in_([lease.id for lease, _ in done]), WorkItem.worker_id == worker_id,
                    WorkItem.status == "leased").values(status="done", lease_until=None).returning(WorkItem.id),
                    execution_options={"synchronize_session": False}))
                for lease, result in done:
                    if lease.id in taken:
                        add_result_rows(s, run_id, lease.policy_id, result, worker_id)
            return len(taken)
        except IntegrityError:  # one of them stored already: nothing of this transaction was kept
            return sum(self.complete(lease, worker_id, run_id, result) for lease, result in done)

    def release(self, worker_id: int) -> None:
        """A worker that stops cleanly gives its unfinished tasks back at once."""
        with self.store._tx() as s:
            s.execute(update(WorkItem).where(WorkItem.worker_id == worker_id, WorkItem.status == "leased")
                      .values(status="pending", lease_until=None))

    def release_run(self, run_id: int) -> None:
        """Every lease of the run back to pending (SQLite: the one process of a run starting again)."""
        with self.store._tx() as s:
            s.execute(update(WorkItem).where(WorkItem.run_id == run_id, WorkItem.status == "leased")
                      .values(status="pending", lease_until=None))

    def counts(self, run_id: int, policy_id: int, split: str, task_ids: Sequence[str]) -> BatchCounts:
        """How far one policy's batch of tasks has come: done, leased (running), failed."""
        with self.store._tx() as s:
            in_batch = (WorkItem.run_id == run_id, WorkItem.policy_id == policy_id, WorkItem.split == split,
                        WorkItem.task_id.in_(list(task_ids)))
            by_status = dict(s.execute(select(WorkItem.status, func.count(WorkItem.id)).where(*in_batch)
                                       .group_by(WorkItem.status)).all())
            failed = s.scalar(select(func.count(Evaluation.id)).where(
                Evaluation.run_id == run_id, Evaluation.policy_id == policy_id, Evaluation.split == split,
                Evaluation.task_id.in_(list(task_ids)), Evaluation.status == "error")) or 0
        return BatchCounts(len(task_ids), by_status.get("done", 0), by_status.get("leased", 0), failed)

    def unfinished(self, run_id: int) -> int:
        """Tasks of the run queued or leased and not done yet."""
        with self.store._tx() as s:
            return s.scalar(select(func.count(WorkItem.id)).where(WorkItem.run_id == run_id,
                                                                  WorkItem.status != "done")) or 0

    def attempts(self, run_id: int) -> dict[tuple[int, str, str], int]:
        """Times each task of the run was leased (more than 1: its first worker died or gave it back)."""
        with self.store._tx() as s:
            rows = s.execute(select(WorkItem.policy_id, WorkItem.split, WorkItem.task_id, WorkItem.attempts)
                             .where(WorkItem.run_id == run_id))
            return {(p, sp, t): a for p, sp, t, a in rows}

    # ---- one proposer per run -----------------------------------------------------------
    @contextmanager
    def proposer_lock(self, run_id: int, run_name: str) -> Iterator[None]:
        """Held while a process proposes for the run; on PostgreSQL a second one is refused, one line."""
        if not self.shared:
            yield  # SQLite: one process per run
            return
        conn: Connection = self.store.engine.connect()
        try:
            key = literal_column(str(_LOCK_SPACE * 1_000_000 + run_id))
            if not conn.execute(select(func.pg_try_advisory_lock(key))).scalar():
                raise StoreError(f"run {run_name!r} is being evolved by another process already; join it with "
                                 f"`akv worker --run {run_name} --db URL` instead")
            conn.commit()
            yield
        finally:
            try:
                conn.execute(text("SELECT pg_advisory_unlock_all()"))
                conn.commit()
            finally:
                conn.close()


_LOCK_SPACE = 4242  # keeps our advisory lock keys apart from other users of the same database
