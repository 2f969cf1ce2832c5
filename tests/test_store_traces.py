"""Trace sets in the store: SQLite and PostgreSQL alike, the migration from version 5, one transaction per import."""
from __future__ import annotations

import sqlite3

import pytest

from store import Proposal, Store
from store.errors import TraceConflict, TraceSetNotFound
from store.migrations import LATEST
from store.records import StoredTrace


def trace(trace_id: str, text: str = "hello", digest: str | None = None) -> StoredTrace:
    messages = ({"role": "user", "content": text}, {"role": "assistant", "content": "ok"})
    return StoredTrace(trace_id, digest or f"d-{trace_id}-{text}", messages, (),
                       ({"index": 1, "usage": {"prompt_tokens": 9}},), "tools", {"format": "openai", "line": 1})


def _contract(url: str) -> None:
    """What every store does with trace sets, checked after each operation."""
    store = Store.open(url)
    try:
        assert store.traces.add("a", [trace("t1"), trace("t2")]) == (2, 0)
        assert store.traces.add("a", [trace("t1"), trace("t3")]) == (1, 1)  # the same run again: unchanged
        assert [t.trace_id for t in store.traces.get("a")] == ["t1", "t2", "t3"]
        with pytest.raises(TraceConflict, match="'t2' is already in 'a' with other content"):
            store.traces.add("a", [trace("t4"), trace("t2", "changed")])
        assert [t.trace_id for t in store.traces.get("a")] == ["t1", "t2", "t3"]  # t4 did not land either
        got = store.traces.get("a")[0]
        assert got.messages == trace("t1").messages and got.requests[0]["usage"] == {"prompt_tokens": 9}
        store.traces.put("a", trace("t1", "longer", digest="d-new"))  # a conversation that went on
        assert store.traces.get("a")[0].digest == "d-new" and len(store.traces.get("a")) == 3
        [info] = store.traces.sets()
        assert (info.name, info.n_traces, info.n_messages, info.n_requests) == ("a", 3, 6, 3)
        assert store.traces.delete("a") == 3 and store.traces.names() == []
        with pytest.raises(TraceSetNotFound, match="no trace set named 'a'"):
            store.traces.get("a")
    finally:
        store.close()


def test_trace_sets_in_sqlite(tmp_path) -> None:
    _contract(f"sqlite:///{tmp_path / 'akv.db'}")


def test_trace_sets_in_postgresql(postgres_url) -> None:
    _contract(postgres_url)


def test_a_version_5_database_gets_trace_tables_and_keeps_its_runs(tmp_path) -> None:
    path = tmp_path / "old.db"
    store = Store.open(f"sqlite:///{path}")
    run = store.create_run("kept", {}, 0, "v", "s")
    store.add_policy(run.id, Proposal("seed", "A", text="A", hash="h"))
    store.close()
    with sqlite3.connect(path) as conn:  # roll the file back to what version 5 had
        for table in ("akv_traces", "akv_trace_sets", "akv_live_policies", "akv_refine_rounds",
                      "akv_conversation_savings"):
            conn.execute(f"DROP TABLE {table}")
        conn.execute("DELETE FROM akv_schema_version WHERE version > 5")
    store = Store.open(f"sqlite:///{path}")
    try:
        assert store.schema_version == LATEST
        assert [p.hash for p in store.policies(store.run("kept").id)] == ["h"]
        assert store.traces.add("new", [trace("t1")]) == (1, 0)
    finally:
        store.close()
