"""The proxy's FastAPI app: chat requests get the policy's decision, everything else passes through.

POST /v1/chat/completions: the body is read, the policy decides (on a worker thread: counting
tokens and writing summaries take time), the new body is forwarded and the upstream's reply,
streamed or not, comes back with its status, headers and usage unchanged. Any other path is
forwarded untouched; /health and /metrics are the proxy's own.
"""
from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from akv_core.server.errors import APIError
from policy_dsl import CachePolicy
from sandbox.backends import Backend, BackendError

from akv_proxy.metrics import ProxyMetrics
from akv_proxy.step import Applied, PolicyStep, RequestError
from akv_proxy.upstream import Upstream, UpstreamError, error_body, response_headers

CHAT_PATH = "/v1/chat/completions"


class Summarizers:
    """One client of the upstream per model name, for the summaries text-mode policies request."""

    def __init__(self, upstream_url: str, timeout_s: float) -> None:
        self.url, self.timeout_s = upstream_url, timeout_s
        self._backends: dict[str, Backend] = {}
        self._lock = threading.Lock()

    def __call__(self, model: str) -> Backend:
        from sandbox.backends.http import HttpBackend

        with self._lock:
            if model not in self._backends:
                self._backends[model] = HttpBackend(self.url, model, timeout_s=self.timeout_s)
            return self._backends[model]

    def close(self) -> None:
        for backend in self._backends.values():
            backend.close()


def create_proxy_app(policy: CachePolicy, upstream_url: str, counter: Any, timeout_s: float = 600.0) -> FastAPI:
    """An app that applies `policy` to chat requests and forwards them to `upstream_url`.

    `counter` is the policy's token counter (the harness's chat tokenizer, so decisions match
    the ones the policy was scored with); `timeout_s` bounds every upstream read.
    """
    upstream = Upstream(upstream_url, timeout_s)
    summarizers = Summarizers(upstream.root, timeout_s)
    step = PolicyStep(policy, counter, summarizers)
    metrics = ProxyMetrics(policy.name)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await upstream.close()
            summarizers.close()

    app = FastAPI(title="AKV proxy", version="0.1.0", lifespan=lifespan,
                  summary="Applies an AKV cache policy to OpenAI chat requests and forwards them.")

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok", "policy": policy.name, "mode": policy.mode, "upstream": upstream.root})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics_text() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post(CHAT_PATH)
    async def chat(request: Request) -> Response:
        raw = await request.body()
        try:
            applied = await asyncio.to_thread(step.apply, _json_object(raw))
        except RequestError as err:
            metrics.requests["rejected"] += 1
            return APIError(str(err), param=err.param).response()
        except BackendError as err:  # a summary the upstream could not write
            return _failure(count(UpstreamError(502, "upstream_summary_failed", f"summary request failed: {err}")))
        metrics.decided(applied)
        content = raw if applied.passthrough else json.dumps(applied.body).encode()
        return await _forward(request, CHAT_PATH, content, applied)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def other(request: Request, path: str) -> Response:
        return await _forward(request, "/" + path, await request.body(), None)

    def count(failure: UpstreamError) -> UpstreamError:
        metrics.upstream_errors[failure.code.removeprefix("upstream_")] += 1
        return failure

    async def _forward(request: Request, path: str, content: bytes, applied: Applied | None) -> Response:
        try:
            response = await upstream.send(request.method, path, request.headers, content, request.url.query)
        except UpstreamError as failure:
            return _failure(count(failure))
        if response.status_code >= 400:
            metrics.upstream_errors[f"http_{response.status_code}"] += 1
        headers = {**response_headers(response), **_policy_headers(policy, applied)}
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            body = upstream.relay(response, count, metrics.observe_sse_line)
            return StreamingResponse(body, status_code=response.status_code, headers=headers)
        try:
            data = await response.aread()
        except httpx.HTTPError as err:  # the upstream went away or stalled while sending its body
            return _failure(count(upstream.error(err)))
        finally:
            await response.aclose()
        if path == CHAT_PATH and response.status_code == 200:
            metrics.observe_usage(_usage_of(data))
        return Response(data, status_code=response.status_code, headers=headers)

    return app


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise RequestError("the body is not valid JSON", "body") from None
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object", "body")
    return body


def _policy_headers(policy: CachePolicy, applied: Applied | None) -> dict[str, str]:
    if applied is None:
        return {}
    return {"x-akv-policy": policy.name, "x-akv-proxy": "passthrough" if applied.passthrough else
            ",".join(applied.effects) or "none"}


def _failure(failure: UpstreamError) -> JSONResponse:
    return JSONResponse(error_body(failure), status_code=failure.status)


def _usage_of(data: bytes) -> Any:
    try:
        return json.loads(data).get("usage")
    except (ValueError, AttributeError):
        return None
