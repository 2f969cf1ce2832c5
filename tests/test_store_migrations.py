"""The versioned schema: fresh databases, older databases, newer databases."""
from __future__ import annotations

import sqlite3

import pytest

from store import Proposal, Store, StoreError
from store.migrations import LATEST


def versions(path) -> list[int]:
    with sqlite3.connect(path) as conn:
        return [v for (v,) in conn.execute("SELECT version FROM akv_schema_version ORDER BY version")]


def test_fresh_database_is_stamped_with_every_step(tmp_path):
    path = tmp_path / "a.db"
    store = Store.open(f"sqlite:///{path}")
    assert store.schema_version == LATEST
    store.close()
    assert versions(path) == list(range(1, LATEST + 1))


def test_version_1_database_is_migrated_and_keeps_its_rows(tmp_path):
    path = tmp_path / "old.db"
    store = Store.open(f"sqlite:///{path}")
    run = store.create_run("kept", {}, 0, "v", "s")
    store.add_policy(run.id, Proposal("seed", "A", text="A", hash="h"))
    store.close()
    with sqlite3.connect(path) as conn:  # roll the file back to what version 1 created
        conn.execute("DROP INDEX ix_akv_eval_run_split")
        conn.execute("DELETE FROM akv_schema_version WHERE version > 1")
    store = Store.open(f"sqlite:///{path}")
    assert store.schema_version == LATEST
    assert [p.hash for p in store.policies(store.run("kept").id)] == ["h"]
    store.close()
    with sqlite3.connect(path) as conn:
        names = {n for (n,) in conn.execute("SELECT name FROM sqlite_master WHERE type='index'")}
    assert "ix_akv_eval_run_split" in names
    assert versions(path) == list(range(1, LATEST + 1))


def test_newer_schema_is_refused(tmp_path):
    path = tmp_path / "new.db"
    Store.open(f"sqlite:///{path}").close()
    with sqlite3.connect(path) as conn:
        conn.execute("INSERT INTO akv_schema_version (version, description, applied_at) "
                     "VALUES (?, 'future', '2030-01-01')", (LATEST + 1,))
    with pytest.raises(StoreError) as err:
        Store.open(f"sqlite:///{path}")
    assert f"version {LATEST + 1}" in str(err.value)
