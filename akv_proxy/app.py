"""The proxy's FastAPI app: chat requests get the policy's decision, everything else passes through.

POST /v1/chat/completions: the body is read, the policy decides (on a worker thread: counting
tokens and writing summaries take time), the new body is forwarded and the upstream's reply,
streamed or not, comes back with its status, headers and usage unchanged. Any other path is
forwarded untouched; /health and /metrics are the proxy's own. With a recorder (`--record`),
each chat request answered with 200 is recorded after its reply has gone to the agent. The server
guard shared with `akv serve` checks the callers' key and the body limit before any of this
(access.py says what the proxy spends for whom).
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.background import BackgroundTask

from akv_core.client import ChatClient, ChatError
from akv_core.server.errors import APIError
from akv_core.server.guard import Guard
from policy_dsl import CachePolicy

from akv_proxy.access import ProxyAccess, RefusedSummaries, SummariesRefused
from akv_proxy.metrics import ProxyMetrics
from akv_proxy.recorder import StreamedReply, TraceRecorder
from akv_proxy.step import Applied, PolicyStep, RequestError, SummaryClient
from akv_proxy.upstream import Upstream, UpstreamError, error_body, response_headers

CHAT_PATH = "/v1/chat/completions"


class Summarizers:
    """One client of the upstream per model name, for the summaries text-mode policies request,
    each with the proxy's upstream key (or one that refuses them all, when not `allowed`)."""

    def __init__(self, upstream_url: str, timeout_s: float, api_key: str | None, allowed: bool) -> None:
        self.url, self.timeout_s, self.api_key, self.allowed = upstream_url, timeout_s, api_key, allowed
        self._clients: dict[str, ChatClient] = {}
        self._lock = threading.Lock()

    def __call__(self, model: str) -> SummaryClient:
        if not self.allowed:
            return RefusedSummaries()
        with self._lock:
            if model not in self._clients:
                # Never a key from the environment (AKV_API_KEY, OPENAI_API_KEY: the operator may hold
                # one for something else): the proxy's summaries use its upstream key only.
                self._clients[model] = ChatClient(self.url, model, timeout_s=self.timeout_s,
                                                  api_key=self.api_key or "none")
            return self._clients[model]

    def close(self) -> None:
        for client in self._clients.values():
            client.close()


def create_proxy_app(policy: CachePolicy, upstream_url: str, counter: Any, timeout_s: float = 600.0,
                     recorder: TraceRecorder | None = None, access: ProxyAccess = ProxyAccess()) -> FastAPI:
    """An app that applies `policy` to chat requests and forwards them to `upstream_url`.

    `counter` is the policy's token counter (the harness's chat tokenizer, so decisions match
    the ones the policy was scored with); `timeout_s` bounds every upstream read. `recorder`
    records the answered chat requests; the app closes it when it stops. `access`: the callers'
    key, the body limit, the upstream key and whether summaries are written (access.py).
    """
    proxy = Proxy(policy, Upstream(upstream_url, timeout_s, access.upstream_api_key), counter, recorder,
                  access.summaries_allowed)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await proxy.close()

    app = FastAPI(title="AKV proxy", version="0.1.0", lifespan=lifespan,
                  summary="Applies an AKV cache policy to OpenAI chat requests and forwards them.")
    app.add_middleware(Guard, api_key=access.api_key, max_body_bytes=access.max_body_bytes,
                       on_refused=lambda path, _status: proxy.refused(path))

    @app.get("/health")
    async def health() -> JSONResponse:
        recording = {"record": recorder.set_name} if recorder is not None else {}
        return JSONResponse({"status": "ok", "policy": policy.name, "mode": policy.mode,
                             "upstream": proxy.upstream.root, **recording})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics_text() -> PlainTextResponse:
        text = proxy.metrics.render() + (recorder.render_metrics() if recorder is not None else "")
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.post(CHAT_PATH)
    async def chat(request: Request) -> Response:
        return await proxy.chat(request)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def other(request: Request, path: str) -> Response:
        return await proxy.forward(request, "/" + path, await request.body(), None)

    return app


@dataclass(frozen=True)
class Recording:
    """A chat request on its way, for the recorder: its body as the agent sent it, and when it came."""

    raw: bytes
    started: float  # time.monotonic()


class Proxy:
    """The policy step, the upstream, the metrics and the recorder (if any) of one proxy app."""

    def __init__(self, policy: CachePolicy, upstream: Upstream, counter: Any,
                 recorder: TraceRecorder | None = None, summaries_allowed: bool = True) -> None:
        self.policy, self.upstream, self.recorder = policy, upstream, recorder
        self.summarizers = Summarizers(upstream.root, upstream.timeout_s, upstream.api_key, summaries_allowed)
        self.step = PolicyStep(policy, counter, self.summarizers)
        self.metrics = ProxyMetrics(policy.name)
        if recorder is not None:
            recorder.serving(policy.name, upstream.root)

    async def chat(self, request: Request) -> Response:
        started = time.monotonic()
        raw = await request.body()
        try:
            applied = await asyncio.to_thread(self.step.apply, _json_object(raw))
        except (RequestError, RecursionError, SummariesRefused) as err:
            self.metrics.requests["rejected"] += 1
            return _refusal(err).response()
        except ChatError as err:  # a summary the upstream could not write
            return self.failure(UpstreamError(502, "upstream_summary_failed", f"summary request failed: {err}"))
        self.metrics.decided(applied)
        content = raw if applied.passthrough else json.dumps(applied.body).encode()
        recording = Recording(raw, started) if self.recorder is not None else None
        return await self.forward(request, CHAT_PATH, content, applied, recording)

    async def forward(self, request: Request, path: str, content: bytes, applied: Applied | None,
                      recording: Recording | None = None) -> Response:
        """The upstream's answer to `content` sent to `path`, status and headers kept.

        With a `recording` and a 200, the reply is recorded once it has gone to the client.
        """
        try:
            response = await self.upstream.send(request.method, path, request.headers, content, request.url.query)
        except UpstreamError as failure:
            return self.failure(failure)
        if response.status_code >= 400:
            self.metrics.upstream_errors[f"http_{response.status_code}"] += 1
        headers = {**response_headers(response), **_policy_headers(self.policy, applied)}
        recording = recording if response.status_code == 200 else None
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            return self.streamed(response, headers, recording)
        try:
            data = await response.aread()
        except httpx.HTTPError as err:  # the upstream went away or stalled while sending its body
            return self.failure(self.upstream.error(err))
        finally:
            await response.aclose()
        if path == CHAT_PATH and response.status_code == 200:
            self.metrics.observe_usage(_usage_of(data))
        background = None if recording is None else \
            BackgroundTask(self.record, recording, data, time.monotonic() - recording.started)
        return Response(data, status_code=response.status_code, headers=headers, background=background)

    def streamed(self, response: httpx.Response, headers: dict[str, str],
                 recording: Recording | None) -> StreamingResponse:
        """The upstream's event stream relayed as it comes; with a `recording`, the reply is
        assembled from the lines passing by and recorded after the last one."""
        on_line, background = self.metrics.observe_sse_line, None
        if recording is not None:
            reply = StreamedReply()
            on_line = _both(self.metrics.observe_sse_line, reply.feed)
            background = BackgroundTask(self.record, recording, reply, None)
        body = self.upstream.relay(response, self.counted, on_line)
        return StreamingResponse(body, status_code=response.status_code, headers=headers, background=background)

    async def record(self, recording: Recording, reply: Any, latency_s: float | None) -> None:
        """Record an answered request (a background task: the client already has the whole reply).

        A streamed reply's latency ends here, when its last chunk has gone out.
        """
        if latency_s is None:
            latency_s = time.monotonic() - recording.started
        await self.recorder.record_reply(recording.raw, reply, latency_s)

    def refused(self, path: str) -> None:
        """A request the guard refused (no key, body too large): a rejected chat request."""
        if path == CHAT_PATH:
            self.metrics.requests["rejected"] += 1

    def counted(self, failure: UpstreamError) -> UpstreamError:
        self.metrics.upstream_errors[failure.code.removeprefix("upstream_")] += 1
        return failure

    def failure(self, failure: UpstreamError) -> JSONResponse:
        return JSONResponse(error_body(self.counted(failure)), status_code=failure.status)

    async def close(self) -> None:
        await self.upstream.close()
        self.summarizers.close()
        if self.recorder is not None:
            self.recorder.close()


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise RequestError("the body is not valid JSON", "body") from None
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object", "body")
    return body


def _refusal(err: RequestError | RecursionError | SummariesRefused) -> APIError:
    """The 4xx of a request the policy step will not forward."""
    if isinstance(err, SummariesRefused):
        return APIError(str(err), status=403, type="permission_error", code="summaries_refused")
    if isinstance(err, RecursionError):  # JSON in a string (tool call arguments) nested too deeply to count
        return APIError("messages: a value is nested too deeply to read", param="messages")
    return APIError(str(err), param=err.param)


def _policy_headers(policy: CachePolicy, applied: Applied | None) -> dict[str, str]:
    if applied is None:
        return {}
    return {"x-akv-policy": policy.name, "x-akv-proxy": "passthrough" if applied.passthrough else
            ",".join(applied.effects) or "none"}


def _both(first: Callable[[bytes], None], second: Callable[[bytes], None]) -> Callable[[bytes], None]:
    def both(line: bytes) -> None:
        first(line)
        second(line)
    return both


def _usage_of(data: bytes) -> Any:
    try:
        return json.loads(data).get("usage")
    except (ValueError, AttributeError):
        return None
