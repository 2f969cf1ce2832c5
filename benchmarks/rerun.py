"""A trajectory run twice against a real `akv serve`: what the second run prefills, and its wall time.

Retrying a task, evaluating another candidate policy on the same tasks, or forking an agent sends
the earlier states of a history again: the history before a drop or a reposition. The server
keeps the KV no request reads any more as retained entries (docs/engine-cache.md, "Retained KV"),
so a second run finds those states instead of prefilling them again.

1. Record: the suites' scripted agents run --tasks train tasks under expert-8k (keep the 4 most
   recent tool responses, drop and reposition the rest) on the replay backend (no model), for at
   most --steps agent steps each. Every request is kept as sent: the full history plus the
   cumulative drop_message / reposition. A trajectory ends before its first request that the
   server would refuse (prompt and max_tokens beyond the model's 8,192-token context).
2. Serve: one `akv serve` subprocess on 127.0.0.1. The first run sends every task's requests, task
   after task, each in order; the second run sends all of them again, in the same order. A salt in
   each task's system message keeps tasks from sharing cache.

Per run: requests, prompt tokens, prefilled tokens, reused tokens whose KV came from retained
entries (the server's `akv_retained_tokens_total`), the summed prefill of each task's last request
and the wall seconds; then the second run over the first. The target: the second run prefills at
most 1.2 times what the first run's last requests prefilled alone. `--preview` sends the same
requests through the replay accounting instead (the engine's cache without a model: the same
usage, no wall time, seconds), and adds the slots eviction took from live and from retained KV.

    python -m benchmarks.rerun [--tasks 4] [--steps 8] [--max-tokens 4] [--kv-tokens 32768] [--json] [--preview]
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from benchmarks.common import AKV, SUITES, format_table, ratio
from benchmarks.serving import Settings as ServingSettings
from benchmarks.serving import Stream, akv_server, record_streams, salted

TARGET_PREFILL_OVER_LAST = 1.2   # the second run's prefill over the first run's last requests' alone
MODEL = "smollm2"
CONTEXT_TOKENS = 8192            # the embedded model's context: the server refuses longer prompts
SALT_TOKENS = 32                 # room for the salt each task's system message gets


@dataclass(frozen=True)
class Settings:
    tasks: int = 4                # train tasks, interleaved over the suites present
    steps: int = 8                # agent steps recorded per task: expert-8k drops from the 5th tool response on
    max_tokens: int = 4           # per request: decode is expensive on a CPU
    kv_tokens: int = 32_768       # the server's pool (its CPU default for the embedded model)
    suites: tuple[str, ...] = SUITES


@dataclass(frozen=True)
class RunFigures:
    """One run over every task's requests, as the server reported it."""

    requests: int
    prompt_tokens: int
    prefilled_tokens: int
    retained_tokens: int          # reused tokens whose KV came from retained entries
    last_prefilled_tokens: int    # each task's last request's prefill, summed
    wall_s: float


def record(settings: Settings, out_dir: Path) -> list[Stream]:
    """expert-8k's recorded streams, one per task (Standard's are recorded beside them and unused)."""
    serving = ServingSettings(streams=settings.tasks, steps=settings.steps, suites=settings.suites,
                              text_engineering=False)
    streams, _, _ = record_streams(serving, out_dir)
    return [within_context(stream, settings.max_tokens) for stream in streams[AKV]]


def within_context(stream: Stream, max_tokens: int) -> Stream:
    """The stream up to its first request whose prompt plus `max_tokens` exceeds the context."""
    fits = next((i for i, prompt in enumerate(stream.prompt) if prompt + SALT_TOKENS + max_tokens > CONTEXT_TOKENS),
                len(stream.prompt))
    return replace(stream, requests=stream.requests[:fits], purposes=stream.purposes[:fits],
                   visible=stream.visible[:fits], prompt=stream.prompt[:fits], cold=stream.cold[:fits])


def send_run(url: str, streams: Sequence[Stream], salt: str, max_tokens: int) -> RunFigures:
    """Send every stream's requests in order, stream after stream; the usage the server reported."""
    from sandbox.backends.http import HttpBackend

    backend = HttpBackend(url, MODEL)
    before = retained_total(url)
    started = time.perf_counter()
    try:
        usages = [[backend.complete(request).usage for request in salted(stream, f"{salt}-{index}", max_tokens)]
                  for index, stream in enumerate(streams)]
    finally:
        backend.close()
    wall = time.perf_counter() - started
    every = [usage for task in usages for usage in task]
    return RunFigures(len(every), sum(u.prompt_tokens for u in every), sum(u.prefilled_tokens for u in every),
                      retained_total(url) - before, sum(task[-1].prefilled_tokens for task in usages if task),
                      round(wall, 2))


def replay_run(simulator: Any, streams: Sequence[Stream], salt: str, max_tokens: int) -> RunFigures:
    """`send_run` through the replay accounting (`CacheSimulator`): the usage the server would report."""
    from sandbox.backends.tokens import shared_tokenizer

    tokenizer = shared_tokenizer()
    usages = []
    for index, stream in enumerate(streams):
        usages.append([])
        for request in salted(stream, f"{salt}-{index}", max_tokens):
            fields = request.cache_operations()
            rendered = tokenizer.render(fields.prompt or request.messages, list(request.tools) or None)
            usages[-1].append(simulator.request(rendered, fields.drop_message, fields.reposition,
                                                max_tokens=max_tokens, thinking_drop=fields.thinking_drop,
                                                text_drop=fields.text_drop))
    every = [usage for task in usages for usage in task]
    return RunFigures(len(every), sum(u.prompt_tokens for u in every), sum(u.prefilled_tokens for u in every),
                      sum(u.retained_tokens for u in every),
                      sum(task[-1].prefilled_tokens for task in usages if task), 0.0)


def retained_total(url: str) -> int:
    """The server's `akv_retained_tokens_total` counter."""
    import httpx

    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("akv_retained_tokens_total "):
            return int(float(line.split()[1]))
    raise RuntimeError("the server's /metrics has no akv_retained_tokens_total")


def measure(settings: Settings = Settings(), progress: Any = None, preview: bool = False) -> dict[str, Any]:
    """Record, serve (or replay), send the trajectories twice; the figures of both runs and their ratios."""
    say = progress or (lambda message: None)
    salt, pool = uuid.uuid4().hex[:8], None
    with tempfile.TemporaryDirectory(prefix="akv-rerun-") as folder:
        say(f"recording {settings.tasks} {AKV} trajectories of at most {settings.steps} steps")
        streams = record(settings, Path(folder))
        if preview:
            from akv_core.cache.simulator import CacheSimulator

            simulator = CacheSimulator(settings.kv_tokens)
            first = replay_run(simulator, streams, salt, settings.max_tokens)
            second = replay_run(simulator, streams, salt, settings.max_tokens)
            stats = simulator.stats()
            pool = {"live_slots_evicted": stats.slots_evicted, "retained_slots_evicted": stats.slots_retained_evicted}
        else:
            say(f"serving them twice on a pool of {settings.kv_tokens} slots")
            with akv_server(settings.kv_tokens, 1, Path(folder)) as url:
                first = send_run(url, streams, salt, settings.max_tokens)
                second = send_run(url, streams, salt, settings.max_tokens)
    bound = TARGET_PREFILL_OVER_LAST * first.last_prefilled_tokens
    return {
        "settings": asdict(settings),
        "policy": AKV,
        "through": "the replay accounting" if preview else "akv serve",
        "pool": pool,
        "tasks": [s.task_id for s in streams],
        "first": asdict(first),
        "second": asdict(second),
        "second_over_first": {"prefilled_tokens": ratio(second.prefilled_tokens, first.prefilled_tokens),
                              "wall_s": ratio(second.wall_s, first.wall_s)},
        "second_prefill_over_first_last": ratio(second.prefilled_tokens, first.last_prefilled_tokens),
        "target_met": second.prefilled_tokens <= bound,
    }


def render(figures: Mapping[str, Any]) -> str:
    header = ("run", "requests", "prompt tokens", "prefilled", "from retained KV", "last requests' prefill",
              "wall s")
    rows = [(name, *(figures[name][field] for field in ("requests", "prompt_tokens", "prefilled_tokens",
                                                        "retained_tokens", "last_prefilled_tokens", "wall_s")))
            for name in ("first", "second")]
    ratios = figures["second_over_first"]
    met = "met" if figures["target_met"] else "missed"
    pool = figures["pool"]
    return "\n".join([
        f"rerun: {len(figures['tasks'])} {figures['policy']} trajectories sent twice to {figures['through']}",
        format_table(header, rows),
        f"second / first: prefilled tokens {ratios['prefilled_tokens']}, wall time {ratios['wall_s']}",
        f"second run's prefill over the first run's last requests' alone: "
        f"{figures['second_prefill_over_first_last']} (target at most {TARGET_PREFILL_OVER_LAST}: {met})",
        *([f"eviction took {pool['live_slots_evicted']:,} slots of live KV and "
           f"{pool['retained_slots_evicted']:,} of retained KV"] if pool else []),
    ])


def parse_args(argv: Sequence[str] | None = None) -> tuple[Settings, bool, bool]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=Settings.tasks, help="train tasks (trajectories)")
    parser.add_argument("--steps", type=int, default=Settings.steps, help="agent steps per task")
    parser.add_argument("--max-tokens", type=int, default=Settings.max_tokens, help="tokens generated per request")
    parser.add_argument("--kv-tokens", type=int, default=Settings.kv_tokens, help="KV pool of the server")
    parser.add_argument("--suites", default=",".join(SUITES), help="comma-separated suites")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    parser.add_argument("--preview", action="store_true",
                        help="the replay accounting of the same requests, no server (seconds)")
    args = parser.parse_args(argv)
    settings = Settings(args.tasks, args.steps, args.max_tokens, args.kv_tokens, tuple(args.suites.split(",")))
    return settings, args.json, args.preview


def main(argv: Sequence[str] | None = None) -> None:
    settings, as_json, preview = parse_args(argv)
    figures = measure(settings, progress=lambda message: print(message, file=sys.stderr, flush=True),
                      preview=preview)
    print(json.dumps(figures, indent=2) if as_json else render(figures))


if __name__ == "__main__":
    main()
