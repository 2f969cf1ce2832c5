"""`/metrics` of the proxy in the Prometheus text format: what the policy did and how the upstream fared.

Counters are updated and read on the event loop only, so they need no lock.
"""
from __future__ import annotations

import json
from collections import Counter
from typing import Any, Mapping

from akv_proxy.step import Applied

USAGE_KINDS = {"cached_tokens": "cached", "drop_skipped_tokens": "drop_skipped", "repos_tokens": "repos",
               "prefilled_tokens": "prefilled"}


class ProxyMetrics:
    def __init__(self, policy: str) -> None:
        self.policy = policy
        self.requests: Counter[str] = Counter()     # outcome -> requests
        self.effects: Counter[str] = Counter()      # drop, reposition, summarize, ... -> requests with it
        self.dropped_tokens = 0
        self.summaries = 0
        self.upstream_errors: Counter[str] = Counter()  # reason -> count
        self.usage: Counter[str] = Counter({kind: 0 for kind in ("prompt", "completion", *USAGE_KINDS.values())})

    def decided(self, applied: Applied) -> None:
        """One request the policy decided on (or passed through untouched)."""
        if applied.passthrough:
            self.requests["passthrough"] += 1
            return
        self.requests["decided"] += 1
        self.effects.update(applied.effects or ("none",))
        self.dropped_tokens += applied.dropped_tokens
        self.summaries += applied.summaries

    def observe_usage(self, usage: Any) -> None:
        """The upstream's usage of one reply, as it came back (unchanged) to the client."""
        if not isinstance(usage, Mapping):
            return
        self.usage["prompt"] += _int(usage.get("prompt_tokens"))
        self.usage["completion"] += _int(usage.get("completion_tokens"))
        details = usage.get("prompt_tokens_details")
        if isinstance(details, Mapping):
            for field, kind in USAGE_KINDS.items():
                self.usage[kind] += _int(details.get(field))

    def observe_sse_line(self, line: bytes) -> None:
        """A streamed line: the chunk that carries usage (stream_options.include_usage) is counted."""
        if line.startswith(b"data: {") and b'"usage"' in line:
            try:
                self.observe_usage(json.loads(line[len(b"data: "):]).get("usage"))
            except (ValueError, AttributeError):
                return

    def render(self) -> str:
        lines: list[str] = []
        _counter(lines, "akv_proxy_requests_total", "Chat requests, by outcome (decided by the policy, passed "
                 "through with their own AKV fields, rejected).", "outcome", self.requests)
        _counter(lines, "akv_proxy_decisions_total", "Decided requests, by what the policy did to them.",
                 "effect", self.effects)
        _counter(lines, "akv_proxy_dropped_tokens_total", "Tokens of the history hidden from attention (kv) or "
                 "edited away (text), summed over requests.", None, {"": self.dropped_tokens})
        _counter(lines, "akv_proxy_summaries_total", "Summary requests sent upstream by text-mode policies.",
                 None, {"": self.summaries})
        _counter(lines, "akv_proxy_upstream_errors_total", "Upstream failures, by reason.", "reason",
                 self.upstream_errors)
        _counter(lines, "akv_proxy_upstream_tokens_total", "Usage the upstream reported, by kind.", "kind", self.usage)
        lines += ["# HELP akv_proxy_info The policy this proxy applies.", "# TYPE akv_proxy_info gauge",
                  f'akv_proxy_info{{policy="{_escape(self.policy)}"}} 1']
        return "\n".join(lines) + "\n"


def _counter(lines: list[str], name: str, help_text: str, label: str | None, values: Mapping[str, int]) -> None:
    lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
    for key, value in sorted(values.items()):
        lines.append(f'{name}{{{label}="{_escape(key)}"}} {value}' if label else f"{name} {value}")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
