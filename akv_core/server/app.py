"""The FastAPI application: routes, and the request lifecycle around the engine.

A chat request is validated (400 naming the field), submitted to the engine,
and its events are turned into one response or a stream of chunks. The engine
request is cancelled whenever the handler stops early, client gone included,
so its cache locks never outlive the connection.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.background import BackgroundTask

from akv_core.request import ERROR_KV_CAPACITY
from akv_core.server.access_log import ACCESS_USAGE, AccessLog
from akv_core.server.assistant_output import AssistantOutputParser
from akv_core.server.engine_loop import ClientGone, EngineLoop, Failed, Finished
from akv_core.server.errors import APIError, install_error_handlers
from akv_core.server.metrics import ServerMetrics
from akv_core.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    Choice,
    ErrorResponse,
    ModelCard,
    ModelList,
    ResponseMessage,
    ServerInfo,
    akv_features,
)
from akv_core.server.streaming import ChunkStream, usage_info
from akv_core.server.validation import generation_args

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request; `param` names the field."},
    404: {"model": ErrorResponse, "description": "Unknown model."},
}


@dataclass
class ServerState:
    loop: EngineLoop
    model_name: str
    aliases: frozenset[str]
    metrics: ServerMetrics
    started: int


def create_app(engine: Any, model_name: str, aliases: frozenset[str] = frozenset()) -> FastAPI:
    """An app serving `engine` under `model_name`; the engine loop runs while the app does."""
    state = ServerState(EngineLoop(engine), model_name, aliases | {model_name},
                        ServerMetrics(), int(time.time()))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.loop.start()
        try:
            yield
        finally:
            state.loop.stop()

    app = FastAPI(title="AKV", version="0.1.0", lifespan=lifespan,
                  summary="OpenAI-compatible chat completions with AKV cache operations.")
    app.state.akv = state
    app.add_middleware(AccessLog)
    install_error_handlers(app, on_error=lambda request, status: state.metrics.count_request(
        _endpoint(request), "rejected" if status < 500 else "failed"))
    _add_routes(app, state)
    return app


def _add_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        healthy = state.loop.alive
        body = {"status": "ok" if healthy else "engine stopped", "model": state.model_name}
        return JSONResponse(body, status_code=200 if healthy else 503)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        card = ModelCard(id=state.model_name, created=state.started,
                         max_model_len=getattr(state.loop.engine, "context_length", None), akv=akv_features())
        return ModelList(data=[card])

    @app.get("/server_info", response_model=ServerInfo)
    async def server_info() -> ServerInfo:
        return ServerInfo(model=state.model_name, akv=akv_features(),
                          max_model_len=getattr(state.loop.engine, "context_length", None))

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        text = state.metrics.render(state.loop.gauges())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses=ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        return await _chat(state, body, request)


def _endpoint(request: Request) -> str:
    return "chat" if request.url.path == "/v1/chat/completions" else "other"


async def _chat(state: ServerState, body: ChatCompletionRequest, request: Request) -> Any:
    if body.model not in state.aliases:
        raise APIError(f"model: the model {body.model!r} does not exist; this server serves "
                       f"{state.model_name!r}", param="model", status=404, code="model_not_found")
    args = generation_args(body)
    started = time.monotonic()
    # A new grammar takes llguidance up to a second to compile (without the GIL): constrained
    # requests are submitted on a worker thread so the other requests stream on meanwhile.
    handle = (await asyncio.to_thread(state.loop.submit, args) if args.grammar is not None
              else state.loop.submit(args))
    parser = AssistantOutputParser(parse_tool_calls=args.tools is not None)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stream = ChunkStream(state.model_name, parser, include_usage)
        chunks = _stream(state, handle, request, stream, started)
        return StreamingResponse(chunks, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                 background=BackgroundTask(handle.cancel))
    return await _complete(state, handle, request, parser, started)


async def _complete(state: ServerState, handle: Any, request: Request,
                    parser: AssistantOutputParser, started: float) -> JSONResponse:
    first_token_at = None
    finished: Finished | None = None
    try:
        async for event in state.loop.events(handle, request.is_disconnected):
            if isinstance(event, Failed):
                raise engine_failure(event)
            if isinstance(event, Finished):
                finished = event
            else:
                first_token_at = first_token_at or time.monotonic()
                parser.feed(event.text)
    except ClientGone:
        state.metrics.count_request("chat", "disconnected")
        return JSONResponse({}, status_code=499)
    if finished is None:
        raise RuntimeError("the engine ended a request without a final event")
    _, message = parser.finish()
    _record(state, finished, started, first_token_at)
    setattr(request.state, ACCESS_USAGE, finished.usage)
    response = ChatCompletionResponse(
        model=state.model_name,
        choices=[Choice(
            message=ResponseMessage(content=message.content, tool_calls=message.tool_calls,
                                    reasoning_content=message.reasoning),
            finish_reason="tool_calls" if message.tool_calls else finished.finish_reason,
        )],
        usage=usage_info(finished.usage),
    )
    body = response.model_dump(exclude_none=True)
    # OpenAI sends content and logprobs as explicit nulls; clients index them directly.
    choice = body["choices"][0]
    body["choices"][0] = {"index": choice["index"],
                          "message": {"role": "assistant", "content": None, **choice["message"]},
                          "logprobs": None, "finish_reason": choice["finish_reason"]}
    return JSONResponse(body)


async def _stream(state: ServerState, handle: Any, request: Request, stream: ChunkStream,
                  started: float) -> AsyncIterator[str]:
    first_token_at = None
    finished = False
    try:
        yield stream.role_chunk()
        async for event in state.loop.events(handle, request.is_disconnected):
            if isinstance(event, Failed):
                finished = True
                error = engine_failure(event)
                state.metrics.count_request("chat", "rejected" if error.status < 500 else "failed")
                yield stream.error_chunk(error)
            elif isinstance(event, Finished):
                finished = True
                _record(state, event, started, first_token_at)
                setattr(request.state, ACCESS_USAGE, event.usage)
                for chunk in stream.final_chunks(event):
                    yield chunk
            else:
                first_token_at = first_token_at or time.monotonic()
                chunk = stream.delta_chunk(event.text)
                if chunk:
                    yield chunk
    except ClientGone:
        pass  # counted below; there is nobody left to send an error to
    finally:
        # Starlette cancels this generator when the client leaves mid-stream.
        if not finished:
            handle.cancel()
            state.metrics.count_request("chat", "disconnected")


def engine_failure(event: Failed) -> APIError:
    """The error a request the engine ended gets: a 400 if the pool can never hold it, else a 500."""
    if event.code == ERROR_KV_CAPACITY:
        message = event.message if event.message.startswith("messages:") else f"messages: {event.message}"
        return APIError(message, param="messages", code=ERROR_KV_CAPACITY)
    return APIError(f"the engine failed while serving this request ({event.message}); other requests "
                    "were not affected", status=500, type="server_error", code=event.code)


def _record(state: ServerState, finished: Finished, started: float,
            first_token_at: float | None) -> None:
    now = time.monotonic()
    state.metrics.count_request("chat", "ok")
    state.metrics.count_tokens(finished.usage)
    state.metrics.request_latency.observe(now - started)
    state.metrics.time_to_first_token.observe((first_token_at or now) - started)
