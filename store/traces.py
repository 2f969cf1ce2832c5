"""Trace sets in the store: recorded agent runs, imported or recorded by the proxy.

Each write is one transaction: an import of many files lands whole or not at all, and a
recorded request replaces its conversation's trace atomically.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Callable, Iterable, Mapping, Sequence

from sqlalchemy import delete, func, inspect, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from store.database import default_url, display_url, open_read_only
from store.errors import StoreError, TraceConflict, TraceSetNotFound
from store.migrations import check_known, current_version
from store.records import StoredTrace, TraceIndexEntry, TraceSetInfo
from store.schema import TraceRow, TraceSet, utcnow


def trace_set_names(url: str | None = None) -> list[str]:
    """The names of the trace sets at `url` (default: AKV_DB, else the data folder's database), read
    without writing anything: nothing is migrated (a schema from before trace sets has none), nothing
    is created where no database exists (none then). StoreError if it cannot be read, or its schema
    is newer than this code."""
    url = url or default_url(create_folder=False)
    engine = open_read_only(url)
    if engine is None:
        return []
    try:
        with engine.connect() as conn:
            check_known(current_version(conn))
            if not inspect(conn).has_table(TraceSet.__tablename__):
                return []
            return list(conn.scalars(select(TraceSet.name).order_by(TraceSet.name)))
    except SQLAlchemyError as err:
        reason = str(getattr(err, "orig", err)).splitlines()[0]
        raise StoreError(f"--db: cannot read {display_url(url)}: {reason}") from None
    finally:
        engine.dispose()


class TraceStore:
    """The store's door to trace sets (`Store.traces`): `tx()` opens one transaction of the store at
    `display_url`."""

    def __init__(self, tx: Callable[[], AbstractContextManager[Session]], display_url: str) -> None:
        self._tx, self._display_url = tx, display_url

    def add(self, name: str, traces: Iterable[StoredTrace]) -> tuple[int, int]:
        """Add traces to the set `name` (created if new): (added, unchanged), all in one transaction.

        A trace whose id the set holds with the same digest is unchanged; with another digest the
        whole import is refused (TraceConflict), so nothing is half-imported. `traces` is consumed
        one at a time and each row leaves the session once written, so an import of many large
        traces holds one in memory, not all (an exception the iterable raises rolls it all back).
        """
        added = unchanged = 0
        with self._tx() as s:
            trace_set = self._set(s, name, create=True)
            known = dict(s.execute(select(TraceRow.trace_id, TraceRow.digest)
                                   .where(TraceRow.set_id == trace_set.id)).all())
            for trace in traces:
                if trace.trace_id in known:
                    if known[trace.trace_id] != trace.digest:
                        raise TraceConflict(f"trace {trace.trace_id!r} is already in {name!r} with other content: "
                                            f"give it another id, or `akv traces delete {name}` first")
                    unchanged += 1
                    continue
                row = _row(trace_set.id, trace)
                s.add(row)
                s.flush()
                s.expunge(row)
                known[trace.trace_id] = trace.digest
                added += 1
            trace_set.updated_at = utcnow()
        return added, unchanged

    def held(self, name: str) -> dict[str, tuple[str, Mapping[str, Any]]]:
        """The set's trace ids with their digest and provenance (none when the set does not exist)."""
        with self._tx() as s:
            trace_set = s.scalar(select(TraceSet).where(TraceSet.name == name))
            if trace_set is None:
                return {}
            rows = s.execute(select(TraceRow.trace_id, TraceRow.digest, TraceRow.provenance)
                             .where(TraceRow.set_id == trace_set.id))
            return {trace_id: (digest, dict(provenance or {})) for trace_id, digest, provenance in rows}

    def put(self, name: str, trace: StoredTrace) -> None:
        """Insert the trace, or replace the set's trace of the same id (a conversation that went on)."""
        with self._tx() as s:
            trace_set = self._set(s, name, create=True)
            row = s.scalar(select(TraceRow).where(TraceRow.set_id == trace_set.id,
                                                  TraceRow.trace_id == trace.trace_id))
            if row is None:
                s.add(_row(trace_set.id, trace))
            else:
                row.digest, row.actions, row.messages = trace.digest, trace.actions, list(trace.messages)
                row.tools, row.requests = list(trace.tools), list(trace.requests)
                row.provenance = dict(trace.provenance)
            trace_set.updated_at = utcnow()

    def get(self, name: str, ids: Sequence[str] | None = None) -> list[StoredTrace]:
        """The set's traces (those of `ids` only, when given) in the order they were added."""
        with self._tx() as s:
            trace_set = self._set(s, name)
            query = select(TraceRow).where(TraceRow.set_id == trace_set.id).order_by(TraceRow.id)
            if ids is not None:
                query = query.where(TraceRow.trace_id.in_(list(ids)))
            return [_stored(r) for r in s.scalars(query)]

    def index(self, name: str) -> list[TraceIndexEntry]:
        """The set's traces without their content, in the order they were added ([] for no such set)."""
        with self._tx() as s:
            rows = s.execute(select(TraceRow.trace_id, TraceRow.digest, TraceRow.created_at, TraceRow.updated_at)
                             .join(TraceSet, TraceSet.id == TraceRow.set_id).where(TraceSet.name == name)
                             .order_by(TraceRow.id)).all()
            return [TraceIndexEntry(*row) for row in rows]

    def names(self) -> list[str]:
        with self._tx() as s:
            return list(s.scalars(select(TraceSet.name).order_by(TraceSet.name)))

    def sets(self) -> list[TraceSetInfo]:
        """Every set with its counts (messages and requests summed over its traces)."""
        with self._tx() as s:
            out = []
            for trace_set in s.scalars(select(TraceSet).order_by(TraceSet.name)):
                rows = s.execute(select(TraceRow.messages, TraceRow.requests)
                                 .where(TraceRow.set_id == trace_set.id)).all()
                out.append(TraceSetInfo(trace_set.name, len(rows), sum(len(m) for m, _ in rows),
                                        sum(len(r) for _, r in rows), trace_set.created_at, trace_set.updated_at))
            return out

    def delete(self, name: str) -> int:
        """Remove the set and its traces; returns how many traces went."""
        with self._tx() as s:
            trace_set = self._set(s, name)
            n = s.scalar(select(func.count(TraceRow.id)).where(TraceRow.set_id == trace_set.id)) or 0
            s.execute(delete(TraceRow).where(TraceRow.set_id == trace_set.id))
            s.delete(trace_set)
            return n

    def _set(self, s: Session, name: str, create: bool = False) -> TraceSet:
        trace_set = s.scalar(select(TraceSet).where(TraceSet.name == name))
        if trace_set is None and create:
            trace_set = TraceSet(name=name)
            s.add(trace_set)
            s.flush()
        if trace_set is None:
            known = ", ".join(s.scalars(select(TraceSet.name).order_by(TraceSet.name))) or "none yet"
            raise TraceSetNotFound(f"NAME: no trace set named {name!r} in {self._display_url} "
                                   f"(known: {known}; `akv traces import` adds one)")
        return trace_set


def _row(set_id: int, trace: StoredTrace) -> TraceRow:
    return TraceRow(set_id=set_id, trace_id=trace.trace_id, digest=trace.digest, actions=trace.actions,
                    messages=list(trace.messages), tools=list(trace.tools), requests=list(trace.requests),
                    provenance=dict(trace.provenance))


def _stored(row: TraceRow) -> StoredTrace:
    return StoredTrace(row.trace_id, row.digest, tuple(row.messages), tuple(row.tools or ()),
                       tuple(row.requests or ()), row.actions, dict(row.provenance or {}))
