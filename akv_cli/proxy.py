"""`akv proxy`: put a cache policy in front of any OpenAI-compatible AKV server."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, NoReturn, Optional

import typer

from akv_cli.errors import fail
from akv_cli.options import DB_HELP, key_option

if TYPE_CHECKING:
    from akv_proxy.access import ProxyAccess
    from akv_proxy.recorder import TraceRecorder

API_KEY_HELP = ("Require the header `Authorization: Bearer KEY` from callers on every request but "
                "GET /health (default: none, anyone who can connect may call; docs/proxy.md, Running exposed).")
UPSTREAM_KEY_HELP = ("The key sent upstream as `Authorization: Bearer KEY`, on forwarded requests and "
                     "summaries; the caller's own is never passed on (default: none, or AKV_API_KEY, deprecated).")
MAX_BODY_HELP = "Refuse request bodies over this many bytes with a 413 (default: 64 MiB, 67108864)."
SUMMARIES_HELP = ("Write a text-mode policy's summaries (with the upstream key) for callers without --api-key "
                  "on a non-loopback --host; refused with a 403 otherwise.")


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
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="AKV_PROXY_API_KEY", help=API_KEY_HELP),
    upstream_api_key: Optional[str] = typer.Option(None, "--upstream-api-key", envvar="AKV_UPSTREAM_API_KEY",
                                                   help=UPSTREAM_KEY_HELP),
    max_body_bytes: Optional[int] = typer.Option(None, "--max-body-bytes", min=1, help=MAX_BODY_HELP),
    allow_unauthenticated_summaries: bool = typer.Option(False, "--allow-unauthenticated-summaries",
                                                         help=SUMMARIES_HELP),
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
    from akv_core.chat import shared_tokenizer
    from akv_proxy import create_proxy_app
    from akv_proxy.upstream import upstream_root

    try:
        upstream_root(upstream)
    except ValueError as error:
        fail(str(error))
    api_key = key_option(api_key, "AKV_PROXY_API_KEY", "--api-key")
    upstream_api_key = key_option(upstream_api_key, "AKV_UPSTREAM_API_KEY", "--upstream-api-key")
    access = _access(host, api_key, _upstream_key(upstream_api_key), max_body_bytes,
                     allow_unauthenticated_summaries, compiled.mode)
    recorder = _recorder(record, db) if record is not None else None
    if not can_bind(host, port):
        fail(f"cannot listen on {host}:{port} (is the port taken?)")
    app = create_proxy_app(compiled, upstream, shared_tokenizer(), timeout_s=timeout, recorder=recorder,
                           access=access)
    recording = f", recording to trace set {record}" if record is not None else ""
    ready = serve_forever(app, host, port, on_ready=lambda url: typer.echo(
        f"AKV proxy ready at {url} (policy {compiled.name}, {compiled.mode} mode, upstream {upstream}{recording})"))
    if not ready:
        fail(f"cannot listen on {host}:{port} (is the port taken?)")


def _upstream_key(given: str | None) -> str | None:
    """--upstream-api-key (or AKV_UPSTREAM_API_KEY), else the deprecated AKV_API_KEY, with one warning line
    (set but empty, it is refused like an empty --upstream-api-key)."""
    if given is None and os.environ.get("AKV_API_KEY") is not None:
        key_option(None, "AKV_API_KEY", "--upstream-api-key")
        typer.echo("warning: AKV_API_KEY is deprecated as the proxy's upstream key; set AKV_UPSTREAM_API_KEY "
                   "(or --upstream-api-key) instead", err=True)
        return os.environ["AKV_API_KEY"]
    return given


def _access(host: str, api_key: str | None, upstream_key: str | None, max_body_bytes: int | None,
            allow_summaries: bool, mode: str) -> ProxyAccess:
    """The proxy's access settings, checked; serving beyond loopback without a key is warned about."""
    from akv_core.server.guard import check_api_key, exposure_warning
    from akv_proxy.access import ALLOW_SUMMARIES_FLAG, ProxyAccess, summaries_allowed

    try:
        check_api_key(api_key, "--api-key")
        check_api_key(upstream_key, "--upstream-api-key")
    except ValueError as error:
        fail(str(error))
    allowed = summaries_allowed(host, api_key, allow_summaries)
    risk = "anyone who can reach the port can send requests through the proxy to the upstream" + \
        (", with the upstream key" if upstream_key is not None else "") + \
        ("" if allowed or mode != "text" else f"; text-mode summaries are refused unless {ALLOW_SUMMARIES_FLAG}")
    warning = exposure_warning(host, api_key, risk)
    if warning is not None:
        typer.echo(warning, err=True)
    limit = {} if max_body_bytes is None else {"max_body_bytes": max_body_bytes}
    return ProxyAccess(api_key, upstream_api_key=upstream_key, summaries_allowed=allowed, **limit)


def _recorder(name: str, db: str | None) -> TraceRecorder:
    """The recorder of trace set `name`, its store opened and the set loaded now: a name or a
    store that cannot be used stops the proxy before it serves."""
    from akv_proxy.recorder import TraceRecorder
    from sandbox.suites import SuiteLoadError, suite_entries
    from sandbox.traces.recording import TraceSetRecording
    from sandbox.traces.records import check_set_name
    from store.errors import StoreError

    def refuse(err: ValueError) -> NoReturn:
        fail(str(err))

    try:
        check_set_name(name, option="--record")
    except ValueError as err:
        refuse(err)
    try:
        recorder = TraceRecorder(TraceSetRecording(db, name))
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
