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
    assert code == 2 and "openai.jsonl:1: --format 'csv' is not a trace format" in err
    code, _, err = akv(env, "traces", "import", str(DATA / "openai.jsonl"), "--name", "localcomp")
    assert code == 2 and "--name: 'localcomp' is already the name of a suite" in err


def test_a_run_changed_in_its_own_file_is_refused_and_the_set_kept(env, tmp_path) -> None:
    assert akv(env, "traces", "import", str(DATA / "openai.jsonl"), "--name", "t")[0] == 0
    first = json.loads(akv(env, "traces", "show", "t", "--json")[1])
    line = json.loads((DATA / "openai.jsonl").read_text().splitlines()[0])
    line["messages"][1]["content"] += " (edited)"
    (tmp_path / "traces").mkdir()
    changed = tmp_path / "traces" / "openai.jsonl"  # the same folder and file name: the same file, changed
    changed.write_text(json.dumps(line) + "\n")
    code, _, err = akv(env, "traces", "import", str(changed), "--name", "t")
    assert code == 2 and err.startswith(f"error: {changed}:1: trace {line['id']!r} is already in the set with other "
                                        "content, from the same file") and "--id-prefix" in err
    assert json.loads(akv(env, "traces", "show", "t", "--json")[1]) == first
    code, _, err = akv(env, "traces", "import", str(DATA / "mswea.traj.json"), str(changed), "--name", "t",
                       "--id-from", "field")
    assert code == 2 and f"trace {line['id']!r} is already in the set with other content" in err
    assert json.loads(akv(env, "traces", "show", "t", "--json")[1]) == first  # the good file did not land


def test_export_reads_back_as_the_same_traces(env, tmp_path) -> None:
    assert akv(env, "traces", "import", str(DATA / "samples.jsonl"), str(DATA / "mswea.traj.json"),
               "--name", "a")[0] == 0
    out = tmp_path / "a.jsonl"
    assert akv(env, "traces", "export", "a", "--out", str(out))[0] == 0
    assert akv(env, "traces", "import", str(out), "--name", "b")[0] == 0
    shown = [json.loads(akv(env, "traces", "show", name, "--trace", "psf__requests-1963", "--json")[1])
             for name in ("a", "b")]
    assert shown[0] == shown[1] and shown[0]["actions"] == "text"
    code, _, err = akv(env, "traces", "show", "nope")
    assert code == 2 and "no trace set named 'nope'" in err


def test_the_policy_that_served_each_request_survives_export_and_import(env, tmp_path) -> None:
    from sandbox.traces.records import trace_of
    from store import Store

    recorded = [json.loads(line) for line in (DATA / "archive-traffic.jsonl").read_text().splitlines()[:2]]
    recorded[1]["requests"][-1]["policy"] = "archive.r1#5"  # a conversation's last request after a promotion
    source = tmp_path / "recorded.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in recorded))
    assert akv(env, "traces", "import", str(source), "--name", "a")[0] == 0
    out = tmp_path / "a.jsonl"
    assert akv(env, "traces", "export", "a", "--out", str(out))[0] == 0
    assert akv(env, "traces", "import", str(out), "--name", "b", "--format", "akv")[0] == 0
    store = Store.open(env["AKV_DB"])
    try:
        served = {name: [[r.policy for r in trace_of(t).requests] for t in store.traces.get(name)] for name in "ab"}
    finally:
        store.close()
    assert served["a"] == served["b"] == [[r.get("policy") for r in t["requests"]] for t in recorded]
    assert served["b"][1][-1] == "archive.r1#5" and set(served["b"][0]) == {"full"}


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
        expert = store.baselines(run.id)["expert"]
        assert all(p.parent_ids == (expert,) and p.meta["edits"][0].startswith("hindsight") for p in reflected)
        assert "predicted" in reflected[0].meta   # what the timelines said the rules would save and lose
        assert store.validations(run.id)
    finally:
        store.close()


def test_every_example_imports_and_show_counts_what_is_scored(env, tmp_path) -> None:
    files = sorted(p for p in (EXAMPLES / "traces").iterdir() if p.suffix != ".md")
    code, out, err = akv(env, "traces", "import", *map(str, files), "--name", "all")
    assert code == 0, err
    assert "1 unchanged" in out  # akv.jsonl is messages.json exported: the same run
    assert err.splitlines() == [f"warning: {EXAMPLES / 'traces' / 'anthropic.jsonl'}:4: trace 'anthropic-4' has "
                                "no tool results: tool-based policies have nothing to drop in it (if its agent acts "
                                "in text, --actions text reads it so)"]
    rows = {r["id"]: r for r in json.loads(akv(env, "traces", "show", "all", "--json")[1])["traces"]}
    assert {r["format"] for r in rows.values()} == {"openai", "messages", "swe-agent", "mini-swe-agent", "tau-bench",
                                                  "openhands", "anthropic", "claude-code", "adp", "otel", "akv-run"}
    text = rows["openai-1"]
    assert (text["actions"], text["tool_results"], text["requests"]) == ("text", 2, 3)  # scored in tool form
    tau = rows["tau-bench-task-38-trial-2"]
    assert tau["outcome"] == "reward 1" and tau["metadata"] == {"task": 38, "trial": 2, "reward": 1.0,
                                                                "agent": "tau-bench"}
    assert rows["client__http-timeout-12"]["outcome"] == "resolved"
    assert rows["astropy__astropy-12907"]["model"] == "deepseek/deepseek-chat"
    assert rows["astropy__astropy-12907"]["outcome"] == "Submitted"
    assert rows["astropy__astropy-12907"]["provenance"]["path"] == "traces/mini-swe-agent.traj.json"
    code, out, _ = akv(env, "traces", "show", "all")
    assert code == 0 and "reward 1" in out and "resolved" in out
    exported = tmp_path / "all.jsonl"
    assert akv(env, "traces", "export", "all", "--out", str(exported))[0] == 0
    records = {r["id"]: r for r in map(json.loads, exported.read_text().splitlines())}
    assert records["client__http-timeout-12"]["metadata"]["resolved"] is True
    assert "metadata" not in records["client__http-timeout-12"]["provenance"]


def test_actions_option_and_the_no_tool_results_warning(env) -> None:
    log = EXAMPLES / "traces" / "openai.jsonl"
    code, _, err = akv(env, "traces", "import", str(log), "--name", "tools", "--actions", "tools")
    assert code == 0 and f"warning: {log}:1: trace 'openai-1' has no tool results" in err
    [row] = json.loads(akv(env, "traces", "show", "tools", "--json")[1])["traces"]
    assert (row["actions"], row["tool_results"]) == ("tools", 0)
    code, _, err = akv(env, "traces", "import", str(log), "--name", "bad", "--actions", "json")
    assert code == 2 and f"{log}:1: --actions 'json': expected one of text, tools" in err


def test_runs_of_one_task_from_two_folders_get_ids_from_their_paths(env, tmp_path) -> None:
    run = json.loads((DATA / "mswea-v2.traj.json").read_text())
    for folder, edit in (("run-a", ""), ("run-b", " (second run)")):
        (tmp_path / folder).mkdir()
        run["messages"][2]["content"] += edit
        (tmp_path / folder / "astropy.traj.json").write_text(json.dumps(run))
    a, b = tmp_path / "run-a" / "astropy.traj.json", tmp_path / "run-b" / "astropy.traj.json"
    code, out, err = akv(env, "traces", "import", str(a), str(b), "--name", "two")
    assert code == 0 and "2 traces added" in out
    assert f"note: {b}:1: trace id 'astropy__astropy-12907' is another run's (from run-a/astropy.traj.json); " \
           "imported as 'run-b/astropy'" in err
    code, out, _ = akv(env, "traces", "import", str(b), str(a), "--name", "two")  # again, either order
    assert code == 0 and "0 traces added, 2 unchanged" in out
    ids = lambda name: sorted(r["id"] for r in json.loads(akv(env, "traces", "show", name, "--json")[1])["traces"])
    assert ids("two") == ["astropy__astropy-12907", "run-b/astropy"]
    assert akv(env, "traces", "import", str(a), str(b), str(EXAMPLES / "traces" / "tau-bench.json"),
               "--name", "paths", "--id-from", "path")[0] == 0
    assert ids("paths") == ["run-a/astropy", "run-b/astropy", "traces/tau-bench/tau-bench-task-35-trial-3",
                            "traces/tau-bench/tau-bench-task-38-trial-2"]
    assert akv(env, "traces", "import", str(a), "--name", "two", "--id-prefix", "exp1-")[0] == 0
    assert ids("two") == ["astropy__astropy-12907", "exp1-astropy__astropy-12907", "run-b/astropy"]
    code, _, err = akv(env, "traces", "import", str(a), str(b), "--name", "field", "--id-from", "field")
    assert code == 2 and err.startswith(f"error: {b}:1: trace 'astropy__astropy-12907' is already in the set with "
                                        "other content, from run-a/astropy.traj.json")
    assert "field" not in json.dumps(json.loads(akv(env, "traces", "list", "--json")[1]))


def test_refusals_name_the_format_assumed_and_how_to_force_another(env, tmp_path) -> None:
    run = json.loads((DATA / "mswea-v2.traj.json").read_text())
    run["messages"].insert(3, run["messages"][-1])
    early = tmp_path / "early.traj.json"
    early.write_text(json.dumps(run))
    code, _, err = akv(env, "traces", "import", str(early), "--name", "t")
    assert code == 2 and err.startswith(f"error: {early}:1: message 3 has role 'exit' before the end of the run")
    assert "(read as mini-swe-agent, detected from its content; --format FORMAT reads it as another: openai," in err
    code, _, err = akv(env, "traces", "import", str(early), "--name", "t", "--format", "swe-agent")
    assert code == 2 and "expected a SWE-agent trajectory" in err and "(read as swe-agent, as --format says;" in err
    unknown = tmp_path / "notes.json"
    unknown.write_text('{"title": "not a trace"}\n')
    code, _, err = akv(env, "traces", "import", str(unknown), "--name", "t")
    assert code == 2 and err.startswith(f"error: {unknown}:1: cannot tell the trace format: expected one of openai,")
    assert "or --format naming it" in err and "Traceback" not in err
    code, _, err = akv(env, "traces", "import", str(tmp_path / "missing.jsonl"), "--name", "t")
    assert code == 2 and f"{tmp_path / 'missing.jsonl'}:1: no such file" in err
    assert json.loads(akv(env, "traces", "list", "--json")[1])["trace_sets"] == []


def test_a_folder_stands_for_its_trace_files(env, tmp_path) -> None:
    from sandbox.traces.reading import TRACE_SUFFIXES

    files = sorted(p for p in (EXAMPLES / "traces").iterdir() if p.suffix in TRACE_SUFFIXES)
    one_by_one = akv(env, "traces", "import", *map(str, files), "--name", "by-file")
    whole = akv(env, "traces", "import", str(EXAMPLES / "traces"), "--name", "by-folder")   # its README is skipped
    assert one_by_one[0] == whole[0] == 0, whole[2]
    assert whole[1].replace("by-folder", "by-file") == one_by_one[1]
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("not a trace")
    code, _out, err = akv(env, "traces", "import", str(tmp_path / "empty"), "--name", "none")
    assert code == 2 and "a folder without trace files" in err and ".jsonl" in err
