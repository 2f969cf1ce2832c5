"""An evolution run as a user runs it: `akv evolve` in a subprocess, killed with SIGKILL mid-run,
resumed, then inspected with runs/lineage/export/compare and the report opened in Chromium."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sqlite3
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from akv_cli.main import app

AKV = [sys.executable, "-m", "akv_cli.main"]
# Held-out tasks the run validates on: few, to keep each validation short, but not as many as its 3
# train tasks, so that a count taken from the wrong split shows.
HELDOUT = 4
# promote_margin keeps equally scoring candidates (the cascade would prune the slightly dearer
# ones), so that some reach held-out validation in a run this small.
# In turn (not `lead`): mutate's and optuna's proposals, as the runs these tests were written on
# (named: the default mix asks the embedded model too, which these tests do not need).
# The reference is Standard at 32K, which costs what `full` does on these tasks: only candidates cheaper
# than the reference on train are validated, and in a run this small the expert's tuned children rarely
# are cheaper than the expert itself (which the finalist choice is tested for in test_evolve_schedule.py).
# Seed 0 is the seed of the session's localcomp build (tests/conftest.py): the run finds its build
# ready instead of rebuilding the shared data folder with another seed (and the tests after it
# find the session's build still there).
SMALL = f"""\
max_candidates: 3
seed: 0
proposers: [mutate, optuna]
schedule: round-robin
cascade:
  subset_size: 1
  train_limit: 3
  promote_margin: 0.5
validation:
  heldout_limit: {HELDOUT}
  top_k: 2
baselines:
  expert: standard-32k
"""


def akv_env() -> dict[str, str]:
    from akv_core.home import akv_home

    # Share the data folder (the built task suite) with the rest of the test session.
    return {**os.environ, "AKV_HOME": str(akv_home().resolve()), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def rows(db: Path, sql: str) -> list[tuple]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as conn:
        return conn.execute(sql).fetchall()


def build_suite_for(config: str) -> None:
    """Build the suite at the run's seed in the shared data folder, as the run would."""
    from akv_core.home import akv_home
    from sandbox.suites import get_suite

    get_suite("localcomp").build(akv_home().resolve(), yaml.safe_load(config)["seed"])


def wait_for_candidate_mid_cascade(db: Path, process: subprocess.Popen, timeout: float = 420) -> None:
    """Block until a proposed candidate has some, not all, of its train results stored."""
    deadline = time.monotonic() + timeout
    sql = ("SELECT count(*) FROM akv_policies p JOIN akv_evaluations e ON e.policy_id = p.id "
           "WHERE p.status = 'proposed' AND p.proposer IN ('mutate', 'optuna')")
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()
        try:
            if db.exists() and rows(db, sql)[0][0] >= 1:
                return
        except sqlite3.OperationalError:
            pass  # tables not created yet
        time.sleep(0.05)
    pytest.fail("the run never reached a candidate's cascade")


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("evolve")
    db, config = folder / "akv.db", folder / "small.yaml"
    config.write_text(SMALL)
    url = f"sqlite:///{db}"
    name = f"resume-{os.getpid()}"
    build_suite_for(SMALL)  # before the clock starts: the wait below times the run, not the build
    process = subprocess.Popen([*AKV, "evolve", "--config", str(config), "--db", url, "--run-name", name],
                               env=akv_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_candidate_mid_cascade(db, process)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    before = rows(db, "SELECT id, policy_id, task_id, split, score, cost_usd FROM akv_evaluations")
    resumed = subprocess.run([*AKV, "evolve", "--resume", "--run-name", name, "--db", url], env=akv_env(),
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    return {"db": db, "url": url, "name": name, "before": before, "stdout": resumed.stdout, "folder": folder}


def test_resume_after_sigkill_loses_nothing_and_repeats_nothing(killed_and_resumed):
    db = killed_and_resumed["db"]
    after = rows(db, "SELECT id, policy_id, task_id, split, score, cost_usd FROM akv_evaluations")
    assert set(killed_and_resumed["before"]) <= set(after)  # every committed row survived, unchanged
    assert len(after) == len({(r[1], r[2], r[3]) for r in after})
    hashes = [h for (h,) in rows(db, "SELECT hash FROM akv_policies WHERE hash IS NOT NULL")]
    assert len(hashes) == len(set(hashes))
    made = rows(db, "SELECT status FROM akv_policies WHERE proposer IN ('mutate', 'optuna', 'llm')")
    assert len(made) == 3 and all(status != "proposed" for (status,) in made)
    # Every fully evaluated policy has all 3 train tasks; the run finished with a validation.
    full = rows(db, "SELECT p.id, count(e.id) FROM akv_policies p JOIN akv_evaluations e ON e.policy_id = p.id "
                    "WHERE p.status = 'evaluated' AND e.split = 'train' GROUP BY p.id")
    assert full and all(n == 3 for _, n in full)
    assert rows(db, "SELECT status FROM akv_runs")[0][0] == "finished"
    assert len(rows(db, "SELECT id FROM akv_validations")) >= 3
    out = killed_and_resumed["stdout"]
    assert "standard-8k" in out and "expert-8k" in out and "text-engineering-8k" in out
    assert "exported" in out and ".akvp" in out


def test_held_out_progress_names_the_policies_not_their_roles(killed_and_resumed):
    progress = [line for line in killed_and_resumed["stdout"].splitlines() if " on heldout: " in line]
    assert progress and not [line for line in progress if line.split()[0] in ("standard", "text_engineering")]


def test_runs_list_show_and_lineage(killed_and_resumed):
    runner, url, name = CliRunner(), killed_and_resumed["url"], killed_and_resumed["name"]
    listed = runner.invoke(app, ["runs", "list", "--db", url], env={"COLUMNS": "200"})
    assert listed.exit_code == 0 and name in listed.output and "finished" in listed.output
    shown = runner.invoke(app, ["runs", "show", name, "--db", url], env={"COLUMNS": "200"})
    assert shown.exit_code == 0 and "train front" in shown.output and "held-out" in shown.output
    assert re.search(r"suite localcomp@e\d+-[0-9a-f]{12}", shown.output), shown.output  # a real suite version
    tree = runner.invoke(app, ["lineage", name, "--db", url], env={"COLUMNS": "200"})
    assert tree.exit_code == 0 and "expert-8k" in tree.output
    assert tree.output.count("mutate") + tree.output.count("optuna") >= 3
    missing = runner.invoke(app, ["runs", "show", "no-such-run", "--db", url])
    assert missing.exit_code == 2 and "no run named" in missing.output


def test_export_writes_a_loadable_policy_and_its_provenance(killed_and_resumed, tmp_path):
    from policy_dsl import load_policy

    url, name = killed_and_resumed["url"], killed_and_resumed["name"]
    db = killed_and_resumed["db"]
    best = rows(db, "SELECT policy_id FROM akv_validations WHERE role = 'candidate' ORDER BY cost_mean LIMIT 1")[0][0]
    out = tmp_path / "best.akvp"
    result = CliRunner().invoke(app, ["export", name, "--db", url, "--out", str(out), "--policy", str(best)])
    assert result.exit_code == 0, result.output
    load_policy(str(out))  # the exported file is a valid policy
    record = json.loads(out.with_suffix(".json").read_text())
    assert record["run"]["name"] == name and record["policy"]["id"] == best
    assert record["metrics"]["heldout"]["tasks"] == HELDOUT and record["metrics"]["train"]["tasks"] == 3
    assert record["lineage"][0]["id"] == best and record["run"]["code_version"]
    assert re.fullmatch(r"localcomp@e\d+-[0-9a-f]{12}", record["run"]["suite_version"])
    assert record["validation"]["round"] == 1
    assert record["validation"]["suite_version"] == record["run"]["suite_version"]


def test_compare_prints_the_table_and_writes_a_report_chromium_renders(killed_and_resumed, tmp_path):
    url, name = killed_and_resumed["url"], killed_and_resumed["name"]
    report = tmp_path / "report.html"
    result = CliRunner().invoke(app, ["compare", name, "--db", url, "--out", str(report)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "standard-8k" in result.output and "vs Std" in result.output
    assert "vs expert" in result.output and "vs full" in result.output and "vs TE" in result.output
    html = report.read_text()
    assert "http://" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "") and "https://" not in html
    shot = tmp_path / "shot.png"
    # One start of Chromium: the rendered DOM on stdout and a screenshot of the same page.
    dom = chromium(report, "--dump-dom", f"--screenshot={shot}", "--window-size=1000,1400")
    assert '<table id="comparison">' in dom and '<svg id="pareto"' in dom and '<svg id="lineage"' in dom
    assert dom.count("<circle") >= 5 and "text-engineering-8k" in dom
    assert distinct_bytes(shot) > 20, "the screenshot is blank"


def chromium(page: Path, *args: str) -> str:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.fail("headless Chromium is required for the report test: apt-get install -y chromium")
    profile = page.parent / "chromium-profile"
    result = subprocess.run([binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                             "--disable-background-networking", "--disable-component-update", "--disable-sync",
                             f"--user-data-dir={profile}", *args, page.as_uri()],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def distinct_bytes(png: Path) -> int:
    """Distinct values in the decoded image data (a blank page has two or three)."""
    data, pos, idat = png.read_bytes(), 8, b""
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        if kind == b"IDAT":
            idat += data[pos + 8:pos + 8 + length]
        pos += 12 + length
    return len(set(zlib.decompress(idat)))


def test_user_errors_are_one_line_and_lose_nothing(killed_and_resumed, tmp_path):
    url, name, db = killed_and_resumed["url"], killed_and_resumed["name"], killed_and_resumed["db"]
    before = rows(db, "SELECT count(*) FROM akv_policies")[0][0]
    runner = CliRunner()
    again = runner.invoke(app, ["evolve", "--run-name", name, "--db", url])
    assert again.exit_code == 2 and "already exists" in again.output and "--resume" in again.output
    assert rows(db, "SELECT count(*) FROM akv_policies")[0][0] == before
    bad_db = runner.invoke(app, ["evolve", "--db", f"sqlite:///{tmp_path}/missing/akv.db"])
    assert bad_db.exit_code == 2 and "does not exist" in bad_db.output
    config = tmp_path / "bad.yaml"
    config.write_text("max_candidates: 3\ncascade:\n  subset: 2\n")
    bad_config = runner.invoke(app, ["evolve", "--config", str(config), "--db", url])
    assert bad_config.exit_code == 2 and f"{config}:3: cascade.subset: unknown field" in bad_config.output
    no_proposer = runner.invoke(app, ["evolve", "--proposer", "nosuch", "--db", url, "--run-name", "never-made"])
    assert no_proposer.exit_code == 2 and "proposers.0" in no_proposer.output and "'reflect'" in no_proposer.output
    seeds = tmp_path / "seeds.yaml"
    seeds.write_text("seed_policies: [no-such-policy]\n")
    unknown = runner.invoke(app, ["evolve", "--config", str(seeds), "--db", url, "--run-name", "never-made"])
    assert unknown.exit_code == 2 and "no-such-policy" in unknown.output
    assert "never-made" not in {n for (n,) in rows(db, "SELECT name FROM akv_runs")}
    for result in (again, bad_db, bad_config, no_proposer, unknown):
        assert result.exception is None or isinstance(result.exception, SystemExit)
        assert "Traceback" not in result.output
    assert "db" not in json.loads(rows(db, "SELECT config FROM akv_runs")[0][0])  # no password at rest


def test_export_and_compare_explain_what_is_missing(killed_and_resumed, tmp_path):
    from store import Store

    url = killed_and_resumed["url"]
    store = Store.open(url)
    try:
        store.create_run("empty", {}, 0, "v", "s")
    finally:
        store.close()
    runner = CliRunner()
    compared = runner.invoke(app, ["compare", "empty", "--db", url, "--out", str(tmp_path / "r.html")])
    assert compared.exit_code == 2 and "no held-out validation yet" in compared.output
    exported = runner.invoke(app, ["export", "empty", "--db", url])
    assert exported.exit_code == 2 and "no champion" in exported.output and "--policy" in exported.output


def test_a_resumed_proposer_sees_train_results_only_although_held_out_ones_are_stored(killed_and_resumed):
    from evolve.config import EvolveConfig
    from evolve.library import library_texts
    from evolve.loop import Evolution
    from evolve.proposers.llm import language_reference
    from evolve.proposers.mutate import MutateProposer
    from evolve.proposers.prompt import fit_prompt
    from evolve.scoring import HarnessEvaluator
    from store import Store

    store = Store.open(killed_and_resumed["url"])
    run = store.run(killed_and_resumed["name"])
    config = EvolveConfig.model_validate(run.config)
    evaluator = HarnessEvaluator(config.suite, config.agent, config.backend, config.seed)
    try:
        assert store.evaluations(run.id, "heldout")  # validation stored its results
        held_out = {e.result.task_id for e in store.evaluations(run.id, "heldout")}
        context = Evolution(store, run, config, evaluator, {}).proposer_context(index=99, timelines=True)
        seen = [r for c in context.population for r in c.results]
        assert seen and {r.split for r in seen} == {"train"}
        proposal = MutateProposer(config.mutate, library_texts()).ask(context)
        assert proposal.rejection_reason is None
        # Timelines are kept for train evaluations only, and no held-out task reaches an llm prompt.
        stored = store.timelines(run.id, [p.id for p in store.policies(run.id)])
        assert stored and {t.split for t in stored} == {"train"}
        assert all(set(c.timelines) <= {r.task_id for r in c.results} for c in context.population)
        system = language_reference(library_texts()[:3])
        for parent in context.front:
            prompt = fit_prompt(system, parent, [], context.front, 8192, 1024, 2, lambda t: len(t) // 3)
            assert prompt.digested and not [t for t in held_out if t in prompt.text]
    finally:
        evaluator.close()
        store.close()


def test_a_finished_run_resumed_says_so_and_changes_nothing_unless_asked_to_revalidate(killed_and_resumed):
    url, name, db = killed_and_resumed["url"], killed_and_resumed["name"], killed_and_resumed["db"]
    tables = ("akv_policies", "akv_evaluations", "akv_validations", "akv_validation_rounds")
    before = {t: rows(db, f"SELECT * FROM {t}") for t in tables}
    # `akv evolve` in this process (no Python start-up per call); an evolve sets AKV_DB for its task
    # processes, which env= keeps from outliving the call.
    runner = CliRunner()
    again = runner.invoke(app, ["evolve", "--resume", "--run-name", name, "--db", url], env={"AKV_DB": None})
    assert again.exit_code == 0 and again.exception is None, again.output
    assert "is finished" in again.stdout and "--revalidate" in again.stdout
    assert {t: rows(db, f"SELECT * FROM {t}") for t in tables} == before  # nothing validated, nothing deleted
    revalidated = runner.invoke(app, ["evolve", "--resume", "--revalidate", "--run-name", name, "--db", url],
                                env={"AKV_DB": None})
    assert revalidated.exit_code == 0 and revalidated.exception is None, revalidated.output
    assert set(before["akv_validations"]) <= set(rows(db, "SELECT * FROM akv_validations"))  # round 1 is kept
    assert [r for (r,) in rows(db, "SELECT round FROM akv_validation_rounds ORDER BY round")] == [1, 2]
    assert rows(db, "SELECT count(*) FROM akv_evaluations") == [(len(before["akv_evaluations"]),)]  # no task ran again
    shown = CliRunner().invoke(app, ["runs", "show", name, "--db", url], env={"COLUMNS": "200"})
    assert "round 2 of 2" in shown.output


def test_listing_and_comparing_at_80_columns_cut_nothing_and_have_json(killed_and_resumed):
    url, name = killed_and_resumed["url"], killed_and_resumed["name"]
    runner = CliRunner()
    for args in (["runs", "list"], ["compare", name], ["runs", "show", name]):
        shown = runner.invoke(app, [*args, "--db", url], env={"COLUMNS": "80"}, terminal_width=80)
        assert shown.exit_code == 0, shown.output
        assert max(map(len, shown.output.splitlines())) <= 80 and "…" not in shown.output, shown.output
        assert "$" not in shown.output
    assert "¢/task" in runner.invoke(app, ["runs", "show", name, "--db", url]).output
    listed = [json.loads(line) for line in runner.invoke(app, ["runs", "list", "--db", url, "--json"]).stdout.splitlines()]
    assert name in {r["name"] for r in listed} and all({"status", "policies", "detail"} <= set(r) for r in listed)
    compared = json.loads(runner.invoke(app, ["compare", name, "--db", url, "--json"]).stdout)
    assert {r["label"] for r in compared["rows"]} >= {"expert-8k", "standard-8k", "full"}
    assert compared["verdict"] and compared["report"].endswith("report.html")


def test_export_best_writes_the_best_validated_candidate_when_there_is_no_champion(killed_and_resumed, tmp_path):
    url, name = killed_and_resumed["url"], killed_and_resumed["name"]
    out = tmp_path / "best.akvp"
    result = CliRunner().invoke(app, ["export", name, "--best", "--db", url, "--out", str(out)])
    assert result.exit_code == 0, result.output
    record = json.loads(out.with_suffix(".json").read_text())
    header = out.read_text().splitlines()[0]
    assert header.startswith(f"# exported from run {name}, policy #{record['policy']['id']}")
    assert ("(champion)" in header) == record["champion"] and ("not a champion" in header) != record["champion"]


def test_compare_oracle_says_how_much_of_the_expert_to_oracle_gap_the_candidate_closed(killed_and_resumed):
    # The hindsight oracle runs on each of the run's HELDOUT held-out tasks (replay backend, seconds).
    from store import Store

    url, name, db = killed_and_resumed["url"], killed_and_resumed["name"], killed_and_resumed["db"]
    runner = CliRunner()
    result = runner.invoke(app, ["compare", name, "--db", url, "--oracle", "--json"])
    assert result.exit_code == 0, result.output
    gap = json.loads(result.stdout)["oracle_gap"]
    assert gap["n_tasks"] == HELDOUT and gap["oracle_same_actions"] == HELDOUT
    means = dict(rows(db, "SELECT policy_id, avg(cost_usd) FROM akv_evaluations WHERE split = 'heldout' "
                          "GROUP BY policy_id"))
    expert = rows(db, "SELECT policy_id FROM akv_baselines WHERE role = 'expert'")[0][0]
    assert gap["expert_cost_usd"] == pytest.approx(means[expert]) and gap["oracle_cost_usd"] < means[expert]
    assert gap["candidate_cost_usd"] == pytest.approx(means[gap["policy_id"]])
    share = 100 * (means[expert] - means[gap["policy_id"]]) / (means[expert] - gap["oracle_cost_usd"])
    low, high = gap["interval_percent"]
    assert gap["closed_percent"] == pytest.approx(share) and low <= share <= high
    shown = runner.invoke(app, ["compare", name, "--db", url, "--oracle"], env={"COLUMNS": "200"})
    who = "champion" if gap["champion"] else "best validated candidate"
    line = (rf"^{who} \({re.escape(gap['candidate'])}\) closes -?[\d.]+% of the expert-to-oracle gap "
            rf"\(95% interval -?[\d.]+%\.\.-?[\d.]+%\) on {HELDOUT} held-out tasks$")
    assert re.search(line, shown.output, re.M), shown.output
    store = Store.open(url)  # the same validations, but the run's agent was the llm agent: no use records
    try:
        llm = store.create_run("llm-agent", {"suite": "localcomp", "agent": "llm", "backend": "replay"}, 3, "v", "s")
        store.save_validations(llm.id, store.validations(store.run(name).id), "v", "s", {})
    finally:
        store.close()
    refused = runner.invoke(app, ["compare", "llm-agent", "--db", url, "--oracle"])
    assert refused.exit_code == 2 and refused.output.startswith("error: --oracle: ")
    assert len(refused.output.strip().splitlines()) == 1 and "llm agent" in refused.output
