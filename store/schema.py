"""The tables of an evolution run: runs, policies with their lineage, evaluations, validations.

Table names carry an `akv_` prefix because optuna keeps its own tables (studies, trials, ...)
in the same database.
"""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Optional

from sqlalchemy import JSON, Float, ForeignKey, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship


def utcnow() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


class Base(DeclarativeBase):
    pass


class SchemaVersion(Base):
    """One row per applied migration; the highest version is the schema's version."""

    __tablename__ = "akv_schema_version"
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    description: Mapped[str] = mapped_column(String(200))
    applied_at: Mapped[datetime] = mapped_column(default=utcnow)


class Run(Base):
    __tablename__ = "akv_runs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    seed: Mapped[int] = mapped_column(Integer, default=0)
    # running -> finished | stopped (a failing proposer, a budget) | killed runs stay "running"
    status: Mapped[str] = mapped_column(String(20), default="running")
    status_detail: Mapped[Optional[str]] = mapped_column(Text, nullable=True)
    code_version: Mapped[str] = mapped_column(String(100))
    suite_version: Mapped[str] = mapped_column(String(100))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    finished_at: Mapped[Optional[datetime]] = mapped_column(nullable=True)

    policies: Mapped[list["Policy"]] = relationship(back_populates="run")


class Policy(Base):
    """A candidate: proposed text, canonical text once parsed, lineage, proposal cost, fate."""

    __tablename__ = "akv_policies"
    __table_args__ = (UniqueConstraint("run_id", "hash", name="uq_policy_run_hash"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("akv_runs.id", ondelete="CASCADE"), index=True)
    # NULL for a rejected proposal (several may share a run); unique per run otherwise.
    hash: Mapped[Optional[str]] = mapped_column(String(64), nullable=True)
    text: Mapped[Optional[str]] = mapped_column(Text, nullable=True)  # canonical DSL
    raw_text: Mapped[Optional[str]] = mapped_column(Text, nullable=True)  # as proposed
    name: Mapped[Optional[str]] = mapped_column(String(100), nullable=True)  # builtins: their name
    generation: Mapped[int] = mapped_column(Integer, default=0)
    proposer: Mapped[str] = mapped_column(String(40))  # seed | baseline | llm | optuna | mutate
    # proposed -> rejected | duplicate | pruned (cascade) | evaluated
    status: Mapped[str] = mapped_column(String(20), default="proposed")
    # Semantic identity (evolve/dedup.py): canonical text without tunable ranges, and the decisions on
    # the run's recorded train histories. A duplicate names the stored policy it repeats.
    structure_hash: Mapped[Optional[str]] = mapped_column(String(64), nullable=True)
    behaviour_hash: Mapped[Optional[str]] = mapped_column(String(64), nullable=True)
    duplicate_of: Mapped[Optional[int]] = mapped_column(Integer, nullable=True)
    rejection_reason: Mapped[Optional[str]] = mapped_column(Text, nullable=True)
    prompt: Mapped[Optional[str]] = mapped_column(Text, nullable=True)
    response: Mapped[Optional[str]] = mapped_column(Text, nullable=True)
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    proposal_cost_usd: Mapped[float] = mapped_column(Float, default=0.0)
    meta: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)  # proposer detail (edit, trial)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    run: Mapped[Run] = relationship(back_populates="policies")
    parent_links: Mapped[list["PolicyParent"]] = relationship(
        foreign_keys="PolicyParent.child_id", order_by="PolicyParent.rank", cascade="all, delete-orphan"
    )

    @property
    def parent_ids(self) -> list[int]:
        return [link.parent_id for link in self.parent_links]


class PolicyParent(Base):
    """Lineage edge; a crossover child has two parents (rank 0 and 1)."""

    __tablename__ = "akv_policy_parents"
    child_id: Mapped[int] = mapped_column(ForeignKey("akv_policies.id", ondelete="CASCADE"), primary_key=True)
    parent_id: Mapped[int] = mapped_column(ForeignKey("akv_policies.id", ondelete="CASCADE"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, default=0)


class Evaluation(Base):
    """One policy on one task of one split."""

    __tablename__ = "akv_evaluations"
    __table_args__ = (UniqueConstraint("policy_id", "task_id", "split", name="uq_eval_policy_task_split"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("akv_runs.id", ondelete="CASCADE"), index=True)
    policy_id: Mapped[int] = mapped_column(ForeignKey("akv_policies.id", ondelete="CASCADE"), index=True)
    task_id: Mapped[str] = mapped_column(String(200))
    split: Mapped[str] = mapped_column(String(40))
    status: Mapped[str] = mapped_column(String(40))
    score: Mapped[float] = mapped_column(Float, default=0.0)
    cost_usd: Mapped[float] = mapped_column(Float, default=0.0)
    n_requests: Mapped[int] = mapped_column(Integer, default=0)
    tokens: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    wall_s: Mapped[float] = mapped_column(Float, default=0.0)
    error: Mapped[Optional[str]] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    worker_id: Mapped[Optional[int]] = mapped_column(Integer, nullable=True)  # the process that evaluated it


class Worker(Base):
    """A process that took part in a run: its `akv evolve` process (role evolve) or an `akv worker`."""

    __tablename__ = "akv_workers"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("akv_runs.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(200))  # host:pid
    role: Mapped[str] = mapped_column(String(20))  # evolve | worker
    concurrency: Mapped[int] = mapped_column(Integer, default=1)
    backend: Mapped[str] = mapped_column(Text, default="")
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_seen: Mapped[datetime] = mapped_column(default=utcnow)


class WorkItem(Base):
    """One task of one policy on one split, queued for whichever worker leases it first.

    pending -> leased (worker_id, lease_until on the database's clock, in epoch seconds) -> done.
    A lease not renewed by `lease_until` (its worker died) may be taken again by another worker.
    """

    __tablename__ = "akv_work"
    __table_args__ = (UniqueConstraint("run_id", "policy_id", "split", "task_id", name="uq_work_item"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("akv_runs.id", ondelete="CASCADE"), index=True)
    policy_id: Mapped[int] = mapped_column(ForeignKey("akv_policies.id", ondelete="CASCADE"))
    split: Mapped[str] = mapped_column(String(40))
    task_id: Mapped[str] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(20), default="pending")
    worker_id: Mapped[Optional[int]] = mapped_column(Integer, nullable=True)
    lease_until: Mapped[Optional[float]] = mapped_column(Float, nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)  # times leased


class Timeline(Base):
    """The message timeline of one train evaluation (evolve/reflection.py), for reflective proposers.

    A few KB per task; held-out evaluations get none (proposers see train results only).
    """

    __tablename__ = "akv_timelines"
    evaluation_id: Mapped[int] = mapped_column(ForeignKey("akv_evaluations.id", ondelete="CASCADE"),
                                               primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("akv_runs.id", ondelete="CASCADE"), index=True)
    policy_id: Mapped[int] = mapped_column(ForeignKey("akv_policies.id", ondelete="CASCADE"), index=True)
    data: Mapped[dict[str, Any]] = mapped_column(JSON)


class ValidationRound(Base):
    """One held-out validation of a run: which code judged which suite build, with which settings.

    A run's first validation is round 1; validating again (`--revalidate`) adds a round and never
    deletes an earlier one.
    """

    __tablename__ = "akv_validation_rounds"
    __table_args__ = (UniqueConstraint("run_id", "round", name="uq_validation_round"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("akv_runs.id", ondelete="CASCADE"), index=True)
    round: Mapped[int] = mapped_column(Integer)
    code_version: Mapped[str] = mapped_column(String(100))
    suite_version: Mapped[str] = mapped_column(String(100))
    settings: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)  # the validation config used
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Validation(Base):
    """Held-out summary of one policy (a candidate or a baseline) in one validation round."""

    __tablename__ = "akv_validations"
    __table_args__ = (UniqueConstraint("run_id", "round", "policy_id", name="uq_validation_run_round_policy"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("akv_runs.id", ondelete="CASCADE"), index=True)
    round: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    policy_id: Mapped[int] = mapped_column(ForeignKey("akv_policies.id", ondelete="CASCADE"))
    role: Mapped[str] = mapped_column(String(20))  # candidate | baseline
    label: Mapped[str] = mapped_column(String(100))
    n_tasks: Mapped[int] = mapped_column(Integer)
    score_mean: Mapped[float] = mapped_column(Float)
    cost_mean: Mapped[float] = mapped_column(Float)
    stats: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)  # deltas vs each baseline, the rule
    non_dominated: Mapped[bool] = mapped_column(default=False)
    champion: Mapped[bool] = mapped_column(default=False)
    verdict: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Baseline(Base):
    """Which stored policy plays which baseline role (standard, text_engineering, expert, full) in a run."""

    __tablename__ = "akv_baselines"
    run_id: Mapped[int] = mapped_column(ForeignKey("akv_runs.id", ondelete="CASCADE"), primary_key=True)
    role: Mapped[str] = mapped_column(String(40), primary_key=True)
    policy_id: Mapped[int] = mapped_column(ForeignKey("akv_policies.id", ondelete="CASCADE"))


class TraceSet(Base):
    """A named set of recorded agent runs (`akv traces import`, `akv proxy --record`): a trace suite."""

    __tablename__ = "akv_trace_sets"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class TraceRow(Base):
    """One recorded agent run: its messages, tool schemas, recorded requests and provenance.

    `trace_id` is the id it came with (unique in its set); `digest` identifies its content, so a
    second import of the same file changes nothing and a different run under a known id is refused.
    """

    __tablename__ = "akv_traces"
    __table_args__ = (UniqueConstraint("set_id", "trace_id", name="uq_trace_set_id"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    set_id: Mapped[int] = mapped_column(ForeignKey("akv_trace_sets.id", ondelete="CASCADE"), index=True)
    trace_id: Mapped[str] = mapped_column(String(200))
    digest: Mapped[str] = mapped_column(String(64))
    actions: Mapped[str] = mapped_column(String(20), default="tools")  # tools | text
    messages: Mapped[list[Any]] = mapped_column(JSON)
    tools: Mapped[list[Any]] = mapped_column(JSON, default=list)
    requests: Mapped[list[Any]] = mapped_column(JSON, default=list)  # per assistant message: usage, latency
    provenance: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class LivePolicyEntry(Base):
    """One change of the live policy of a trace set that a refining proxy serves (`akv proxy --refine`).

    `kind`: start (the policy the proxy was started with), promotion (a candidate of run `run_name`
    that the champion rule crowned over the live policy and the expert; `figures` holds both
    verdicts) or rollback (`restores` names the entry whose policy came back). The latest entry of
    a set is its live policy; entries are never changed or deleted, so they are its lineage.
    """

    __tablename__ = "akv_live_policies"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    set_name: Mapped[str] = mapped_column(String(200), index=True)
    kind: Mapped[str] = mapped_column(String(20))
    name: Mapped[str] = mapped_column(String(200))  # the label requests record: `best`, `mytraffic.r3#12`
    text: Mapped[str] = mapped_column(Text)
    run_name: Mapped[Optional[str]] = mapped_column(String(200), nullable=True)
    policy_id: Mapped[Optional[int]] = mapped_column(Integer, nullable=True)  # the run's policy
    restores: Mapped[Optional[int]] = mapped_column(Integer, nullable=True)
    figures: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    note: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class RefineRound(Base):
    """One evolution a refiner ran on the recent traffic of a trace set, and what came of it.

    running -> promoted | kept (no proven winner) | dry_run (a winner, not promoted) | failed |
    timed_out | interrupted (its refiner died). `through` is when the newest conversation of its
    window last changed: conversations finished after it are the new traffic of the next round.
    """

    __tablename__ = "akv_refine_rounds"
    __table_args__ = (UniqueConstraint("set_name", "number", name="uq_refine_round"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    set_name: Mapped[str] = mapped_column(String(200), index=True)
    number: Mapped[int] = mapped_column(Integer)
    run_name: Mapped[str] = mapped_column(String(200))  # the evolution run, and the window's trace set
    status: Mapped[str] = mapped_column(String(20), default="running")
    detail: Mapped[str] = mapped_column(Text, default="")
    traces: Mapped[int] = mapped_column(Integer, default=0)
    through: Mapped[Optional[datetime]] = mapped_column(nullable=True)
    live_id: Mapped[Optional[int]] = mapped_column(Integer, nullable=True)  # the live entry it was judged against
    figures: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[Optional[datetime]] = mapped_column(nullable=True)


class ConversationSavings(Base):
    """One recorded conversation replayed under the policy that served it, the expert and `full`.

    Replayed on the replay backend (costs in USD); `digest` is the trace's content when measured,
    so a conversation that went on is measured again. `skipped` holds why a conversation could not
    be measured (bad content, a policy whose text is unknown); its figures are then zero.
    """

    __tablename__ = "akv_conversation_savings"
    __table_args__ = (UniqueConstraint("set_name", "trace_id", name="uq_conversation_savings"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    set_name: Mapped[str] = mapped_column(String(200), index=True)
    trace_id: Mapped[str] = mapped_column(String(200))
    digest: Mapped[str] = mapped_column(String(64))
    policy: Mapped[str] = mapped_column(String(200))
    requests: Mapped[int] = mapped_column(Integer, default=0)
    cost_usd: Mapped[float] = mapped_column(Float, default=0.0)
    expert_cost_usd: Mapped[float] = mapped_column(Float, default=0.0)
    full_cost_usd: Mapped[float] = mapped_column(Float, default=0.0)
    lost_reuses: Mapped[int] = mapped_column(Integer, default=0)
    reuses: Mapped[int] = mapped_column(Integer, default=0)
    drops: Mapped[int] = mapped_column(Integer, default=0)
    repositions: Mapped[int] = mapped_column(Integer, default=0)
    skipped: Mapped[Optional[str]] = mapped_column(Text, nullable=True)
    measured_at: Mapped[datetime] = mapped_column(default=utcnow)
