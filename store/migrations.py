"""A small versioned migration table.

A fresh database gets the current schema from the models and is stamped with the latest
version. An existing database runs, in order, every step newer than its stamped version, in
the caller's transaction; steps that change tables use alembic's operations (batch mode on
SQLite, which rebuilds a table to change its constraints), so one step serves SQLite and
PostgreSQL alike. A database stamped newer than this code refuses to open rather than guess.
"""
from __future__ import annotations

from typing import Callable

from alembic.migration import MigrationContext
from alembic.operations import Operations
from sqlalchemy import Column, Connection, Integer, String, inspect, select, text

from store.errors import StoreError
from store.schema import (Base, ConversationSavings, LivePolicyEntry, RefineRound, Run, SchemaVersion, Timeline,
                          TraceRow, TraceSet, Validation, ValidationRound, WorkItem, Worker)

Step = Callable[[Connection], None]


def _create_tables(conn: Connection) -> None:
    Base.metadata.create_all(conn)


def _index_evaluations_by_split(conn: Connection) -> None:
    # Run summaries read all evaluations of one split of one run.
    conn.execute(text("CREATE INDEX IF NOT EXISTS ix_akv_eval_run_split ON akv_evaluations (run_id, split)"))


def _identities_and_validation_rounds(conn: Connection) -> None:
    # A fresh database is created at the latest schema (migrate stamps this step there too).
    if "structure_hash" in {c["name"] for c in inspect(conn).get_columns("akv_policies")}:
        return
    ops = Operations(MigrationContext.configure(conn))
    ops.add_column("akv_policies", Column("structure_hash", String(64), nullable=True))
    ops.add_column("akv_policies", Column("behaviour_hash", String(64), nullable=True))
    ops.add_column("akv_policies", Column("duplicate_of", Integer, nullable=True))
    ValidationRound.__table__.create(conn)
    with ops.batch_alter_table("akv_validations") as batch:
        batch.add_column(Column("round", Integer, nullable=False, server_default="1"))
        batch.drop_constraint("uq_validation_run_policy", type_="unique")
        batch.create_unique_constraint("uq_validation_run_round_policy", ["run_id", "round", "policy_id"])
    # Every validation stored so far becomes round 1 of its run, judged by the run's own versions.
    validated = conn.execute(select(Validation.run_id).distinct()).scalars().all()
    for run in conn.execute(select(Run).where(Run.id.in_(validated))).all():
        conn.execute(ValidationRound.__table__.insert().values(
            run_id=run.id, round=1, code_version=run.code_version, suite_version=run.suite_version,
            settings=(run.config or {}).get("validation", {})))


def _timelines(conn: Connection) -> None:
    # Message timelines of train evaluations, for reflective proposers; earlier runs simply have none.
    Timeline.__table__.create(conn, checkfirst=True)


def _work_leases_and_workers(conn: Connection) -> None:
    # A fresh database is created at the latest schema (migrate runs this step there too).
    if "worker_id" in {c["name"] for c in inspect(conn).get_columns("akv_evaluations")}:
        return
    Operations(MigrationContext.configure(conn)).add_column(
        "akv_evaluations", Column("worker_id", Integer, nullable=True))
    Worker.__table__.create(conn)
    WorkItem.__table__.create(conn)


def _traces(conn: Connection) -> None:
    # Recorded agent runs as evaluation data (`akv traces import`, `akv proxy --record`).
    TraceSet.__table__.create(conn, checkfirst=True)
    TraceRow.__table__.create(conn, checkfirst=True)


def _refining_proxies(conn: Connection) -> None:
    # `akv proxy --refine`: the live policy of each trace set with its lineage, the evolutions tried,
    # and what each recorded conversation cost under its policy, the expert and full. New tables only.
    for table in (LivePolicyEntry, RefineRound, ConversationSavings):
        table.__table__.create(conn, checkfirst=True)


MIGRATIONS: list[tuple[int, str, Step]] = [
    (1, "runs, policies, lineage, evaluations, validations, baselines", _create_tables),
    (2, "index evaluations by run and split", _index_evaluations_by_split),
    (3, "policy structure, behaviour and duplicate_of; validation rounds", _identities_and_validation_rounds),
    (4, "message timelines of train evaluations", _timelines),
    (5, "work leases, workers, and the worker of each evaluation", _work_leases_and_workers),
    (6, "trace sets and traces: recorded agent runs", _traces),
    (7, "refining proxies: live policies and their lineage, refinement rounds, conversation savings",
     _refining_proxies),
]
LATEST = MIGRATIONS[-1][0]


def current_version(conn: Connection) -> int:
    """The schema version stamped in the database; 0 for a database without our tables."""
    if not inspect(conn).has_table(SchemaVersion.__tablename__):
        return 0
    versions = conn.execute(select(SchemaVersion.version)).scalars().all()
    return max(versions, default=0)


def check_known(version: int) -> None:
    """StoreError for a schema stamped newer than this code: it refuses to guess at its tables."""
    if version > LATEST:
        raise StoreError(
            f"database schema version {version} is newer than this akv understands ({LATEST}); upgrade akv"
        )


def migrate(conn: Connection) -> int:
    """Bring the schema to LATEST inside the caller's transaction; return the version reached."""
    version = current_version(conn)
    check_known(version)
    if version == 0:
        _create_tables(conn)
        pending = MIGRATIONS  # stamp every step: create_all already produced the latest schema
        for step_version, description, step in pending:
            if step_version > 1:
                step(conn)
            conn.execute(SchemaVersion.__table__.insert().values(version=step_version, description=description))
        return LATEST
    for step_version, description, step in MIGRATIONS:
        if step_version > version:
            step(conn)
            conn.execute(SchemaVersion.__table__.insert().values(version=step_version, description=description))
    return LATEST
