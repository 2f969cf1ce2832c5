"""The OpenAI-compatible AKV HTTP server (see docs/server.md).

`create_app(engine, model_name)` builds the FastAPI app; `serve_in_thread(app)`
runs it on loopback for tests and in-process harnesses; `akv serve` runs it in
the foreground.
"""
from __future__ import annotations

from akv_core.server.app import create_app
from akv_core.server.runner import serve_forever, serve_in_thread

__all__ = ["create_app", "serve_forever", "serve_in_thread"]
