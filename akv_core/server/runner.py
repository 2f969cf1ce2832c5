"""Running the app with uvicorn: in the foreground (`akv serve`) or on a background thread.

The background form is for tests and in-process harnesses: it binds a free
loopback port when asked for port 0 and returns only once the socket accepts.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI


LOG_LEVELS = ("debug", "info", "warning", "error")


def _server(app: FastAPI, host: str, port: int, log_level: str) -> uvicorn.Server:
    # Our access log (akv.access) replaces uvicorn's, which knows no tokens.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            lifespan="on", timeout_graceful_shutdown=5)
    return uvicorn.Server(config)


def log_to_stderr(level: str) -> None:
    """The server's own loggers (`akv.*`: access lines, engine errors) to stderr at `level`."""
    if level not in LOG_LEVELS:
        raise ValueError(f"log_level: expected one of {', '.join(LOG_LEVELS)}, got {level!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ("akv", "akv_core"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level.upper())
        logger.propagate = False


def serve_forever(app: FastAPI, host: str, port: int, on_ready: Callable[[str], None],
                  log_level: str = "info") -> bool:
    """Serve until interrupted, logging at `log_level`; `on_ready(url)` runs once the socket accepts.

    Returns False when the server could not start (for example, the port is taken).
    """
    log_to_stderr(log_level)
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
