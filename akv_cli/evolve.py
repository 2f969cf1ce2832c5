"""`akv evolve` and the store-backed commands."""
from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add the evolution command to the root app."""

    @app.command()
    def evolve() -> None:
        """Run a policy evolution (not available yet)."""
        typer.echo("akv evolve is not available yet: the evolution loop has not landed.", err=True)
        raise typer.Exit(code=2)
