"""The refiner of `akv proxy --refine`: a process of its own that evolves on the proxy's recorded
traffic and promotes a candidate only when the champion rule crowns it over the live policy.

The proxy records; the refiner, started by the proxy (`refining.py`) at nice NICE, never touches
a request. Every CHECK_S seconds it reads the trace set's index from the store. A conversation
no request has extended for `idle` seconds is finished. Finished conversations are measured
(`sandbox/traces/savings.py`: replayed under the policy that served them, the expert and `full`)
at most every SAVINGS_EVERY_S. When `every` new finished conversations have come since the last
round (or `period` seconds have passed with at least one), a round begins:

1. the latest `window` finished conversations are frozen as the trace set `NAME.rN`
   (`sandbox/traces/window.py`), split train / held-out as every trace suite is (`split_key`);
2. `akv evolve` runs on it as run `NAME.rN` (its defaults for trace sets, with the refiner's
   budget and proposers when set), in a child process stopped after `timeout` seconds;
3. the run's champion (crowned against the expert) is judged against the live policy on the same
   held-out traces (`evolve/promotion.py`); crowned there too, it is promoted: one row in the
   store, checked against the live entry it was judged against (a rollback meanwhile wins).

A failing or timed-out evolution, a champion that is not crowned, a policy a person rolled back
before, or `dry_run` change nothing; each round's outcome is stored with the figures and written
beside the run's report. The refiner may die at any moment (kill -9): the proxy records the
traffic, the live policy changes only by that one row, and the next refiner ends the round it
finds running as interrupted.
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Mapping, Sequence

from akv_cli.refine_settings import RefineSettings
from akv_proxy.recorder import first_line

CHECK_S = 2.0            # how often the trace set's index is read
SAVINGS_EVERY_S = 30.0   # finished conversations are measured at most this often (and before each round)
MEASURE_BATCH = 200      # conversations measured in one pass at most
KEPT_WINDOWS = 3         # the frozen windows of the latest rounds are kept; older ones are deleted
NICE = 10                # the refiner and its evolutions yield the CPU to the proxy and the upstream
STOP_GRACE_S = 10.0
log = logging.getLogger("akv.refine")


@dataclass(frozen=True)
class RefinerConfig:
    """What the refiner process is started with."""

    set_name: str
    db_url: str
    settings: RefineSettings
    parent_pid: int


def round_name(set_name: str, number: int) -> str:
    """The run, and the frozen window's trace set, of round `number`: `NAME.rN`."""
    return f"{set_name}.r{number}"


def refiner_main(config: RefinerConfig) -> None:
    """The refiner process (a `multiprocessing` target): refine until the proxy ends."""
    from akv_core.server.runner import log_to_stderr

    os.nice(NICE)
    os.environ["AKV_DB"] = config.db_url  # the frozen windows are suites of this store, for every process
    log_to_stderr("info")
    exit_with_parent(config.parent_pid)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # asked to stop: a clean exit, not started again
    try:
        Refiner(config).run_forever()
    except KeyboardInterrupt:
        return


def exit_with_parent(parent_pid: int) -> None:
    """End this process as soon as its parent is gone (a proxy or a refiner killed with -9 leaves no orphan)."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)
    threading.Thread(target=watch, name="akv-parent-watch", daemon=True).start()


class Refiner:
    """One trace set's refinement loop (module docstring)."""

    def __init__(self, config: RefinerConfig) -> None:
        from store.schema import utcnow

        self.config, self.settings, self.name = config, config.settings, config.set_name
        self.store: Any = None
        self.started = utcnow()
        self.measured_at = float("-inf")
        self.said: str | None = None  # the last waiting or failure note, logged once
        self.unfinished: tuple[Any, ...] | None = None  # a round's outcome the store did not take yet
        self.split_memo: dict[tuple[str, datetime], str | None] = {}  # (trace id, last change): its split

    # ---- the loop ----------------------------------------------------------------------------------
    def run_forever(self) -> None:
        from sqlalchemy.exc import SQLAlchemyError

        from store import StoreError

        first = True
        while True:
            try:
                if first:
                    self._interrupted()
                    first = False
                self.cycle()
            except (StoreError, SQLAlchemyError) as err:
                self._say(f"the store does not answer ({type(err).__name__}: {first_line(err)}); trying again")
                self._close_store()
            time.sleep(CHECK_S)

    def _interrupted(self) -> None:
        """End the rounds a dead refiner left running, and their runs (a later round takes their traffic)."""
        detail = "its refiner ended before it did"
        for stale in self._store().live.interrupt_running(self.name, detail):
            log.warning("round %d (%s) was interrupted: %s", stale.number, stale.run_name, detail)
            self._stopped(stale.run_name, f"interrupted: {detail}")

    def cycle(self) -> None:
        """Measure what is due, and begin a round when enough new traffic has finished."""
        from sandbox.traces.window import finished
        from store.schema import utcnow

        store = self._store()
        if self.unfinished is not None:
            store.live.finish_round(*self.unfinished)
            self.unfinished = None
        now = utcnow()
        done = finished(store.traces.index(self.name), self.settings.idle, now)
        if time.monotonic() - self.measured_at >= SAVINGS_EVERY_S:
            self.measure(done)
        if self._due(done, now):
            self.refine(done)

    def _due(self, done: Sequence[Any], now: datetime) -> bool:
        rounds = [r for r in self._store().live.rounds(self.name) if r.status != "interrupted"]
        last = rounds[-1] if rounds else None  # an interrupted round's traffic is new to the next one
        through = last.through if last is not None else None
        new = [e for e in done if through is None or e.updated_at > through]
        since = last.started_at if last is not None else self.started
        period = self.settings.period
        return len(new) >= self.settings.every or (period is not None and bool(new)
                                                   and (now - since).total_seconds() >= period)

    # ---- a round -----------------------------------------------------------------------------------
    def refine(self, done: Sequence[Any]) -> None:
        """One round on the latest finished conversations (module docstring)."""
        from sandbox.traces.window import freeze_window

        store = self._store()
        latest = list(done[-self.settings.window:])
        splits = self._splits(latest)
        if min(splits.count("train"), splits.count("heldout")) < 2:
            self._say(f"waiting for traffic: the latest {len(latest)} finished conversations hold "
                      f"{splits.count('train')} train and {splits.count('heldout')} held-out ones (2 of each needed)")
            return
        live = store.live.live(self.name)
        if live is None:
            self._say(f"waiting: trace set {self.name!r} has no live policy yet (the proxy sets it when it starts)")
            return
        self.measure(done)
        round_ = store.live.begin_round(self.name, lambda n: round_name(self.name, n), len(latest),
                                        max(e.updated_at for e in done), live.id)
        try:
            window = freeze_window(store, self.name, round_.run_name, latest)
            for trace_id, reason in window.left_out:
                log.warning("round %d: conversation %s left out of the window: %s", round_.number, trace_id, reason)
            log.info("round %d: evolving on %d conversations (%d train, %d held-out) as run %s; live policy %s",
                     round_.number, len(window.train) + len(window.heldout), len(window.train), len(window.heldout),
                     round_.run_name, live.name)
            status, detail, figures = self._evolve_and_judge(round_, live)
        except Exception as err:  # a round that breaks changes nothing, and is stored as failed with why
            status, detail, figures = "failed", f"{type(err).__name__}: {first_line(err)}", {}
        self.unfinished = (round_.id, status, detail, figures)  # taken by the next cycle if the store fails now
        store.live.finish_round(*self.unfinished)
        self.unfinished = None
        self.said = None
        log.info("round %d: %s: %s", round_.number, status.replace("_", " "), detail)
        self._report(round_, status, detail, figures)
        self._prune_windows()

    def _splits(self, latest: Sequence[Any]) -> list[str]:
        """The split of each conversation of `latest` (`window.splits`), each read from the store once
        per change: a refiner waiting for a held-out side asks again every CHECK_S."""
        from sandbox.traces.window import splits

        missing = [e for e in latest if (e.trace_id, e.updated_at) not in self.split_memo]
        found = splits(self._store(), self.name, [e.trace_id for e in missing]) if missing else {}
        self.split_memo = {(e.trace_id, e.updated_at): self.split_memo.get((e.trace_id, e.updated_at))
                           or found.get(e.trace_id) for e in latest}
        return [side for side in self.split_memo.values() if side is not None]

    def _evolve_and_judge(self, round_: Any, live: Any) -> tuple[str, str, dict[str, Any]]:
        """(status, detail, figures) of a round whose window is frozen."""
        from evolve.promotion import judge_against_live
        from store import LiveChanged

        store = self._store()
        failure = self._evolve(round_.run_name)
        if failure is not None:
            return *failure, {}
        judgement = judge_against_live(store, round_.run_name, live.name, live.text)
        figures = {**judgement.figures, "reason": judgement.reason}
        if not judgement.promotable:
            return "kept", judgement.reason, figures
        if judgement.text in store.live.rolled_back(self.name):
            return "kept", f"{judgement.label} was rolled back once; it is not promoted again ({judgement.reason})", \
                figures
        if self.settings.dry_run:
            return "dry_run", f"would promote {judgement.label}: {judgement.reason}", figures
        try:
            note = f"crowned over {live.name} and the expert on {judgement.figures['heldout']} held-out conversations"
            entry = store.live.promote(self.name, live.id, judgement.label, judgement.text, round_.run_name,
                                       judgement.policy_id, figures, note)
        except LiveChanged as err:
            return "kept", str(err), figures
        return "promoted", f"{entry.name} is live (entry #{entry.id}): {judgement.reason}", figures

    def _evolve(self, run_name: str) -> tuple[str, str] | None:
        """Run `akv evolve` on the window in a child process; (status, detail) when it did not finish well."""
        from akv_core.home import data_path

        log_path = data_path("refine", self.name, f"{run_name}.log")
        overrides = {"suite": run_name, "db": self.config.db_url, "run_name": run_name,
                     **self.settings.evolve_overrides()}
        process = multiprocessing.get_context("spawn").Process(
            target=evolution_main, args=(overrides, str(log_path), os.getpid()), name=f"akv-evolve-{run_name}")
        process.start()
        deadline = time.monotonic() + self.settings.timeout
        while process.is_alive() and time.monotonic() < deadline:
            process.join(min(CHECK_S * 5, max(deadline - time.monotonic(), 0.0)))
            if process.is_alive() and time.monotonic() - self.measured_at >= SAVINGS_EVERY_S:
                self._measure_now()
        if process.is_alive():
            _stop(process)
            self._stopped(run_name, f"timed out after {self.settings.timeout:g} s (akv proxy --refine-timeout)")
            return "timed_out", f"the evolution ran past {self.settings.timeout:g} s and was stopped (log: {log_path})"
        if process.exitcode != 0:
            return "failed", (f"akv evolve ended with status {process.exitcode}: {_last_error(log_path)} "
                              f"(log: {log_path})")
        return None

    def _stopped(self, run_name: str, detail: str) -> None:
        store = self._store()
        if run_name in store.run_names():
            store.set_run_status(store.run(run_name).id, "stopped", detail)

    # ---- what served conversations cost ------------------------------------------------------------
    def _measure_now(self) -> None:
        from sandbox.traces.window import finished
        from store.schema import utcnow

        self.measure(finished(self._store().traces.index(self.name), self.settings.idle, utcnow()))

    def measure(self, done: Sequence[Any]) -> None:
        """Replay the finished conversations not measured at their present content (a batch at most)."""
        from sandbox.traces.formats import as_tool_calls
        from sandbox.traces.records import trace_of
        from sandbox.traces.savings import bad_content, conversation_cost, served_policy, skipped
        from sandbox.traces.suite import TraceSuite

        self.measured_at = time.monotonic()
        store = self._store()
        known = store.live.measured(self.name)
        todo = {e.trace_id: e.digest for e in done if known.get(e.trace_id) != e.digest}
        todo = dict(list(todo.items())[-MEASURE_BATCH:])
        if not todo:
            return
        context = [e.trace_id for e in done[-self.settings.window:]]
        traces = {t.trace_id: trace_of(t) for t in store.traces.get(self.name, list(dict.fromkeys([*context, *todo])))}
        suite = TraceSuite(self.name, self.config.db_url, traces=[as_tool_calls(t) for t in traces.values()])
        policies = _PolicyTexts({e.name: e.text for e in store.live.lineage(self.name)})
        costs = []
        for trace_id, digest in todo.items():
            if trace_id not in traces:  # deleted since the index was read
                continue
            trace = as_tool_calls(traces[trace_id])
            name = served_policy(trace) or "unknown"
            policy = policies.compiled(name)
            why = bad_content(trace) or (None if policy is not None else
                                         f"the text of policy {name!r} is unknown (not in the lineage, not a built-in)")
            cost = skipped(trace, name, why) if why else conversation_cost(suite, trace, name, policy)
            if cost.skipped:
                log.warning("conversation %s skipped: %s", trace_id, cost.skipped)
            costs.append(dataclasses.replace(cost, digest=digest))
        store.live.save_costs(self.name, costs)

    # ---- reports, windows, the store ---------------------------------------------------------------
    def _report(self, round_: Any, status: str, detail: str, figures: Mapping[str, Any]) -> None:
        """The round's outcome and what each served policy saved, beside the run's evolution report."""
        from akv_core.home import data_path

        from akv_cli.proxy_lineage import savings_text

        lines = [f"refinement round {round_.number} of trace set {self.name}: {status.replace('_', ' ')}", detail, ""]
        for reference in ("vs_expert", "vs_live"):
            verdict = figures.get(reference) or {}
            if verdict:
                lines.append(f"{reference.replace('_', ' ')}: cost {verdict.get('cost_percent', 0):+.1f}% "
                             f"(Holm p {verdict.get('cost_p_holm', 1):.3g}), "
                             f"score {100 * verdict.get('score_delta', 0):+.1f} points "
                             f"(lower bound {100 * verdict.get('score_low', 0):+.1f}), "
                             f"{verdict.get('n', 0)} held-out conversations")
        lines += ["", savings_text(self._store().live.totals(self.name))]
        path = data_path("reports", round_.run_name, "refinement.txt")
        try:
            path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        except OSError as err:  # the round is stored already; the file is a copy for reading
            log.warning("round %d: cannot write %s: %s", round_.number, path, err.strerror)

    def _prune_windows(self) -> None:
        store = self._store()
        names = set(store.traces.names())
        for old in store.live.rounds(self.name)[:-KEPT_WINDOWS]:
            if old.run_name in names:
                store.traces.delete(old.run_name)

    def _store(self) -> Any:
        if self.store is None:
            from store import Store

            self.store = Store.open(self.config.db_url)
            if self.said is not None and self.said.startswith("the store"):
                log.info("the store answers again")
                self.said = None
        return self.store

    def _close_store(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None

    def _say(self, note: str) -> None:
        if note != self.said:
            log.warning("%s", note)
            self.said = note


class _PolicyTexts:
    """Served policy names to compiled policies: the lineage's texts, else a built-in's (never a file)."""

    def __init__(self, texts: Mapping[str, str]) -> None:
        self.texts = texts
        self.found: dict[str, Any] = {}

    def compiled(self, name: str) -> Any:
        from policy_dsl import PolicyError, compile_policy, load_policy, parse
        from policy_dsl.library import builtin_names

        if name not in self.found:
            try:
                if name in self.texts:
                    self.found[name] = compile_policy(parse(self.texts[name]), name=name)
                else:
                    self.found[name] = load_policy(name) if name in builtin_names() else None
            except PolicyError:
                self.found[name] = None
        return self.found[name]


def evolution_main(overrides: Mapping[str, Any], log_path: str, parent_pid: int) -> None:
    """One evolution (a `multiprocessing` target): `akv evolve` with `overrides`, its output in `log_path`."""
    from rich.console import Console

    from evolve.command import EvolveError, run_command

    exit_with_parent(parent_pid)
    with open(log_path, "a", encoding="utf-8", buffering=1) as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        try:
            run_command(None, dict(overrides), False, console=Console(file=sys.stdout, width=120))
        except EvolveError as err:
            print(f"error: {err}", flush=True)
            sys.exit(err.exit_code)


def _stop(process: Any) -> None:
    process.terminate()
    process.join(STOP_GRACE_S)
    if process.is_alive():
        process.kill()
        process.join()


def _last_error(log_path: Any) -> str:
    """The last `error:` line of an evolution's log, else its last line (a traceback's exception)."""
    try:
        lines = [line for line in open(log_path, encoding="utf-8").read().splitlines() if line.strip()]
    except OSError:
        return "(no log)"
    return next((line for line in reversed(lines) if line.startswith("error:")), lines[-1] if lines else "(empty log)")


