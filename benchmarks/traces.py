"""Traces: every policy on recorded agent traffic, side by side in one run (`akv bench traces`).

Each trace of a trace set is replayed under `full`, its hindsight oracle (each message dropped
right after its last use, made from the `full` run), the expert (`expert`: the paper's keep-12
window), upstream's `keep-12`, `rolling-3`, `turn-based`, `token-based`, Standard, Text Engineering
(the full-scale baselines `akv evolve` uses on a trace set: `TraceSuite.baselines`) and any
`--policy`, on the replay backend (the engine's own accounting, one fresh cache per trace). Per
policy: the mean fidelity score, the reuses lost out of all (`docs/traces.md`), the
cost per trace and its change against `full` and against the expert, and the seconds the
policy's scoring took with the requests it replayed (the scoring speed).

    python benchmarks/traces.py --suite NAME [--split all|train|heldout] [--policy P ...] [--json]
    python benchmarks/traces.py --synthetic 15     # 15 generated code-repair traces of 68 requests, up
                                                   # to ~160K prompt tokens each: the scoring speed

JSON: costs are USD per trace (`cost_usd`), as in the other benchmarks' JSON; the table shows cents.
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.common import format_table
from benchmarks.headroom import FULL, ORACLE, _built_suite, run_task_policies
from sandbox.traces.suite import TraceSuite

EXPERT = TraceSuite.baselines["expert"]
# Upstream's options, then every baseline `akv evolve` scores a trace set against (Standard, Text Engineering).
POLICIES = tuple(dict.fromkeys((FULL, EXPERT, "keep-12", "rolling-3", "turn-based", "token-based",
                                *TraceSuite.baselines.values())))
SPLITS = ("train", "heldout")


SYNTHETIC_STEPS, SYNTHETIC_CHARS = 67, 9000  # tool results of ~2.4K tokens: the last request ~160K tokens


@dataclass(frozen=True)
class Settings:
    suite: str | None
    split: str = "all"              # all, train or heldout
    extra: tuple[str, ...] = ()     # more policies (built-in names or .akvp files)
    seed: int = 0
    synthetic: int = 0              # > 0: that many generated long traces in a throwaway database

    def policies(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(POLICIES + self.extra))


def measure(settings: Settings, progress: Any = print) -> dict[str, Any]:
    """Every policy on every trace of the chosen split(s): per-policy totals and per-trace rows."""
    if settings.synthetic > 0:
        return _on_synthetic(settings, progress)
    if not settings.suite:
        raise ValueError("--suite: expected a trace set (or --synthetic N for generated long traces)")
    return _measure(settings, progress)


def _measure(settings: Settings, progress: Any) -> dict[str, Any]:
    from sandbox.runs.harness import select_tasks

    if settings.split not in ("all", *SPLITS):
        raise ValueError(f"--split: expected all, train or heldout, got {settings.split!r}")
    suite = _built_suite(settings.suite, settings.seed)
    if not hasattr(suite, "scored_reuses"):
        raise ValueError(f"--suite: {settings.suite!r} is not a trace set (see `akv traces list`)")
    splits = SPLITS if settings.split == "all" else (settings.split,)
    tasks = [(split, task.id) for split in splits for task in select_tasks(suite, split)]
    if not tasks:
        raise ValueError(f"--suite: {settings.suite!r} has no traces in {settings.split}")
    per_trace = []
    for number, (split, task_id) in enumerate(tasks, 1):
        started = time.perf_counter()
        runs = run_task_policies(settings.suite, split, task_id, settings.policies(), settings.seed)
        per_trace.append({"trace": task_id, "split": split, "reuses": suite.scored_reuses(task_id),
                          "results": {name: {**r.to_dict(), "reason": r.reason} for name, r in runs.results.items()},
                          "oracle_same_actions": runs.same_actions, "oracle_unavailable": runs.unavailable})
        progress(f"{settings.suite} trace {number}/{len(tasks)}: {task_id} in {time.perf_counter() - started:.1f} s")
    names = [*settings.policies(), ORACLE]
    return {"suite": settings.suite, "split": settings.split, "traces": len(per_trace),
            "requests": sum(t["results"][FULL]["n_requests"] for t in per_trace),
            "policies": [_totals(name, per_trace) for name in names if name in per_trace[0]["results"]],
            "per_trace": per_trace}


def _on_synthetic(settings: Settings, progress: Any) -> dict[str, Any]:
    """`measure` on generated long code-repair traces, stored in a throwaway database."""
    import os
    import tempfile

    from sandbox.traces.records import stored_of
    from store.repository import Store

    with tempfile.TemporaryDirectory(prefix="akv-traces-") as folder:
        url = f"sqlite:///{Path(folder) / 'synthetic.db'}"
        store = Store.open(url)
        store.traces.add("synthetic", [stored_of(synthetic_trace(f"long-{i}", i)) for i in range(settings.synthetic)])
        store.close()
        before = os.environ.get("AKV_DB")
        os.environ["AKV_DB"] = url
        try:
            return _measure(Settings("synthetic", "all", settings.extra, settings.seed), progress)
        finally:
            os.environ.pop("AKV_DB") if before is None else os.environ.__setitem__("AKV_DB", before)


def synthetic_trace(trace_id: str, seed: int) -> Any:
    """A long code-repair run: a file read per step, each result ~SYNTHETIC_CHARS of code-like text
    quoting a few identifiers of earlier results, so that use records and drops have work to do."""
    import random

    from sandbox.traces.model import Trace, with_requests

    rng = random.Random(seed)
    words = "value config handler returns parse token error line path data self item result".split()
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You repair code with the bash tool."},
                                      {"role": "user", "content": "The parser drops the last row. Fix it."}]
    names: list[str] = []
    for step in range(SYNTHETIC_STEPS):
        path = f"src/pkg_{step % 7}/module_{step}.py"
        quoted = rng.choice(names) if names and rng.random() < 0.3 else path
        messages.append({"role": "assistant", "content": f"Next: {quoted}.", "tool_calls": [{
            "id": f"call_{step}", "type": "function",
            "function": {"name": "bash", "arguments": json.dumps({"command": f"cat {path}"})}}]})
        names.append(f"handler_{seed}_{step}_{rng.randint(100, 999)}")
        body = " ".join(rng.choice(words) for _ in range(SYNTHETIC_CHARS // 7))
        messages.append({"role": "tool", "tool_call_id": f"call_{step}", "name": "bash",
                         "content": f"# {path}\ndef {names[-1]}(row):\n    {body}"})
    messages.append({"role": "assistant", "content": f"Fixed in {names[len(names) // 2]}."})
    return with_requests(Trace(trace_id, tuple(messages)))


def _totals(name: str, per_trace: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One policy over the traces: score, lost reuses, cost and its changes, scoring seconds."""
    rows = [t["results"][name] for t in per_trace]
    reuses = sum(t["reuses"] for t in per_trace)
    lost = sum(round((1.0 - r["score"]) * t["reuses"]) for r, t in zip(rows, per_trace))
    cost = sum(r["cost_usd"] for r in rows)
    full = sum(t["results"][FULL]["cost_usd"] for t in per_trace)
    expert = sum(t["results"][EXPERT]["cost_usd"] for t in per_trace) if EXPERT in per_trace[0]["results"] else 0.0
    seconds = sum(r["wall_s"] for r in rows)
    return {"policy": name, "score": round(sum(r["score"] for r in rows) / len(rows), 4),
            "lost_reuses": lost, "reuses": reuses, "errors": sum(r["status"] == "error" for r in rows),
            "cost_usd": round(cost / len(rows), 9),
            "vs_full_pct": round(100 * (cost - full) / full, 2) if full else None,
            "vs_expert_pct": round(100 * (cost - expert) / expert, 2) if expert else None,
            "seconds": round(seconds, 2), "requests": sum(r["n_requests"] for r in rows),
            "requests_per_s": round(sum(r["n_requests"] for r in rows) / seconds, 1) if seconds else None}


def render(figures: dict[str, Any]) -> str:
    header = ["policy", "score", "lost reuses", "¢/trace", "vs full", "vs expert", "errors", "s", "requests/s"]
    rows = [[p["policy"], p["score"], f"{p['lost_reuses']} of {p['reuses']}", f"{100 * p['cost_usd']:.3f}",
             _pct(p["vs_full_pct"]), _pct(p["vs_expert_pct"]), p["errors"], p["seconds"], p["requests_per_s"]]
            for p in figures["policies"]]
    diverged = [t["trace"] for t in figures["per_trace"] if not t["oracle_same_actions"]]
    failed = [(t["trace"], name, r["reason"]) for t in figures["per_trace"] for name, r in t["results"].items()
              if r["status"] == "error"]
    lines = [f"{figures['suite']} ({figures['split']}): {figures['traces']} traces, {figures['requests']} recorded "
             "requests, replay backend", format_table(header, rows)]
    if diverged:
        lines.append(f"oracle: the replay left the recording on {', '.join(diverged)}")
    lines += [f"error: trace {trace} under {name}: {reason}" for trace, name, reason in failed]
    return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1f}%"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite")
    parser.add_argument("--synthetic", type=int, default=0)
    parser.add_argument("--split", default="all")
    parser.add_argument("--policy", action="append", default=[])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    figures = measure(Settings(args.suite, args.split, tuple(args.policy), args.seed, args.synthetic),
                      progress=lambda text: print(text, file=sys.stderr))
    print(json.dumps(figures) if args.json else render(figures))


if __name__ == "__main__":
    main()
