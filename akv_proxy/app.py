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
import logging
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
from policy_dsl import CachePolicy, PolicyError, compile_policy, parse

from akv_proxy.access import ProxyAccess, RefusedSummaries, SummariesRefused
from akv_proxy.live import LiveSource, LiveState, Policies, ServedPolicy
from akv_proxy.metrics import ProxyMetrics, RefineMetrics
from akv_proxy.recorder import StreamedReply, TraceRecorder, first_line
from akv_proxy.step import Applied, RequestError, SummaryClient
from akv_proxy.upstream import Upstream, UpstreamError, error_body, response_headers

CHAT_PATH = "/v1/chat/completions"
POLL_S = 1.0  # a refining proxy asks its store for the live policy this often (off the request path)
RESUMED_CONVERSATIONS = 1024  # a restarted refining proxy's most recent recorded conversations that keep their policy
log = logging.getLogger("akv.proxy")


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
                     recorder: TraceRecorder | None = None, access: ProxyAccess = ProxyAccess(),
                     live: Refining | None = None) -> FastAPI:
    """An app that applies `policy` to chat requests and forwards them to `upstream_url`.

    `counter` is the policy's token counter (the harness's chat tokenizer, so decisions match
    the ones the policy was scored with); `timeout_s` bounds every upstream read. `recorder`
    records the answered chat requests; the app closes it when it stops. `access`: the callers'
    key, the body limit, the upstream key and whether summaries are written (access.py). `live`
    (a refining proxy): where the live policy is polled from; `policy` is then its entry's.
    """
    proxy = Proxy(policy, Upstream(upstream_url, timeout_s, access.upstream_api_key), counter, recorder,
                  access.summaries_allowed, live)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        watcher = asyncio.create_task(proxy.watch()) if live is not None else None
        try:
            yield
        finally:
            if watcher is not None:
                watcher.cancel()
            await proxy.close()

    app = FastAPI(title="AKV proxy", version="0.1.0", lifespan=lifespan,
                  summary="Applies an AKV cache policy to OpenAI chat requests and forwards them.")
    app.add_middleware(Guard, api_key=access.api_key, max_body_bytes=access.max_body_bytes,
                       on_refused=lambda path, _status: proxy.refused(path))

    @app.get("/health")
    async def health() -> JSONResponse:
        recording = {"record": recorder.set_name} if recorder is not None else {}
        served = proxy.policies.live
        return JSONResponse({"status": "ok", "policy": served.name, "mode": served.policy.mode,
                             "upstream": proxy.upstream.root, **recording, **proxy.refine_health()})

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics_text() -> PlainTextResponse:
        text = proxy.metrics.render() + (recorder.render_metrics() if recorder is not None else "")
        if proxy.refine is not None:
            text += proxy.refine.render(proxy.policies.live.name)
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
    policy: str     # the policy that served it


@dataclass(frozen=True)
class Refining:
    """A refining proxy's live policy: the lineage entry it starts with and where changes are polled from."""

    source: LiveSource
    entry: int
    poll_s: float = POLL_S


class Proxy:
    """The policies, the upstream, the metrics and the recorder (if any) of one proxy app."""

    def __init__(self, policy: CachePolicy, upstream: Upstream, counter: Any,
                 recorder: TraceRecorder | None = None, summaries_allowed: bool = True,
                 live: Refining | None = None) -> None:
        self.upstream, self.recorder, self.live = upstream, recorder, live
        self.summarizers = Summarizers(upstream.root, upstream.timeout_s, upstream.api_key, summaries_allowed)
        self.policies = Policies(policy, counter, self.summarizers, live.entry if live is not None else None,
                                 pinned=live is not None)
        self.metrics = ProxyMetrics(policy.name)
        self.refine = RefineMetrics() if live is not None else None
        if recorder is not None:
            recorder.serving(policy.name, upstream.root)
            if live is not None:
                self._resume_conversations()

    def _resume_conversations(self) -> None:
        """A restarted refining proxy: the recorded conversations under way whose policy is not the
        live one keep theirs, when its text is known (the lineage's)."""
        live = self.policies.live
        known = {live.name: live}
        for history, name in self.recorder.under_way(RESUMED_CONVERSATIONS):
            if name not in known:
                known[name] = self._served(name)
            if known[name] is not None and name != live.name:
                self.policies.remember(history, known[name])

    def _served(self, name: str) -> ServedPolicy | None:
        """The lineage's policy `name`, ready to serve (None when its text is unknown or does not compile)."""
        text = self.live.source.text_of(name)
        try:
            return None if text is None else self.policies.serving(name, _compiled(text, name))
        except PolicyError:
            return None

    async def watch(self) -> None:
        """Poll the live source off the request path; a change is taken up by new conversations."""
        while True:
            try:
                state = await asyncio.to_thread(self.live.source.poll)
            except Exception as err:  # the store is unreachable: keep serving the live policy, say so once
                self.refine.poll_errors += 1
                if self.refine.reachable:
                    self.refine.reachable = False
                    log.warning("the store does not answer (%s: %s); serving the live policy %s until it does",
                                type(err).__name__, first_line(err), self.policies.live.name)
            else:
                if not self.refine.reachable:
                    self.refine.reachable = True
                    log.warning("the store answers again; live policy %s", state.name)
                self.refine.state = state
                if state.entry != self.policies.live.entry:
                    self.take_up(state)
            await asyncio.sleep(self.live.poll_s)

    def take_up(self, state: LiveState) -> None:
        """Make the state's policy live for new conversations (a text that does not compile is logged, not taken)."""
        try:
            policy = _compiled(state.text, state.name)
        except PolicyError as err:
            log.error("live policy %s (entry #%d) does not compile, keeping %s: %s", state.name, state.entry,
                      self.policies.live.name, err)
            return
        self.policies.swap(self.policies.serving(state.name, policy, state.entry))
        self.metrics.policy = state.name
        self.refine.changes += 1
        log.warning("live policy is now %s (entry #%d, %s) for new conversations; those under way keep theirs",
                    state.name, state.entry, state.kind)

    def refine_health(self) -> dict[str, Any]:
        if self.refine is None:
            return {}
        state = self.refine.state
        return {"refine": {"entry": self.policies.live.entry, "store": "ok" if self.refine.reachable else "unreachable",
                           "refiner_pid": state.refiner_pid if state is not None else None}}

    async def chat(self, request: Request) -> Response:
        started = time.monotonic()
        raw = await request.body()
        try:
            applied = await asyncio.to_thread(self.policies.apply, _json_object(raw))
        except (RequestError, RecursionError, SummariesRefused) as err:
            self.metrics.requests["rejected"] += 1
            return _refusal(err).response()
        except ChatError as err:  # a summary the upstream could not write
            return self.failure(UpstreamError(502, "upstream_summary_failed", f"summary request failed: {err}"))
        self.metrics.decided(applied)
        content = raw if applied.passthrough else json.dumps(applied.body).encode()
        recording = Recording(raw, started, applied.policy) if self.recorder is not None else None
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
        headers = {**response_headers(response), **_policy_headers(applied)}
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
        await self.recorder.record_reply(recording.raw, reply, latency_s, recording.policy)

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
        if self.live is not None:
            self.live.source.close()


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


def _policy_headers(applied: Applied | None) -> dict[str, str]:
    if applied is None:
        return {}
    return {"x-akv-policy": applied.policy, "x-akv-proxy": "passthrough" if applied.passthrough else
            ",".join(applied.effects) or "none"}


def _compiled(text: str, name: str) -> CachePolicy:
    """A stored policy text, compiled under its lineage name (PolicyError when it does not)."""
    return compile_policy(parse(text), name=name)


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
