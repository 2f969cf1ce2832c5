"""The store contract, run against every backend: SQLite (always) and PostgreSQL (a throwaway
server started here when its binaries and psycopg are installed)."""
from __future__ import annotations

import sqlite3

import pytest

from store import DuplicateRunName, Proposal, RunNotFound, Store, StoreError, TaskResult, ValidationRecord


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'akv.db'}"
    else:
        url = request.getfixturevalue("postgres_url")
    s = Store.open(url)
    yield s
    s.close()


def make_run(store: Store, name: str = "r1"):
    return store.create_run(name, {"suite": "localcomp"}, 7, "0.1.0", "localcomp@1")


def test_run_round_trip_and_duplicate_name_is_a_one_line_error(store):
    run = make_run(store)
    assert store.run("r1").id == run.id and store.run(run.id).seed == 7
    with pytest.raises(DuplicateRunName) as err:
        make_run(store)
    assert "--run-name" in str(err.value) and "\n" not in str(err.value)
    assert [r.name for r in store.runs()] == ["r1"]  # the first run is untouched
    with pytest.raises(RunNotFound):
        store.run("nope")


def test_policies_deduplicate_by_hash_and_keep_lineage_with_two_parents(store):
    run = make_run(store)
    a, created_a = store.add_policy(run.id, Proposal("seed", "A", text="A", hash="ha", name="expert"))
    again, created_again = store.add_policy(run.id, Proposal("mutate", "A", text="A", hash="ha"))
    assert created_a and not created_again and again == a
    b, _ = store.add_policy(run.id, Proposal("seed", "B", text="B", hash="hb"))
    child, _ = store.add_policy(run.id, Proposal("mutate", "C", parent_ids=(b, a), generation=1, text="C", hash="hc"))
    assert store.policy(child).parent_ids == (b, a)  # order kept: rank 0 is the edited parent
    # Rejected proposals have no hash; several may coexist, each with its reason.
    r1, _ = store.add_policy(run.id, Proposal("llm", "junk", rejection_reason="no policy: no fenced block"))
    r2, _ = store.add_policy(run.id, Proposal("llm", "junk", rejection_reason="invalid policy: x:1:1: bad"))
    rejected = store.policies(run.id, status="rejected")
    assert [p.id for p in rejected] == [r1, r2]
    assert rejected[1].rejection_reason.startswith("invalid policy")


def test_same_hash_in_two_runs_is_two_policies(store):
    one, two = make_run(store, "one"), make_run(store, "two")
    p1, _ = store.add_policy(one.id, Proposal("seed", "A", text="A", hash="h"))
    p2, created = store.add_policy(two.id, Proposal("seed", "A", text="A", hash="h"))
    assert created and p1 != p2


def test_evaluations_are_stored_once_per_policy_task_split(store):
    run = make_run(store)
    pid, _ = store.add_policy(run.id, Proposal("seed", "A", text="A", hash="h"))
    result = TaskResult("t1", "train", "ok", 1.0, 0.002, 5, {"input": 10, "cached": 4}, 0.1)
    assert store.add_evaluation(run.id, pid, result)
    assert not store.add_evaluation(run.id, pid, result)  # a resumed run cannot duplicate it
    assert store.add_evaluation(run.id, pid, TaskResult("t1", "heldout", "ok", 0.0, 0.001))
    train = store.evaluations(run.id, "train")
    assert len(train) == 1 and train[0].result.tokens == {"input": 10, "cached": 4}
    assert len(store.evaluations(run.id)) == 2


def test_baselines_are_idempotent_and_validations_are_versioned_never_replaced(store):
    run = make_run(store)
    std, _ = store.add_policy(run.id, Proposal("baseline", "S", text="S", hash="hs", name="standard-8k"))
    cand, _ = store.add_policy(run.id, Proposal("mutate", "C", text="C", hash="hc"))
    store.set_baseline(run.id, "standard", std)
    store.set_baseline(run.id, "standard", std)  # idempotent on resume
    assert store.baselines(run.id) == {"standard": std}
    assert store.validations(run.id) == [] and store.validation_rounds(run.id) == []
    first = ValidationRecord(cand, "candidate", f"#{cand}", 5, 1.0, 0.004, {"rule": {"cost_p_holm": 0.03}},
                             True, True, "champion: cheaper than the expert")
    second = ValidationRecord(cand, "candidate", f"#{cand}", 5, 1.0, 0.004, {"rule": {"cost_p_holm": 0.2}},
                              True, False, "not significantly cheaper than the expert")
    assert store.save_validations(run.id, [first], "code-1", "localcomp@e1-aaaaaaaaaaaa", {"alpha": 0.05}) == 1
    assert store.save_validations(run.id, [second], "code-2", "localcomp@e1-aaaaaaaaaaaa", {"alpha": 0.01}) == 2
    assert store.validations(run.id) == [second]  # the latest round
    assert store.validations(run.id, round=1) == [first]  # the earlier one is kept
    rounds = store.validation_rounds(run.id)
    assert [(r.round, r.code_version, r.settings, r.n_policies) for r in rounds] == [
        (1, "code-1", {"alpha": 0.05}, 1), (2, "code-2", {"alpha": 0.01}, 1)]


def test_known_policy_matches_by_hash_structure_or_behaviour_but_never_a_duplicate(store):
    run = make_run(store)
    a, _ = store.add_policy(run.id, Proposal("seed", "A", text="A", hash="ha", structure_hash="sa",
                                             behaviour_hash="ba"))
    dup, _ = store.add_policy(run.id, Proposal("mutate", "A2", text="A2", structure_hash="sx", behaviour_hash="bx",
                                               duplicate_of=a, rejection_reason=f"duplicate of #{a}"))
    assert store.policy(dup).status == "duplicate" and store.policy(dup).duplicate_of == a
    assert store.known_policy(run.id, "ha").id == a
    assert store.known_policy(run.id, "h?", structure="sa").id == a
    assert store.known_policy(run.id, "h?", structure="s?", behaviour="ba").id == a
    assert store.known_policy(run.id, "h?", structure="sx", behaviour="bx") is None  # a duplicate is no original
    assert store.known_policy(run.id, "h?", structure="s?", behaviour=None) is None


def test_sqlite_uses_wal(tmp_path):
    path = tmp_path / "wal.db"
    Store.open(f"sqlite:///{path}").close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_db_url_from_environment(tmp_path, monkeypatch):
    path = tmp_path / "env.db"
    monkeypatch.setenv("AKV_DB", f"sqlite:///{path}")
    store = Store.open()
    make_run(store, "from-env")
    store.close()
    assert path.exists()


@pytest.mark.parametrize("url, expected", [
    ("not a url", "cannot parse"),
    ("mysql://u@localhost/db", "unsupported database"),
    ("sqlite:////no/such/folder/akv.db", "does not exist"),
    ("postgresql://akv@127.0.0.1:1/akv", ""),  # no psycopg here: or, with it, nothing listening
])
def test_bad_database_urls_give_one_line_errors(url, expected):
    with pytest.raises(StoreError) as err:
        Store.open(url)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_a_file_that_is_not_a_database_is_refused_and_left_alone(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_bytes(b"these are my notes, not a database\n" * 200)
    before = path.read_bytes()
    with pytest.raises(StoreError) as err:
        Store.open(f"sqlite:///{path}")
    assert "not a database" in str(err.value)
    assert path.read_bytes() == before


def test_optuna_studies_share_a_postgresql_database_with_the_store(postgres_url):
    import random

    import optuna

    from evolve.config import OptunaProposerConfig
    from evolve.context import Candidate, ProposerContext
    from evolve.library import load_checked
    from evolve.proposers.base import Outcome
    from evolve.proposers.optuna_search import OptunaProposer
    from store.database import normalize_url

    url = postgres_url
    store = Store.open(url)
    run = make_run(store)
    parent = Candidate(1, load_checked("expert-8k").text, 0, 0.5, 0.01, ())
    context = ProposerContext((parent,), (parent,), frozenset(), random.Random(0))
    proposer = OptunaProposer(OptunaProposerConfig(), normalize_url(url), run.name, seed=0)
    proposal = proposer.ask(context)
    proposer.tell(proposal, 2, Outcome("evaluated", 0.6, 0.008))
    store.close()
    study = optuna.load_study(study_name=proposal.meta["study"], storage=normalize_url(url))
    assert study.trials[0].values == [0.5, 0.01]  # the parent, entered as a completed trial
    assert study.trials[1].values == [0.6, 0.008]
    reopened = Store.open(url)
    assert reopened.run(run.name).id == run.id  # our tables are intact beside optuna's
    reopened.close()


def test_a_worker_leases_its_share_and_commits_several_results_only_while_it_holds_them(store):
    """Leases of a few tasks take the worker's share of what is free (the others' too); results committed
    together are stored once each, and one whose lease another worker took is not stored."""
    run = make_run(store)
    pid, _ = store.add_policy(run.id, Proposal("seed", "A", text="A", hash="h"))
    queue = store.work
    queue.enqueue(run.id, pid, "train", [f"t{i}" for i in range(7)])
    me, other = queue.register(run.id, "worker", 1, "replay"), queue.register(run.id, "worker", 1, "replay")
    first = queue.lease(run.id, me, 4, 60.0, least=1)
    assert [lease.task_id for lease in first] == ["t0", "t1", "t2", "t3"]  # 7 free, 2 workers: 4, at most 4
    second = queue.lease(run.id, other, 4, 60.0, least=1)
    assert [lease.task_id for lease in second] == ["t4", "t5"]  # 3 free over 2 workers: 2
    result = {lease.id: TaskResult(lease.task_id, "train", "ok", 1.0, 0.001) for lease in first + second}
    queue.release(other)  # as a worker whose lease ran out: another takes its tasks
    retaken = queue.lease(run.id, me, 1, 60.0)
    assert [lease.task_id for lease in retaken] == ["t4"]
    assert queue.complete_many([(lease, result[lease.id]) for lease in first[:3]], me, run.id) == 3
    assert queue.complete_many([(second[0], result[second[0].id])], other, run.id) == 0  # no longer its own
    assert queue.complete_many([(lease, result[lease.id]) for lease in first[2:] + retaken], me, run.id) == 2
    stored = sorted(e.result.task_id for e in store.evaluations(run.id))
    assert stored == ["t0", "t1", "t2", "t3", "t4"]  # each once: t2 was stored already, t4 by its new holder
    assert queue.unfinished(run.id) == 2
