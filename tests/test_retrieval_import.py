"""`akv tasks import retrieval`: a deep-research suite from a small corpus generated here, run with the
scripted agent (which sees only what the policy leaves visible) and the llm agent; bad import files
named by line and field; the optional judge asked through a real server."""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from akv_cli.main import app

runner = CliRunner()
PORTS = ["Aldmouth", "Brisk Harbor", "Cray Point", "Dunmere", "Elvaston", "Fairhaven"]


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def small_corpus(folder: Path, seed: int = 0) -> tuple[Path, Path]:
    """Ships, each docked at a port whose harbour master is named in the port's own document: every
    question needs the ship's document and then the port's (two hops)."""
    rng = random.Random(seed)
    filler = "Records of the harbour board list tonnage, crew and the season's weather. " * 8
    masters = {port: f"{rng.choice(['Ada', 'Bo', 'Cy', 'Di'])} {rng.choice(['Marr', 'Holt', 'Vane'])}"
               for port in PORTS}
    docs = [{"id": f"port-{i}", "title": f"Port of {port}",
             "text": f"{filler}The harbour master of {port} is {masters[port]}. {filler}"}
            for i, port in enumerate(PORTS)]
    queries = []
    for n in range(12):
        port = rng.randrange(len(PORTS))
        docs.append({"id": f"ship-{n}", "title": f"The ship Gull {n}",
                     "text": f"{filler}The Gull {n} docks at {PORTS[port]}. {filler}"})
        queries.append({"id": f"q{n}", "question": f"Who is the harbour master where the Gull {n} docks?",
                        "answer": masters[PORTS[port]], "evidence_ids": [f"ship-{n}", f"port-{port}"],
                        "split": "train" if n < 8 else "heldout"})
    return write_jsonl(folder / "docs.jsonl", docs), write_jsonl(folder / "queries.jsonl", queries)


@pytest.fixture()
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("AKV_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def import_args(docs: Path, queries: Path, name: str = "harbours") -> list[str]:
    return ["tasks", "import", "retrieval", "--corpus", str(docs), "--queries", str(queries), "--name", name]


def run_json(*args: str) -> dict[str, Any]:
    result = runner.invoke(app, ["run", *args, "--json"])
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def test_an_imported_suite_is_listed_and_runs_under_policies(home, tmp_path) -> None:
    docs, queries = small_corpus(tmp_path)
    done = runner.invoke(app, import_args(docs, queries))
    assert done.exit_code == 0, done.stderr
    assert "18 documents, 8 train tasks, 4 heldout tasks" in done.stdout
    listed = json.loads(runner.invoke(app, ["tasks", "list", "--suites", "--json"]).stdout)["suites"]
    entry = next(r for r in listed if r["name"] == "harbours")
    assert entry["error"] is None and entry["distribution"].startswith("imported at ")
    full = run_json("--suite", "harbours", "--split", "train", "--policy", "full")
    assert full["summary"]["n_tasks"] == 8 and full["summary"]["mean_score"] == 1.0
    # A one-response window never shows a ship and its port together: the agent fetches again, then gives up.
    window = tmp_path / "one.akvp"
    window.write_text("mode kv\non each tool_response: drop role tool keep last 1\n")
    narrow = run_json("--suite", "harbours", "--split", "train", "--policy", str(window), "--limit", "2")
    assert narrow["summary"]["statuses"]["gave_up"] == 2 and narrow["summary"]["mean_score"] == 0.0
    assert narrow["summary"]["mean_cost_usd"] > full["summary"]["mean_cost_usd"]


def test_the_scripted_agent_reads_only_visible_evidence_and_records_it(home, tmp_path) -> None:
    from sandbox.backends import open_backend
    from sandbox.runs.harness import run_task
    from sandbox.suites import get_suite
    from policy_dsl import load_policy

    docs, queries = small_corpus(tmp_path)
    assert runner.invoke(app, import_args(docs, queries)).exit_code == 0
    suite = get_suite("harbours")
    task = suite.tasks("heldout")[0]
    result, trajectory = run_task(task, suite, load_policy("full"), suite.scripted_agent(task), open_backend("replay"))
    assert result.status == "ok" and result.score == 1.0
    final = trajectory.exchanges[-1].request.messages
    used = [i for i, m in enumerate(final) if m.get("role") == "tool" and m.get("name") == "get_document"]
    assert sorted(final[i]["content"].split("]")[0][1:] for i in used) == sorted(task.meta["evidence_ids"])
    grade = suite.open(task).grade(f"Answer: {task.meta['gold']['answer'].upper()}.")
    assert grade.score == 1.0  # localcomp's normalization: case and punctuation do not matter


@pytest.mark.parametrize("file, rows, message", [
    ("docs", [{"id": "a", "title": "A", "text": "x"}, {"id": "b", "text": "y"}], ":2: field 'title': missing"),
    ("docs", [{"id": "a", "title": "A", "text": "x"}, {"id": "a", "title": "B", "text": "y"}],
     ":2: field 'id': duplicate 'a' (first on line 1)"),
    ("docs", ['{"id": "a", "title": "A", "text": "x"}', "{nope"], ":2: not valid JSON"),
    ("queries", [{"id": "q", "question": "?", "answer": "x", "split": "train"}], ":1: field 'evidence_ids': missing"),
    ("queries", [{"id": "q", "question": "?", "answer": "x", "evidence_ids": ["zz"], "split": "train"}],
     ":1: field 'evidence_ids': no document with id 'zz'"),
    ("queries", [{"id": "q", "question": "?", "answer": "x", "evidence_ids": [], "split": "test"}],
     ":1: field 'split': expected train or heldout"),
])
def test_a_bad_import_file_names_the_line_and_the_field(home, tmp_path, file: str, rows: list[Any],
                                                        message: str) -> None:
    docs = write_jsonl(tmp_path / "docs.jsonl", rows if file == "docs" else [{"id": "a", "title": "A", "text": "x"}])
    queries = write_jsonl(tmp_path / "queries.jsonl", rows if file == "queries" else
                          [{"id": "q", "question": "?", "answer": "x", "evidence_ids": ["a"], "split": "train"}])
    result = runner.invoke(app, import_args(docs, queries))
    assert result.exit_code == 2 and "Traceback" not in result.stderr
    assert f"{file}.jsonl{message}" in result.stderr
    assert not (home / "suites" / "harbours").exists()  # nothing half-built is left


def test_names_are_checked_and_an_import_is_never_overwritten_silently(home, tmp_path) -> None:
    docs, queries = small_corpus(tmp_path)
    assert runner.invoke(app, import_args(docs, queries, "localcomp")).exit_code == 2
    assert runner.invoke(app, import_args(docs, queries, "Bad Name")).exit_code == 2
    assert runner.invoke(app, import_args(docs, queries)).exit_code == 0
    again = runner.invoke(app, import_args(docs, queries))
    assert again.exit_code == 2 and "--replace" in again.stderr
    assert runner.invoke(app, [*import_args(docs, queries), "--replace"]).exit_code == 0


@pytest.mark.server
@pytest.mark.model
@pytest.mark.slow
def test_the_llm_agent_runs_and_the_judge_is_asked_when_exact_match_fails(home, tmp_path, pytestconfig) -> None:
    from sandbox.suites import get_suite
    from test_server_support import MODEL, live_server

    server = live_server(pytestconfig)
    docs, queries = small_corpus(tmp_path)
    done = runner.invoke(app, [*import_args(docs, queries), "--judge", server.url + "/v1", "--judge-model", MODEL])
    assert done.exit_code == 0, done.stderr
    llm = run_json("--suite", "harbours", "--split", "heldout", "--policy", "expert-8k", "--agent", "llm",
                   "--backend", server.url, "--model", MODEL, "--limit", "1", "--max-steps", "2",
                   "--max-tokens", "16")
    assert llm["summary"]["n_tasks"] == 1 and llm["results"][0]["status"] in ("ok", "max_steps")
    suite = get_suite("harbours")
    task = suite.tasks("train")[0]
    env = suite.open(task)
    try:
        assert env.grade(task.meta["gold"]["answer"]).detail.endswith("matches " + repr(task.meta["gold"]["answer"]))
        judged = env.grade("Answer: the harbour master of that port")
        assert judged.score in (0.0, 1.0) and f"judge {MODEL} said" in judged.detail
    finally:
        suite.close()
