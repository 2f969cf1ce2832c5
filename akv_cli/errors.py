"""How every command reports an error: lines starting `error: ` on stderr and one of two exit statuses.

- 2 (`USAGE`): the command could not do what was asked: bad input, an unknown name, a file that
  does not parse, a missing model, a port that is taken, a store that cannot be opened;
- 1 (`VERDICT`): the command ran and its answer is no: `akv policy check` found an error in the
  policy, `akv policy akvalgo` found a construct upstream's options cannot express.
"""
from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import typer

USAGE = 2
VERDICT = 1


def fail(message: str, code: int = USAGE) -> NoReturn:
    """One `error: message` line on stderr, then exit with `code`."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=code)


def fail_located(error: Exception, text: str | None, code: int = USAGE) -> NoReturn:
    """`error: FILE:LINE:COL: message`, the source line and a caret under the column; exit `code`."""
    typer.echo(f"error: {error}", err=True)
    line, column = getattr(error, "line", 0), getattr(error, "column", 0)
    lines = text.splitlines() if text else []
    if 1 <= line <= len(lines):
        shown = lines[line - 1].replace("\t", " ")
        shown = "".join(c if c.isprintable() else "?" for c in shown)
        typer.echo(shown, err=True)
        typer.echo(" " * (column - 1) + "^", err=True)
    raise typer.Exit(code)


def raw_text(file: str) -> str | None:
    """The file's text for showing an error line, readable or not; None when there is none to show."""
    path = Path(file)
    try:
        if path.is_file() and path.stat().st_size <= 64 * 1024:
            return path.read_bytes().decode("utf-8", errors="replace")
    except OSError:
        return None
    return None
