"""Tables at 80 columns and in a pipe: numbers never cut, columns left out by need, costs in cents."""
from __future__ import annotations

import json
import re

from rich.console import Console
from typer.testing import CliRunner

from akv_cli.main import app
from sandbox.tables import Column, fitted_table
from sandbox.runs.cost import cents


def rendered(table, width: int) -> list[str]:
    console = Console(width=width, record=True, file=open("/dev/null", "w"), color_system=None)
    console.print(table)
    return console.export_text().splitlines()


def test_a_narrow_table_leaves_out_the_least_needed_columns_and_never_cuts_a_number() -> None:
    columns = [Column("task", keep=9), Column("note"), Column("tokens", True, 5), Column("cost ¢", True, 9),
               Column("extra", True, 1)]
    rows = [["localcomp-heldout-0001", "a long free-text note that can wrap", "1234567", "12.345", "99999999"]]
    wide = rendered(fitted_table(columns, rows, 200), 200)
    assert "extra" in wide[1] and "left out" not in "\n".join(wide)
    narrow = rendered(fitted_table(columns, rows, 40), 40)
    text = "\n".join(narrow)
    assert max(map(len, narrow)) <= 40 and "…" not in text
    assert "1234567" in text and "12.345" in text  # whole, on one line
    assert "99999999" not in text and "left out at 40 columns: note, extra" in text


def test_akv_run_at_80_columns_cuts_no_cell_and_states_cents() -> None:
    result = CliRunner().invoke(app, ["run", "--suite", "localcomp", "--split", "train", "--policy", "expert-8k",
                                      "--limit", "2"], env={"COLUMNS": "80"}, terminal_width=80)
    assert result.exit_code == 0, result.output
    table = result.stdout.splitlines()
    assert max(map(len, table)) <= 80 and "…" not in result.output
    assert "cost ¢" in result.stdout and "¢/task" in result.stdout and "$" not in result.output
    # progress lines (stderr) are never broken by the console: each task's line is whole
    tasks = [line for line in result.stderr.splitlines() if "score=" in line]
    assert len(tasks) == 2 and all(re.search(r"cost=[0-9.]+¢  [0-9.]+s", line) for line in tasks), result.stderr
    summary = json.loads(CliRunner().invoke(app, ["run", "--suite", "localcomp", "--split", "train", "--policy",
                                                  "expert-8k", "--limit", "2", "--json"]).stdout)
    assert cents(summary["summary"]["mean_cost_usd"]) in result.output  # the same figure, in cents


def test_the_held_out_comparison_fits_80_columns_and_leaves_out_the_weakest_baselines_when_narrow() -> None:
    from evolve.command import print_comparison
    from store import ValidationRecord

    versus = {"cost": {"percent": -12.345, "p_value": 0.0123}, "score": {"mean_delta": 0.0125, "p_value": 0.5}}
    stats = {"vs": {role: versus for role in ("expert", "standard", "text_engineering", "full")},
             "score_ci": [0.40, 0.60], "cost_ci": [0.0021, 0.0029]}
    rule = {**stats, "rule": {"cost_percent": -12.345, "cost_p_holm": 0.0312, "score_delta": 0.0, "score_low": -0.021}}
    validations = [ValidationRecord(1, "baseline", "expert-8k", 8, 0.5, 0.0025, stats, True, False, "baseline (expert)"),
                   ValidationRecord(7, "candidate", "#7", 8, 0.5, 0.0022, rule, True, True, "champion: cheaper")]

    def shown(width: int) -> list[str]:
        console = Console(width=width, record=True, file=open("/dev/null", "w"), color_system=None)
        print_comparison(console, validations)
        return console.export_text().splitlines()

    wide, narrow = shown(80), shown(44)
    assert max(map(len, wide)) <= 80 and "left out" not in "\n".join(wide) and "vs full" in "\n".join(wide)
    text = "\n".join(narrow)
    assert max(map(len, narrow)) <= 44 and "…" not in text
    assert "vs expert" in text and "-12.3%" in text  # the champion rule's column stays, numbers whole
    assert "left out at 44 columns:" in text and "vs full" in text.split("left out", 1)[1]
