"""What the benchmarks share: recorded scripted-agent runs, ratios and a text table (statistics: akv_stats)."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sandbox.tables import plain_table

# The paper's baselines and our policy, at the 8K-context scale of the embedded model.
AKV, STANDARD, TEXT_ENGINEERING = "expert-8k", "standard-8k", "text-engineering-8k"
SUITES = ("localcomp", "localswe")


def cpu_model() -> str:
    """The CPU's model name as the kernel reports it (benchmark headers)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def present_suites(wanted: Sequence[str]) -> tuple[list[str], list[str]]:
    """(suites that load, notes on the ones left out): a suite still being written is skipped, not fatal."""
    from sandbox.suites import get_suite

    present, notes = [], []
    for name in wanted:
        try:
            get_suite(name)
        except ImportError as err:
            notes.append(f"{name} left out: {err}")
            continue
        present.append(name)
    if not present:
        raise ValueError(f"none of the suites {', '.join(wanted)} can be loaded: {'; '.join(notes)}")
    return present, notes


def run_split(suite: str, split: str, policy: str, *, limit: int | None = None, max_steps: int | None = None,
              out_dir: Path | None = None) -> Any:
    """The harness's RunReport for the scripted agent on the replay backend (no model)."""
    from sandbox.runs.harness import RunLimits, run_tasks

    limits = RunLimits() if max_steps is None else RunLimits(max_steps=max_steps)
    return run_tasks(suite, split, policy, agent="scripted", backend="replay", limit=limit,
                     out_dir=out_dir, limits=limits)


def ratio(numerator: float, denominator: float) -> float | None:
    """numerator / denominator, or None when the denominator is zero (no ratio to report)."""
    return round(numerator / denominator, 3) if denominator else None


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain fixed-width table (sandbox.tables.plain_table): first column left-aligned, the others
    right-aligned, figures formatted by `_cell`."""
    return plain_table([str(c) for c in header], [[_cell(c) for c in row] for row in rows])


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 100 else f"{value:,.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def verdict(value: float | None, target: float) -> str:
    """'met' / 'missed' for a ratio that should reach `target`; '-' when there is no ratio."""
    if value is None:
        return "-"
    return "met" if value >= target else "missed"


def at_once(tasks: Sequence[Callable[[], None]], name: str = "worker") -> float:
    """Run every task on a thread of its own, all released together; wall seconds until the last one ends."""
    start = threading.Barrier(len(tasks) + 1)

    def body(task: Callable[[], None]) -> None:
        start.wait()
        task()

    threads = [threading.Thread(target=body, args=(task,), name=f"{name}-{i}") for i, task in enumerate(tasks)]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    return time.perf_counter() - began
