"""Per-proposer accounting in `akv compare` (text, --json) and in the report, the chosen policy's
lineage and text, and the Pareto plot's cost axis fitted to the candidates, the expert and `full`."""
from __future__ import annotations

import json
import os
import re
import subprocess
from html import escape
from pathlib import Path

import pytest
from test_evolve_run import AKV, akv_env, rows
from typer.testing import CliRunner

from akv_cli.main import app
from evolve.pareto import Point
from evolve.report import cost_range, edit_note, pareto_svg, proposer_tallies, tally_table
from store import PolicyInfo, Store, ValidationRecord

QUICK = Path(__file__).resolve().parents[1] / "examples" / "quick.yaml"


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> dict:
    """examples/quick.yaml in a database of its own, with the random proposer too (1 candidate each),
    judged against Standard at 32K (what `full` costs here): the lineage shown is a validated
    candidate's, and only candidates cheaper than the reference on train are validated."""
    folder = tmp_path_factory.mktemp("accounting")
    url, name = f"sqlite:///{folder / 'akv.db'}", f"quick-{os.getpid()}"
    config = folder / "quick.yaml"
    config.write_text(QUICK.read_text() + "baselines:\n  expert: standard-32k\n")
    done = subprocess.run([*AKV, "evolve", "--config", str(config), "--proposer", "mutate,random,optuna",
                           "--schedule", "round-robin", "--db", url, "--run-name", name], env=akv_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {"url": url, "name": name, "db": folder / "akv.db", "folder": folder}


def compared(run: dict, *args: str, columns: int = 200) -> str:
    result = CliRunner().invoke(app, ["compare", run["name"], "--db", run["url"], *args],
                                env={"COLUMNS": str(columns)}, terminal_width=columns)
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.mark.slow
def test_the_tallies_add_up_to_the_runs_policies_and_match_the_store(quick_run):
    found = json.loads(compared(quick_run, "--json", "--out", str(quick_run["folder"] / "r.html")))
    tallies, db = found["proposers"], quick_run["db"]
    stored = rows(db, "SELECT proposer, status, count(*) FROM akv_policies GROUP BY proposer, status")
    assert sum(t["proposed"] for t in tallies) == sum(n for _, _, n in stored) == rows(
        db, "SELECT count(*) FROM akv_policies")[0][0]
    for t in tallies:
        fates = {status: n for proposer, status, n in stored if proposer == t["proposer"]}
        assert t["proposed"] == t["rejected"] + t["duplicate"] + t["pruned"] + t["evaluated"] + t["pending"]
        assert {s: t[s] for s in ("rejected", "duplicate", "pruned", "evaluated")} == {
            s: fates.get(s, 0) for s in ("rejected", "duplicate", "pruned", "evaluated")}
        assert t["given"] == (t["proposer"] in ("seed", "baseline"))
    searched = [t for t in tallies if not t["given"]]
    assert [t["proposer"] for t in searched] == ["mutate", "random", "optuna"]  # the run's order
    assert sum(t["proposed"] for t in searched) == 3  # quick.yaml's max_candidates
    assert [t["proposer"] for t in tallies[len(searched):]] == ["seed", "baseline"]
    validated = rows(db, "SELECT count(*), sum(champion) FROM akv_validations WHERE role = 'candidate'")[0]
    assert sum(t["finalists"] for t in tallies) == validated[0]
    assert sum(t["champion"] for t in tallies) == (validated[1] or 0)
    assert 1 <= sum(t["front"] for t in tallies) <= sum(t["evaluated"] for t in tallies)


@pytest.mark.slow
def test_compare_json_and_text_give_the_chosen_policys_lineage(quick_run):
    found = json.loads(compared(quick_run, "--json", "--out", str(quick_run["folder"] / "r.html")))
    chosen, nodes = found["lineage"]["policy"], found["lineage"]["nodes"]
    best = rows(quick_run["db"], "SELECT policy_id FROM akv_validations WHERE role = 'candidate'")
    assert chosen["policy_id"] in {i for (i,) in best} and nodes[0]["policy_id"] == chosen["policy_id"]
    assert chosen["text"] and chosen["text"].startswith("mode ")
    assert nodes[-1]["parent_ids"] == [] and nodes[-1]["proposer"] in ("seed", "baseline", "random")
    assert all(n["note"] for n in nodes if n["proposer"] in ("mutate", "optuna"))  # a proposal says what it changed
    store = Store.open(quick_run["url"])
    try:
        proposed = [p for p in store.policies(store.run(quick_run["name"]).id)
                    if p.proposer in ("mutate", "optuna", "random") and p.status != "rejected"]
    finally:
        store.close()
    assert proposed and all(edit_note(p.meta) for p in proposed)   # the chosen one may be the seed itself
    proposers = dict(rows(quick_run["db"], "SELECT id, proposer FROM akv_policies"))
    assert all(n["proposer"] == proposers[n["policy_id"]] for n in nodes)
    text = compared(quick_run, "--out", str(quick_run["folder"] / "r.html"), columns=80)
    assert "policies by proposer" in text and "lineage of the " in text
    assert all(re.search(rf"^ {p}\b", text, re.M) for p in ("mutate", "random", "optuna", "seed", "baseline"))
    assert max(map(len, text.splitlines())) <= 80 and "…" not in text


@pytest.mark.slow
def test_the_report_names_each_lineage_nodes_proposer_and_shows_the_chosen_text(quick_run):
    report = quick_run["folder"] / "report.html"
    found = json.loads(compared(quick_run, "--json", "--out", str(report)))
    html = report.read_text(encoding="utf-8")
    assert f"<pre id='chosen-policy'>{escape(found['lineage']['policy']['text'])}</pre>" in html
    table = re.search(r'<table id="chosen-lineage">(.*?)</table>', html, re.S).group(1)
    cells = [re.findall(r"<td>([^<]*)</td>", row) for row in re.findall(r'<tr class="">(.*?)</tr>', table)]
    assert [(c[0], c[1]) for c in cells] == [(escape(n["label"]), n["proposer"]) for n in found["lineage"]["nodes"]]
    named = dict(re.findall(r'<text class="node"[^>]*>([^<]*)<tspan class="by"[^>]*> ([^<]*)</tspan>', html))
    proposers = {f"#{i}" if n is None else n: p for i, n, p in rows(quick_run["db"],
                                                                      "SELECT id, name, proposer FROM akv_policies")}
    assert named == {escape(k): v for k, v in proposers.items()}  # every node of the tree names its proposer
    assert html.count('class="chain"') >= len(found["lineage"]["nodes"]) - 1
    assert '<table id="proposers">' in html and "Policies by proposer" in html


def test_the_cost_axis_leaves_out_a_far_outlier() -> None:
    focus = [0.0064, 0.0072, 0.0084, 0.0097]  # candidates, the expert, full
    low, high = cost_range(focus, [0.0145, 0.0272, 0.0001])  # Standard, Text Engineering, a far cheaper seed
    assert low <= 0.0064 and 0.0097 <= high < 0.0145 and low > 0.0001
    low, high = cost_range(focus, [0.0110, 0.0272])  # within one span of the candidates: kept
    assert 0.0110 <= high < 0.0272
    assert cost_range([0.005], [0.005, 0.5])[1] < 0.5  # one focus point: a range around it
    assert cost_range([], [0.002, 0.004]) == pytest.approx((0.0019, 0.0041))  # nothing in focus: every point


def test_the_plot_draws_an_outlier_past_the_axis_with_its_cost() -> None:
    heldout = [ValidationRecord(1, "baseline", "expert-8k", 8, 1.0, 0.0084, {}, True, False, ""),
               ValidationRecord(2, "baseline", "text-engineering-8k", 8, 0.375, 0.0272, {}, True, False, ""),
               ValidationRecord(3, "candidate", "#5", 8, 1.0, 0.0072, {}, True, True, "")]
    svg = pareto_svg([Point(3, 1.0, 0.0070), Point(2, 0.25, 0.029)], heldout, focus={1, 3})
    ticks = [float(t) for t in re.findall(r'text-anchor="middle">([\d.]+)</text>', svg)]
    assert ticks and max(ticks) < 1.0  # cents: the axis ends well before Text Engineering's 2.720¢
    assert "text-engineering-8k 2.720¢" in svg and svg.count('class="beyond"') == 3  # 2 arrowheads, 1 caption
    assert "expert-8k</text>" in svg  # points on the axis keep their bare names


def test_edit_notes_say_what_each_proposer_changed() -> None:
    assert edit_note({"edits": ["a", "b"]}) == "a; b"
    assert edit_note({"edits": ["distilled 4 rules"], "reflected_on": 11}) == \
        "distilled 4 rules (reflected on #11's timelines)"
    assert edit_note({"params": {"rules[2].action.target.selector.parts[1].n": 4, "window": 8}}) == \
        "tuned rules[2]..parts[1].n=4, window=8"
    assert edit_note({"diagnosis": "old tool results dominate"}) == "diagnosis: old tool results dominate"
    assert edit_note({"draws": 3}) == "random draw (3 tries)" and edit_note({}) == ""


def test_tallies_order_proposers_put_given_policies_last_and_count_pending_ones() -> None:
    def info(pid: int, proposer: str, status: str) -> PolicyInfo:
        return PolicyInfo(pid, 1, None, "mode kv", None, None, 1, proposer, status, None, (), 0, 0, 0.0, {})

    policies = [info(1, "seed", "evaluated"), info(2, "baseline", "evaluated"), info(3, "optuna", "evaluated"),
                info(4, "mutate", "pruned"), info(5, "mutate", "proposed"), info(6, "optuna", "rejected"),
                info(7, "llm", "duplicate")]
    validations = [ValidationRecord(3, "candidate", "#3", 8, 1.0, 0.01, {}, True, True, "champion")]
    tallies = proposer_tallies(policies, {1, 3}, validations, order=("mutate", "optuna"))
    assert [t.proposer for t in tallies] == ["mutate", "optuna", "llm", "seed", "baseline"]
    mutate, optuna = tallies[0], tallies[1]
    assert (mutate.proposed, mutate.pruned, mutate.pending) == (2, 1, 1)
    assert (optuna.evaluated, optuna.rejected, optuna.front, optuna.finalists, optuna.champion) == (1, 1, 1, 1, 1)
    table = tally_table(tallies)
    assert "pending" in table[0] and table[2][0] == "optuna ★" and "champion" not in table[0]
    assert "pending" not in tally_table(tallies[1:])[0]  # shown only where some policy is pending
