"""`/metrics` in the Prometheus text exposition format (version 0.0.4).

A few counters, gauges and histograms are all the server needs, so they are
written here instead of pulling in a client library. Counters are updated from
request handlers on the event loop and read there too: no lock is needed.
"""
from __future__ import annotations

import math
from collections import Counter as _Tally
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

# Seconds; CPU decode of a small model sits in the 10 ms - 10 s range per request.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

TOKEN_KINDS = ("prefilled", "decoded", "cached", "drop_skipped", "repositioned")


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        self.n += 1
        self.total += value
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1

    def lines(self, name: str) -> Iterable[str]:
        for bound, count in zip(self.buckets, self.counts):
            yield f'{name}_bucket{{le="{_number(bound)}"}} {count}'
        yield f'{name}_bucket{{le="+Inf"}} {self.n}'
        yield f"{name}_sum {_number(self.total)}"
        yield f"{name}_count {self.n}"


@dataclass(frozen=True)
class PoolGauges:
    """What the engine reports about its KV pool and scheduler at scrape time."""

    kv_slots_total: int
    kv_slots_used: int
    kv_slots_free: int
    kv_slots_cached: int
    requests_running: int
    requests_waiting: int
    # Forward passes and their wall seconds, by kind: "prefill" (with prompt rows) and "decode" (decode only).
    passes: Mapping[str, int] = field(default_factory=dict)
    pass_seconds: Mapping[str, float] = field(default_factory=dict)
    kv_slots_retained: int = 0   # of the cached slots: KV no path end reads, kept for earlier states


class ServerMetrics:
    def __init__(self) -> None:
        self.requests = _Tally[tuple[str, str]]()  # (endpoint, outcome) -> count
        self.tokens = _Tally[str]({kind: 0 for kind in TOKEN_KINDS})
        self.retained_tokens = 0   # a subset of the reused kinds, so not one of TOKEN_KINDS
        self.request_latency = Histogram()
        self.time_to_first_token = Histogram()

    def count_request(self, endpoint: str, outcome: str) -> None:
        self.requests[(endpoint, outcome)] += 1

    def count_tokens(self, usage: Mapping[str, int]) -> None:
        """Add one finished request's usage (the HTTP usage field names)."""
        self.tokens["prefilled"] += usage.get("prefilled_tokens", 0)
        self.tokens["decoded"] += usage.get("completion_tokens", 0)
        self.tokens["cached"] += usage.get("cached_tokens", 0)
        self.tokens["drop_skipped"] += usage.get("drop_skipped_tokens", 0)
        self.tokens["repositioned"] += usage.get("repos_tokens", 0)
        self.retained_tokens += usage.get("retained_tokens", 0)

    def render(self, pool: PoolGauges | None) -> str:
        lines: list[str] = []
        lines += _header("akv_requests_total", "counter", "Requests served, by endpoint and outcome.")
        for (endpoint, outcome), count in sorted(self.requests.items()):
            lines.append(f'akv_requests_total{{endpoint="{endpoint}",outcome="{outcome}"}} {count}')
        lines += _header("akv_tokens_total", "counter", "Prompt and completion tokens, by kind.")
        for kind in TOKEN_KINDS:
            lines.append(f'akv_tokens_total{{kind="{kind}"}} {self.tokens[kind]}')
        lines += _header("akv_retained_tokens_total", "counter",
                         "Reused prompt tokens whose KV came back from retained (dropped or superseded) "
                         "entries; also counted as cached, repositioned or drop_skipped.")
        lines.append(f"akv_retained_tokens_total {self.retained_tokens}")
        if pool is not None:
            lines += _gauges(pool)
        lines += _header("akv_request_latency_seconds", "histogram", "Time from request to last token.")
        lines += self.request_latency.lines("akv_request_latency_seconds")
        lines += _header("akv_time_to_first_token_seconds", "histogram", "Time from request to first token.")
        lines += self.time_to_first_token.lines("akv_time_to_first_token_seconds")
        return "\n".join(lines) + "\n"


def _gauges(pool: PoolGauges) -> list[str]:
    rows = [
        # Not `_total`: Prometheus keeps that suffix for counters, and this is a gauge.
        ("akv_kv_slots", "KV token slots in the pool.", pool.kv_slots_total),
        ("akv_kv_slots_used", "KV token slots holding state.", pool.kv_slots_used),
        ("akv_kv_slots_free", "KV token slots on the free list.", pool.kv_slots_free),
        ("akv_kv_slots_cached", "KV token slots held by the radix cache for reuse.",
         pool.kv_slots_cached),
        ("akv_kv_slots_retained", "Of the cached slots: dropped or superseded KV kept for earlier states "
         "(evicted first).", pool.kv_slots_retained),
        ("akv_requests_running", "Requests in the running batch.", pool.requests_running),
        ("akv_queue_length", "Requests waiting for admission.", pool.requests_waiting),
    ]
    lines: list[str] = []
    for name, help_text, value in rows:
        lines += _header(name, "gauge", help_text)
        lines.append(f"{name} {value}")
    lines += _header("akv_forward_passes_total", "counter",
                     "Forward passes, by kind: prefill (with prompt rows) or decode (decode rows only).")
    lines += [f'akv_forward_passes_total{{kind="{kind}"}} {count}' for kind, count in sorted(pool.passes.items())]
    lines += _header("akv_forward_seconds_total", "counter", "Wall seconds spent in forward passes, by kind.")
    lines += [f'akv_forward_seconds_total{{kind="{kind}"}} {_number(seconds)}'
              for kind, seconds in sorted(pool.pass_seconds.items())]
    return lines


def _header(name: str, kind: str, help_text: str) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf"
    return repr(float(value))
