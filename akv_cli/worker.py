"""`akv worker`: join a run shared through PostgreSQL and evaluate its candidates' tasks."""
from __future__ import annotations

from typing import Optional

import typer

from akv_cli.errors import fail

DB_HELP = "Database URL of the shared run: postgresql://USER@HOST/DB (default: $AKV_DB)."


def register(app: typer.Typer) -> None:
    """Add the worker command to the root app."""

    @app.command()
    def worker(
        run: str = typer.Option(..., "--run", help="Name or id of the run to join."),
        db: Optional[str] = typer.Option(None, "--db", envvar="AKV_DB", help=DB_HELP),
        concurrency: Optional[int] = typer.Option(None, "--concurrency", min=1, help="Tasks run at once "
                                                  "(default: the run's evaluation.concurrency)."),
        backend: Optional[str] = typer.Option(None, "--backend", help="This worker's backend, e.g. the URL of a "
                                              "server on its machine (default: the run's)."),
        unsafe_no_sandbox: bool = typer.Option(False, "--unsafe-no-sandbox", help="Run task commands without the "
                                       "sandbox (AKV_UNSAFE_NO_SANDBOX=1): only inside a container of your own "
                                       "(docs/localswe.md, Isolation; default: refuse without bubblewrap)."),
    ) -> None:
        """Evaluate the queued tasks of a shared run until it finishes (docs/evolve.md, several machines)."""
        from evolve.command import EvolveError
        from evolve.join import join_run

        if unsafe_no_sandbox:  # inherited by task worker processes
            from sandbox.isolation import set_unsafe_no_sandbox

            set_unsafe_no_sandbox()

        try:
            join_run(db, run, concurrency, backend)
        except EvolveError as err:
            fail(str(err), err.exit_code)
