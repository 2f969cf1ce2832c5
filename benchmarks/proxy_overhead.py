"""Proxy overhead: the request path with refinement off, and with an evolution running in the background.

Side by side in one run, every request is sent three ways in turn (the order rotating each round):
to the upstream alone, through `akv proxy --record` (refinement off) and through `akv proxy --record
--refine` while its refiner evolves (a round on a trace set primed with long generated traces,
whose budget outlasts the measurement; the run checks the evolution is still going at the end).
Both proxies serve the same policy and record every request. The requests are agent histories
that grow turn by turn (generated code-repair conversations, `benchmarks/traces.py`), so the
proxies count tokens, decide and record as they would for a real agent.

The upstream is by default a constant one (a process of its own answering every chat request
with the same short completion at once), so that what is measured is the proxy's own cost;
`--upstream URL` sends everything to a server of yours instead (`akv serve`), whose own time
then varies with the load the evolution adds. The overhead at a percentile is the proxy's
latency there minus the upstream's; the ratio refine / off is what the request path pays for
refining.

    python benchmarks/proxy_overhead.py [--rounds 300] [--upstream constant|URL] [--steps 20] [--chars 2400]
                                        [--json]
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import multiprocessing
import os
import re
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

from akv_stats.paired import percentile
from benchmarks.common import cpu_model, format_table, ratio

CONTENDERS = ("upstream", "refine off", "refine on")
PRIMED = 20            # generated traces the refining proxy's trace set starts with (a round's window)
POLICY = "expert"      # what both proxies serve
START_TIMEOUT_S = 600.0
MODEL = "smollm2"


@dataclass(frozen=True)
class Settings:
    rounds: int = 300              # requests per contender
    upstream: str = "constant"     # or a server URL
    steps: int = 20                # requests per generated conversation (its history grows each step)
    chars: int = 2400              # characters of each tool result (about a quarter as many tokens)

    def __post_init__(self) -> None:
        if self.rounds < 10:
            raise ValueError(f"--rounds: expected at least 10, got {self.rounds}")
        if self.steps < 1 or self.chars < 1:
            raise ValueError(f"--steps, --chars: expected at least 1, got {self.steps}, {self.chars}")
        if self.upstream != "constant" and not self.upstream.startswith(("http://", "https://")):
            raise ValueError(f"--upstream: expected constant or an http(s):// URL, got {self.upstream!r}")


def measure(settings: Settings = Settings(), progress: Any = print) -> dict[str, Any]:
    """Latency percentiles of the three contenders, their overheads and the refine / off ratios."""
    import httpx

    with tempfile.TemporaryDirectory(prefix="akv-proxy-bench-") as folder, ExitStack() as stack:
        home = Path(folder)
        upstream = settings.upstream if settings.upstream != "constant" else stack.enter_context(_constant_upstream())
        off_db, on_db = f"sqlite:///{home / 'off.db'}", f"sqlite:///{home / 'on.db'}"
        _prime(on_db)
        off = stack.enter_context(_proxy(home, upstream, off_db, "off", []))
        on = stack.enter_context(_proxy(home, upstream, on_db, "on", [
            "--refine", "--refine-every", str(PRIMED), "--refine-idle", "1", "--refine-budget", "100000",
            "--refine-proposers", "mutate,optuna"]))
        progress("waiting for the refiner's evolution to start ...")
        run = _evolution_running(on_db, home / "on-home")
        urls = {"upstream": upstream, "refine off": off, "refine on": on}
        bodies = _bodies(settings)
        latencies: dict[str, list[float]] = {name: [] for name in CONTENDERS}
        with httpx.Client(timeout=120) as client:
            for name in CONTENDERS:  # one conversation's worth each, untimed: connections and memos warm
                for body in bodies[:settings.steps]:
                    _send(client, urls[name], body)
            for i in range(settings.rounds):
                body = bodies[i % len(bodies)]
                for name in _rotated(CONTENDERS, i):
                    latencies[name].append(_send(client, urls[name], body))
                if (i + 1) % 100 == 0:
                    progress(f"{i + 1}/{settings.rounds} rounds")
        still = _round_status(on_db) == "running"
    return _figures(settings, latencies, run, still)


def _figures(settings: Settings, latencies: dict[str, list[float]], run: str, still: bool) -> dict[str, Any]:
    rows = {name: {f"p{q}_ms": round(1000 * percentile(values, q), 3) for q in (50, 99)}
            for name, values in latencies.items()}
    for name in CONTENDERS[1:]:
        for q in (50, 99):
            rows[name][f"overhead_p{q}_ms"] = round(rows[name][f"p{q}_ms"] - rows["upstream"][f"p{q}_ms"], 3)
    ratios = {f"p{q}": ratio(rows["refine on"][f"overhead_p{q}_ms"], rows["refine off"][f"overhead_p{q}_ms"])
              for q in (50, 99)}
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "rounds": settings.rounds, "upstream": settings.upstream,
            "policy": POLICY, "evolution": run, "evolution_ran_throughout": still, "contenders": rows,
            "refine_on_over_off": ratios}


def render(figures: dict[str, Any]) -> str:
    rows = []
    for name in CONTENDERS:
        row = figures["contenders"][name]
        rows.append([name, row["p50_ms"], row["p99_ms"], row.get("overhead_p50_ms"), row.get("overhead_p99_ms")])
    ratios = figures["refine_on_over_off"]
    lines = [f"proxy overhead, {figures['rounds']} requests per contender in turn, policy {figures['policy']}, "
             f"upstream {figures['upstream']}; {figures['cpu']} ({figures['cores']} cores)",
             format_table(["contender", "p50 ms", "p99 ms", "overhead p50 ms", "overhead p99 ms"], rows),
             f"overhead with refinement on (evolution {figures['evolution']} running) over off: "
             f"p50 x{ratios['p50']}, p99 x{ratios['p99']}"]
    if not figures["evolution_ran_throughout"]:
        lines.append("note: the evolution ended before the measurement did")
    return "\n".join(lines)


# ---- the contenders ------------------------------------------------------------------------------------

def _send(client: Any, url: str, body: dict[str, Any]) -> float:
    started = time.perf_counter()
    reply = client.post(url + "/v1/chat/completions", json=body)
    elapsed = time.perf_counter() - started
    reply.raise_for_status()
    return elapsed


def _rotated(names: Sequence[str], i: int) -> list[str]:
    k = i % len(names)
    return [*names[k:], *names[:k]]


def _bodies(settings: Settings) -> list[dict[str, Any]]:
    """Growing agent histories: each generated conversation's requests, turn by turn."""
    from benchmarks.traces import synthetic_trace

    bodies = []
    for n in range((settings.rounds + settings.steps - 1) // settings.steps + 1):
        trace = synthetic_trace(f"measured-{n}", 1000 + n)
        messages = [{**m, "content": m["content"][:settings.chars]} if m["role"] == "tool" else m
                    for m in trace.messages]
        for index in trace.assistant_indices()[:settings.steps]:
            bodies.append({"model": MODEL, "messages": messages[:index], "max_tokens": 1, "temperature": 0})
    return bodies


def _prime(db_url: str) -> None:
    """The refining proxy's trace set, holding enough finished traffic for a round at once."""
    from benchmarks.traces import synthetic_trace
    from sandbox.traces.records import stored_of
    from store.repository import Store

    store = Store.open(db_url)
    try:
        store.traces.add("traffic", [stored_of(synthetic_trace(f"traffic-{i:05d}", i)) for i in range(PRIMED)])
    finally:
        store.close()


@contextmanager
def _proxy(home: Path, upstream: str, db_url: str, tag: str, options: list[str]) -> Iterator[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "AKV_HOME": str(home / f"{tag}-home")}
    log = open(home / f"{tag}.log", "w")
    process = subprocess.Popen([sys.executable, "-m", "akv_cli.main", "proxy", "--policy", POLICY, "--upstream",
                                upstream, "--port", "0", "--record", "traffic", "--db", db_url, *options],
                               stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    try:
        line = process.stdout.readline()
        found = re.search(r"ready at (http://[\d.]+:\d+)", line)
        if not found:
            raise RuntimeError(f"the {tag} proxy did not start: {line!r}; log {home / f'{tag}.log'}")
        yield found.group(1)
    finally:
        process.terminate()
        process.wait(30)
        log.close()


def _evolution_running(db_url: str, home: Path) -> str:
    """Wait until the refiner's round runs its evolution (its run is in the store); the run's name."""
    from store.repository import Store

    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        store = Store.open(db_url)
        try:
            rounds = store.live.rounds("traffic")
            if rounds and rounds[-1].status == "running" and rounds[-1].run_name in store.run_names():
                return rounds[-1].run_name
            if rounds and rounds[-1].status != "running":
                raise RuntimeError(f"the refiner's round ended before the measurement: {rounds[-1].status}: "
                                   f"{rounds[-1].detail}")
        finally:
            store.close()
        time.sleep(1.0)
    raise RuntimeError(f"no evolution started within {START_TIMEOUT_S:g} s (refiner log: {home})")


def _round_status(db_url: str) -> str:
    from store.repository import Store

    store = Store.open(db_url)
    try:
        return store.live.rounds("traffic")[-1].status
    finally:
        store.close()


@contextmanager
def _constant_upstream() -> Iterator[str]:
    """A process answering every chat request at once with the same completion."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = multiprocessing.get_context("spawn").Process(target=_serve_constant, args=(port,), daemon=True)
    process.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline or not process.is_alive():
                raise RuntimeError("the constant upstream did not start") from None
            time.sleep(0.1)
    try:
        yield url
    finally:
        process.terminate()
        process.join(10)


COMPLETION = {"id": "chatcmpl-constant", "object": "chat.completion", "created": 0, "model": MODEL,
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "Done."}, "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2,
                        "prompt_tokens_details": {"cached_tokens": 0, "drop_skipped_tokens": 0, "repos_tokens": 0}}}


def _serve_constant(port: int) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def chat(request: Any) -> JSONResponse:
        await request.body()
        return JSONResponse(COMPLETION)

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=Settings.rounds, help="requests per contender")
    parser.add_argument("--upstream", default="constant", help="constant (default) or a server URL")
    parser.add_argument("--steps", type=int, default=Settings.steps, help="requests per generated conversation")
    parser.add_argument("--chars", type=int, default=Settings.chars, help="characters of each tool result")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        settings = Settings(args.rounds, args.upstream, args.steps, args.chars)
    except ValueError as err:
        parser.exit(2, f"error: {err}\n")
    figures = measure(settings, progress=lambda text: print(text, file=sys.stderr))
    print(json.dumps(figures) if args.json else render(figures))


if __name__ == "__main__":
    main()
