"""`akv worker --run NAME --db postgresql://...`: a process joins a run and evaluates its queued tasks.

The worker scores with the run's own settings (suite, agent, backend, seed; its suite build must
be the one the run recorded), and may be given its own backend (a server on its machine) and
concurrency. It waits while the run is running and has nothing queued, and stops when the run
finishes or stops. Refused with one line: a SQLite database (one process uses a SQLite run: its
`akv evolve` process), an unknown run, a database it cannot reach.
"""
from __future__ import annotations

import os

from rich.console import Console

from evolve.command import EvolveError
from evolve.config import stored_config
from evolve.scoring import HarnessEvaluator
from evolve.workers import Worker
from sandbox.runs.progress import TaskDisplay
from store import Store, StoreError


def join_run(db: str | None, run_ref: str, concurrency: int | None = None, backend: str | None = None,
             console: Console | None = None) -> int:
    """Evaluate the run's queued tasks until it ends; the number of tasks this worker stored."""
    console = console or Console()
    try:
        store = Store.open(db)
    except StoreError as err:
        raise EvolveError(str(err)) from None
    if db:  # trace suites live in the run's database; task processes inherit this
        os.environ["AKV_DB"] = db
    try:
        if not store.work.shared:
            raise EvolveError(f"--db: {store.display_url} is SQLite, which one process uses at a time: a SQLite "
                              "run is evaluated by its `akv evolve` process alone (evaluation.concurrency runs its "
                              "tasks side by side); to share a run between workers use PostgreSQL "
                              "(--db postgresql://...)")
        run = store.run(run_ref)
        if run.status != "running":
            console.print(f"run {run.name} is {run.status}: nothing to evaluate")
            return 0
        return _work(store, run, concurrency, backend, console)
    except StoreError as err:
        raise EvolveError(str(err)) from None
    finally:
        store.close()


def _work(store: Store, run, concurrency: int | None, backend: str | None, console: Console) -> int:
    config = stored_config(run.config)
    concurrency = concurrency or config.evaluation.concurrency
    backend = backend or config.backend
    display = TaskDisplay(console, labelled=True)  # one line per task (the evaluator says when a model loads)
    try:
        evaluator = HarnessEvaluator(config.suite, config.agent, backend, config.seed,
                                     recorded_version=run.suite_version, concurrency=concurrency, display=display,
                                     precision=config.precision, agent_mode=config.agent_mode,
                                     use_records=config.evaluation.use_records)
    except ValueError as err:
        display.close()
        raise EvolveError(str(err)) from None
    worker = None
    try:
        worker = Worker(store, run, evaluator, "worker", concurrency, config.evaluation.lease_s, backend)
        display.line(f"worker {worker.id} joined run {run.name} in {store.display_url} ({config.suite}, "
                     f"{config.agent} agent, backend {backend}, concurrency {concurrency})")
        waiting = {"said": False}

        def keep_going() -> bool:
            return store.run_status(run.id) == "running"

        def idle() -> None:
            if not waiting["said"]:
                display.line("waiting for queued tasks (the run's akv evolve process queues them)")
                waiting["said"] = True

        try:
            worker.serve(keep_going, idle)
        except KeyboardInterrupt:
            raise EvolveError(f"interrupted; {worker.done} tasks stored, the rest given back to the run", 130) \
                from None
        display.line(f"run {run.name} is {store.run_status(run.id)}; this worker stored {worker.done} tasks")
        return worker.done
    finally:
        if worker is not None:
            worker.close()
        evaluator.close()
        display.close()
