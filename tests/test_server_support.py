"""One real AKV server on loopback (the embedded SmolLM2), shared by the server test modules.

Loading the model once per session keeps the server tests inside their time
budget; the server stops when the session ends. This module holds no tests.
"""
from __future__ import annotations

import re
import signal
import subprocess
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

MODEL = "smollm2"
KV_TOKENS = 8_192
MAX_RUNNING = 8


def ready_url(process: subprocess.Popen) -> str:
    """The URL an `akv serve` subprocess prints once it is ready (its stdout a text pipe)."""
    line = process.stdout.readline()   # blocks until the server is ready (or died)
    match = re.search(r"ready at (http://127\.0\.0\.1:\d+)", line)
    assert match, (line, process.stderr.read() if process.poll() is not None else "")
    return match.group(1)


def interrupt(process: subprocess.Popen) -> None:
    """Stop a server subprocess as Ctrl-C does; kill it if it has not ended within 30 s."""
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@dataclass
class LiveServer:
    url: str
    engine: Any
    client: httpx.Client

    def chat(self, body: dict[str, Any]) -> httpx.Response:
        return self.client.post("/v1/chat/completions", json={"model": MODEL, **body})

    def check_idle_and_intact(self) -> None:
        """No request is running or queued, and every KV slot is free or owned once."""
        stats = self.engine.stats()
        assert stats.running == 0 and stats.waiting == 0, stats
        self.engine.check_integrity()


_stack = ExitStack()
_live: LiveServer | None = None


def live_server(config: pytest.Config) -> LiveServer:
    """The session's server, started on first use."""
    global _live
    if _live is None:
        from akv_core import Engine
        from akv_core.server import create_app, serve_in_thread

        engine = Engine.from_pretrained(MODEL, device="cpu", kv_tokens=KV_TOKENS,
                                        max_running=MAX_RUNNING)
        url = _stack.enter_context(serve_in_thread(create_app(engine, MODEL)))
        client = _stack.enter_context(httpx.Client(base_url=url, timeout=120))
        config.add_cleanup(_stack.close)
        _live = LiveServer(url, engine, client)
    return _live


def greeting(text: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": text}]
