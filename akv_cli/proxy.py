"""`akv proxy`: put a cache policy in front of any OpenAI-compatible AKV server; with `--refine`, one that
evolves on its own recorded traffic (`akv proxy policies|rollback|status NAME`: proxy_lineage.py)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, Optional

import typer

from akv_cli import proxy_lineage
from akv_cli.errors import fail
from akv_cli.options import DB_HELP, key_option

if TYPE_CHECKING:
    from akv_cli.refine_settings import RefineSettings
    from akv_cli.refining import RefinerProcess, StoreLiveSource
    from akv_proxy.app import Refining
    from akv_proxy.access import ProxyAccess
    from akv_proxy.recorder import TraceRecorder
    from policy_dsl import CachePolicy

API_KEY_HELP = ("Require the header `Authorization: Bearer KEY` from callers on every request but "
                "GET /health (default: none, anyone who can connect may call; docs/proxy.md, Running exposed).")
UPSTREAM_KEY_HELP = ("The key sent upstream as `Authorization: Bearer KEY`, on forwarded requests and "
                     "summaries; the caller's own is never passed on (default: none, or AKV_API_KEY, deprecated).")
MAX_BODY_HELP = "Refuse request bodies over this many bytes with a 413 (default: 64 MiB, 67108864)."
SUMMARIES_HELP = ("Write a text-mode policy's summaries (with the upstream key) for callers without --api-key "
                  "on a non-loopback --host; refused with a 403 otherwise.")
REFINE_HELP = ("Evolve in the background, in a process of its own, on the traffic --record records, and make a "
               "candidate live only when the champion rule crowns it over the live policy and the expert "
               "(docs/proxy.md, Refining; default: off).")

proxy_app = typer.Typer(help="Serve a cache policy in front of an AKV server; with --refine, refine it on the "
                        "recorded traffic.")


def register(app: typer.Typer) -> None:
    """Add this group's commands to the root app."""
    proxy_lineage.register(proxy_app)
    app.add_typer(proxy_app, name="proxy")


@proxy_app.callback(invoke_without_command=True)
def proxy(
    ctx: typer.Context,
    policy: Optional[str] = typer.Option(None, "--policy", help="A .akvp file (e.g. from `akv export`) or a "
                                         "built-in name (required to serve)."),
    upstream: Optional[str] = typer.Option(None, "--upstream", help="The AKV server: http://HOST:PORT or its /v1 "
                                           "URL (required to serve)."),
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
    refine: bool = typer.Option(False, "--refine", help=REFINE_HELP),
    config: Optional[Path] = typer.Option(None, "--config", help="A YAML file whose `refine:` block holds the "
                                          "--refine-* settings (flags win); it turns --refine on (default: none)."),
    refine_every: Optional[int] = typer.Option(None, "--refine-every", help="New finished conversations that "
                                               "start an evolution (default 50)."),
    refine_period: Optional[float] = typer.Option(None, "--refine-period", help="Seconds after which any new "
                                                  "finished conversation starts one (default: none)."),
    refine_window: Optional[int] = typer.Option(None, "--refine-window", help="The latest finished conversations "
                                                "an evolution runs on, at least 4 (default 200)."),
    refine_idle: Optional[float] = typer.Option(None, "--refine-idle", help="Seconds without a request after "
                                                "which a conversation is finished (default 300)."),
    refine_timeout: Optional[float] = typer.Option(None, "--refine-timeout", help="Seconds an evolution may take; "
                                                   "one that runs longer changes nothing (default 3600)."),
    refine_budget: Optional[int] = typer.Option(None, "--refine-budget", help="Candidates per evolution "
                                                "(default: akv evolve's)."),
    refine_proposers: Optional[str] = typer.Option(None, "--refine-proposers", help="Comma-separated proposers of "
                                                   "each evolution (default: akv evolve's)."),
    refine_dry_run: bool = typer.Option(False, "--refine-dry-run", help="Evolve and judge, never promote "
                                        "(default: promote a proven winner)."),
) -> None:
    """Serve the OpenAI chat API, adding the policy's decision to each request before forwarding it."""
    if ctx.invoked_subcommand is not None:
        return
    if policy is None or upstream is None:
        fail(f"{'--policy' if policy is None else '--upstream'}: required to serve (akv proxy --help); "
             "`akv proxy policies|rollback|status NAME` read a refining proxy's lineage")
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
    flags = {"every": refine_every, "period": refine_period, "window": refine_window, "idle": refine_idle,
             "timeout": refine_timeout, "budget": refine_budget, "dry_run": refine_dry_run or None,
             "proposers": _names(refine_proposers) if refine_proposers is not None else None}
    settings = _settings(flags, config) if refine or config is not None else None
    if settings is not None and record is None:
        fail("--refine: needs --record NAME, the trace set whose traffic it evolves on")
    api_key = key_option(api_key, "AKV_PROXY_API_KEY", "--api-key")
    upstream_api_key = key_option(upstream_api_key, "AKV_UPSTREAM_API_KEY", "--upstream-api-key")
    access = _access(host, api_key, _upstream_key(upstream_api_key), max_body_bytes,
                     allow_unauthenticated_summaries, compiled.mode)
    recorder = _recorder(record, db) if record is not None else None
    if not can_bind(host, port):
        fail(f"cannot listen on {host}:{port} (is the port taken?)")
    served, live = _live(record, db, compiled, text) if settings is not None else (compiled, None)
    app = create_proxy_app(served, upstream, shared_tokenizer(), timeout_s=timeout, recorder=recorder,
                           access=access, live=live)
    recording = f", recording to trace set {record}" if record is not None else ""
    refining = f", refining (live entry #{live.entry})" if live is not None else ""
    refiner = _start_refiner(record, db, settings, live.source) if live is not None else None
    try:
        ready = serve_forever(app, host, port, on_ready=lambda url: typer.echo(
            f"AKV proxy ready at {url} (policy {served.name}, {served.mode} mode, upstream {upstream}"
            f"{recording}{refining})"))
    finally:
        if refiner is not None:
            refiner.stop()
    if not ready:
        fail(f"cannot listen on {host}:{port} (is the port taken?)")


def _settings(flags: dict, config: Path | None) -> RefineSettings:
    from akv_cli.refine_settings import SettingsError, refine_settings

    try:
        settings = refine_settings(flags, config)
    except SettingsError as err:
        fail(str(err))
    return settings


def _live(record: str, db: str | None, compiled: CachePolicy, text: str) -> tuple[CachePolicy, Refining]:
    """(the policy to serve, the app's Refining: the store's live source for trace set `record`).

    A proxy started again with the policy of its last start goes on with the live policy (promoted
    or rolled back since); another policy is a new start and becomes live. Either is said on stderr.
    """
    from akv_cli.refining import StoreLiveSource
    from akv_proxy.app import Refining
    from policy_dsl import PolicyError, compile_policy, parse
    from store import StoreError
    from store.database import default_url

    source = StoreLiveSource(db or default_url(), record)
    try:
        entry, new = source.start(compiled.name, text)
    except StoreError as err:
        fail(str(err))
    try:
        served = compiled if new else compile_policy(parse(entry.text), name=entry.name)
    except PolicyError as err:
        fail(f"the live policy of trace set {record!r} (entry #{entry.id}, {entry.name}) does not compile: {err}; "
             f"`akv proxy rollback {record} --to ID` restores another")
    if new:
        typer.echo(f"refining: {entry.name} is the live policy of trace set {record} (entry #{entry.id}, a new "
                   "start)", err=True)
    elif entry.text != text:
        typer.echo(f"refining: trace set {record} goes on with its live policy {entry.name} (entry #{entry.id}, "
                   f"{entry.kind}), not --policy {compiled.name}, which it started from; "
                   f"`akv proxy policies {record}` lists them", err=True)
    return served, Refining(source, entry.id)


def _start_refiner(record: str, db: str | None, settings: RefineSettings, source: StoreLiveSource) -> RefinerProcess:
    from akv_cli.refining import RefinerProcess
    from akv_core.server.runner import log_to_stderr
    from store.database import default_url

    log_to_stderr("info")  # the refiner's start and restarts, before the server's own lines
    refiner = RefinerProcess(record, db or default_url(), settings)
    refiner.start()
    source.refiner = refiner
    return refiner


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


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
