"""The one progress display of long work: tasks done, running and failed, an ETA, and what is happening.

On a terminal it is a live line (rich) with lines printed above it; anywhere else (a pipe, a log
file, CI) it prints one plain line per step instead, never a control character. `akv run` and
`akv evolve` use it; a command that loads a model says so through `phase` before the load starts.

Counts come either from the tasks this process runs (`started` / `finished`, callable from lane
threads) or, for a run shared by several workers, from the database (`counts`).
"""
from __future__ import annotations

import threading
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

FAILED = ("error",)  # result statuses counted as failed


class TaskDisplay:
    """`task_lines`: a line per finished task (`akv run`); without, one line per batch off a terminal (`akv evolve`).

    `labelled`: each task's line starts with its batch's label and no batch gets a line of its own
    (`akv worker`, whose batches are its leases of a task or a few, not a policy's whole split).
    """

    def __init__(self, console: Console | None = None, live: bool | None = None, task_lines: bool = True,
                 labelled: bool = False) -> None:
        self.console = console or Console(stderr=True)
        self.live = self.console.is_terminal if live is None else live
        self.task_lines = task_lines
        self.labelled = labelled
        self._lock = threading.Lock()
        self._bar: Progress | None = None
        self._bar_id: Any = None
        self.label, self.total = "", 0
        self.done = self.running = self.failed = 0
        self._since = time.perf_counter()

    # ---- what is happening -------------------------------------------------------------
    def phase(self, text: str) -> None:
        """A step that takes a while with no tasks to count (loading a model, validating)."""
        self.line(f"{text} ...")

    def line(self, text: str) -> None:
        """A line of output above the live display (or on its own off a terminal)."""
        with self._lock:
            self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    # ---- counting tasks ----------------------------------------------------------------
    def begin(self, total: int, label: str) -> None:
        with self._lock:
            self.label, self.total = label, total
            self.done = self.running = self.failed = 0
            self._since = time.perf_counter()
            if self.live:
                if self._bar is None:
                    self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                         TextColumn("{task.fields[status]}"), console=self.console,
                                         transient=True)
                    self._bar.start()
                if self._bar_id is not None:
                    self._bar.remove_task(self._bar_id)
                self._bar_id = self._bar.add_task(label, total=total, status=self.status())
            elif self.task_lines and not self.labelled:
                self.console.print(f"{label}: {total} task{'s' if total != 1 else ''}", markup=False,
                                   highlight=False, soft_wrap=True)

    def started(self, _job: Any = None) -> None:
        with self._lock:
            self.running += 1
            self._refresh()

    def finished(self, result: Any) -> None:
        """A task's result: counted, and one line (its id, status, score, cost, time)."""
        with self._lock:
            self.running = max(0, self.running - 1)
            self.done += 1
            self.failed += result.status in FAILED
            text = f"{self.label}: {task_line(result)}" if self.labelled else task_line(result)
            if self.task_lines and (self.live or self.labelled):
                self.console.print(text, markup=False, highlight=False, soft_wrap=True)
            elif not self.live and self.task_lines:
                self.console.print(f"[{self.done}/{self.total}] {text}  ({self.status()})", markup=False,
                                   highlight=False, soft_wrap=True)
            elif not self.live and self.done == self.total:
                self.console.print(f"{self.label}: {self.done}/{self.total} tasks ({self.status()})", markup=False,
                                   highlight=False, soft_wrap=True)
            self._refresh()

    def counts(self, done: int, running: int, failed: int) -> None:
        """Counts from elsewhere (a shared run's work in the database); a line off a terminal when they change."""
        with self._lock:
            changed = (done, running, failed) != (self.done, self.running, self.failed)
            self.done, self.running, self.failed = done, running, failed
            if self.live:
                self._refresh()
            elif changed and (self.task_lines or done >= self.total):
                self.console.print(f"{self.label}: {self.done}/{self.total} ({self.status()})", markup=False,
                                   highlight=False, soft_wrap=True)

    def status(self) -> str:
        """`2 running, 0 failed, ETA 14 s`: the ETA from the rate so far (none before the first result)."""
        elapsed = time.perf_counter() - self._since
        left = max(0, self.total - self.done)
        eta = f"ETA {_duration(elapsed / self.done * left)}" if self.done and left else (
            "ETA -" if left else f"done in {_duration(elapsed)}")
        return f"{self.running} running, {self.failed} failed, {eta}"

    def _refresh(self) -> None:
        if self._bar is not None and self._bar_id is not None:
            self._bar.update(self._bar_id, completed=self.done, status=self.status())

    def close(self) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.stop()
                self._bar = self._bar_id = None

    def __enter__(self) -> TaskDisplay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def task_line(result: Any) -> str:
    from sandbox.runs.cost import cents

    line = (f"{result.task_id}  {result.status:<9} score={result.score:.2f}  requests={result.n_requests}  "
            f"cost={cents(result.cost_usd)}¢  {result.wall_s:.1f}s")
    reason = getattr(result, "reason", None) or getattr(result, "error", None)
    return line + (f"  ({reason})" if reason else "")


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"
