"""A small versioned migration table.

A fresh database gets the current schema from the models and is stamped with the latest
version. An existing database runs, in order, every step newer than its stamped version.
A database stamped newer than this code refuses to open rather than guess.
"""
from __future__ import annotations

from typing import Callable

from sqlalchemy import Connection, inspect, select, text

from store.errors import StoreError
from store.schema import Base, SchemaVersion

Step = Callable[[Connection], None]


def _create_tables(conn: Connection) -> None:
    Base.metadata.create_all(conn)


def _index_evaluations_by_split(conn: Connection) -> None:
    # Run summaries read all evaluations of one split of one run.
    conn.execute(text("CREATE INDEX IF NOT EXISTS ix_akv_eval_run_split ON akv_evaluations (run_id, split)"))


MIGRATIONS: list[tuple[int, str, Step]] = [
    (1, "runs, policies, lineage, evaluations, validations, baselines", _create_tables),
    (2, "index evaluations by run and split", _index_evaluations_by_split),
]
LATEST = MIGRATIONS[-1][0]


def current_version(conn: Connection) -> int:
    """The schema version stamped in the database; 0 for a database without our tables."""
    if not inspect(conn).has_table(SchemaVersion.__tablename__):
        return 0
    versions = conn.execute(select(SchemaVersion.version)).scalars().all()
    return max(versions, default=0)


def migrate(conn: Connection) -> int:
    """Bring the schema to LATEST inside the caller's transaction; return the version reached."""
    version = current_version(conn)
    if version > LATEST:
        raise StoreError(
            f"database schema version {version} is newer than this akv understands ({LATEST}); upgrade akv"
        )
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
