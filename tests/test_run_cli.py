"""`akv run` and `akv tasks` through the real command line app (in-process, replay backend)."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from akv_cli.main import app
from sandbox.suites import get_suite

runner = CliRunner()


def test_run_json_prints_exactly_one_object_with_results_and_summary() -> None:
    result = runner.invoke(app, ["run", "--suite", "localcomp", "--split", "train", "--policy", "expert",
                                 "--agent", "scripted", "--backend", "replay", "--limit", "2", "--json"])
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)  # one object and nothing else on stdout
    assert set(report) == {"results", "summary"}
    assert len(report["results"]) == 2 and report["summary"]["policy"] == "expert"
    assert report["summary"]["mean_cost_usd"] > 0


def test_run_prints_rows_and_a_summary_without_json() -> None:
    result = runner.invoke(app, ["run", "--suite", "localcomp", "--policy", "full", "--limit", "1"])
    assert result.exit_code == 0, result.stderr
    assert "mean score" in result.stdout and "mean cost" in result.stdout


@pytest.mark.parametrize("args, expected", [
    (["--suite", "nosuite", "--policy", "expert"], "unknown suite 'nosuite'"),
    (["--suite", "localcomp", "--split", "nosplit", "--policy", "expert"], "nosplit"),
    (["--suite", "localcomp", "--policy", "nopolicy"], "nopolicy"),
    (["--suite", "localcomp", "--policy", "expert", "--agent", "llm"], "needs a model"),
    (["--suite", "localcomp", "--policy", "expert", "--backend", "gpu"], "expected replay, embedded"),
    (["--suite", "localcomp", "--policy", "expert", "--precision", "int4"], "embedded backend only"),
])
def test_bad_input_is_one_line_and_exit_2(args: list[str], expected: str) -> None:
    result = runner.invoke(app, ["run", *args, "--json"])
    assert result.exit_code == 2
    assert expected in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert result.stdout == ""


def test_an_unreachable_endpoint_is_a_task_error_not_a_crash() -> None:
    result = runner.invoke(app, ["run", "--suite", "localcomp", "--policy", "expert", "--agent", "llm",
                                 "--endpoint", "http://127.0.0.1:9/v1", "--model", "m", "--limit", "1", "--json"])
    assert result.exit_code == 0, result.stderr
    (row,) = json.loads(result.stdout)["results"]
    assert row["status"] == "error"


def test_tasks_list_shows_the_split() -> None:
    result = runner.invoke(app, ["tasks", "list", "--suite", "localcomp", "--split", "train", "--json"])
    assert result.exit_code == 0, result.stderr
    listing = json.loads(result.stdout)
    expected = [task.id for task in get_suite("localcomp").tasks("train")]
    assert listing["split"] == "train" and [t["id"] for t in listing["tasks"]] == expected and expected


def test_tasks_list_unknown_split_is_one_line_and_exit_2() -> None:
    result = runner.invoke(app, ["tasks", "list", "--suite", "localcomp", "--split", "dev"])
    assert result.exit_code == 2 and "dev" in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args, expected", [
    (["--suite", "localcomp", "--edition", "7"], "unknown localcomp edition 7: expected one of 1, 2"),
    (["--edition", "1"], "--edition needs --suite"),
])
def test_tasks_build_with_a_bad_edition_is_one_line_and_exit_2(args: list[str], expected: str) -> None:
    result = runner.invoke(app, ["tasks", "build", *args])
    assert result.exit_code == 2 and expected in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_tasks_build_edition_1_builds_it_and_runs_stay_on_it(tmp_path, monkeypatch) -> None:
    import shutil

    from akv_core.home import akv_home
    from sandbox.suites.localcomp.facts import FACTS_VERSION

    facts = f"facts.v{FACTS_VERSION}.json"
    (tmp_path / "localcomp").mkdir()
    shutil.copy(akv_home() / "localcomp" / facts, tmp_path / "localcomp" / facts)  # skip the slow extraction
    monkeypatch.setenv("AKV_HOME", str(tmp_path))
    result = runner.invoke(app, ["tasks", "build", "--suite", "localcomp", "--edition", "1"])
    assert result.exit_code == 0, result.stderr
    assert json.loads((tmp_path / "localcomp" / "build.json").read_text())["edition"] == 1
    run = runner.invoke(app, ["run", "--suite", "localcomp", "--policy", "full", "--limit", "1", "--json"])
    assert run.exit_code == 0, run.stderr
    assert json.loads((tmp_path / "localcomp" / "build.json").read_text())["edition"] == 1  # not rebuilt
    (row,) = json.loads(run.stdout)["results"]
    assert row["status"] == "ok" and row["score"] == 1.0
