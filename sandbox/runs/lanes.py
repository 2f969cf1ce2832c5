"""Running tasks several at a time: lanes of threads or of processes, results handed back in task order.

A lane runs one task at a time on a backend of its own. How lanes are made depends on the backend
(`Backend.parallel`):

- `threads`: a remote backend spends its time waiting for the server, so lanes are threads; each
  gets `backend.lane()` (the HTTP client itself, or a server pool's lane that pins each task to one
  server).
- `processes`: the replay backend is CPU-bound Python, so threads would only take turns on the
  interpreter lock; lanes are processes that open their own backend (`backend.reopen()`). Task
  `i` of the job list always goes to lane `i % n`, so each lane's prefix memo sees the same
  tasks candidate after candidate, as one process would.
- `none`: the embedded engine starts each task from an empty cache, which tasks running beside
  each other would clear under one another: it runs one task at a time.

Every task's outcome depends only on the task, the policy, the agent and the seed (replay and the
embedded engine start each task from an empty cache; a scripted agent is deterministic), so the
results are those of a serial run. `run_jobs` yields them in job order whatever order they
finish in, so what is stored from them is stored in the serial order too.
"""
from __future__ import annotations

import multiprocessing
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from sandbox.backends.base import check_concurrency, lane_kind
from sandbox.suites.base import Task


@dataclass(frozen=True)
class TaskJob:
    """One task to run, as plain data a process lane can receive."""

    task: Task
    policy: Any  # a compiled policy (any object with `name`, `mode` and `decide`)
    agent: str  # scripted | llm
    seed: int
    limits: Any  # harness.RunLimits
    prices: Any  # cost.PriceTable
    out_dir: Path | None = None
    agent_mode: str = "tools"  # the llm agent's: tools or free (sandbox/agents/llm.py)
    use_records: str = "references"  # where the llm agent's use records come from (harness.USE_RECORDS)


Heard = Callable[[Any], None]  # a display hearing of a job that starts, or of a result
# What runs one job on a lane's backend: (job, suite, backend) -> (result, trajectory). The harness
# passes its `run_job`; a process lane receives it with each job, so it must be a module-level function.
RunJob = Callable[[TaskJob, Any, Any], tuple[Any, Any]]


class Lanes:
    """`n` lanes over one backend, kept open between calls (an evolution runs many candidates)."""

    def __init__(self, backend: Any, n: int = 1) -> None:
        check_concurrency(backend, n)
        self.backend, self.n = backend, n
        self.kind = lane_kind(backend) if n > 1 else "none"
        self._threads: ThreadPoolExecutor | None = None
        self._thread_lanes: list[Any] = []
        self._processes: list[_LaneProcess] = []

    def run_jobs(self, jobs: Sequence[TaskJob], suite: Any, run_job: RunJob, started: Heard | None = None,
                 finished: Heard | None = None) -> Iterator[tuple[Any, Any]]:
        """(result, trajectory or None) per job, in job order, each job run by `run_job`.

        `started` hears of each job as a lane takes it, `finished` of each result as it comes
        (in the order they finish; from lane threads too).
        """
        started = started or (lambda _job: None)
        finished = finished or (lambda _result: None)
        if self.kind == "none":
            for job in jobs:
                started(job)
                outcome = run_job(job, suite, self.backend)
                finished(outcome[0])
                yield outcome
        elif self.kind == "threads":
            yield from self._run_threads(jobs, suite, run_job, started, finished)
        else:
            yield from self._run_processes(jobs, run_job, started, finished)

    # ---- threads -----------------------------------------------------------------------
    def _run_threads(self, jobs: Sequence[TaskJob], suite: Any, run_job: RunJob, started: Heard,
                     finished: Heard) -> Iterator[tuple[Any, Any]]:
        if self._threads is None:
            self._threads = ThreadPoolExecutor(self.n, thread_name_prefix="akv-lane")
            self._thread_lanes = [self.backend.lane() for _ in range(self.n)]
        free = list(self._thread_lanes)
        lock = threading.Lock()

        def one(job: TaskJob) -> tuple[Any, Any]:
            with lock:
                lane = free.pop()
            try:
                started(job)
                outcome = run_job(job, suite, lane)
                finished(outcome[0])
                return outcome
            finally:
                with lock:
                    free.append(lane)

        futures: list[Future] = [self._threads.submit(one, job) for job in jobs]
        for future in futures:  # in job order: a later one that finished first waits its turn
            yield future.result()

    # ---- processes ---------------------------------------------------------------------
    def _run_processes(self, jobs: Sequence[TaskJob], run_job: RunJob, started: Heard,
                       finished: Heard) -> Iterator[tuple[Any, Any]]:
        if not self._processes:
            context = multiprocessing.get_context("spawn")  # never fork a process that runs threads
            results = context.Queue()
            self._processes = [_LaneProcess(context, self.backend.reopen(), results, i) for i in range(self.n)]
        results = self._processes[0].results
        for position, job in enumerate(jobs):
            self._processes[position % self.n].send(position, job, run_job)
        done: dict[int, tuple[Any, Any]] = {}
        next_out = 0
        while next_out < len(jobs):
            if next_out in done:
                yield done.pop(next_out)
                next_out += 1
                continue
            try:
                kind, position, payload = results.get(timeout=1.0)
            except queue.Empty:
                self._check_alive()
                continue
            if kind == "started":
                started(jobs[position])
            else:
                finished(payload)
                done[position] = (payload, None)

    def _check_alive(self) -> None:
        dead = [p for p in self._processes if not p.process.is_alive()]
        if dead:
            raise RuntimeError(f"lane process {dead[0].index} stopped (exit code {dead[0].process.exitcode}); "
                               "its tasks were not finished")

    def close(self) -> None:
        if self._threads is not None:
            self._threads.shutdown(wait=True)
            for lane in self._thread_lanes:
                if lane is not self.backend:
                    lane.close()
            self._threads = None
        for lane in self._processes:
            lane.stop()
        self._processes = []


class _LaneProcess:
    """One process that runs the jobs it is sent, in order, on a backend of its own."""

    def __init__(self, context: Any, open_backend: Callable[[], Any], results: Any, index: int) -> None:
        self.index, self.results = index, results
        self.jobs = context.Queue()
        self.process = context.Process(target=_lane_main, args=(open_backend, self.jobs, results),
                                       name=f"akv-lane-{index}", daemon=True)
        self.process.start()

    def send(self, position: int, job: TaskJob, run_job: RunJob) -> None:
        self.jobs.put((position, job, run_job))

    def stop(self) -> None:
        if self.process.is_alive():
            self.jobs.put(None)
            self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def _lane_main(open_backend: Callable[[], Any], jobs: Any, results: Any) -> None:
    """A process lane: run each job it is sent and send the result back. Suites are opened by
    name (`get_suite`); trajectories go to the job's out_dir from here."""
    from sandbox.suites import get_suite

    backend = open_backend()
    suites: dict[str, Any] = {}
    try:
        while (item := jobs.get()) is not None:
            position, job, run_job = item
            results.put(("started", position, None))
            suite = suites.get(job.task.suite) or suites.setdefault(job.task.suite, get_suite(job.task.suite))
            result, _trajectory = run_job(job, suite, backend)
            results.put(("done", position, result))
    finally:
        backend.close()
