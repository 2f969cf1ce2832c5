"""`akv` commands of this group (filled in by the owning layer)."""
from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this group's commands to the root app."""
