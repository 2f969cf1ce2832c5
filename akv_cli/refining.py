"""What `akv proxy --refine` adds to the proxy process: the store as its live source, and the refiner
process beside it, started again when it dies.

The proxy itself (`akv_proxy/`) knows neither the store nor the refiner: it polls a `LiveSource`
off the request path. `StoreLiveSource` is that source: the set's latest lineage entry, what each
served policy's conversations cost (the refiner's measurements), the rounds by outcome and the
refiner's pid. A poll that fails drops the connection, so the next one opens it anew.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from typing import Any

from akv_cli.refine_settings import RefineSettings
from akv_cli.refiner import RefinerConfig, refiner_main
from akv_proxy.live import LiveState

RESTART_S = (5.0, 300.0)  # a refiner that died is started again after 5 s, doubling up to 5 min
log = logging.getLogger("akv.refine")


class RefinerProcess:
    """The refiner of one trace set, a child process, started again after it dies (with backoff); one
    asked to stop (SIGTERM: an exit status 0) is not."""

    def __init__(self, set_name: str, db_url: str, settings: RefineSettings) -> None:
        self.config = RefinerConfig(set_name, db_url, settings, os.getpid())
        self.process: Any = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._supervise, name="akv-refiner-supervisor", daemon=True)

    @property
    def pid(self) -> int | None:
        """The refiner's pid while it runs."""
        process = self.process
        return process.pid if process is not None and process.is_alive() else None

    def start(self) -> None:
        self._spawn()
        self._thread.start()

    def _spawn(self) -> None:
        self.process = multiprocessing.get_context("spawn").Process(
            target=refiner_main, args=(self.config,), name=f"akv-refiner-{self.config.set_name}")
        self.process.start()
        log.info("refiner of trace set %s started (pid %d)", self.config.set_name, self.process.pid)

    def _supervise(self) -> None:
        delay = RESTART_S[0]
        while not self._stopping.is_set():
            self.process.join(1.0)
            if self.process.is_alive() or self._stopping.is_set():
                continue
            code = self.process.exitcode
            if code == 0:  # it was asked to stop (SIGTERM)
                log.warning("refiner of trace set %s stopped; the proxy serves on, refining again when it is "
                            "started again", self.config.set_name)
                return
            how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit status {code}"
            log.warning("refiner of trace set %s ended (%s); starting it again in %g s (the live policy is "
                        "unchanged)", self.config.set_name, how, delay)
            if self._stopping.wait(delay):
                return
            self._spawn()
            delay = min(delay * 2, RESTART_S[1])

    def stop(self) -> None:
        """End the refiner (its evolution ends with it) and stop restarting it."""
        self._stopping.set()
        process = self.process
        if process is not None and process.is_alive():
            process.terminate()
            process.join(10.0)
            if process.is_alive():
                process.kill()
                process.join()


class StoreLiveSource:
    """The live policy of trace set `set_name` in the store at `db_url`, for the proxy to poll."""

    def __init__(self, db_url: str, set_name: str, refiner: RefinerProcess | None = None) -> None:
        self.db_url, self.set_name, self.refiner = db_url, set_name, refiner
        self._store: Any = None
        self._lock = threading.Lock()

    def start(self, name: str, text: str) -> tuple[Any, bool]:
        """(the live lineage entry, whether `text` is a new start) for a proxy started with policy `text`."""
        with self._lock:
            return self._open().live.start(self.set_name, name, text)

    def poll(self) -> LiveState:
        with self._lock:
            try:
                live = self._open().live
                entry = live.live(self.set_name)
                if entry is None:
                    raise LookupError(f"trace set {self.set_name!r} has no live policy in the store")
                savings = tuple(live.totals(self.set_name))
                rounds = live.round_outcomes(self.set_name)
            except Exception:
                self._close()
                raise
        return LiveState(entry.id, entry.name, entry.text, entry.kind, savings, rounds,
                         self.refiner.pid if self.refiner is not None else None)

    def text_of(self, name: str) -> str | None:
        with self._lock:
            try:
                entries = self._open().live.lineage(self.set_name)
            except Exception:  # a restarted proxy without its store: conversations under way take the live policy
                self._close()
                return None
        return next((e.text for e in reversed(entries) if e.name == name), None)

    def _open(self) -> Any:
        if self._store is None:
            from store import Store

            self._store = Store.open(self.db_url)
        return self._store

    def _close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    def close(self) -> None:
        with self._lock:
            self._close()
