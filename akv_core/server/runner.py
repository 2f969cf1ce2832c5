"""Running the app with uvicorn: in the foreground (`akv serve`) or on a background thread.

The background form is for tests and in-process harnesses: it binds a free
loopback port when asked for port 0 and returns only once the socket accepts.
"""
from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI


def _server(app: FastAPI, host: str, port: int, log_level: str) -> uvicorn.Server:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            lifespan="on", timeout_graceful_shutdown=5)
    return uvicorn.Server(config)


def serve_forever(app: FastAPI, host: str, port: int, on_ready: Callable[[str], None],
                  log_level: str = "warning") -> bool:
    """Serve until interrupted; `on_ready(url)` runs once the socket accepts.

    Returns False when the server could not start (for example, the port is taken).
    """
    server = _server(app, host, port, log_level)

    async def announce() -> None:
        while not server.started:
            await asyncio.sleep(0.05)
        on_ready(_url(server, host))

    async def main() -> None:
        watcher = asyncio.create_task(announce())
        try:
            await server.serve()
        finally:
            watcher.cancel()

    try:
        asyncio.run(main())
    except SystemExit:  # uvicorn exits when it cannot bind
        return False
    return server.started


def can_bind(host: str, port: int) -> bool:
    """Whether (host, port) is free now: checked before a slow model load, not a guarantee."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError:
        return False
    return True


@contextmanager
def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0,
                    log_level: str = "warning") -> Iterator[str]:
    """Yield the base URL of `app` served on a thread; stop it on exit."""
    server = _server(app, host, port, log_level)
    thread = threading.Thread(target=server.run, name="akv-http", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"the server did not start on {host}:{port}")
        thread.join(timeout=0.05)
    try:
        yield _url(server, host)
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def _url(server: uvicorn.Server, host: str) -> str:
    port = server.servers[0].sockets[0].getsockname()[1]
    return f"http://{host}:{port}"
