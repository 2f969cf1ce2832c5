"""`/metrics` of the proxy in the Prometheus text format: what the policy did and how the upstream fared.

Counters are updated and read on the event loop only, so they need no lock. A refining proxy adds
`RefineMetrics`: its live policy, whether the store answers, and what each served policy's
conversations cost, replayed under it, the expert and `full` (figures the refiner stores).
"""
from __future__ import annotations

import json
from collections import Counter
from typing import Any, Mapping

from akv_proxy.live import LiveState
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
        self.by_policy: Counter[tuple[str, str]] = Counter()  # (policy, effect) -> decided requests with it
        self.served: Counter[str] = Counter()  # policy -> decided requests

    def decided(self, applied: Applied) -> None:
        """One request the policy decided on (or passed through untouched)."""
        if applied.passthrough:
            self.requests["passthrough"] += 1
            return
        self.requests["decided"] += 1
        self.effects.update(applied.effects or ("none",))
        self.served[applied.policy] += 1
        self.by_policy.update((applied.policy, effect) for effect in applied.effects or ("none",))
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
        _samples(lines, "akv_proxy_policy_requests_total", "Decided requests, by the policy that served them.",
                 "counter", {(("policy", p),): n for p, n in self.served.items()})
        _samples(lines, "akv_proxy_policy_decisions_total", "Decided requests, by policy and what it did to them.",
                 "counter", {(("policy", p), ("effect", e)): n for (p, e), n in self.by_policy.items()})
        lines += ["# HELP akv_proxy_info The policy this proxy applies (to new conversations).",
                  "# TYPE akv_proxy_info gauge", f'akv_proxy_info{{policy="{_escape(self.policy)}"}} 1']
        return "\n".join(lines) + "\n"


class RefineMetrics:
    """A refining proxy's view of its store: reachable or not, the live policy, the refinement's figures."""

    def __init__(self) -> None:
        self.reachable = True
        self.poll_errors = 0
        self.changes = 0  # live policy swaps seen (promotions, rollbacks)
        self.state: LiveState | None = None  # the last state polled

    def render(self, live: str) -> str:
        lines: list[str] = []
        _samples(lines, "akv_proxy_store_reachable", "1 while the store answers the proxy's polls; 0 while it does "
                 "not (the proxy keeps serving its live policy).", "gauge", {(): int(self.reachable)})
        _samples(lines, "akv_proxy_store_poll_errors_total", "Polls of the store that failed.", "counter",
                 {(): self.poll_errors})
        _samples(lines, "akv_proxy_live_policy_changes_total", "Live policy changes taken up (promotions, "
                 "rollbacks).", "counter", {(): self.changes})
        state = self.state
        entry = str(state.entry) if state is not None else ""
        _samples(lines, "akv_proxy_live_policy", "The policy new conversations get, with its lineage entry.",
                 "gauge", {(("policy", live), ("entry", entry)): 1})
        if state is None:
            return "\n".join(lines) + "\n"
        _samples(lines, "akv_proxy_refiner_up", "1 while the refiner process runs.", "gauge",
                 {(): int(state.refiner_pid is not None)})
        _samples(lines, "akv_proxy_refine_rounds", "Refinement rounds, by outcome (promoted, kept, dry_run, failed, "
                 "timed_out, interrupted, running).", "gauge", {(("outcome", o),): n for o, n in state.rounds.items()})
        self._savings(lines, state)
        return "\n".join(lines) + "\n"

    @staticmethod
    def _savings(lines: list[str], state: LiveState) -> None:
        rows = state.savings
        _samples(lines, "akv_proxy_policy_conversations", "Finished conversations measured, by the policy that "
                 "served them (replayed on the replay backend).", "gauge",
                 {(_policy(s),): s.conversations for s in rows})
        _samples(lines, "akv_proxy_policy_conversations_skipped", "Finished conversations that could not be "
                 "measured (bad content; the refiner logs why).", "gauge", {(_policy(s),): s.skipped for s in rows})
        _samples(lines, "akv_proxy_policy_cost_usd", "What the measured conversations cost, replayed under the "
                 "policy that served them and, counterfactually, under the expert and full.", "gauge",
                 {(_policy(s), ("under", under)): round(cost, 9) for s in rows for under, cost in
                  (("policy", s.cost_usd), ("expert", s.expert_cost_usd), ("full", s.full_cost_usd))})
        _samples(lines, "akv_proxy_policy_lost_reuses_per_conversation", "Reuses the policy hid from the model "
                 "(the fidelity score's lost reuses), per measured conversation.", "gauge",
                 {(_policy(s),): round(s.lost_reuses / s.conversations, 6) for s in rows if s.conversations})
        _samples(lines, "akv_proxy_policy_drops", "Messages the policy dropped in its measured conversations.",
                 "gauge", {(_policy(s),): s.drops for s in rows})
        _samples(lines, "akv_proxy_policy_repositions", "Repositions the policy made in its measured conversations.",
                 "gauge", {(_policy(s),): s.repositions for s in rows})


def _counter(lines: list[str], name: str, help_text: str, label: str | None, values: Mapping[str, int]) -> None:
    lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
    for key, value in sorted(values.items()):
        lines.append(f'{name}{{{label}="{_escape(key)}"}} {value}' if label else f"{name} {value}")


def _policy(savings: Any) -> tuple[str, str]:
    """The label of a per-policy sample."""
    return ("policy", savings.policy)


def _samples(lines: list[str], name: str, help_text: str, kind: str,
             values: Mapping[tuple[tuple[str, str], ...], float]) -> None:
    """One metric of any labels: `values` maps each sample's (label, value) pairs to its value."""
    lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    for labels, value in sorted(values.items()):
        shown = ",".join(f'{label}="{_escape(text)}"' for label, text in labels)
        lines.append(f"{name}{{{shown}}} {value}" if labels else f"{name} {value}")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
