"""Suite versions: what they hash, how a run records them, and the clear refusal of a resume whose
suite build is missing or stale."""
from __future__ import annotations

import json
import re
import shutil

import pytest
from typer.testing import CliRunner

from akv_cli.main import app
from evolve.config import EvolveConfig
from sandbox.suites import get_suite
from sandbox.suites.version import SuiteNotBuilt, check_recorded, rebuild_command
from store import Store


@pytest.fixture(scope="module")
def built_copy(tmp_path_factory):
    """A copy of the test session's localcomp build in a data folder of its own."""
    from akv_core.home import akv_home

    home = tmp_path_factory.mktemp("home")
    shutil.copytree(akv_home() / "localcomp", home / "localcomp")
    return home


def test_the_version_names_the_suite_and_edition_and_follows_the_built_content(built_copy):
    from akv_core.home import akv_home

    suite = get_suite("localcomp")
    version = suite.version(built_copy)
    assert re.fullmatch(r"localcomp@e2-[0-9a-f]{12}", version)  # the default edition
    assert suite.version(akv_home()) == version  # the same build in another folder is the same version
    tasks = built_copy / "localcomp" / "tasks.json"
    original = tasks.read_text()
    try:
        tasks.write_text(json.dumps(json.loads(original)[:-1]))  # one task fewer
        assert suite.version(built_copy) != version
    finally:
        tasks.write_text(original)
    assert suite.version(built_copy) == version
    manifest = built_copy / "localcomp" / "build.json"
    params = json.loads(manifest.read_text())
    try:
        manifest.write_text(json.dumps({**params, "edition": 1}))  # a build parameter is part of the version
        assert suite.version(built_copy).startswith("localcomp@e1-")
    finally:
        manifest.write_text(json.dumps(params))


def test_a_missing_build_names_the_command_that_builds_it(tmp_path):
    with pytest.raises(SuiteNotBuilt, match=r"localcomp is not built .*akv tasks build --suite localcomp"):
        get_suite("localcomp").version(tmp_path)
    with pytest.raises(SuiteNotBuilt, match="akv tasks build --suite localswe"):
        get_suite("localswe").version(tmp_path)


def test_the_rebuild_command_names_the_edition_only_where_editions_are_in_play():
    assert rebuild_command("localcomp", "localcomp@e1-0123456789ab", "localcomp@e1-ba9876543210", 3) == \
        "akv tasks build --suite localcomp --seed 3"
    assert rebuild_command("localcomp", "localcomp@e1-0123456789ab", "localcomp@e2-ba9876543210", 0) == \
        "akv tasks build --suite localcomp --seed 0 --edition 1"
    assert rebuild_command("localswe", "localswe@e2-0123456789ab", None, 0).endswith("--edition 2")
    check_recorded("localcomp", None, "localcomp@unversioned", 0)  # older runs cannot be checked: they pass
    check_recorded("localcomp", "localcomp@e1-0123456789ab", "localcomp@e1-0123456789ab", 0)
    with pytest.raises(ValueError, match=r"stale for this run\): rebuild it with `akv tasks build"):
        check_recorded("localcomp", "localcomp@e1-ba9876543210", "localcomp@e1-0123456789ab", 0)


def test_tasks_build_prints_the_version_a_run_records(built_copy):
    built = CliRunner().invoke(app, ["tasks", "build", "--suite", "localcomp"], env={"AKV_HOME": str(built_copy)})
    assert built.exit_code == 0, built.output
    assert f"(version {get_suite('localcomp').version(built_copy)})" in built.output
    assert built.output.startswith("localcomp: already built under ")  # nothing was built: it does not say it was


def _recorded_run(url: str, name: str, suite_version: str) -> None:
    store = Store.open(url)
    try:
        config = EvolveConfig.model_validate({"run_name": name, "max_candidates": 1})
        store.create_run(name, config.model_dump(mode="json", exclude={"db"}), 0, "test", suite_version)
    finally:
        store.close()


def test_resume_refuses_a_stale_or_missing_suite_build_and_changes_nothing(tmp_path, built_copy):
    url = f"sqlite:///{tmp_path / 'akv.db'}"
    _recorded_run(url, "stale", "localcomp@e1-000000000000")
    runner = CliRunner()
    stale = runner.invoke(app, ["evolve", "--resume", "--run-name", "stale", "--db", url],
                          env={"AKV_HOME": str(built_copy), "COLUMNS": "200"})
    assert stale.exit_code == 2, stale.output
    assert "localcomp@e1-000000000000" in stale.output and "stale for this run" in stale.output
    assert "akv tasks build --suite localcomp --seed 0" in stale.output and "Traceback" not in stale.output
    assert str(built_copy / "localcomp") in stale.output.replace("\n", "")
    empty = tmp_path / "empty-home"
    missing = runner.invoke(app, ["evolve", "--resume", "--run-name", "stale", "--db", url],
                            env={"AKV_HOME": str(empty), "COLUMNS": "200"})
    assert missing.exit_code == 2 and "localcomp is not built" in missing.output
    assert not (empty / "localcomp").exists()  # refusing builds nothing
    store = Store.open(url)
    try:
        run = store.run("stale")
        assert run.status == "running" and store.policies(run.id) == []  # untouched, still resumable
    finally:
        store.close()
