"""Options that several commands share, written once: the store's `--db` and `--unsafe-no-sandbox`."""
from __future__ import annotations

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
