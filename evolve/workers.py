"""Evaluation shared by every process of a run: the `akv evolve` process and any `akv worker`.

The evolve process queues the tasks each step needs (a candidate's cascade stage, the held-out
split of the finalists and the baselines; `store/work.py`) and then works on the queue itself
until they are done. Workers on other machines lease tasks from the same queue (a few at a time:
their share of what is free, so the last tasks are not held by one) and commit the results with
their leases, several in one transaction. Proposals stay with the evolve process, one at a time, so the lineage does
not depend on how many workers helped: every step waits for all of its tasks, whoever ran them.
"""
from __future__ import annotations

import threading
import time
from itertools import groupby
from typing import Callable, Sequence

from evolve.scoring import Evaluator
from sandbox.runs.progress import TaskDisplay
from store import Lease, RunInfo, Store, TaskResult

POLL_S = 0.2  # how often a process with nothing to run asks the queue again
SQLITE_LEASE = 64  # a SQLite run has one process: it may take many tasks at a time
LEASE_AHEAD = 4  # a shared run: at most this many tasks per lane in one lease (fewer near the end)
FLUSH_S = 1.0  # results wait at most this long to be committed together (a crash loses no more)


class Worker:
    """One process's part of a run: leases tasks, evaluates them, commits the results with their leases.

    A heartbeat thread renews the leases every third of `lease_s`; a process that dies stops
    renewing, and its tasks go to another worker once `lease_s` has passed (its results not yet
    committed included: they are evaluated again, and stored once).
    """

    def __init__(self, store: Store, run: RunInfo, evaluator: Evaluator, role: str, concurrency: int,
                 lease_s: float, backend: str) -> None:
        self.store, self.run, self.evaluator = store, run, evaluator
        self.queue = store.work
        self.lease_s = lease_s
        self.concurrency = concurrency
        self.batch = concurrency * LEASE_AHEAD if self.queue.shared else max(concurrency, SQLITE_LEASE)
        if not self.queue.shared:
            self.queue.release_run(run.id)  # leases of an earlier process of this SQLite run: it is gone
        self.id = self.queue.register(run.id, role, concurrency, backend)
        self.done = 0
        self._policies: dict[int, tuple[str, str]] = {}
        self._unsaved: list[tuple[Lease, TaskResult]] = []
        self._saved_at = time.monotonic()
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="akv-heartbeat", daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                self.queue.heartbeat(self.id, self.lease_s)
            except Exception:  # noqa: BLE001 - a missed beat is retried; the lease outlives two of them
                continue

    def work_once(self) -> int:
        """Lease this worker's share of what is free, evaluate it, commit the results; how many were leased."""
        least = self.concurrency if self.queue.shared else None
        leases = self.queue.lease(self.run.id, self.id, self.batch, self.lease_s, least=least)
        for (policy_id, split), group in groupby(leases, key=lambda lease: (lease.policy_id, lease.split)):
            by_task = {lease.task_id: lease for lease in group}
            text, label = self._policy(policy_id)
            try:
                self.evaluator.evaluate(text, label, split, list(by_task),
                                        lambda result, by_task=by_task: self._heard(by_task[result.task_id], result))
            finally:
                self._save()
        return len(leases)

    def _heard(self, lease: Lease, result: TaskResult) -> None:
        self._unsaved.append((lease, result))
        if time.monotonic() - self._saved_at >= FLUSH_S:
            self._save()

    def _save(self) -> None:
        """Commit the results heard so far in one transaction (each only while its lease is still ours)."""
        unsaved, self._unsaved = self._unsaved, []
        self.done += self.queue.complete_many(unsaved, self.id, self.run.id)
        self._saved_at = time.monotonic()

    def _policy(self, policy_id: int) -> tuple[str, str]:
        if policy_id not in self._policies:
            info = self.store.policy(policy_id)
            self._policies[policy_id] = (info.text or "", info.label)
        return self._policies[policy_id]

    def serve(self, keep_going: Callable[[], bool], idle: Callable[[], None] = lambda: None) -> None:
        """Work until `keep_going()` is False while nothing is free to lease (`idle` hears each empty poll)."""
        while True:
            if self.work_once():
                continue
            if not keep_going():
                return
            idle()
            time.sleep(POLL_S)

    def close(self) -> None:
        """Stop renewing and give back what was leased but not finished."""
        self._stop.set()
        self._beat.join(timeout=5)
        self.queue.release(self.id)


class SharedEvaluation:
    """What the cascade and validation call: queue a policy's tasks, then work until all are done."""

    def __init__(self, make_worker: Callable[[], Worker], display: TaskDisplay | None = None) -> None:
        self._make_worker = make_worker
        self._worker: Worker | None = None
        self.display = display

    @property
    def worker(self) -> Worker:
        if self._worker is None:  # registered on first use: a process that only reads registers nothing
            self._worker = self._make_worker()
        return self._worker

    def enqueue(self, policy_id: int, split: str, task_ids: Sequence[str]) -> None:
        """Queue tasks ahead, so that other workers can take them while this process works on others."""
        self.worker.queue.enqueue(self.worker.run.id, policy_id, split, task_ids)

    def run(self, policy_id: int, label: str, split: str, task_ids: Sequence[str]) -> None:
        worker = self.worker
        worker.queue.enqueue(worker.run.id, policy_id, split, task_ids)
        if self.display is not None:
            self.display.begin(len(task_ids), f"{label} on {split}")

        def unfinished() -> bool:
            counts = worker.queue.counts(worker.run.id, policy_id, split, task_ids)
            if self.display is not None:
                self.display.counts(counts.done, counts.running, counts.failed)
            return counts.done < counts.total

        while unfinished():
            if not worker.work_once():
                time.sleep(POLL_S)  # the rest is leased by other workers

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None
