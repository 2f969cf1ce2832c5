"""Options that several commands share, written once: the store's `--db`, `--unsafe-no-sandbox`, and
the keys `akv serve` and `akv proxy` read from the environment."""
from __future__ import annotations

import os
from typing import Any

import typer

DB_HELP = "Database URL (default: $AKV_DB, then the SQLite file in the data folder)."
UNSAFE_NO_SANDBOX_HELP = ("Run task commands without the sandbox (AKV_UNSAFE_NO_SANDBOX=1): only inside a container "
                          "of your own (docs/localswe.md, Isolation; default: refuse without bubblewrap).")


def unsafe_no_sandbox_option() -> Any:
    """`--unsafe-no-sandbox`, off by default (a fresh typer option for each command that takes it)."""
    return typer.Option(False, "--unsafe-no-sandbox", help=UNSAFE_NO_SANDBOX_HELP)


def apply_unsafe_no_sandbox(unsafe: bool) -> None:
    """With `--unsafe-no-sandbox`, run task commands unsandboxed, in this process and the task worker
    processes it starts (they inherit the setting)."""
    if unsafe:
        from sandbox.isolation.sandbox import set_unsafe_no_sandbox

        set_unsafe_no_sandbox()


def key_option(given: str | None, variable: str, option: str) -> str | None:
    """The key `option` gave (typer reads it from `variable` too), after checking the one case typer
    lets through: `variable` set but empty, which typer takes for unset and which would leave the
    server open. It ends the command as an empty `option` does (exit 2, naming the variable)."""
    from akv_cli.errors import fail
    from akv_core.server.guard import check_api_key

    if given is None and os.environ.get(variable) == "":
        try:
            check_api_key("", variable)
        except ValueError as error:
            fail(f"{error}; unset {variable} to go without a key, or pass {option}")
    return given
