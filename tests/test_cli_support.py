"""Shared by the CLI tests (it holds no tests itself): `akv` run by its own app in this process, without a
Python start-up per call."""
from __future__ import annotations

from typer.testing import CliRunner

from akv_cli.main import app


def akv_in_process(env: dict[str, str | None], *words: str) -> tuple[int, str, str]:
    """`akv WORDS` with `env` laid over this process's environment for the call (None unsets a variable): its
    exit code, stdout and stderr. An exception other than the command's own exit is raised here."""
    result = CliRunner().invoke(app, list(words), env=env)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr
