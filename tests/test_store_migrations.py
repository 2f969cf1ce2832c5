"""The versioned schema: fresh databases, older databases, newer databases."""
from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from store import Proposal, Store, StoreError, ValidationRecord
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


DATA = Path(__file__).parent / "data"
V2_ROWS = [
    "INSERT INTO akv_schema_version (version, description, applied_at) VALUES "
    "(1, 'tables', '2026-11-01 00:00:00'), (2, 'index', '2026-11-01 00:00:00')",
    "INSERT INTO akv_runs (id, name, config, seed, status, code_version, suite_version, created_at, updated_at) "
    "VALUES (1, 'old', '{\"validation\": {\"alpha\": 0.05}}', 0, 'finished', '0.1.0+abc', 'localcomp@unversioned', "
    "'2026-11-01 00:00:00', '2026-11-01 00:00:00')",
    "INSERT INTO akv_policies (id, run_id, hash, text, generation, proposer, status, prompt_tokens, completion_tokens, "
    "proposal_cost_usd, meta, created_at) VALUES (1, 1, 'h1', 'mode kv', 0, 'seed', 'evaluated', 0, 0, 0, '{}', "
    "'2026-11-01 00:00:00')",
    "INSERT INTO akv_validations (run_id, policy_id, role, label, n_tasks, score_mean, cost_mean, stats, "
    "non_dominated, champion, verdict, created_at) VALUES (1, 1, 'candidate', '#1', 5, 1.0, 0.004, "
    "'{\"cost\": {\"percent\": -10.0, \"p_value\": 0.01}, \"score\": {\"mean_delta\": 0.0, \"p_value\": 1.0}}', "
    "true, true, 'champion: saves 10.0% vs Standard', '2026-11-01 00:00:00')",
]


def _check_version_2_migrated(url: str) -> None:
    store = Store.open(url)
    try:
        assert store.schema_version == LATEST
        run = store.run("old")
        [kept] = store.validations(run.id)
        assert kept.champion and kept.verdict.startswith("champion: saves") and kept.stats["cost"]["p_value"] == 0.01
        [first] = store.validation_rounds(run.id)  # the old validation became round 1, with the run's versions
        assert (first.round, first.code_version, first.suite_version, first.settings, first.n_policies) == (
            1, "0.1.0+abc", "localcomp@unversioned", {"alpha": 0.05}, 1)
        policy = store.policy(1)
        assert policy.hash == "h1" and policy.structure_hash is None and policy.duplicate_of is None
        again = ValidationRecord(1, "candidate", "#1", 5, 1.0, 0.004, {}, True, False, "not significantly cheaper")
        assert store.save_validations(run.id, [again], "0.2.0", "localcomp@e1-0123456789ab", {}) == 2
        assert store.validations(run.id) == [again] and store.validations(run.id, round=1) == [kept]
    finally:
        store.close()


def test_version_2_sqlite_database_gets_identities_and_validation_rounds(tmp_path):
    path = tmp_path / "v2.db"
    with sqlite3.connect(path) as conn:
        conn.executescript((DATA / "store-v2.sqlite.sql").read_text())
        for statement in V2_ROWS:
            conn.execute(statement.replace("true", "1"))
    _check_version_2_migrated(f"sqlite:///{path}")
    assert versions(path) == list(range(1, LATEST + 1))


def test_version_2_postgresql_database_gets_identities_and_validation_rounds(postgres_url):
    import psycopg

    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute((DATA / "store-v2.postgresql.sql").read_text())
        for statement in V2_ROWS:
            conn.execute(statement)
        conn.execute("SELECT setval('akv_policies_id_seq', 1); SELECT setval('akv_runs_id_seq', 1)")
    _check_version_2_migrated(postgres_url)


V3_ROWS = [
    "INSERT INTO akv_schema_version (version, description, applied_at) VALUES (1, 'tables', '2026-11-01 00:00:00'), "
    "(2, 'index', '2026-11-01 00:00:00'), (3, 'rounds', '2026-11-20 00:00:00')",
    "INSERT INTO akv_runs (id, name, config, seed, status, code_version, suite_version, created_at, updated_at) "
    "VALUES (1, 'old', '{}', 0, 'running', '0.1.0+abc', 'localcomp@e1-0123456789ab', '2026-11-20 00:00:00', "
    "'2026-11-20 00:00:00')",
    "INSERT INTO akv_policies (id, run_id, hash, text, generation, proposer, status, prompt_tokens, completion_tokens, "
    "proposal_cost_usd, meta, created_at) VALUES (1, 1, 'h1', 'mode kv', 0, 'seed', 'proposed', 0, 0, 0, '{}', "
    "'2026-11-20 00:00:00')",
    "INSERT INTO akv_evaluations (run_id, policy_id, task_id, split, status, score, cost_usd, n_requests, tokens, "
    "wall_s, created_at) VALUES (1, 1, 't1', 'train', 'ok', 1.0, 0.004, 3, '{}', 0.1, '2026-11-20 00:00:00')",
]


def _check_version_3_migrated(url: str) -> None:
    """Steps 4 and 5: the old evaluation is kept (no worker), and the run can be shared from then on."""
    from store import TaskResult

    store = Store.open(url)
    try:
        assert store.schema_version == LATEST
        run = store.run("old")
        [kept] = store.evaluations(run.id)
        assert (kept.result.task_id, kept.result.cost_usd) == ("t1", 0.004)
        assert store.work.workers(run.id) == []
        worker = store.work.register(run.id, "worker", 2, "replay")
        store.work.enqueue(run.id, 1, "train", ["t1", "t2"])
        leases = store.work.lease(run.id, worker, 5, 60)
        assert [lease.task_id for lease in leases] == ["t1", "t2"]
        assert not store.work.complete(leases[0], worker, run.id, TaskResult("t1", "train", "ok", 1.0, 0.004))
        assert store.work.complete(leases[1], worker, run.id, TaskResult("t2", "train", "ok", 1.0, 0.003))
        assert [w.n_evaluations for w in store.work.workers(run.id)] == [1]
        assert len(store.evaluations(run.id)) == 2  # the stored t1 was not stored twice
    finally:
        store.close()


def test_version_3_sqlite_database_gets_work_leases_and_workers(tmp_path):
    path = tmp_path / "v3.db"
    with sqlite3.connect(path) as conn:
        conn.executescript((DATA / "store-v3.sqlite.sql").read_text())
        for statement in V3_ROWS:
            conn.execute(statement)
    _check_version_3_migrated(f"sqlite:///{path}")
    assert versions(path) == list(range(1, LATEST + 1))


def test_version_3_postgresql_database_gets_work_leases_and_workers(postgres_url):
    import psycopg

    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute((DATA / "store-v3.postgresql.sql").read_text())
        for statement in V3_ROWS:
            conn.execute(statement)
        conn.execute("SELECT setval('akv_policies_id_seq', 1); SELECT setval('akv_runs_id_seq', 1)")
    _check_version_3_migrated(postgres_url)


def test_version_6_database_gets_the_refining_proxy_s_tables_and_keeps_its_traces(tmp_path):
    """Step 7 adds the live policies, refinement rounds and conversation costs; a trace set stays as it was."""
    from store.records import ConversationCost, StoredTrace

    path = tmp_path / "v6.db"
    store = Store.open(f"sqlite:///{path}")
    store.traces.add("traffic", [StoredTrace("t1", "d1", ({"role": "user", "content": "hi"},
                                                            {"role": "assistant", "content": "hello"}))])
    store.close()
    with sqlite3.connect(path) as conn:  # roll the file back to what version 6 created
        for table in ("akv_live_policies", "akv_refine_rounds", "akv_conversation_savings"):
            conn.execute(f"DROP TABLE {table}")
        conn.execute("DELETE FROM akv_schema_version WHERE version > 6")
    store = Store.open(f"sqlite:///{path}")
    try:
        assert store.schema_version == LATEST == 7
        assert [t.trace_id for t in store.traces.get("traffic")] == ["t1"]
        entry, new = store.live.start("traffic", "full", "mode kv\n")
        assert new and store.live.live("traffic") == entry
        store.live.save_costs("traffic", [ConversationCost("t1", "d1", "full", 1, 0.01, 0.01, 0.01)])
        assert [t.conversations for t in store.live.totals("traffic")] == [1]
    finally:
        store.close()
    assert versions(path) == list(range(1, LATEST + 1))
