"""Tables at 80 columns and in a pipe: numbers never cut, columns left out by need, costs in cents."""
from __future__ import annotations

import json
import re

from rich.console import Console
from typer.testing import CliRunner

from akv_cli.main import app
from akv_cli.tables import Column, fitted_table
from sandbox.cost import cents


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
