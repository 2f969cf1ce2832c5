"""Entry point of the `akv` command.

Each command group lives in its own module and registers itself on the app.
Modules import heavy dependencies (torch, the engine) inside command bodies so
that `akv --help` and `akv policy ...` stay fast.
"""
from __future__ import annotations

import typer

from akv_cli import bench, conformance, evolve, policy, proxy, runs, serve, tasks, traces, worker
from akv_cli.help import flags_show_no_type

flags_show_no_type()

app = typer.Typer(
    name="akv",
    help="AKV: cache engineering for LLM agents, with self-refining cache policies.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def main() -> None:
    """Cache engineering for LLM agents: serve, run tasks, evolve and compare cache policies."""


for module in (policy, serve, proxy, conformance, tasks, traces, evolve, worker, runs, bench):
    module.register(app)


if __name__ == "__main__":
    app()
