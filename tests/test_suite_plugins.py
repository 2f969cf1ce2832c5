"""Suites as plugins: the example package of docs/sandbox.md installed into this environment with
pip, listed by `akv tasks list --suites` beside a plugin that fails to import, run and evolved on."""
from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox.suites import SuiteLoadError, get_suite, suite_entries

AKV = [sys.executable, "-m", "akv_cli.main"]
DOCS = Path(__file__).resolve().parents[1] / "docs" / "sandbox.md"
PACKAGE = "akv-ledger-suite"
BROKEN = 'ledger-broken = "akv_ledger_suite_missing:Nothing"\n'  # a second plugin whose module is absent
SMALL = """\
max_candidates: 2
seed: 1
proposers: [mutate, optuna]  # no model: the default mix asks the embedded one too
seed_policies: [expert-8k]
cascade: {subset_size: 1, train_limit: 3, promote_margin: 0.5}
validation: {heldout_limit: 4, top_k: 1}
"""


def example_files() -> dict[str, str]:
    """The files of the documented example package: each fenced block in its section that opens
    with `# FILENAME`."""
    text = DOCS.read_text(encoding="utf-8")
    section = text[text.index("### A complete minimal suite in its own package"):]
    section = section[: section.index("\n## ")]
    blocks = re.findall(r"```(?:toml|python)\n# (\S+)\n(.*?)```", section, re.DOTALL)
    return {name: body for name, body in blocks}


def pip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The example installed (no index, no build isolation: offline), uninstalled afterwards."""
    folder = tmp_path_factory.mktemp("plugin") / PACKAGE
    folder.mkdir()
    files = example_files()
    assert set(files) == {"pyproject.toml", "akv_ledger_suite.py"}, files.keys()
    for name, body in files.items():
        (folder / name).write_text(body + (BROKEN if name == "pyproject.toml" else ""), encoding="utf-8")
    done = pip("install", "--no-deps", "--no-index", "--no-build-isolation", "--quiet", str(folder))
    assert done.returncode == 0, done.stderr
    try:
        yield tmp_path_factory.mktemp("home")
    finally:
        pip("uninstall", "--yes", "--quiet", PACKAGE)


def akv(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "AKV_HOME": str(home), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([*AKV, *args], capture_output=True, text=True, timeout=600, env=env)


def test_our_suites_are_registered_as_entry_points() -> None:
    ours = {e.name: e for e in suite_entries() if e.distribution.startswith("akv-agents ")}
    assert ours["localcomp"].target == "sandbox.suites.localcomp:LocalComp"
    assert ours["localswe"].target == "sandbox.suites.localswe:LocalSWE"
    with pytest.raises(ValueError, match="unknown suite 'nosuite': expected one of .*localcomp"):
        get_suite("nosuite")


def test_suites_list_shows_sources_and_a_broken_plugin_beside_the_others(installed) -> None:
    result = akv(installed, "tasks", "list", "--suites", "--json")
    assert result.returncode == 0, result.stderr
    rows = {r["name"]: r for r in json.loads(result.stdout)["suites"]}
    assert rows["ledger"] == {"name": "ledger", "target": "akv_ledger_suite:LedgerSuite",
                              "distribution": f"{PACKAGE} 0.1.0", "error": None}
    assert rows["localcomp"]["error"] is None and rows["localcomp"]["distribution"].startswith("akv-agents ")
    broken = rows["ledger-broken"]["error"]
    assert "'ledger-broken'" in broken and "ModuleNotFoundError" in broken and "akv_ledger_suite_missing" in broken
    table = akv(installed, "tasks", "list", "--suites")
    assert table.returncode == 0 and "ledger-broken" in table.stdout and PACKAGE in table.stdout
    refused = akv(installed, "run", "--suite", "ledger-broken", "--policy", "expert")
    assert refused.returncode == 2 and "ModuleNotFoundError" in refused.stderr
    assert "Traceback" not in refused.stderr


@pytest.mark.slow
def test_evolution_runs_on_the_installed_suite(installed, tmp_path) -> None:
    run = akv(installed, "run", "--suite", "ledger", "--split", "train", "--policy", "expert-8k", "--json")
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)["summary"]
    assert summary["suite"] == "ledger" and summary["n_tasks"] == 8 and summary["mean_score"] == 1.0
    config = tmp_path / "small.yaml"
    config.write_text(SMALL)
    db = tmp_path / "akv.db"
    evolved = akv(installed, "evolve", "--suite", "ledger", "--config", str(config),
                  "--db", f"sqlite:///{db}", "--run-name", "ledger-run")
    assert evolved.returncode == 0, evolved.stdout + evolved.stderr
    with sqlite3.connect(db) as conn:
        tasks = {row[0] for row in conn.execute("SELECT DISTINCT task_id FROM akv_evaluations")}
    assert tasks and all(t.startswith("ledger-") for t in tasks)
    assert {t.split("-")[1] for t in tasks} == {"train", "heldout"}


def test_a_suite_whose_name_disagrees_with_its_entry_point_is_refused() -> None:
    from sandbox.suites import SuiteEntry, load_suite

    entry = SuiteEntry("notlocalcomp", "sandbox.suites.localcomp:LocalComp", "akv-agents 0.1.0")
    with pytest.raises(SuiteLoadError, match="calls itself 'localcomp'"):
        load_suite(entry)
    with pytest.raises(SuiteLoadError, match="failed to load: AttributeError"):
        load_suite(SuiteEntry("x", "sandbox.suites.localcomp:NoSuchClass", "akv-agents 0.1.0"))
