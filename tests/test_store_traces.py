"""Trace sets in the store: SQLite and PostgreSQL alike, the migration from version 5, one transaction per import,
and the read-only listing that suite lookups use."""
from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import pytest

from sandbox.suites import get_suite, suite_names
from store import Proposal, Store
from store.errors import TraceConflict, TraceSetNotFound
from store.migrations import LATEST
from store.records import StoredTrace
from store.traces import trace_set_names


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

        def failing():  # an import that reads its files as it writes: a bad file rolls back what came before
            yield trace("t5")
            raise ValueError("a bad file")
        with pytest.raises(ValueError, match="a bad file"):
            store.traces.add("a", failing())
        assert store.traces.held("a") == {t: (f"d-{t}-hello", {"format": "openai", "line": 1})
                                          for t in ("t1", "t2", "t3")}
        assert store.traces.held("none") == {}
        got = store.traces.get("a")[0]
        assert got.messages == trace("t1").messages and got.requests[0]["usage"] == {"prompt_tokens": 9}
        store.traces.put("a", trace("t1", "longer", digest="d-new"))  # a conversation that went on
        assert store.traces.get("a")[0].digest == "d-new" and len(store.traces.get("a")) == 3
        [info] = store.traces.sets()
        assert (info.name, info.n_traces, info.n_messages, info.n_requests) == ("a", 3, 6, 3)
        assert trace_set_names(url) == ["a"]   # read while the store is open, without writing
        assert store.traces.delete("a") == 3 and store.traces.names() == []
        with pytest.raises(TraceSetNotFound, match="no trace set named 'a'"):
            store.traces.get("a")
    finally:
        store.close()


def test_trace_sets_in_sqlite(tmp_path) -> None:
    _contract(f"sqlite:///{tmp_path / 'akv.db'}")


def test_trace_sets_in_postgresql(postgres_url) -> None:
    _contract(postgres_url)


def version_5_database(path: Path) -> None:
    """A database as version 5 left it: a run with a policy, no trace tables."""
    store = Store.open(f"sqlite:///{path}")
    run = store.create_run("kept", {}, 0, "v", "s")
    store.add_policy(run.id, Proposal("seed", "A", text="A", hash="h"))
    store.close()
    with sqlite3.connect(path) as conn:  # roll the file back to what version 5 had
        for table in ("akv_traces", "akv_trace_sets", "akv_live_policies", "akv_refine_rounds",
                      "akv_conversation_savings"):
            conn.execute(f"DROP TABLE {table}")
        conn.execute("DELETE FROM akv_schema_version WHERE version > 5")
    conn.close()


def test_a_version_5_database_gets_trace_tables_and_keeps_its_runs(tmp_path) -> None:
    path = tmp_path / "old.db"
    version_5_database(path)
    store = Store.open(f"sqlite:///{path}")
    try:
        assert store.schema_version == LATEST
        assert [p.hash for p in store.policies(store.run("kept").id)] == ["h"]
        assert store.traces.add("new", [trace("t1")]) == (1, 0)
    finally:
        store.close()


def folder_state(folder: Path) -> dict[str, tuple[str, int]]:
    """Every file of `folder` with its digest and modification time."""
    return {p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns) for p in folder.iterdir()}


def test_listing_suites_never_writes_the_store(tmp_path, monkeypatch) -> None:
    # A current database, its file and folder made read-only: its trace set is listed, nothing changes.
    current = tmp_path / "current"
    current.mkdir()
    store = Store.open(f"sqlite:///{current / 'akv.db'}")
    store.traces.add("mine", [trace("t1")])
    store.close()
    before = folder_state(current)
    (current / "akv.db").chmod(0o444)
    current.chmod(0o555)
    try:
        monkeypatch.setenv("AKV_DB", f"sqlite:///{current / 'akv.db'}")
        assert "mine" in suite_names() and get_suite("mine").name == "mine"
    finally:
        current.chmod(0o755)
    assert folder_state(current) == before
    # A database from before trace sets: listed as none, not migrated.
    old = tmp_path / "old"
    old.mkdir()
    version_5_database(old / "akv.db")
    before = folder_state(old)
    monkeypatch.setenv("AKV_DB", f"sqlite:///{old / 'akv.db'}")
    assert "localcomp" in suite_names() and get_suite("localcomp").name == "localcomp"
    assert folder_state(old) == before
    with sqlite3.connect(old / "akv.db") as conn:
        assert max(v for (v,) in conn.execute("SELECT version FROM akv_schema_version")) == 5
    conn.close()
    # No database: none is created, at AKV_DB or in a data folder that does not exist yet.
    monkeypatch.setenv("AKV_DB", f"sqlite:///{tmp_path / 'absent.db'}")
    assert trace_set_names() == [] and "localcomp" in suite_names()
    monkeypatch.delenv("AKV_DB")
    monkeypatch.setenv("AKV_HOME", str(tmp_path / "fresh-home"))
    assert trace_set_names() == [] and "localcomp" in suite_names()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["current", "old"]
