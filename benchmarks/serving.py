"""Serving under load: AKV (expert-8k) against Standard and Text Engineering on a real `akv serve`.

1. Record: the suites' scripted agents run train tasks under each policy on the replay backend
   (no model), for at most --steps agent steps. A trajectory holds every request as sent: the
   full history plus drop_message / reposition, and the summarization calls of text-mode policies.
2. Attention: the model's decode attention over all layers is timed in-process at the visible
   token counts those requests produce (the engine's metrics do not report it). Visible means
   not dropped; a text-mode history is visible in full.
3. Serve: one `akv serve` subprocess on 127.0.0.1 whose KV pool is smaller than what Standard's
   streams need together at the highest concurrency. For each concurrency c, and each policy in
   turn (so that load from other processes falls on all alike), c streams of different tasks
   replay their requests, each stream in order, all c at once. A salt in each run's system
   message keeps runs from reusing each other's cache.

Per policy and concurrency: input throughput (prompt tokens/s), output throughput, agent steps/s,
P50 / P95 request latency, prefilled tokens and how many of them eviction forced (beyond what the
same requests prefill with an unbounded pool), attention time per decode step; then the
AKV/Standard and AKV/Text-Engineering ratios against the paper's.

    python benchmarks/serving.py [--streams 8] [--steps 3] [--concurrency 1,4,8] [--json]
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import functools
import json
import re
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from akv_stats.paired import percentile
from benchmarks.common import (AKV, STANDARD, SUITES, TEXT_ENGINEERING, at_once, format_table, present_suites,
                               ratio, run_split, verdict)

POLICIES = (AKV, STANDARD, TEXT_ENGINEERING)
# Longer contexts the embedded model is served at (RoPE stretched by YaRN, docs/server.md), with the
# baselines scaled to each. AKV keeps expert-8k's window: its unit is a tool response (see the docs).
LONG_CONTEXTS = {32768: (AKV, "standard-32k", "text-engineering-32k")}
# The paper's serving ratios (GPT-OSS-120B, 80 long SWE-bench Verified tasks), AKV over Standard.
TARGETS = {"input_throughput": 1.53, "p95_latency": 1.51, "attention_per_decode_step": 7.082 / 2.849}
SPLIT = "train"
UNBOUNDED_POOL = 1 << 24
SERVER_START_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Settings:
    streams: int = 8                     # distinct tasks per policy; concurrency c replays the first c
    steps: int = 3                       # agent steps recorded per task (see docs/benchmarks.md on length)
    concurrency: tuple[int, ...] = (1, 4, 8)
    max_tokens: int = 4                  # per request: decode is expensive on a CPU
    kv_tokens: int | None = None         # None: sized from Standard's streams (see `pool_size`)
    pool_fraction: float = 0.5           # ... this share of what Standard's streams need together
    suites: tuple[str, ...] = SUITES
    context: int | None = None           # None: the model's own 8K; else a key of LONG_CONTEXTS
    rope_scaling: str = "yarn"           # how the server stretches RoPE to `context`
    text_engineering: bool = True        # False: AKV and Standard only (a shorter run)

    @property
    def policies(self) -> tuple[str, ...]:
        """(AKV, Standard[, Text Engineering]) at this context."""
        chosen = POLICIES if self.context is None else LONG_CONTEXTS[self.context]
        return chosen if self.text_engineering else chosen[:2]

    @property
    def server_options(self) -> tuple[str, ...]:
        return () if self.context is None else ("--context", str(self.context), "--rope-scaling", self.rope_scaling)


@dataclass(frozen=True)
class Stream:
    """One task's recorded requests under one policy, ready to replay."""

    policy: str
    task_id: str
    requests: tuple[Any, ...]            # sandbox BackendRequest, in order
    purposes: tuple[str, ...]            # "agent" or "summary", per request
    visible: tuple[int, ...]             # visible prompt tokens per request
    prompt: tuple[int, ...]              # prompt tokens per request
    cold: tuple[int, ...]                # KV slots per request on an empty cache (re-rotated copies included)


@dataclass(frozen=True)
class Outcome:
    """One replayed request as the server answered it."""

    purpose: str
    latency_s: float
    usage: Any | None                    # sandbox Usage; None when the server rejected the request
    error: str | None = None


# -- recording ---------------------------------------------------------------------------------------


def record_streams(settings: Settings, out_dir: Path) -> tuple[dict[str, list[Stream]], list[str], list[str]]:
    """Per policy, `settings.streams` streams interleaved over the suites present (same tasks per policy).

    Returns (streams per policy, suites used, notes on suites left out).
    """
    from sandbox.runs.trajectory import read_trajectory

    suites, notes = present_suites(settings.suites)
    per_suite = -(-settings.streams // len(suites))
    streams: dict[str, list[Stream]] = {}
    for policy in settings.policies:
        by_suite = []
        for suite in suites:
            folder = out_dir / policy / suite
            report = run_split(suite, SPLIT, policy, limit=per_suite, max_steps=settings.steps, out_dir=folder)
            by_suite.append([_stream(policy, r.task_id, read_trajectory(_trajectory_file(folder, r.task_id))[1])
                             for r in report.results])
        interleaved = [s for group in _zip_longest(by_suite) for s in group]
        streams[policy] = interleaved[:settings.streams]
    return streams, suites, notes


def _trajectory_file(folder: Path, task_id: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in task_id)
    return folder / "trajectories" / f"{safe}.jsonl"


def _zip_longest(groups: list[list[Stream]]) -> Iterator[list[Stream]]:
    for i in range(max(len(g) for g in groups)):
        yield [g[i] for g in groups if i < len(g)]


def _stream(policy: str, task_id: str, recorded: Sequence[Any]) -> Stream:
    from sandbox.backends.tokens import shared_tokenizer

    tokenizer = shared_tokenizer()
    visible, prompt, cold = [], [], []
    for item in recorded:
        request = item.request
        rendered = tokenizer.render(request.messages, list(request.tools) or None)
        dropped = {index for indices in request.drop_message.values() for index in indices}
        hidden = sum(end - start for index, (start, end) in enumerate(rendered.spans) if index in dropped)
        prompt.append(len(rendered.token_ids))
        visible.append(len(rendered.token_ids) - hidden)
        cold.append(_cold_slots(rendered, request))
    return Stream(policy, task_id, tuple(r.request for r in recorded), tuple(r.purpose for r in recorded),
                  tuple(visible), tuple(prompt), tuple(cold))


def _cold_slots(rendered: Any, request: Any) -> int:
    """Slots the engine's planner asks for when nothing of the request is cached (after an eviction).

    A history with repositions also needs the re-rotated copies that are alive at once (a copy a
    later record supersedes gives its slot to a later one), so this exceeds the prompt.
    """
    from akv_core.cache.key import build_key
    from akv_core.cache.kv_cache import KVCache
    from akv_core.cache.ops import validate_operations

    operations = validate_operations(len(rendered.spans), request.drop_message or None, request.reposition)
    return KVCache(UNBOUNDED_POOL).plan(build_key(rendered, operations)).slots_needed


def standard_need(streams: dict[str, list[Stream]], settings: Settings) -> int:
    """KV slots Standard's streams hold together at the highest concurrency (their largest prompts)."""
    return sum(max(s.visible) for s in streams[settings.policies[1]][:max(settings.concurrency)])


def largest_request(streams: dict[str, list[Stream]]) -> int:
    """The most slots any one request can ask for: the server rejects it outright in a smaller pool."""
    return max(c for policy in streams.values() for s in policy for c in s.cold)


def pool_size(streams: dict[str, list[Stream]], settings: Settings) -> int:
    """KV slots for the server: `pool_fraction` of Standard's need, never less than the largest request.

    When the largest request (an AKV history restored after eviction, with its live re-rotated copies)
    needs more than that fraction, the pool grows to it and Standard may no longer have to evict;
    `measure` reports whether it must.
    """
    if settings.kv_tokens is not None:
        return settings.kv_tokens
    return max(int(standard_need(streams, settings) * settings.pool_fraction),
               largest_request(streams) + settings.max_tokens + 64)


# -- attention per decode step -----------------------------------------------------------------------


def attention_per_step_ms(streams: dict[str, list[Stream]], repeats: int = 5, grain: int = 256) -> dict[str, float]:
    """Mean decode attention time (all layers, one sequence, ms) over each policy's requests.

    Timed with the model's own attention call on K/V gathered from scattered slots, at every
    visible count rounded up to `grain`; each count's figure is the median of `repeats` runs.
    """
    import statistics

    import torch

    from akv_core.model.loader import load_model
    from akv_core.threads import phase_threads

    counts = {policy: [v for s in group for v in s.visible] for policy, group in streams.items()}
    grid = sorted({-(-v // grain) * grain for values in counts.values() for v in values})
    model = load_model("smollm2", device="cpu")
    c = model.config
    pool = 2 * grid[-1]
    generator = torch.Generator().manual_seed(0)
    kv = model.new_kv_buffers(pool)
    for layer in range(c.num_layers):
        kv.k[layer].normal_(generator=generator)
        kv.v[layer].normal_(generator=generator)
    query = torch.randn(1, c.num_heads, c.head_dim, generator=generator)
    times: dict[int, float] = {}
    with phase_threads("decode"), torch.inference_mode():
        for count in grid:
            slots = torch.randperm(pool, generator=generator)[:count].sort().values
            runs = []
            for _ in range(repeats):
                started = time.perf_counter()
                for layer in range(c.num_layers):
                    model.attend(layer, 0, query, kv, slots, None)
                runs.append(time.perf_counter() - started)
            times[count] = statistics.median(runs) * 1e3
    return {policy: round(sum(times[-(-v // grain) * grain] for v in values) / len(values), 3)
            for policy, values in counts.items()}


# -- the server and the replay -----------------------------------------------------------------------


@contextmanager
def akv_server(kv_tokens: int, max_running: int, log_dir: Path, options: Sequence[str] = ()) -> Iterator[str]:
    """`akv serve` on a free loopback port with a pool of `kv_tokens` (and `options`, e.g. a precision);
    yields its URL, stops it on exit."""
    log = log_dir / "server.log"
    command = [sys.executable, "-m", "akv_cli.main", "serve", "--host", "127.0.0.1", "--port", "0",
               "--kv-tokens", str(kv_tokens), "--max-running", str(max_running), "--device", "cpu", *options]
    with log.open("wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT,
                                   cwd=Path(__file__).resolve().parents[1])
    # A benchmark stopped with SIGTERM must not leave its server running: turn the signal into
    # SystemExit so that the `finally` below runs (Ctrl-C already does, as KeyboardInterrupt).
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if in_main else None
    try:
        yield _wait_ready(process, log)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if in_main:
            signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _wait_ready(process: subprocess.Popen, log: Path) -> str:
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        found = re.search(r"ready at (http://\S+)", log.read_text(errors="replace"))
        if found:
            return found.group(1)
        if process.poll() is not None:
            raise RuntimeError(f"akv serve exited with code {process.returncode}: "
                               f"{log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.2)
    raise RuntimeError(f"akv serve was not ready after {SERVER_START_TIMEOUT_S:.0f} s")


def salted(stream: Stream, salt: str, max_tokens: int) -> list[Any]:
    """The stream's requests with `salt` opening the first message and `max_tokens` for every request."""
    out = []
    for request in stream.requests:
        first = dict(request.messages[0])
        first["content"] = f"[{salt}] {first.get('content') or ''}"
        out.append(replace(request, messages=(first, *request.messages[1:]), max_tokens=max_tokens))
    return out


def replay_streams(url: str, model: str, streams: Sequence[Stream], salt: str, max_tokens: int
                   ) -> tuple[list[list[Outcome]], float, list[list[Any]]]:
    """Replay all streams at once, each in order: (outcomes per stream, wall seconds, requests sent)."""
    from sandbox.backends.http import HttpBackend

    sent = [salted(s, f"{salt}-{i}", max_tokens) for i, s in enumerate(streams)]
    outcomes: list[list[Outcome]] = [[] for _ in streams]
    backends = [HttpBackend(url, model) for _ in streams]

    def worker(index: int) -> None:
        for request, purpose in zip(sent[index], streams[index].purposes):
            outcomes[index].append(_send(backends[index], request, purpose))
        backends[index].close()

    wall = at_once([functools.partial(worker, i) for i in range(len(streams))], name="stream")
    return outcomes, wall, sent


def _send(backend: Any, request: Any, purpose: str) -> Outcome:
    from sandbox.backends import BackendError

    started = time.perf_counter()
    try:
        reply = backend.complete(request)
    except BackendError as err:  # a rejected request is counted and shown, the stream goes on
        return Outcome(purpose, time.perf_counter() - started, None, str(err))
    return Outcome(purpose, time.perf_counter() - started, reply.usage)


class MinimumPrefill:
    """What requests prefill on a cache that never evicts, fed every run's requests in run order.

    One cache for the whole benchmark, like the server's: the chat template's opening tokens,
    shared by every run despite the salts, are computed once there too.
    """

    def __init__(self) -> None:
        from sandbox.backends.replay import ReplayBackend

        self._backend = ReplayBackend(kv_tokens=UNBOUNDED_POOL, fresh_cache_per_task=False)

    def add(self, requests: Sequence[Any]) -> int:
        return sum(self._backend.complete(r).usage.prefilled_tokens for r in requests)


def summarize_cell(policy: str, concurrency: int, streams: Sequence[Stream], outcomes: list[list[Outcome]],
                   wall_s: float, minimum_prefill: int, attention_ms: float) -> dict[str, Any]:
    """The figures of one (policy, concurrency) run."""
    done = [o for stream in outcomes for o in stream if o.usage is not None]
    prompt = sum(o.usage.prompt_tokens for o in done)
    prefilled = sum(o.usage.prefilled_tokens for o in done)
    latencies = [o.latency_s for o in done]
    errors = [o.error for stream in outcomes for o in stream if o.error]
    return {
        "policy": policy, "concurrency": concurrency, "streams": len(streams),
        "tasks": [s.task_id for s in streams],
        "requests": sum(len(s) for s in outcomes), "errors": len(errors), "first_error": errors[0] if errors else None,
        "agent_steps": sum(o.purpose == "agent" for o in done), "wall_s": round(wall_s, 2),
        "prompt_tokens": prompt, "visible_prompt_tokens": sum(v for s in streams for v in s.visible),
        "completion_tokens": sum(o.usage.completion_tokens for o in done),
        "prefilled_tokens": prefilled, "evicted_recompute_tokens": prefilled - minimum_prefill if not errors else None,
        "input_tok_s": round(prompt / wall_s, 1),
        "visible_input_tok_s": round(sum(v for s in streams for v in s.visible) / wall_s, 1),
        "output_tok_s": round(sum(o.usage.completion_tokens for o in done) / wall_s, 2),
        "agent_steps_per_s": round(sum(o.purpose == "agent" for o in done) / wall_s, 4),
        "p50_latency_s": round(percentile(latencies, 50), 3), "p95_latency_s": round(percentile(latencies, 95), 3),
        "attention_ms_per_decode_step": attention_ms,
    }


# -- the benchmark -----------------------------------------------------------------------------------


def measure(settings: Settings = Settings(), progress: Any = None) -> dict[str, Any]:
    """Record, time attention, serve and replay; every figure of the run in one dict."""
    say = progress or (lambda text: None)
    if max(settings.concurrency) > settings.streams:
        raise ValueError(f"concurrency {max(settings.concurrency)} needs at least as many streams "
                         f"(--streams {settings.streams})")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="akv-serving-") as tmp:
        say("recording trajectories on the replay backend ...")
        streams, suites, notes = record_streams(settings, Path(tmp))
        say("timing decode attention in-process ...")
        attention = attention_per_step_ms(streams)
        kv_tokens = pool_size(streams, settings)
        cells, minimum = [], MinimumPrefill()
        with akv_server(kv_tokens, max(settings.concurrency), Path(tmp), settings.server_options) as url:
            say(f"akv serve ready, KV pool {kv_tokens} tokens")
            for concurrency in settings.concurrency:
                for policy in settings.policies:
                    group = streams[policy][:concurrency]
                    outcomes, wall, sent = replay_streams(url, "smollm2", group, f"c{concurrency}-{policy}",
                                                          settings.max_tokens)
                    least = sum(minimum.add(requests) for requests in sent)
                    cells.append(summarize_cell(policy, concurrency, group, outcomes, wall, least, attention[policy]))
                    say(f"c={concurrency} {policy}: {wall:.1f} s")
    return {
        "settings": {"streams": settings.streams, "steps": settings.steps, "concurrency": list(settings.concurrency),
                     "max_tokens": settings.max_tokens, "kv_tokens": kv_tokens, "split": SPLIT,
                     "standard_need_tokens": standard_need(streams, settings),
                     "largest_request_slots": largest_request(streams),
                     "suites": suites, "notes": notes, "context": settings.context,
                     "rope_scaling": settings.rope_scaling if settings.context else None,
                     "policies": list(settings.policies)},
        "cells": cells, "ratios": ratios(cells, settings.policies), "targets": TARGETS,
        "wall_s": round(time.perf_counter() - started, 1),
    }


def preview(settings: Settings = Settings(), progress: Any = None) -> dict[str, Any]:
    """The serving run's prefill from the replay accounting alone, in seconds and without a model.

    Per policy and concurrency c, the first c streams' requests are served in turn (one request of
    each stream, then the next of each) by the replay simulator with the run's KV pool, and again
    with a pool that never evicts. Serving one request at a time, it shows what the pool costs in
    recomputation, not the timings; the server runs requests concurrently.
    """
    from sandbox.backends.replay import ReplayBackend

    say = progress or (lambda text: None)
    with tempfile.TemporaryDirectory(prefix="akv-serving-") as tmp:
        say("recording trajectories on the replay backend ...")
        streams, suites, notes = record_streams(settings, Path(tmp))
    kv_tokens = pool_size(streams, settings)
    rows = []
    for concurrency in settings.concurrency:
        for policy in settings.policies:
            group = streams[policy][:concurrency]
            requests = [replace(r, max_tokens=settings.max_tokens) for r in _in_turn(group)]
            prefill = []
            for pool in (kv_tokens, UNBOUNDED_POOL):
                backend = ReplayBackend(kv_tokens=pool, fresh_cache_per_task=False)
                prefill.append(sum(backend.complete(r).usage.prefilled_tokens for r in requests))
            rows.append({"policy": policy, "concurrency": concurrency, "requests": len(requests),
                         "prefilled_tokens": prefill[0], "unbounded_prefilled_tokens": prefill[1]})
    return {"settings": {"streams": settings.streams, "steps": settings.steps, "kv_tokens": kv_tokens,
                         "concurrency": list(settings.concurrency), "max_tokens": settings.max_tokens,
                         "standard_need_tokens": standard_need(streams, settings),
                         "largest_request_slots": largest_request(streams), "context": settings.context,
                         "suites": suites, "notes": notes}, "preview": rows}


def _in_turn(streams: Sequence[Stream]) -> list[Any]:
    """One request of each stream, then the next of each, ..."""
    longest = max((len(s.requests) for s in streams), default=0)
    return [s.requests[i] for i in range(longest) for s in streams if i < len(s.requests)]


def render_preview(figures: Mapping[str, Any]) -> str:
    settings = figures["settings"]
    header = (f"serving preview (replay accounting, requests served in turn): {settings['streams']} streams, "
              f"at most {settings['steps']} agent steps each; KV pool {settings['kv_tokens']:,} tokens; "
              f"Standard's streams need {settings['standard_need_tokens']:,} together, the largest request "
              f"{settings['largest_request_slots']:,}")
    rows = [[r["policy"], r["concurrency"], r["requests"], r["prefilled_tokens"], r["unbounded_prefilled_tokens"],
             r["prefilled_tokens"] - r["unbounded_prefilled_tokens"]] for r in figures["preview"]]
    table = format_table(["policy", "c", "req", "prefilled in pool", "never evicting", "evict recompute"], rows)
    return "\n".join([header, "", table, *settings["notes"]])


def ratios(cells: Sequence[Mapping[str, Any]], policies: Sequence[str] = POLICIES) -> list[dict[str, Any]]:
    """AKV (the first of `policies`) over each baseline per concurrency; > 1 when AKV is better."""
    by = {(c["policy"], c["concurrency"]): c for c in cells}
    out = []
    for (policy, concurrency), akv in sorted(by.items(), key=lambda item: item[0][1]):
        if policy != policies[0]:
            continue
        for baseline in policies[1:]:
            base = by.get((baseline, concurrency))
            if base is None:
                continue
            out.append({
                "baseline": baseline, "concurrency": concurrency,
                "input_throughput": ratio(akv["input_tok_s"], base["input_tok_s"]),
                "visible_input_throughput": ratio(akv["visible_input_tok_s"], base["visible_input_tok_s"]),
                "output_throughput": ratio(akv["output_tok_s"], base["output_tok_s"]),
                "agent_steps_per_s": ratio(akv["agent_steps_per_s"], base["agent_steps_per_s"]),
                "p50_latency": ratio(base["p50_latency_s"], akv["p50_latency_s"]),
                "p95_latency": ratio(base["p95_latency_s"], akv["p95_latency_s"]),
                "prefilled_tokens": ratio(base["prefilled_tokens"], akv["prefilled_tokens"]),
                "attention_per_decode_step": ratio(base["attention_ms_per_decode_step"],
                                                   akv["attention_ms_per_decode_step"]),
            })
    return out


def render(figures: Mapping[str, Any]) -> str:
    """The per-policy table, the ratio table and the verdicts against the paper's targets."""
    s = figures["settings"]
    context = f"context {s['context']:,} ({s['rope_scaling']})" if s.get("context") else "context 8,192"
    head = (f"serving: {s['streams']} streams of {', '.join(s['suites'])} {s['split']} tasks, at most "
            f"{s['steps']} agent steps each; concurrency {s['concurrency']}; max_tokens {s['max_tokens']}; "
            f"{context}; KV pool {s['kv_tokens']:,} tokens; {figures['wall_s']:.0f} s in all")
    cells = format_table(
        ["policy", "c", "req", "err", "wall s", "in tok/s", "visible tok/s", "out tok/s", "steps/s", "P50 s",
         "P95 s", "prefilled", "evict recompute", "attn ms/step"],
        [[c["policy"], c["concurrency"], c["requests"], c["errors"], c["wall_s"], c["input_tok_s"],
          c["visible_input_tok_s"], c["output_tok_s"], c["agent_steps_per_s"], c["p50_latency_s"],
          c["p95_latency_s"], c["prefilled_tokens"], c["evicted_recompute_tokens"],
          c["attention_ms_per_decode_step"]] for c in figures["cells"]])
    targets = figures["targets"]
    table = format_table(
        ["AKV vs", "c", "input", "visible input", "output", "steps/s", "P50", "P95", "prefill", "attention"],
        [[r["baseline"], r["concurrency"], r["input_throughput"], r["visible_input_throughput"],
          r["output_throughput"], r["agent_steps_per_s"], r["p50_latency"], r["p95_latency"],
          r["prefilled_tokens"], r["attention_per_decode_step"]] for r in figures["ratios"]])
    standard = s.get("policies", POLICIES)[1]
    top = [r for r in figures["ratios"] if r["baseline"] == standard and r["concurrency"] == max(s["concurrency"])]
    lines = [head, "", cells, "", "ratios (> 1: AKV better; latency and attention as baseline / AKV):", table]
    if top:
        lines.append("")
        lines.append(f"paper targets vs Standard at concurrency {top[0]['concurrency']}:")
        for name, target in targets.items():
            lines.append(f"  {name}: {top[0][name]}x (paper {target:.2f}x) {verdict(top[0][name], target)}")
    errors = [c for c in figures["cells"] if c["errors"]]
    for c in errors:
        lines.append(f"{c['policy']} c={c['concurrency']}: {c['errors']} rejected, first: {c['first_error']}")
    if s["kv_tokens"] >= s["standard_need_tokens"]:
        lines.append(f"note: Standard's streams need {s['standard_need_tokens']:,} slots together, which fits the "
                     f"pool: it did not have to evict (the largest request needs {s['largest_request_slots']:,})")
    else:
        lines.append(f"Standard's streams need {s['standard_need_tokens']:,} slots together at their largest, more "
                     f"than the pool; the largest request needs {s['largest_request_slots']:,}")
    for note in s["notes"]:
        lines.append(note)
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> tuple[Settings, bool, bool]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=Settings.streams, help="tasks per policy")
    parser.add_argument("--steps", type=int, default=Settings.steps, help="agent steps per task")
    parser.add_argument("--concurrency", default=",".join(map(str, Settings.concurrency)),
                        help="comma-separated concurrent streams")
    parser.add_argument("--max-tokens", type=int, default=Settings.max_tokens, help="tokens generated per request")
    parser.add_argument("--kv-tokens", type=int, default=None, help="KV pool of the server (default: sized "
                        "from Standard's streams)")
    parser.add_argument("--suites", default=",".join(SUITES), help="comma-separated suites")
    parser.add_argument("--context", type=int, default=None, choices=sorted(LONG_CONTEXTS),
                        help="serve the model at this longer context (RoPE stretched) with the baselines "
                        "scaled to it (default: the model's 8,192)")
    parser.add_argument("--rope-scaling", default=Settings.rope_scaling,
                        help="the server's --rope-scaling at --context (default yarn)")
    parser.add_argument("--without-text-engineering", action="store_true",
                        help="serve AKV and Standard only (a shorter run)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    parser.add_argument("--preview", action="store_true",
                        help="only the replay accounting's prefill in the pool (seconds, no server)")
    args = parser.parse_args(argv)
    settings = Settings(args.streams, args.steps, tuple(int(c) for c in args.concurrency.split(",")),
                        args.max_tokens, args.kv_tokens, Settings.pool_fraction, tuple(args.suites.split(",")),
                        args.context, args.rope_scaling, not args.without_text_engineering)
    return settings, args.json, args.preview


def main(argv: Sequence[str] | None = None) -> None:
    settings, as_json, only_preview = parse_args(argv)
    progress = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    if only_preview:
        figures = preview(settings, progress)
        print(json.dumps(figures) if as_json else render_preview(figures))
        return
    figures = measure(settings, progress=progress)
    print(json.dumps(figures) if as_json else render(figures))


if __name__ == "__main__":
    main()
