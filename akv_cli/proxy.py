"""`akv proxy`: put a cache policy in front of any OpenAI-compatible AKV server."""
from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn, Optional

import typer

from akv_cli.errors import fail
from akv_cli.runs import DB_HELP

if TYPE_CHECKING:
    from akv_proxy.recorder import TraceRecorder


def register(app: typer.Typer) -> None:
    """Add this group's commands to the root app."""
    app.command(name="proxy")(proxy)


def proxy(
    policy: str = typer.Option(..., "--policy", help="A .akvp file (e.g. from `akv export`) or a built-in name."),
    upstream: str = typer.Option(..., "--upstream", help="The AKV server: http://HOST:PORT or its /v1 URL."),
    host: str = typer.Option("127.0.0.1", help="Address to bind."),
    port: int = typer.Option(30001, min=0, max=65535, help="Port to bind (0: any free port)."),
    timeout: float = typer.Option(600.0, min=0.1, help="Seconds to wait for the upstream's answer before a 504 "
                                  "(connecting gives up after 10 s at most, with a 502)."),
    record: Optional[str] = typer.Option(None, "--record", metavar="NAME", help="Record the agent's requests "
                                         "and replies as the trace set NAME in the store (a suite of that "
                                         "name), one trace per conversation (default: none, nothing recorded)."),
    db: Optional[str] = typer.Option(None, "--db", envvar="AKV_DB", help="Where --record writes. " + DB_HELP),
) -> None:
    """Serve the OpenAI chat API, adding the policy's decision to each request before forwarding it."""
    from akv_cli.errors import fail_located, raw_text
    from akv_core.server.runner import can_bind, serve_forever
    from policy_dsl import PolicyError, compile_policy, parse
    from policy_dsl.library import read_source

    text = None
    try:
        filename, text = read_source(policy)
        compiled = compile_policy(parse(text, filename=filename), name=_name(policy, filename))
    except PolicyError as error:  # the proxy never starts with a policy it cannot run
        fail_located(error, text if text is not None else raw_text(policy))
    from akv_proxy import create_proxy_app
    from akv_proxy.upstream import upstream_root
    from sandbox.backends.tokens import shared_tokenizer

    try:
        upstream_root(upstream)
    except ValueError as error:
        fail(str(error))
    recorder = _recorder(record, db) if record is not None else None
    if not can_bind(host, port):
        fail(f"cannot listen on {host}:{port} (is the port taken?)")
    app = create_proxy_app(compiled, upstream, shared_tokenizer(), timeout_s=timeout, recorder=recorder)
    recording = f", recording to trace set {record}" if record is not None else ""
    ready = serve_forever(app, host, port, on_ready=lambda url: typer.echo(
        f"AKV proxy ready at {url} (policy {compiled.name}, {compiled.mode} mode, upstream {upstream}{recording})"))
    if not ready:
        fail(f"cannot listen on {host}:{port} (is the port taken?)")


def _recorder(name: str, db: str | None) -> TraceRecorder:
    """The recorder of trace set `name`, its store opened and the set loaded now: a name or a
    store that cannot be used stops the proxy before it serves."""
    from akv_proxy.recorder import TraceRecorder
    from sandbox.suites import SuiteLoadError, suite_entries
    from sandbox.traces.records import check_set_name
    from store.errors import StoreError

    def refuse(err: ValueError) -> NoReturn:
        fail(str(err))

    try:
        check_set_name(name, option="--record")
    except ValueError as err:
        refuse(err)
    try:
        recorder = TraceRecorder(db, name)
    except StoreError as err:
        fail(str(err))
    try:  # after the store: a bad --db is reported as such, not as suites that cannot be listed
        check_set_name(name, {e.name for e in suite_entries() if not e.target.startswith("sandbox.traces.")},
                       "--record")
    except (SuiteLoadError, ValueError) as err:
        recorder.close()
        refuse(err)
    return recorder


def _name(policy: str, filename: str) -> str:
    from pathlib import Path

    from policy_dsl import builtin_names

    return policy if policy in builtin_names() else Path(filename).stem
