"""A fresh held-out: validation on held-out tasks nobody has looked at, by index range
(`validation.heldout_range`) or from a build of the suite with another seed
(`validation.heldout_seed`), recorded in the round and shown by `akv runs show`, `akv compare` and
the export's provenance; bad settings are refused naming the field."""
from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from test_cli_support import akv_in_process

ROOT = Path(__file__).resolve().parents[1]
AKV = [sys.executable, "-m", "akv_cli.main"]
RANGE = (8, 12)  # beyond examples/quick.yaml's first 8 held-out tasks
NEXT_RANGE = (12, 15)


def akv_env(home: Path | None = None) -> dict[str, str]:
    from akv_core.home import akv_home

    # The shared data folder holds the seed-0 localcomp build of the session (tests/conftest.py).
    return {**os.environ, "AKV_HOME": str(home or akv_home().resolve()), "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1"}


def akv(*args: str, home: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*AKV, *args], capture_output=True, text=True, env=akv_env(home), cwd=ROOT, timeout=900)


def akv_here(*args: str, home: Path | None = None) -> subprocess.CompletedProcess:
    """`akv ARGS` run by the same app in this process (`akv_in_process`) in the data folder `akv` above gives;
    an evolve sets AKV_DB for its task processes, which the call's env keeps from outliving it."""
    code, out, err = akv_in_process({"AKV_HOME": akv_env(home)["AKV_HOME"], "AKV_DB": None}, *args)
    return subprocess.CompletedProcess(["akv", *args], code, out, err)


def quick(folder: Path, drop: tuple[str, ...] = (), **validation: object) -> Path:
    """examples/quick.yaml's settings with these validation settings (less those in `drop`), as a config file."""
    config = yaml.safe_load((ROOT / "examples" / "quick.yaml").read_text(encoding="utf-8"))
    settings = {**config.get("validation", {}), **validation}
    config["validation"] = {k: v for k, v in settings.items() if k not in drop}
    path = folder / f"config-{len(list(folder.glob('config-*')))}.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def rows(db: Path, sql: str) -> list[tuple]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as conn:
        return conn.execute(sql).fetchall()


def held_out_ids(db: Path) -> set[str]:
    return {r[0] for r in rows(db, "SELECT DISTINCT task_id FROM akv_evaluations WHERE split = 'heldout'")}


@pytest.fixture(scope="module")
def ranged(tmp_path_factory):
    """A quick run validated on held-out tasks 8-11 only (quick.yaml's limit dropped)."""
    folder = tmp_path_factory.mktemp("fresh")
    db = folder / "akv.db"
    name = f"fresh-range-{os.getpid()}"
    done = akv("evolve", "--config", str(quick(folder, drop=("heldout_limit",), heldout_range=list(RANGE))),
               "--run-name", name, "--db", f"sqlite:///{db}")
    assert done.returncode == 0, done.stdout + done.stderr
    return folder, db, name, done.stdout


def test_a_range_runs_exactly_those_held_out_tasks_and_the_round_records_it(ranged):
    _folder, db, _name, out = ranged
    expected = {f"localcomp-heldout-{i:03d}" for i in range(*RANGE)}
    assert held_out_ids(db) == expected
    assert {n for (n,) in rows(db, "SELECT n_tasks FROM akv_validations")} == {len(expected)}
    [(settings, round_version)] = rows(db, "SELECT settings, suite_version FROM akv_validation_rounds")
    settings = json.loads(settings)
    assert settings["heldout_range"] == list(RANGE) and settings["heldout_limit"] is None
    assert settings["heldout_seed"] is None
    assert round_version == rows(db, "SELECT suite_version FROM akv_runs")[0][0]  # the run's own build
    assert "held-out: tasks 8-11 of the run's build" in out


def test_runs_show_compare_and_the_provenance_name_the_range(ranged):
    folder, db, name, _out = ranged
    url = f"sqlite:///{db}"
    shown = akv_here("runs", "show", name, "--db", url)
    assert shown.returncode == 0, shown.stderr
    assert "round 1: tasks 8-11 of the run's build (localcomp@" in shown.stdout
    compared = akv_here("compare", name, "--db", url, "--out", str(folder / "report.html"))
    assert compared.returncode == 0, compared.stderr
    assert "held-out: tasks 8-11 of the run's build" in compared.stdout
    exported = akv_here("export", name, "--best", "--db", url, "--out", str(folder / "best.akvp"))
    assert exported.returncode == 0, exported.stderr
    heldout = json.loads((folder / "best.json").read_text())["validation"]["heldout"]
    assert heldout["range"] == list(RANGE) and heldout["seed"] is None and heldout["tasks"] == 4
    assert (heldout["first"], heldout["last"]) == ("localcomp-heldout-008", "localcomp-heldout-011")


def test_revalidating_with_another_range_adds_a_round_and_keeps_the_first(ranged):
    folder, db, name, _out = ranged
    config = quick(folder, heldout_range=list(NEXT_RANGE))
    again = akv_here("evolve", "--resume", "--revalidate", "--config", str(config), "--run-name", name,
                "--db", f"sqlite:///{db}")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "validation.heldout_range [12, 15]" in again.stdout
    rounds = rows(db, "SELECT round, settings FROM akv_validation_rounds ORDER BY round")
    assert [(r, json.loads(s)["heldout_range"]) for r, s in rounds][:2] == [(1, list(RANGE)), (2, list(NEXT_RANGE))]
    latest = max(r for r, _s in rounds)
    assert {n for (n,) in rows(db, f"SELECT n_tasks FROM akv_validations WHERE round = {latest}")} == {3}
    assert {f"localcomp-heldout-{i:03d}" for i in range(*NEXT_RANGE)} <= held_out_ids(db)


@pytest.mark.slow  # the first time, a localcomp build with another seed: about a minute on two cores
def test_a_fresh_seed_runs_another_build_and_records_its_version(ranged):
    from akv_core.home import akv_home
    from evolve.scoring import fresh_folder
    from sandbox.suites import get_suite

    folder, db, name, _out = ranged
    own = get_suite("localcomp").version(akv_home())
    config = quick(folder, heldout_seed=1, heldout_limit=4)
    again = akv_here("evolve", "--resume", "--revalidate", "--config", str(config), "--run-name", name,
                "--db", f"sqlite:///{db}")
    assert again.returncode == 0, again.stdout + again.stderr
    fresh = get_suite("localcomp").version(fresh_folder(akv_home(), "localcomp", 1))
    assert fresh != own and get_suite("localcomp").version(akv_home()) == own  # the run's own build is untouched
    settings, version = rows(db, "SELECT settings, suite_version FROM akv_validation_rounds ORDER BY round DESC")[0]
    assert version == fresh and json.loads(settings)["heldout_seed"] == 1
    assert {f"localcomp-heldout-{i:03d}@seed1" for i in range(4)} <= held_out_ids(db)
    assert f"a fresh build with seed 1 ({fresh})" in again.stdout
    shown = akv_here("runs", "show", name, "--db", f"sqlite:///{db}")
    assert f"the first 4 tasks of a fresh build with seed 1 ({fresh})" in shown.stdout
    gap = akv_here("compare", name, "--db", f"sqlite:///{db}", "--oracle", "--json", "--out", str(folder / "o.html"))
    assert gap.returncode == 0, gap.stdout + gap.stderr   # the oracle runs the tagged tasks on their fresh build
    assert json.loads(gap.stdout)["oracle_gap"]["n_tasks"] == 4


@pytest.mark.parametrize("setting, message", [
    ("heldout_range: [-1, 5]", "validation.heldout_range: .*start -1 is negative"),
    ("heldout_range: [5, 5]", r"validation.heldout_range: .*\[5, 5\) holds no task"),
    ("heldout_range: [9, 3]", r"validation.heldout_range: .*start must be below stop"),
    ("heldout_seed: -2", "validation.heldout_seed: .*greater than or equal to 0"),
])
def test_a_bad_setting_is_a_located_config_error(tmp_path, setting, message):
    from evolve.config import ConfigError, load_config

    path = tmp_path / "bad.yaml"
    path.write_text(f"seed: 0\nvalidation:\n  {setting}\n")
    with pytest.raises(ConfigError, match=rf"^{path}:3: {message}"):
        load_config(path)


def test_a_range_past_the_split_or_the_run_s_own_seed_stops_before_a_run_exists(tmp_path):
    db = tmp_path / "akv.db"
    past = akv_here("evolve", "--config", str(quick(tmp_path, heldout_range=[100, 400])), "--db", f"sqlite:///{db}")
    assert past.returncode == 2 and "validation.heldout_range: [100, 400) reaches past the 170 held-out" in past.stderr
    same = akv_here("evolve", "--config", str(quick(tmp_path, heldout_seed=0)), "--db", f"sqlite:///{db}")
    assert same.returncode == 2 and "validation.heldout_seed: 0 is the run's own seed" in same.stderr
    assert not db.exists() or rows(db, "SELECT count(*) FROM akv_runs") == [(0,)]


def test_a_suite_that_cannot_build_from_another_seed_is_refused(tmp_path):
    home = tmp_path / "home"
    imported = akv_here("tasks", "import", "retrieval", "--corpus", str(ROOT / "examples" / "docs.jsonl"),
                   "--queries", str(ROOT / "examples" / "queries.jsonl"), "--name", "fresh-docs", home=home)
    assert imported.returncode == 0, imported.stderr
    refused = akv_here("evolve", "--suite", "fresh-docs", "--config", str(quick(tmp_path, heldout_seed=1)),
                  "--db", f"sqlite:///{tmp_path / 'akv.db'}", home=home)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "validation.heldout_seed: suite fresh-docs cannot build its tasks again from another seed" in refused.stderr
    assert "validation.heldout_range" in refused.stderr


@pytest.mark.slow  # the first time, a localcomp build with another seed: about a minute on two cores
def test_a_tagged_task_runs_on_its_fresh_build_without_settings_and_on_process_lanes():
    """As a worker of a shared run does: no held-out settings, only the tagged ids it leases; concurrency 2
    on replay runs in process lanes, which open suites by name, so the fresh tasks run in this process."""
    from akv_core.home import akv_home
    from evolve.library import load_checked
    from evolve.scoring import HarnessEvaluator, fresh_folder
    from policy_dsl import compile_policy, parse
    from sandbox.backends import open_backend
    from sandbox.runs.harness import run_task
    from sandbox.suites import get_suite

    text, own_ids = load_checked("expert-8k").text, [f"localcomp-heldout-{i:03d}" for i in range(3)]
    evaluator = HarnessEvaluator("localcomp", "scripted", "replay", 0, concurrency=2)
    try:
        heard = []
        evaluator.evaluate(text, "expert-8k", "heldout", [f"{t}@seed1" for t in own_ids], heard.append)
    finally:
        evaluator.close()
    fresh = get_suite("localcomp")
    fresh.build(fresh_folder(akv_home(), "localcomp", 1), 1)
    replay, policy = open_backend("replay", None), compile_policy(parse(text), name="expert-8k")
    try:
        direct = [run_task(t, fresh, policy, fresh.scripted_agent(t), replay, seed=0)[0]
                  for t in fresh.tasks("heldout") if t.id in own_ids]
    finally:
        replay.close()
    assert [r.task_id for r in heard] == [f"{t}@seed1" for t in own_ids]
    assert [(r.status, r.score, r.cost_usd, dict(r.tokens)) for r in heard] == \
        [(r.status, r.score, r.cost_usd, r.tokens.to_dict()) for r in direct]
