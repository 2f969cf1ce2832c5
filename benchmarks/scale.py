"""Evaluation at scale, measured side by side in one run: `python benchmarks/scale.py` (`akv bench scale`).

1. **Workers.** Replay evaluations per second with 1 and 2 `akv worker` processes sharing a run
   through a throwaway PostgreSQL cluster: the same work each time (localcomp train tasks under
   several built-in policies), queued in one transaction only once every worker has joined, and
   timed from then until the last result is stored. Each level gets a fresh database. Beside the
   wall clock, the CPU seconds over the same window of the workers, of the PostgreSQL server and of
   this process (read from /proc): CPU per evaluation does not depend on what else the machine runs.
2. **Concurrent tasks.** Tasks per second of the `llm` agent against `akv serve` (the embedded
   SmolLM2 on the CPU) at concurrency 1, 4 and 8: the same tasks and limits, a fresh server for each
   level (so that no level finds the prefixes of another cached; each is warmed by one request that
   shares nothing with the tasks, and this process by the same tasks on replay, before the clock
   starts, which it does once the server's start-up has faded from its idle-core reading). The
   small model answers at its first step, so these tasks are one prefill-bound request each.
3. **Multi-step tasks** (`multistep`): the same levels with the scripted agent's trajectories (its
   requests, several per task, growing histories under the policy), while the server decodes
   `reply_tokens` tokens for every request. The requests are the same at every level whatever the
   model writes, so the levels do exactly the same work, and the decode that batching serves is real.
4. **Per request.** From those runs: prompt tokens computed and cached per request, tokens the
   server decoded (its `/metrics`), seconds per request, and the server's CPU seconds per task (from
   /proc: batching's saving in work, whatever else the machine runs); docs/benchmarks.md projects
   a GPU fleet from them (labelled as a projection). Per level, the seconds the server spent in
   forward passes with prompt rows and in decode-only passes (its `/metrics`), and from them a
   ceiling on batching's ratio: concurrency 1's wall over a level's prefill-pass seconds.

The ratios (2 workers vs 1, concurrency c vs 1) come from levels measured one after another in
this one run, on the same machine. With `--rounds N` the concurrency levels are measured N times,
in alternating order (1, 4, 8, then 8, 4, 1, ...), and each level reports its median round.
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import `benchmarks` and the packages from this checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import multiprocessing
import os
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Sequence

from benchmarks import postgres
from benchmarks.common import format_table, ratio

ROOT = Path(__file__).resolve().parents[1]
Say = Callable[[str], None]


@dataclass(frozen=True)
class Settings:
    suite: str = "localcomp"
    policies: tuple[str, ...] = ("expert-8k", "standard-8k", "text-engineering-8k", "full", "rolling-3",
                                 "turn-based")
    train_tasks: int = 20  # per policy, for the workers
    workers: tuple[int, ...] = (1, 2)
    llm_tasks: int = 8
    llm_steps: int = 3
    llm_max_tokens: int = 32
    multistep_tasks: int = 8
    multistep_steps: int = 4
    reply_tokens: int = 128
    concurrency: tuple[int, ...] = (1, 4, 8)
    rounds: int = 1   # of the llm and multistep levels; each level's median round is reported
    kv_tokens: int = 32_768
    parts: tuple[str, ...] = field(default=("workers", "llm", "multistep"))


# -- 1. workers sharing a run ------------------------------------------------------------------------


def measure_workers(settings: Settings, say: Say) -> list[dict[str, Any]]:
    reason = postgres.missing()
    if reason:
        raise ValueError(f"the workers part needs PostgreSQL: {reason}")
    with postgres.throwaway_cluster() as server:
        return [_workers_level(postgres.fresh_database(server), n, settings, say) for n in settings.workers]


def cpu_ceiling(processes: int = 2, seconds: float = 3.0) -> float:
    """Work done by `processes` busy Python processes over the work of one, now: what a shared machine
    offers several workers at this moment (2.0 on two idle cores)."""
    counts = []
    for n in (1, processes):
        with multiprocessing.get_context("spawn").Pool(n) as pool:
            counts.append(sum(pool.map(_spin, [seconds] * n)))
    return round(counts[1] / counts[0], 3)


def _spin(seconds: float) -> int:
    deadline, n = time.perf_counter() + seconds, 0
    while time.perf_counter() < deadline:
        n += sum(range(1000))
    return n


def _workers_level(url: str, n: int, settings: Settings, say: Say) -> dict[str, Any]:
    from store import Store

    store = Store.open(url)
    try:
        run, items = _queued_run(store, settings)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        with tempfile.TemporaryDirectory(prefix="akv-scale-") as logs:
            processes = [subprocess.Popen([sys.executable, "-m", "akv_cli.main", "worker", "--run", run.name,
                                           "--db", url], env=env, cwd=ROOT, stdout=open(Path(logs) / f"{i}.log", "w"),
                                          stderr=subprocess.STDOUT) for i in range(n)]
            try:
                _wait(lambda: len(store.work.workers(run.id)) == n, processes, logs, "the workers to join")
                server = _server_pid(store)
                cpu_before = _cpu_now(processes, server)
                started = time.perf_counter()
                for policy_id, tasks in items.items():
                    store.work.enqueue(run.id, policy_id, "train", tasks)
                _wait(lambda: store.work.unfinished(run.id) == 0, processes, logs, "the queued work")
                wall = time.perf_counter() - started
                cpu = {k: round(v - cpu_before[k], 2) for k, v in _cpu_now(processes, server).items()}
                store.set_run_status(run.id, "finished")
                for process in processes:
                    process.wait(timeout=60)
            finally:
                for process in processes:
                    if process.poll() is None:
                        process.kill()
                        process.wait()
        per_worker = [w.n_evaluations for w in store.work.workers(run.id)]
        stored = len(store.evaluations(run.id))
    finally:
        store.close()
    load = os.getloadavg()[0]
    say(f"workers {n}: {stored} evaluations in {wall:.1f} s ({per_worker}); CPU s {cpu}; load {load:.2f}")
    return {"workers": n, "evaluations": stored, "wall_s": round(wall, 2),
            "evaluations_per_s": round(stored / wall, 2), "per_worker": per_worker, "cpu_s": cpu,
            "worker_cpu_ms_per_evaluation": round(cpu["workers"] / max(stored, 1) * 1000, 1),
            "load_1min": round(load, 2)}


def _server_pid(store: Any) -> int:
    """The PostgreSQL server's main process (the parent of our connection's backend)."""
    from sqlalchemy import text

    with store.engine.connect() as conn:
        backend = conn.execute(text("SELECT pg_backend_pid()")).scalar()
    return int(_proc_stat(backend)[1])


def _proc_stat(pid: int) -> list[str]:
    """Fields 3.. of /proc/PID/stat (state, ppid, ...), after the command name."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    return raw[raw.rindex(")") + 2:].split()


def _cpu_of(pid: int, reaped: bool = False) -> float:
    """CPU seconds of a process (user + system), with those of its children it waited for."""
    try:
        fields = _proc_stat(pid)
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    ticks = sum(int(v) for v in fields[11:13 + (2 if reaped else 0)])
    return ticks / os.sysconf("SC_CLK_TCK")


def _cpu_now(workers: Sequence[subprocess.Popen], server: int) -> dict[str, float]:
    """CPU seconds so far of the worker processes, the PostgreSQL server (its live and ended processes)
    and this process."""
    children = _children(server)
    times = os.times()
    return {"workers": sum(_cpu_of(p.pid) for p in workers),
            "postgres": _cpu_of(server, reaped=True) + sum(_cpu_of(pid) for pid in children),
            "benchmark": times.user + times.system}


def _parent(pid: int) -> int | None:
    try:
        return int(_proc_stat(pid)[1])
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        return None


def _queued_run(store: Any, settings: Settings) -> tuple[Any, dict[int, list[str]]]:
    """A running run whose config the workers score with, its policies stored; the work to queue."""
    from akv_core.home import akv_home
    from policy_dsl import parse
    from policy_dsl.library import builtin_source
    from policy_dsl.printer import canonical_hash
    from sandbox.suites import get_suite
    from store import Proposal

    suite = get_suite(settings.suite)
    suite.build(akv_home(), 0)
    config = {"suite": settings.suite, "agent": "scripted", "backend": "replay", "seed": 0,
              "evaluation": {"concurrency": 1, "lease_s": 60.0}}
    run = store.create_run("scale", config, 0, "benchmark", suite.version(akv_home()))
    tasks = [t.id for t in suite.tasks("train")][: settings.train_tasks]
    items = {}
    for name in settings.policies:
        text = builtin_source(name)
        pid, _ = store.add_policy(run.id, Proposal("seed", text, text=text, hash=canonical_hash(parse(text)),
                                                   name=name))
        items[pid] = tasks
    return run, items


def _wait(done: Callable[[], bool], processes: Sequence[subprocess.Popen], logs: str, what: str,
          timeout_s: float = 1800.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        failed = [p for p in processes if p.poll() is not None]
        if failed or time.monotonic() > deadline:
            tails = "; ".join(p.read_text()[-500:] for p in sorted(Path(logs).glob("*.log")))
            raise RuntimeError(f"waiting for {what}: {'a worker exited' if failed else 'timed out'}: {tails}")
        time.sleep(0.1)  # each look is a query: polling more often takes CPU from the workers it times


# -- 2. the llm agent at concurrency 1, 4, 8 -------------------------------------------------------------


def measure_llm(settings: Settings, say: Say) -> list[dict[str, Any]]:
    """The llm agent: the embedded model's replies are its actions."""
    from sandbox.runs.harness import RunLimits

    limits = RunLimits(max_steps=settings.llm_steps, max_tokens=settings.llm_max_tokens)
    return _concurrency_levels(settings, "llm", settings.llm_tasks, limits, say)


def measure_multistep(settings: Settings, say: Say) -> list[dict[str, Any]]:
    """Multi-step tasks with real replies: the scripted agent's trajectories (the same requests at every
    level, whatever the model writes) while the server decodes `reply_tokens` tokens for each request."""
    from sandbox.runs.harness import RunLimits

    limits = RunLimits(max_steps=settings.multistep_steps, scripted_max_tokens=settings.reply_tokens)
    return _concurrency_levels(settings, "scripted", settings.multistep_tasks, limits, say)


def _concurrency_levels(settings: Settings, agent: str, n_tasks: int, limits: Any, say: Say) -> list[dict[str, Any]]:
    """Every level `settings.rounds` times, the order reversed every other round (so that a drift of the
    machine's speed falls on every level alike); each level's cell is its median round by wall time,
    with every round's wall beside it."""
    rounds: dict[int, list[dict[str, Any]]] = {level: [] for level in settings.concurrency}
    _warm_up(settings, n_tasks)
    for index in range(settings.rounds):
        order = settings.concurrency if index % 2 == 0 else tuple(reversed(settings.concurrency))
        for level in order:
            rounds[level].append(_concurrency_level(settings, agent, n_tasks, limits, level, say))
    cells = []
    for level in settings.concurrency:
        ranked = sorted(rounds[level], key=lambda cell: cell["wall_s"])
        cells.append({**ranked[(len(ranked) - 1) // 2], "walls_s": [cell["wall_s"] for cell in rounds[level]]})
    return cells


def _warm_up(settings: Settings, n_tasks: int) -> None:
    """Load what this process loads once (the suite's tasks, the tokenizer, the harness) before any level is
    timed, so that the first level measured does not pay for it: the same tasks on the replay backend."""
    from sandbox.runs.harness import run_tasks

    run_tasks(settings.suite, "train", "expert-8k", agent="scripted", backend="replay", limit=n_tasks)


def _concurrency_level(settings: Settings, agent: str, n_tasks: int, limits: Any, level: int,
                       say: Say) -> dict[str, Any]:
    from benchmarks.serving import akv_server
    from sandbox.runs.harness import run_tasks

    with tempfile.TemporaryDirectory(prefix="akv-scale-") as folder:
        with akv_server(settings.kv_tokens, max(settings.concurrency), Path(folder)) as url:
            _warm_server(url)
            _settle()
            served_before = _served(url)
            servers = _children(os.getpid())
            cpu_before = sum(_cpu_of(pid) for pid in servers)
            started = time.perf_counter()
            report = run_tasks(settings.suite, "train", "expert-8k", agent=agent, backend=url, limit=n_tasks,
                               concurrency=level, model="smollm2", limits=limits)
            wall = time.perf_counter() - started
            cpu = sum(_cpu_of(pid) for pid in servers) - cpu_before
            served = {kind: count - served_before.get(kind, 0) for kind, count in _served(url).items()}
    cell = _llm_cell(level, report.results, wall, cpu, served)
    say(f"{agent} agent, concurrency {level}: {len(report.results)} tasks, {cell['requests']} requests "
        f"in {wall:.1f} s, server CPU {cpu:.1f} s; load {cell['load_1min']}")
    return cell


WARM_UP = ("Before the tasks: count the planets of the solar system from the Sun outwards, then the months of "
           "the year, then the days of the week, each list on one line, and say which list is the longest. " * 3)


def _warm_server(url: str) -> None:
    """One request that shares nothing with the tasks but the chat template's first tokens, so that the
    timed level does not pay a fresh server's first prefill and decode (allocations, thread pools): the
    server an evaluation runs against has served before. It goes through the tasks' own backend, so that
    this process has loaded the HTTP client (its imports) before the clock starts too."""
    from sandbox.backends import BackendRequest, open_backend

    open_backend(url, "smollm2").complete(BackendRequest([{"role": "user", "content": WARM_UP}], max_tokens=8))


def _settle() -> None:
    """Wait, untimed, until the CPU a fresh server spent starting up and warming (its own work outside forward
    passes, which akv_core.threads counts as busy elsewhere) has faded from its idle-core reading: a server an
    evaluation runs against has been up a while, and its first timed prefill should get the idle cores."""
    from akv_core.threads import BUSY_WINDOW_S

    time.sleep(2 * BUSY_WINDOW_S)


def _children(pid: int) -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _parent(int(p.name)) == pid]


def _served(url: str) -> dict[str, float]:
    """The server's own counters (`/metrics`): tokens by kind (what it prefilled and decoded), and the wall
    seconds of its forward passes by kind (`prefill_s`: passes with prompt rows; `decode_s`: decode only)."""
    import re
    import urllib.request

    base = url.split("/v1")[0].rstrip("/")
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as response:
        text = response.read().decode()
    counters = {kind: float(value) for kind, value in re.findall(r'akv_tokens_total\{kind="(\w+)"\} (\S+)', text)}
    for kind, value in re.findall(r'akv_forward_seconds_total\{kind="(\w+)"\} (\S+)', text):
        counters[f"{kind}_s"] = float(value)
    return counters


def _llm_cell(level: int, results: Sequence[Any], wall: float, server_cpu: float = 0.0,
              served: Mapping[str, float] | None = None) -> dict[str, Any]:
    requests = sum(r.n_requests for r in results)
    served = served or {}
    tokens = {k: sum(getattr(r.tokens, k) for r in results) for k in ("input", "cached", "output")}
    return {"concurrency": level, "tasks": len(results), "wall_s": round(wall, 2),
            "tasks_per_s": round(len(results) / wall, 4), "requests": requests,
            "server_cpu_s_per_task": round(server_cpu / max(len(results), 1), 2),
            "server_pass_s": {"prefill": round(served.get("prefill_s", 0.0), 2),
                              "decode": round(served.get("decode_s", 0.0), 2)},
            "errors": sum(r.status == "error" for r in results),
            "per_request": {"computed_prompt_tokens": round(tokens["input"] / max(requests, 1), 1),
                            "cached_prompt_tokens": round(tokens["cached"] / max(requests, 1), 1),
                            "completion_tokens": round(tokens["output"] / max(requests, 1), 1),
                            "decoded_by_server": round(served.get("decoded", 0) / max(requests, 1), 1),
                            "seconds": round(wall / max(requests, 1) * level, 3)},
            "load_1min": round(os.getloadavg()[0], 2)}


# -- the run and its table ----------------------------------------------------------------------------------


def measure(settings: Settings = Settings(), progress: Say | None = None) -> dict[str, Any]:
    say = progress or (lambda _text: None)
    figures: dict[str, Any] = {"settings": asdict(settings)}
    if "workers" in settings.parts:
        figures["cpu_ceiling_before"] = cpu_ceiling(max(settings.workers))
        figures["workers"] = measure_workers(settings, say)
        figures["cpu_ceiling_after"] = cpu_ceiling(max(settings.workers))
    if "llm" in settings.parts:
        figures["llm"] = measure_llm(settings, say)
    if "multistep" in settings.parts:
        figures["multistep"] = measure_multistep(settings, say)
    figures["ratios"] = ratios(figures)
    return figures


def ratios(figures: Mapping[str, Any]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    workers = {c["workers"]: c["evaluations_per_s"] for c in figures.get("workers", [])}
    for n, rate in workers.items():
        if n != 1 and 1 in workers:
            out[f"workers {n} vs 1 (evaluations/s)"] = ratio(rate, workers[1])
    cpu = {c["workers"]: c["worker_cpu_ms_per_evaluation"] for c in figures.get("workers", []) if "cpu_s" in c}
    for n, ms in cpu.items():  # below 1.0: each evaluation costs the workers more CPU when there are n of them
        if n != 1 and 1 in cpu:
            out[f"workers {n} vs 1 (evaluations per worker CPU s)"] = ratio(cpu[1], ms)
    for part, name in (("llm", "llm"), ("multistep", "multi-step")):
        cells = figures.get(part, [])
        rates = {c["concurrency"]: c["tasks_per_s"] for c in cells}
        for level, rate in rates.items():
            if level != 1 and 1 in rates:
                out[f"{name} concurrency {level} vs 1 (tasks/s)"] = ratio(rate, rates[1])
        walls = {c["concurrency"]: c["wall_s"] for c in cells}
        for c in cells:   # the most batching could give if the passes with prompt rows were all a level cost
            prefill_s = c.get("server_pass_s", {}).get("prefill")
            if c["concurrency"] != 1 and 1 in walls and prefill_s:
                out[f"{name} concurrency {c['concurrency']} vs 1, ceiling (the level's prefill passes alone)"] = \
                    ratio(walls[1], prefill_s)
        per_cpu = {c["concurrency"]: c.get("server_cpu_s_per_task") for c in cells}
        for level, seconds in per_cpu.items():  # what batching saves in work, whatever else the machine runs
            if level != 1 and per_cpu.get(1) and seconds:
                out[f"{name} concurrency {level} vs 1 (tasks per server CPU s)"] = ratio(per_cpu[1], seconds)
    return out


def render(figures: Mapping[str, Any]) -> str:
    parts = []
    if figures.get("workers"):
        parts.append("replay evaluations by akv worker processes sharing a run (PostgreSQL)")
        parts.append(format_table(["workers", "evaluations", "wall s", "evaluations/s", "per worker",
                                   "worker CPU s", "postgres CPU s", "benchmark CPU s", "worker CPU ms/eval",
                                   "load"],
                                  [[c["workers"], c["evaluations"], c["wall_s"], c["evaluations_per_s"],
                                    "/".join(map(str, c["per_worker"])), c["cpu_s"]["workers"],
                                    c["cpu_s"]["postgres"], c["cpu_s"]["benchmark"],
                                    c["worker_cpu_ms_per_evaluation"], c["load_1min"]] for c in figures["workers"]]))
        parts.append(f"CPU the machine offered {max(c['workers'] for c in figures['workers'])} busy processes vs 1, "
                     f"measured just before and after: {figures['cpu_ceiling_before']}x, "
                     f"{figures['cpu_ceiling_after']}x (2.0 on two idle cores)")
    titles = {"llm": "llm agent against akv serve (embedded SmolLM2, CPU)",
              "multistep": "multi-step tasks against akv serve: the scripted agent's requests, each reply decoded "
                           "by the model (embedded SmolLM2, CPU)"}
    for part, title in titles.items():
        if figures.get(part):
            parts.append(title)
            parts.append(format_table(
                ["concurrency", "tasks", "requests", "errors", "wall s", "tasks/s", "computed/req", "cached/req",
                 "completion/req", "decoded/req", "s/request", "server CPU s/task", "prefill passes s",
                 "decode passes s", "load", "rounds' wall s"],
                [[c["concurrency"], c["tasks"], c["requests"], c["errors"], c["wall_s"], c["tasks_per_s"],
                  *c["per_request"].values(), c["server_cpu_s_per_task"], c.get("server_pass_s", {}).get("prefill"),
                  c.get("server_pass_s", {}).get("decode"), c["load_1min"],
                  "/".join(map(str, c.get("walls_s", [c["wall_s"]])))] for c in figures[part]]))
    parts.append("ratios, measured side by side in this run:")
    parts += [f"  {name}: {value}x" for name, value in figures["ratios"].items()]
    return "\n".join(parts)


def parse_args(argv: Sequence[str] | None = None) -> tuple[Settings, bool]:
    parser = argparse.ArgumentParser(prog="benchmarks/scale.py", description=__doc__.splitlines()[0])
    defaults = Settings()
    parser.add_argument("--parts", default=",".join(defaults.parts),
                        help="workers,llm,multistep (default: all three)")
    parser.add_argument("--train-tasks", type=int, default=defaults.train_tasks)
    parser.add_argument("--workers", default=",".join(map(str, defaults.workers)))
    parser.add_argument("--llm-tasks", type=int, default=defaults.llm_tasks)
    parser.add_argument("--llm-steps", type=int, default=defaults.llm_steps)
    parser.add_argument("--llm-max-tokens", type=int, default=defaults.llm_max_tokens)
    parser.add_argument("--multistep-tasks", type=int, default=defaults.multistep_tasks)
    parser.add_argument("--multistep-steps", type=int, default=defaults.multistep_steps)
    parser.add_argument("--reply-tokens", type=int, default=defaults.reply_tokens,
                        help="tokens the server decodes for each request of the multi-step tasks")
    parser.add_argument("--concurrency", default=",".join(map(str, defaults.concurrency)))
    parser.add_argument("--rounds", type=int, default=defaults.rounds,
                        help="rounds of the llm and multistep levels, in alternating order; the median is reported")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args(argv)
    parts = tuple(p for p in args.parts.split(",") if p)
    unknown = set(parts) - {"workers", "llm", "multistep"}
    if unknown:
        parser.error(f"--parts: unknown part {sorted(unknown)[0]!r}; expected workers, llm, multistep")
    numbers = {}
    for option in ("workers", "concurrency"):
        try:
            numbers[option] = tuple(int(v) for v in getattr(args, option).split(","))
        except ValueError:
            parser.error(f"--{option}: expected positive integers separated by commas")
        if min(numbers[option]) < 1:
            parser.error(f"--{option}: expected positive integers separated by commas")
    if args.rounds < 1:
        parser.error(f"--rounds: expected a positive integer, got {args.rounds}")
    settings = Settings(train_tasks=args.train_tasks, workers=numbers["workers"], llm_tasks=args.llm_tasks,
                        llm_steps=args.llm_steps, llm_max_tokens=args.llm_max_tokens,
                        multistep_tasks=args.multistep_tasks, multistep_steps=args.multistep_steps,
                        reply_tokens=args.reply_tokens, concurrency=numbers["concurrency"], rounds=args.rounds,
                        parts=parts)
    return settings, args.json


def main(argv: Sequence[str] | None = None) -> None:
    settings, as_json = parse_args(argv)
    figures = measure(settings, progress=lambda text: print(text, file=sys.stderr, flush=True))
    print(json.dumps(figures) if as_json else render(figures))


if __name__ == "__main__":
    main()
