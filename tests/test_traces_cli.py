"""`akv traces ...`, `akv bench traces` and `akv evolve` on a trace set, through the real command app
with a throwaway database: each format imported, bad input refused whole, the built-ins and the
oracle scored, the loop's reflect proposer working from inferred use records."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from sandbox.traces.suite import TraceSuite
from test_cli_support import akv_in_process as akv

DATA = Path(__file__).parent / "data" / "traces"
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {"AKV_DB": f"sqlite:///{tmp_path / 'akv.db'}", "COLUMNS": "160"}


def test_every_format_imports_into_one_set_and_lists_by_id(env) -> None:
    files = [DATA / f for f in ("openai.jsonl", "sweagent-fc.traj", "sweagent-text.traj", "mswea.traj.json",
                                "samples.jsonl")]
    code, out, err = akv(env, "traces", "import", *map(str, files), "--name", "mixed")
    assert code == 0, err
    assert "traces added, 0 unchanged" in out
    code, out, _ = akv(env, "traces", "show", "mixed", "--json")
    shown = json.loads(out)["traces"]
    ids = {t["id"] for t in shown}
    assert {"sweagent-fc", "psf__requests-1963", "mswea-gemini3pro-11", "taubench-gpt4o-05"} <= ids
    assert {t["format"] for t in shown} == {"openai", "swe-agent", "mini-swe-agent"}
    code, out, _ = akv(env, "tasks", "list", "--suite", "mixed", "--split", "train", "--json")
    listed = {t["id"] for t in json.loads(out)["tasks"]}
    code, out, _ = akv(env, "tasks", "list", "--suite", "mixed", "--split", "heldout", "--json")
    assert listed | {t["id"] for t in json.loads(out)["tasks"]} == ids
    # A second import of the same files changes nothing.
    code, out, _ = akv(env, "traces", "import", *map(str, files), "--name", "mixed")
    assert code == 0 and " 0 traces added" in out


def test_a_bad_file_imports_nothing_and_names_file_and_line(env) -> None:
    for bad, expected in (("bad-notjson.jsonl", "not JSON"), ("bad-norole.jsonl", "role"),
                          ("bad-orphan-tool.jsonl", "answers no call"), ("bad-noassistant.jsonl", "no assistant")):
        code, _, err = akv(env, "traces", "import", str(DATA / "openai.jsonl"), str(DATA / bad), "--name", "t")
        assert code == 2 and err.startswith(f"error: {DATA / bad}:") and expected in err, err
    code, out, _ = akv(env, "traces", "list", "--json")
    assert json.loads(out)["trace_sets"] == []  # the good file of each import was not kept either
    code, _, err = akv(env, "traces", "import", str(DATA / "openai.jsonl"), "--name", "t", "--format", "csv")
    assert code == 2 and "unknown trace format 'csv'" in err
    code, _, err = akv(env, "traces", "import", str(DATA / "openai.jsonl"), "--name", "localcomp")
    assert code == 2 and "--name: 'localcomp' is already the name of a suite" in err


def test_a_known_id_with_other_content_is_refused_and_the_set_kept(env, tmp_path) -> None:
    assert akv(env, "traces", "import", str(DATA / "openai.jsonl"), "--name", "t")[0] == 0
    first = json.loads(akv(env, "traces", "show", "t", "--json")[1])
    line = json.loads((DATA / "openai.jsonl").read_text().splitlines()[0])
    line["messages"][1]["content"] += " (edited)"
    changed = tmp_path / "changed.jsonl"
    changed.write_text(json.dumps(line) + "\n")
    code, _, err = akv(env, "traces", "import", str(changed), "--name", "t")
    assert code == 2 and f"trace {line['id']!r} is already in 't' with other content" in err
    assert json.loads(akv(env, "traces", "show", "t", "--json")[1]) == first


def test_export_reads_back_as_the_same_traces(env, tmp_path) -> None:
    assert akv(env, "traces", "import", str(DATA / "samples.jsonl"), str(DATA / "mswea.traj.json"), "--name", "a")[0] == 0
    out = tmp_path / "a.jsonl"
    assert akv(env, "traces", "export", "a", "--out", str(out))[0] == 0
    assert akv(env, "traces", "import", str(out), "--name", "b")[0] == 0
    shown = [json.loads(akv(env, "traces", "show", name, "--trace", "psf__requests-1963", "--json")[1])
             for name in ("a", "b")]
    assert shown[0] == shown[1] and shown[0]["actions"] == "text"
    code, _, err = akv(env, "traces", "show", "nope")
    assert code == 2 and "no trace set named 'nope'" in err


def test_bench_traces_scores_the_built_ins_and_a_lossless_oracle(env) -> None:
    assert akv(env, "traces", "import", str(EXAMPLES / "traces.jsonl"), "--name", "ex")[0] == 0
    code, out, err = akv(env, "bench", "traces", "--suite", "ex", "--json")
    assert code == 0, err
    rows = {p["policy"]: p for p in json.loads(out)["policies"]}
    assert {"full", "expert", "keep-12", "rolling-3", "turn-based", "token-based", "standard", "text-engineering",
            "oracle"} <= set(rows)
    assert set(TraceSuite.baselines.values()) <= set(rows)   # every baseline `akv evolve` uses on a trace set
    assert rows["full"]["score"] == 1.0 and rows["full"]["lost_reuses"] == 0
    assert rows["oracle"]["score"] == 1.0 and rows["oracle"]["cost_usd"] < rows["full"]["cost_usd"]
    assert rows["rolling-3"]["lost_reuses"] > 0 and rows["rolling-3"]["cost_usd"] < rows["full"]["cost_usd"]
    assert all(p["errors"] == 0 for p in rows.values())
    code, _, err = akv(env, "bench", "traces", "--suite", "localcomp")
    assert code == 2 and "not a trace set" in err


def test_evolve_on_a_trace_set_reflects_on_inferred_use_records(env, tmp_path) -> None:
    from store import Store

    assert akv(env, "traces", "import", str(DATA / "samples.jsonl"), str(DATA / "openai.jsonl"),
               str(DATA / "mswea.traj.json"), str(DATA / "sweagent-fc.traj"), "--name", "ex")[0] == 0
    code, _, err = akv(env, "traces", "import", str(DATA / "samples.jsonl"), str(EXAMPLES / "traces.jsonl"),
                       "--name", "twice")
    assert code == 2 and "appears more than once in the files" in err
    config = tmp_path / "c.yaml"
    config.write_text("proposers: [reflect, optuna]\nmax_candidates: 4\n")
    code, out, err = akv(env, "evolve", "--config", str(config), "--suite", "ex", "--run-name", "tr")
    assert code == 0, err
    store = Store.open(env["AKV_DB"])
    try:
        run = store.run("tr")
        assert run.config["baselines"]["expert"] == "expert" and run.config["seed_policies"] == ["expert"]
        reflected = [p for p in store.policies(run.id) if p.proposer == "reflect"]
        assert reflected and all(p.status != "rejected" for p in reflected), [p.rejection_reason for p in reflected]
        assert "idle >=" in " ".join(store.policy(p.id).text or "" for p in reflected)
        assert store.validations(run.id)
    finally:
        store.close()
