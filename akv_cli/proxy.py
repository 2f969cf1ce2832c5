"""`akv proxy`: put a cache policy in front of any OpenAI-compatible AKV server."""
from __future__ import annotations

import typer

from akv_cli.errors import fail


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
    if not can_bind(host, port):
        fail(f"cannot listen on {host}:{port} (is the port taken?)")
    app = create_proxy_app(compiled, upstream, shared_tokenizer(), timeout_s=timeout)
    ready = serve_forever(app, host, port, on_ready=lambda url: typer.echo(
        f"AKV proxy ready at {url} (policy {compiled.name}, {compiled.mode} mode, upstream {upstream})"))
    if not ready:
        fail(f"cannot listen on {host}:{port} (is the port taken?)")


def _name(policy: str, filename: str) -> str:
    from pathlib import Path

    from policy_dsl import builtin_names

    return policy if policy in builtin_names() else Path(filename).stem
