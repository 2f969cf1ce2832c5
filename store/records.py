"""Plain frozen records that leave the store; callers never hold ORM objects or sessions."""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Mapping


@dataclass(frozen=True)
class RunInfo:
    id: int
    name: str
    config: Mapping[str, Any]
    seed: int
    status: str
    status_detail: str | None
    code_version: str
    suite_version: str
    created_at: datetime
    finished_at: datetime | None
    n_policies: int = 0
    n_evaluations: int = 0


@dataclass(frozen=True)
class Proposal:
    """What a proposer hands the store: a candidate (parsed or not) and how it came about."""

    proposer: str
    raw_text: str | None
    parent_ids: tuple[int, ...] = ()
    generation: int = 0
    text: str | None = None  # canonical text, set once it parsed and validated
    hash: str | None = None
    name: str | None = None
    rejection_reason: str | None = None
    prompt: str | None = None
    response: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    meta: Mapping[str, Any] = field(default_factory=dict)
    structure_hash: str | None = None  # canonical text without tunable ranges (evolve/dedup.py)
    behaviour_hash: str | None = None  # decisions on the run's recorded train histories
    duplicate_of: int | None = None  # set: stored as a duplicate of that policy, never evaluated


@dataclass(frozen=True)
class PolicyInfo:
    id: int
    run_id: int
    hash: str | None
    text: str | None
    raw_text: str | None
    name: str | None
    generation: int
    proposer: str
    status: str
    rejection_reason: str | None
    parent_ids: tuple[int, ...]
    prompt_tokens: int
    completion_tokens: int
    proposal_cost_usd: float
    meta: Mapping[str, Any]
    prompt: str | None = None
    response: str | None = None
    structure_hash: str | None = None
    behaviour_hash: str | None = None
    duplicate_of: int | None = None

    @property
    def label(self) -> str:
        return self.name or f"#{self.id}"


@dataclass(frozen=True)
class TaskResult:
    """One task's outcome as the store keeps it, from the harness's `sandbox.runs.harness.TaskOutcome`."""

    task_id: str
    split: str
    status: str
    score: float
    cost_usd: float
    n_requests: int = 0
    tokens: Mapping[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    error: str | None = None
    # The message timeline (evolve/reflection.py); stored beside the result, read by `Store.timelines`.
    timeline: Mapping[str, Any] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class EvaluationRecord:
    policy_id: int
    result: TaskResult


@dataclass(frozen=True)
class TimelineRecord:
    """A stored timeline: the policy and the split and task of the evaluation it belongs to."""

    policy_id: int
    task_id: str
    split: str
    data: Mapping[str, Any]


@dataclass(frozen=True)
class ValidationRecord:
    policy_id: int
    role: str  # candidate | baseline
    label: str
    n_tasks: int
    score_mean: float
    cost_mean: float
    stats: Mapping[str, Any]
    non_dominated: bool
    champion: bool
    verdict: str


@dataclass(frozen=True)
class ValidationRound:
    """One held-out validation of a run (round 1, 2, ...): which code judged which suite build."""

    round: int
    code_version: str
    suite_version: str
    settings: Mapping[str, Any]
    created_at: datetime
    n_policies: int


@dataclass(frozen=True)
class StoredTrace:
    """One recorded agent run as the store keeps it (sandbox/traces/model.py's `Trace`, as JSON)."""

    trace_id: str
    digest: str
    messages: tuple[Mapping[str, Any], ...]
    tools: tuple[Mapping[str, Any], ...] = ()
    requests: tuple[Mapping[str, Any], ...] = ()
    actions: str = "tools"
    provenance: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TraceSetInfo:
    name: str
    n_traces: int
    n_messages: int
    n_requests: int
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True)
class TraceIndexEntry:
    """A trace of a set without its content: enough to tell new, changed and finished conversations."""

    trace_id: str
    digest: str
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True)
class LiveEntry:
    """One entry of a trace set's live-policy lineage (`store.schema.LivePolicyEntry`)."""

    id: int
    set_name: str
    kind: str  # start | promotion | rollback
    name: str
    text: str
    run_name: str | None
    policy_id: int | None
    restores: int | None
    figures: Mapping[str, Any]
    note: str
    created_at: datetime

    @property
    def origin(self) -> int:
        """The entry that first made this policy live: the restored one for a rollback, else itself."""
        return self.restores if self.restores is not None else self.id


@dataclass(frozen=True)
class RoundInfo:
    """One refinement round (`store.schema.RefineRound`)."""

    id: int
    set_name: str
    number: int
    run_name: str
    status: str
    detail: str
    traces: int
    through: datetime | None
    live_id: int | None
    figures: Mapping[str, Any]
    started_at: datetime
    finished_at: datetime | None


@dataclass(frozen=True)
class ConversationCost:
    """One conversation replayed under the policy that served it, the expert and `full` (USD)."""

    trace_id: str
    digest: str
    policy: str
    requests: int = 0
    cost_usd: float = 0.0
    expert_cost_usd: float = 0.0
    full_cost_usd: float = 0.0
    lost_reuses: int = 0
    reuses: int = 0  # the reuses its fidelity score counts (lost_reuses of them were hidden)
    drops: int = 0
    repositions: int = 0
    skipped: str | None = None  # why it could not be measured; the figures are then zero


@dataclass(frozen=True)
class PolicyTotals:
    """What one served policy's measured conversations cost, and what the expert and `full` would have."""

    policy: str
    conversations: int
    requests: int
    cost_usd: float
    expert_cost_usd: float
    full_cost_usd: float
    lost_reuses: int
    reuses: int
    drops: int
    repositions: int
    skipped: int  # conversations that could not be measured
