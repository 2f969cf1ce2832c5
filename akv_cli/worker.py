"""`akv worker`: join a run shared through PostgreSQL and evaluate its candidates' tasks."""
from __future__ import annotations

from typing import Optional

import typer

from akv_cli.errors import fail
from akv_cli.options import apply_unsafe_no_sandbox, unsafe_no_sandbox_option

# Not options.DB_HELP: a worker joins a run shared through PostgreSQL, never the local SQLite file.
SHARED_DB_HELP = "Database URL of the shared run: postgresql://USER@HOST/DB (default: $AKV_DB)."


def register(app: typer.Typer) -> None:
    """Add the worker command to the root app."""

    @app.command()
    def worker(
        run: str = typer.Option(..., "--run", help="Name or id of the run to join."),
        db: Optional[str] = typer.Option(None, "--db", envvar="AKV_DB", help=SHARED_DB_HELP),
        concurrency: Optional[int] = typer.Option(None, "--concurrency", min=1, help="Tasks run at once "
                                                  "(default: the run's evaluation.concurrency)."),
        backend: Optional[str] = typer.Option(None, "--backend", help="This worker's backend, e.g. the URL of a "
                                              "server on its machine (default: the run's)."),
        unsafe_no_sandbox: bool = unsafe_no_sandbox_option(),
    ) -> None:
        """Evaluate the queued tasks of a shared run until it finishes (docs/evolve.md, several machines)."""
        from evolve.command import EvolveError
        from evolve.join import join_run

        apply_unsafe_no_sandbox(unsafe_no_sandbox)

        try:
            join_run(db, run, concurrency, backend)
        except EvolveError as err:
            fail(str(err), err.exit_code)
