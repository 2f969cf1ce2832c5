"""What a recorded conversation cost under the policy that served it, and what the expert and `full` would have.

A refining proxy (`akv proxy --refine`) serves each conversation with one policy and records it.
Its refiner replays every finished conversation three times on the replay backend (the engine's
own accounting, one fresh cache per run): under the policy that served it, under the expert (the
trace suite's `baselines["expert"]`, the paper's keep-12) and under `full` (no drop), the agent
sending the recorded messages (`TraceAgent`). The same accounting on the same requests, so the
three costs compare; the served policy's fidelity gives the reuses it hid (lost, of those the
score counts), and the last request it sent its drops (messages hidden) and repositions.

A conversation that cannot be replayed (bad content: a tool message that answers no call, no
assistant message; a replay that errs) is skipped with the reason, never measured halfway.
"""
from __future__ import annotations

from typing import Any

from store.records import ConversationCost

from sandbox.traces.model import Trace, TraceError, check_trace
from sandbox.traces.suite import SPLITS, TraceSuite


def served_policy(trace: Trace) -> str | None:
    """The name of the policy that served the conversation: its last request's, else its provenance's."""
    recorded = next((r.policy for r in reversed(trace.requests) if r.policy), None)
    named = trace.provenance.get("policy")
    return recorded or (named if isinstance(named, str) and named else None)


def skipped(trace: Trace, policy: str, reason: str) -> ConversationCost:
    return ConversationCost(trace.id, trace.digest(), policy, skipped=reason)


def bad_content(trace: Trace) -> str | None:
    """Why the conversation cannot be replayed (`check_trace`), or None."""
    try:
        check_trace(trace, f"trace {trace.id}")
    except TraceError as err:
        return f"bad content: {err}"
    return None


def conversation_cost(suite: TraceSuite, trace: Trace, name: str, policy: Any) -> ConversationCost:
    """The conversation `trace` of `suite` replayed under `policy` (named `name`), the expert and `full`."""
    from sandbox.backends.replay import ReplayBackend
    from sandbox.runs.harness import resolve_policy, run_task

    problem = bad_content(trace)
    if problem is not None:
        return skipped(trace, name, problem)
    task = next(t for split in SPLITS for t in suite.tasks(split) if t.id == trace.id)
    results = {}
    for role, contender in (("policy", policy), ("expert", resolve_policy(suite.baselines["expert"])),
                            ("full", resolve_policy("full"))):
        result, trajectory = run_task(task, suite, contender, suite.scripted_agent(task), ReplayBackend())
        if result.status == "error":
            return skipped(trace, name, f"its replay under {role} failed: {result.reason}")
        results[role] = (result, trajectory)
    served, trajectory = results["policy"]
    reuses = suite.scored_reuses(trace.id)  # the fidelity score's denominator
    drops, repositions = _operations(trajectory)
    return ConversationCost(trace.id, trace.digest(), name, served.n_requests, served.cost_usd,
                            results["expert"][0].cost_usd, results["full"][0].cost_usd,
                            round((1.0 - served.score) * reuses), reuses, drops, repositions)


def _operations(trajectory: Any) -> tuple[int, int]:
    """(messages dropped, repositions) by the end of a replay: kv fields are cumulative, so the last
    agent request holds them all; a text policy's edits count as its drops."""
    agent = [ex for ex in trajectory.exchanges if ex.purpose == "agent"]
    if not agent:
        return 0, 0
    last = agent[-1].request
    dropped = {index for ids in last.drop_message.values() for index in ids}
    edits = sum(len(note.get("edits", ())) for note in trajectory.notes if note.get("type") == "text_edits")
    return len(dropped) + edits, len(last.reposition)
