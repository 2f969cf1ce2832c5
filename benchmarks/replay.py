"""Replay accounting throughput on recorded trajectories (a benchmark, not a test).

Records scripted-agent trajectories of localcomp's train split under several policies with the
replay backend, reads them back from their JSONL files, and then measures side by side in one run:

- accounting: `CacheSimulator.request` on pre-rendered requests (the per-request work evolution
  repeats for every candidate), one fresh simulator per trajectory;
- replay backend: `ReplayBackend.complete` on the full requests (rendering through the
  tokenizer's per-message memo, then accounting), as the harness calls it, without the task
  prefix memo and then with every request a memo hit (re-scoring the same trajectories).

Target: at least 10,000 requests of accounting per second. Each rate is given per wall-clock
second (the target) and per CPU second of this process (steadier on a shared machine: other
processes' turns do not count).

    python benchmarks/replay.py [--tasks 10] [--repeat 5] [--json]      # or: akv bench replay ...
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import `benchmarks` and the packages from this checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import tempfile
import time
from typing import Any, Callable

POLICIES = ("full", "expert", "standard-8k")
TARGET_PER_S = 10_000


def record(out_dir: Path, tasks: int) -> list[list[Any]]:
    """Run the scripted agent on replay under each policy; read back each trajectory's requests."""
    from sandbox.runs.harness import run_tasks
    from sandbox.runs.trajectory import read_trajectory

    for policy in POLICIES:
        run_tasks("localcomp", "train", policy, limit=tasks, out_dir=out_dir / policy)
    return [[r.request for r in read_trajectory(path)[1]]
            for path in sorted(out_dir.glob("*/trajectories/*.jsonl"))]


def measure(tasks: int = 10, repeat: int = 5) -> dict[str, Any]:
    from akv_core.cache.simulator import CacheSimulator
    from sandbox.backends.replay import DEFAULT_KV_TOKENS, ReplayBackend, TaskPrefixMemo
    from sandbox.backends.tokens import shared_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        trajectories = record(Path(tmp), tasks)
    tokenizer = shared_tokenizer()
    rendered = [[(tokenizer.render(r.messages, list(r.tools) or None), r.api_fields()) for r in t]
                for t in trajectories]
    n_requests = sum(len(t) for t in trajectories)
    n_tokens = sum(len(x.token_ids) for t in rendered for x, _ in t)

    def accounting() -> None:
        for trajectory in rendered:
            simulator = CacheSimulator(DEFAULT_KV_TOKENS)
            for prompt, fields in trajectory:
                simulator.request(prompt, fields.get("drop_message"), fields.get("reposition"))

    def replay_backend(backend: ReplayBackend) -> Callable[[], None]:
        def run() -> None:
            for trajectory in trajectories:
                backend.start_task()
                for request in trajectory:
                    backend.complete(request)
        return run

    acct_wall, acct_cpu = _timed(accounting, repeat)
    cold_wall, cold_cpu = _timed(replay_backend(ReplayBackend(memo=None)), repeat)
    warm = replay_backend(ReplayBackend(memo=TaskPrefixMemo()))
    warm()  # re-scoring the same trajectories: every request is a memo hit
    warm_wall, warm_cpu = _timed(warm, repeat)
    per_pass = n_requests
    accounting_rate = per_pass / acct_wall
    return {
        "trajectories": len(trajectories), "requests": n_requests, "prompt_tokens": n_tokens,
        "repeat": repeat, "policies": list(POLICIES),
        "accounting_requests_per_s": round(accounting_rate),
        "accounting_requests_per_cpu_s": round(per_pass / acct_cpu),
        "replay_backend_requests_per_s": round(per_pass / cold_wall),
        "replay_backend_requests_per_cpu_s": round(per_pass / cold_cpu),
        "replay_backend_memo_hit_requests_per_s": round(per_pass / warm_wall),
        "replay_backend_memo_hit_requests_per_cpu_s": round(per_pass / warm_cpu),
        "target_requests_per_s": TARGET_PER_S, "meets_target": accounting_rate >= TARGET_PER_S,
        "meets_target_per_cpu_s": per_pass / acct_cpu >= TARGET_PER_S,
    }


def _timed(work: Callable[[], None], repeat: int) -> tuple[float, float]:
    """Best-of-`repeat` seconds per pass, wall clock and this process's CPU time.

    On a shared machine the wall clock also counts other processes' turns; CPU time does not.
    """
    walls, cpus = [], []
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        work()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return min(walls), min(cpus)


PATHS = (("accounting (pre-rendered)", "accounting"),
         ("replay backend (render + accounting)", "replay_backend"),
         ("replay backend, every request a memo hit", "replay_backend_memo_hit"))


def render(figures: dict[str, Any]) -> str:
    """The figures as a table: each path per wall-clock and per CPU second, against the target."""
    from benchmarks.common import format_table, ratio

    target = figures["target_requests_per_s"]
    rows = [[label, figures[f"{name}_requests_per_s"], figures[f"{name}_requests_per_cpu_s"],
             ratio(figures[f"{name}_requests_per_s"], target)] for label, name in PATHS]
    verdict = {True: "met", False: "missed"}
    return "\n".join([
        f"replay: {figures['trajectories']} trajectories, {figures['requests']:,} requests, "
        f"{figures['prompt_tokens']:,} prompt tokens, best of {figures['repeat']}",
        format_table(["path", "requests/s", "per CPU s", "x target"], rows),
        f"target {target:,} requests/s of accounting: {verdict[figures['meets_target']]} per wall-clock second, "
        f"{verdict[figures['meets_target_per_cpu_s']]} per CPU second"])


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    """Parse `argv` (the command line when None), measure, print a table or one JSON object."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=_positive, default=10, help="localcomp train tasks per policy")
    parser.add_argument("--repeat", type=_positive, default=5, help="passes over all trajectories (the best counts)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args(argv)
    figures = measure(args.tasks, args.repeat)
    print(json.dumps(figures) if args.json else render(figures))


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


if __name__ == "__main__":
    main()
