"""Store-backed commands: `akv runs list|show`, `akv lineage`, `akv export`, `akv compare`."""
from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Callable, Optional

import typer

from akv_cli.errors import fail
from akv_cli.options import DB_HELP


class ExportFormat(str, Enum):
    akvp = "akvp"
    akvalgo = "akvalgo"


def _with_store(db: Optional[str], body: Callable) -> None:
    """Open the store, run `body(store)`, turn user errors into one line and exit code 2."""
    from store import Store, StoreError

    try:
        store = Store.open(db)
    except StoreError as err:
        fail(str(err))
    try:
        body(store)
    except StoreError as err:
        fail(str(err))
    finally:
        store.close()


def _show_rounds(store, info, console) -> None:  # noqa: ANN001 - a Store, a RunInfo, a rich Console
    """One line per validation round: which held-out tasks of which build it ran (docs/evolve.md)."""
    from evolve.validation import describe_heldout, round_heldout

    rounds = store.validation_rounds(info.id)
    if rounds:
        console.print("held-out tasks by validation round:")
    for r in rounds:
        console.print(f"  round {r.round}: {describe_heldout(round_heldout(r.settings, r.suite_version))}",
                      soft_wrap=True, markup=False, highlight=False)


def runs_list(db: Optional[str] = typer.Option(None, "--db", envvar="AKV_DB", help=DB_HELP),
              as_json: bool = typer.Option(False, "--json", help="One JSON object per run, one per line.")) -> None:
    """One line per run: name, status, policies, evaluations, creation time."""
    from rich.console import Console

    from sandbox.tables import Column, fitted_table

    def body(store) -> None:
        runs = store.runs()
        if as_json:
            for r in runs:
                typer.echo(json.dumps({"id": r.id, "name": r.name, "status": r.status, "policies": r.n_policies,
                                       "evaluations": r.n_evaluations, "created": r.created_at.isoformat(),
                                       "detail": r.status_detail}))
            return
        columns = [Column("id", True, 9), Column("name", keep=9), Column("status", keep=8),
                   Column("policies", True, 5), Column("evaluations", True, 4), Column("created", True, 3),
                   Column("detail", keep=1)]
        rows = [[str(r.id), r.name, r.status, str(r.n_policies), str(r.n_evaluations),
                 r.created_at.strftime("%Y-%m-%d %H:%M:%S"), r.status_detail or ""] for r in runs]
        console = Console()
        console.print(fitted_table(columns, rows, console.width))
    _with_store(db, body)


def runs_show(run: str = typer.Argument(..., help="Run name or id."),
              db: Optional[str] = typer.Option(None, "--db", envvar="AKV_DB", help=DB_HELP)) -> None:
    """A run's settings, candidates by fate, train front and held-out verdicts."""
    from rich.console import Console

    from evolve.views import show_run

    def body(store) -> None:
        console = Console()
        show_run(store, run, console)
        _show_rounds(store, store.run(run), console)
    _with_store(db, body)


def lineage(run: str = typer.Argument(..., help="Run name or id."),
            db: Optional[str] = typer.Option(None, "--db", envvar="AKV_DB", help=DB_HELP)) -> None:
    """The run's lineage tree: every candidate under its parent, with its fate."""
    from rich.console import Console

    from evolve.views import lineage_tree

    _with_store(db, lambda store: Console().print(lineage_tree(store, run)))


def export(run: str = typer.Argument(..., help="Run name or id."),
           out: Optional[Path] = typer.Option(None, "--out", help="File to write (default: the data folder's "
                                              "exports/RUN.akvp, or RUN.akvalgo.json); provenance goes "
                                              "next to it."),
           policy: Optional[int] = typer.Option(None, "--policy", help="Export this policy id instead of "
                                                "the champion (default: the champion)."),
           best: bool = typer.Option(False, "--best", help="Without a champion, the best candidate validated "
                                     "on held-out (its file and provenance say it is not a champion)."),
           format: ExportFormat = typer.Option(ExportFormat.akvp, "--format", help="akvp (our policy "
                                               "language) or akvalgo (upstream AKVPolicy keyword arguments, "
                                               "JSON)."),
           db: Optional[str] = typer.Option(None, "--db", envvar="AKV_DB", help=DB_HELP)) -> None:
    """Write the champion's policy and its JSON provenance record."""
    from evolve.export import export_akvalgo, export_run
    from policy_dsl.akvalgo import NotExpressible

    def body(store) -> None:
        if format is ExportFormat.akvp:
            done = export_run(store, run, out, policy, allow_best=best)
        else:
            try:
                done = export_akvalgo(store, run, out, policy, allow_best=best)
            except NotExpressible as err:
                fail(f"not expressible as akvalgo options: {err}")
        typer.echo(f"{done.policy_path}\n{done.provenance_path}")
    _with_store(db, body)


def compare(run: str = typer.Argument(..., help="Run name or id."),
            out: Optional[Path] = typer.Option(None, "--out", help="Where to write the HTML report "
                                               "(default: reports/RUN/report.html in the data folder)."),
            db: Optional[str] = typer.Option(None, "--db", envvar="AKV_DB", help=DB_HELP),
            as_json: bool = typer.Option(False, "--json", help="The table's rows (costs in USD), the verdict, "
                                         "the per-proposer counts, the champion's lineage and the report's "
                                         "path as one JSON object."),
            oracle: bool = typer.Option(False, "--oracle", help="Also run the hindsight oracle on the held-out "
                                        "tasks (replay backend) and say what share of the expert-to-oracle "
                                        "cost gap the champion (else the best validated candidate) closed.")
            ) -> None:
    """Print the held-out table against the baselines, the policies by proposer and the champion's
    lineage, and write a self-contained report.html."""
    from dataclasses import asdict

    from rich.console import Console

    from akv_core.home import data_path
    from evolve.command import print_comparison
    from evolve.report import comparison_rows, oracle_gap, render_html, run_accounting, summary_line
    from evolve.views import print_accounting
    from store import StoreError

    def body(store) -> None:
        info = store.run(run)
        validations = store.validations(info.id)
        if not validations:
            raise StoreError(f"RUN: run {info.name!r} has no held-out validation yet (status {info.status})")
        gap = None
        if oracle:
            try:
                gap = oracle_gap(store, info)
            except ValueError as err:
                fail(f"--oracle: {err}")
        path = out if out is not None else data_path("reports", info.name, "report.html")
        accounting = run_accounting(store, info)
        path.write_text(render_html(store, info, accounting), encoding="utf-8")
        if as_json:
            found = {"run": info.name, "rows": [asdict(r) for r in comparison_rows(validations)],
                     "verdict": summary_line(validations), **accounting.as_dict(), "report": str(path)}
            typer.echo(json.dumps(found | ({"oracle_gap": gap.as_dict()} if gap is not None else {})))
            return
        console = Console()
        print_comparison(console, validations)
        console.print(summary_line(validations))
        print_accounting(console, accounting)
        if gap is not None:
            typer.echo(gap.line())  # unwrapped: one line to read or grep
        console.print(f"report: {path}")
    _with_store(db, body)


def register(app: typer.Typer) -> None:
    """Add this group's commands to the root app."""
    runs_app = typer.Typer(help="Evolution runs stored in the database.", no_args_is_help=True)
    app.add_typer(runs_app, name="runs")
    runs_app.command("list")(runs_list)
    runs_app.command("show")(runs_show)
    app.command()(lineage)
    app.command()(export)
    app.command()(compare)
