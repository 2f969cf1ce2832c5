"""Trajectory shape: what the scripted agent's tool outputs are like and how long it needs them.

The suite's scripted agent runs a split under `full` (nothing dropped) on the replay backend; each
step's use record (AgentAction.used, the messages it read to decide) says when every tool output
is needed. Per tool: outputs per task, their size in tokens (the embedded model's tokenizer), the
share read only on the step they arrive, the share superseded (the same call answered again
later: a newer run of the same tests, a re-read of the same lines), and how many steps after
arriving an output is last read. Overall: the share of tool-output tokens read only on arrival,
and the outputs still needed ten steps or more after they arrived (long-range uses).

    python benchmarks/shape.py [--suite localswe] [--split heldout] [--limit N] [--json]
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from akv_stats.paired import percentile
from benchmarks.common import format_table

LONG_RANGE = 10  # steps between arrival and last use that make a use long-range


@dataclass(frozen=True)
class Output:
    """One tool output of a run: its tool, size, the steps it arrived and was last read, whether superseded."""

    task: str
    tool: str
    tokens: int
    arrived: int
    last_read: int
    superseded: bool
    edited_file: bool | None  # read_file: whether the agent ever edited that file (None for other tools)


class _Recorder:
    """The scripted agent, with each step's history length and use record kept."""

    def __init__(self, agent: Any) -> None:
        self.agent, self.name, self.steps = agent, agent.name, []

    def act(self, view: Any) -> Any:
        action = self.agent.act(view)
        if action.used is None:
            raise ValueError(f"the {self.name} agent does not record which messages it used")
        self.steps.append((len(view.messages), set(action.used)))
        return action


def outputs_of_task(suite: Any, task: Any) -> list[Output]:
    from sandbox.backends import open_backend
    from sandbox.backends.tokens import shared_tokenizer
    from sandbox.runs.harness import resolve_policy, run_task

    recorder = _Recorder(suite.scripted_agent(task))
    _, trajectory = run_task(task, suite, resolve_policy("full"), recorder, open_backend("replay"))
    history = list(trajectory.exchanges[-1].request.messages)
    return _outputs(task.id, history, recorder.steps, shared_tokenizer())


def _outputs(task_id: str, history: list[dict], steps: list[tuple[int, set[int]]], counter: Any) -> list[Output]:
    calls = {c["id"]: (c["function"]["name"], _canonical(c["function"].get("arguments")))
             for m in history if m.get("role") == "assistant" for c in m.get("tool_calls") or ()}
    edited = {json.loads(args).get("path") for name, args in calls.values() if name == "edit"}
    tool_messages = [(i, calls.get(m.get("tool_call_id"), (m.get("name") or "?", ""))) for i, m in enumerate(history)
                     if m.get("role") == "tool"]
    out = []
    for n, (i, (tool, args)) in enumerate(tool_messages):
        arrived = next((t for t, (length, _) in enumerate(steps) if length > i), len(steps))
        last = max((t for t, (_, used) in enumerate(steps) if i in used), default=arrived)
        superseded = any(call == (tool, args) for _, call in tool_messages[n + 1:])
        path = json.loads(args).get("path") if tool == "read_file" and args else None
        out.append(Output(task_id, tool, counter.count(history[i]), arrived, last, superseded,
                          path in edited if tool == "read_file" else None))
    return out


def _canonical(arguments: Any) -> str:
    try:
        return json.dumps(json.loads(arguments) if isinstance(arguments, str) else arguments, sort_keys=True)
    except (TypeError, ValueError):
        return str(arguments)


def summarize(outputs: list[Output], n_tasks: int) -> dict[str, Any]:
    by_tool: dict[str, list[Output]] = defaultdict(list)
    for o in outputs:
        by_tool[o.tool].append(o)
    total = sum(o.tokens for o in outputs) or 1
    tools = {}
    for tool, items in sorted(by_tool.items()):
        sizes, spans = [o.tokens for o in items], [o.last_read - o.arrived for o in items]
        reads = [o for o in items if o.edited_file is not None]
        tools[tool] = {
            "per_task": round(len(items) / n_tasks, 1), "tokens_median": round(percentile(sizes, 50)),
            "tokens_p90": round(percentile(sizes, 90)), "tokens_max": max(sizes), "token_share": sum(sizes) / total,
            "read_on_arrival_only": sum(s == 0 for s in spans) / len(items),
            "superseded": sum(o.superseded for o in items) / len(items),
            "last_read_after_median": round(percentile(spans, 50)), "last_read_after_max": max(spans),
            "files_never_edited": sum(not o.edited_file for o in reads) / len(reads) if reads else None,
        }
    long_range = [o.last_read - o.arrived for o in outputs if o.last_read - o.arrived >= LONG_RANGE]
    return {
        "tasks": n_tasks, "outputs": len(outputs), "tokens": total, "tools": tools,
        "token_share_read_on_arrival_only": sum(o.tokens for o in outputs if o.last_read == o.arrived) / total,
        "token_share_superseded": sum(o.tokens for o in outputs if o.superseded) / total,
        "long_range_share": len(long_range) / len(outputs) if outputs else 0.0,
        "long_range_after_median": round(percentile(long_range, 50)), "long_range_after_max": max(long_range, default=0),
    }


def run(suite_name: str, split: str, limit: int | None) -> dict[str, Any]:
    from akv_core.home import akv_home
    from sandbox.runs.harness import select_tasks
    from sandbox.suites import get_suite

    suite = get_suite(suite_name)
    suite.build(akv_home())
    tasks = select_tasks(suite, split, limit=limit)
    started = time.perf_counter()
    outputs = [o for task in tasks for o in outputs_of_task(suite, task)]
    return {"suite": suite_name, "split": split, **summarize(outputs, len(tasks)),
            "wall_s": round(time.perf_counter() - started, 1)}


def report(result: dict[str, Any]) -> str:
    rows = [[tool, f"{t['per_task']:.1f}", t["tokens_median"], t["tokens_p90"], t["tokens_max"], f"{100 * t['token_share']:.0f}%",
             f"{100 * t['read_on_arrival_only']:.0f}%", f"{100 * t['superseded']:.0f}%", t["last_read_after_median"],
             t["last_read_after_max"],
             "-" if t["files_never_edited"] is None else f"{100 * t['files_never_edited']:.0f}%"]
            for tool, t in result["tools"].items()]
    head = (f"shape: scripted agent on {result['suite']} {result['split']} under full (replay), "
            f"{result['tasks']} tasks, {result['outputs']} tool outputs, {result['tokens']:,} tokens; "
            f"{result['wall_s']} s")
    table = format_table(["tool", "per task", "tokens p50", "p90", "max", "of tokens", "read on arrival only",
                          "superseded", "last read after (p50)", "(max)", "file never edited"], rows)
    tail = (f"tokens read only on arrival: {100 * result['token_share_read_on_arrival_only']:.0f}%; "
            f"tokens superseded: {100 * result['token_share_superseded']:.0f}%; outputs read {LONG_RANGE}+ steps "
            f"after arriving: {100 * result['long_range_share']:.0f}% (median {result['long_range_after_median']:.0f}, "
            f"max {result['long_range_after_max']} steps)")
    return "\n".join([head, "", table, "", tail])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--suite", default="localswe")
    parser.add_argument("--split", default="heldout")
    parser.add_argument("--limit", type=int, default=None, help="the first N tasks of the split")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    args = parser.parse_args(argv)
    result = run(args.suite, args.split, args.limit)
    print(json.dumps(result) if args.json else report(result))


if __name__ == "__main__":
    main()
