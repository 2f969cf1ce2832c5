"""Running the app with uvicorn: in the foreground (`akv serve`) or on a background thread.

The background form is for tests and in-process harnesses: it binds a free
loopback port when asked for port 0 and returns only once the socket accepts.
"""
from __future__ import annotations

import asyncio
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

    async def main() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            on_ready(_url(server, host))
        await task

    try:
        asyncio.run(main())
    except SystemExit:  # uvicorn exits when it cannot bind
        return False
    return server.started


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
