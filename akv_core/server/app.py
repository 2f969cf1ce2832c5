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

from akv_core.request import ERROR_KV_CAPACITY, FINISH_LENGTH
from akv_core.server.access_log import ACCESS_USAGE, AccessLog
from akv_core.server.assistant_output import AssistantOutputParser
from akv_core.server.engine_loop import ClientGone, EngineLoop, Failed, Finished
from akv_core.server.errors import APIError, install_error_handlers
from akv_core.server.guard import Guard, body_limit_for, check_api_key
from akv_core.server.metrics import ServerMetrics
from akv_core.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    Choice,
    CpuKernels,
    ErrorResponse,
    ModelCard,
    ModelList,
    ResponseMessage,
    ServerInfo,
    TokenLogprobEntry,
    akv_features,
)
from akv_core.server.logprobs import TokenTexts, choice_logprobs, token_texts
from akv_core.server.streaming import ChunkStream, combined_usage, finish_reason, usage_info
from akv_core.server.reply_fields import attribution_field, prompt_logprobs_field
from akv_core.server.validation import GenerationArgs, generation_args, ignored_params

IGNORED_HEADER = "x-akv-ignored-params"   # the accepted-and-ignored fields a request sent

DEFAULT_CONTEXT_TOKENS = 32_768  # for an engine that does not say: the longest context `akv serve` stretches to

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


def create_app(engine: Any, model_name: str, aliases: frozenset[str] = frozenset(),
               api_key: str | None = None, max_body_bytes: int | None = None) -> FastAPI:
    """An app serving `engine` under `model_name`; the engine loop runs while the app does.

    With `api_key`, every request but GET /health needs `Authorization: Bearer KEY`; bodies over
    `max_body_bytes` (default: room for the longest history the engine's context holds) get a 413.
    """
    state = ServerState(EngineLoop(engine), model_name, aliases | {model_name},
                        ServerMetrics(), int(time.time()))
    check_api_key(api_key, "api_key")
    context = getattr(engine, "context_length", None) or DEFAULT_CONTEXT_TOKENS

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
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes or body_limit_for(context),
                       on_refused=lambda path, _status: state.metrics.count_request(_endpoint_of(path), "rejected"))
    app.add_middleware(AccessLog)   # added last, so it is outermost: refused requests are logged too
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
        return ModelList(data=[_card(state)])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=ERROR_RESPONSES)
    async def model(model_id: str) -> ModelCard:
        if model_id not in state.aliases:
            raise APIError(f"model: the model {model_id!r} does not exist; this server serves "
                           f"{state.model_name!r}", param="model", status=404, code="model_not_found")
        return _card(state)

    @app.get("/server_info", response_model=ServerInfo)
    async def server_info() -> ServerInfo:
        model = getattr(state.loop.engine, "model", None)
        path = getattr(model, "prefill_path", None)
        return ServerInfo(model=state.model_name, akv=akv_features(), prefill=None if path is None else str(path),
                          prefill_attention=getattr(model, "prefill_attention", None), cpu_kernels=_cpu_kernels(model),
                          max_model_len=getattr(state.loop.engine, "context_length", None))

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        text = state.metrics.render(state.loop.gauges())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses=ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        return await _chat(state, body, request)


def _cpu_kernels(model: Any) -> CpuKernels | None:
    """The C kernels' state for a model on the CPU (`CausalLM.kernels_refusal`); None on another device."""
    if model is None or getattr(model, "device", None) is None or model.device.type != "cpu":
        return None
    refusal = model.kernels_refusal
    if refusal is None:
        return CpuKernels(available=True)
    return CpuKernels(available=False, reason=refusal.reason, fix=refusal.fix)


def _card(state: ServerState) -> ModelCard:
    return ModelCard(id=state.model_name, created=state.started,
                     max_model_len=getattr(state.loop.engine, "context_length", None), akv=akv_features())


def _endpoint(request: Request) -> str:
    return _endpoint_of(request.url.path)


def _endpoint_of(path: str) -> str:
    return "chat" if path == "/v1/chat/completions" else "other"


async def _chat(state: ServerState, body: ChatCompletionRequest, request: Request) -> Any:
    if body.model not in state.aliases:
        raise APIError(f"model: the model {body.model!r} does not exist; this server serves "
                       f"{state.model_name!r}", param="model", status=404, code="model_not_found")
    args = generation_args(body)
    started = time.monotonic()
    # A new grammar takes llguidance up to a second to compile (without the GIL), and the token table
    # of log probabilities a third of a second once: such requests are set up on a worker thread so
    # the other requests stream on meanwhile.
    scores = args.top_logprobs is not None or args.reply.prompt_logprobs is not None
    texts = await asyncio.to_thread(token_texts, state.loop.engine) if scores else None
    slow = args.grammar is not None or scores
    handles = await asyncio.to_thread(state.loop.submit_all, args) if slow else state.loop.submit_all(args)
    parsers = [AssistantOutputParser(parse_tool_calls=args.tools is not None) for _ in handles]
    ignored = ignored_params(body)
    headers = {IGNORED_HEADER: ",".join(ignored)} if ignored else {}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stream = ChunkStream(state.model_name, parsers, include_usage, None if args.top_logprobs is None else texts)
        chunks = _stream(state, handles, request, stream, started)
        return StreamingResponse(chunks, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers},
                                 background=BackgroundTask(_cancel, handles))
    response = await _complete(state, handles, request, parsers, started, texts, args)
    response.headers.update(headers)
    return response


@dataclass
class _Collected:
    """Every choice's end and log probabilities, for the one response of a request."""

    finished: list[Finished]
    entries: list[list[TokenLogprobEntry]]
    first_token_at: float | None


async def _complete(state: ServerState, handles: list[Any], request: Request,
                    parsers: list[AssistantOutputParser], started: float,
                    texts: TokenTexts | None, args: GenerationArgs) -> JSONResponse:
    collected = await _collect(state, handles, request, parsers, texts)
    if collected is None:
        state.metrics.count_request("chat", "disconnected")
        return JSONResponse({}, status_code=499)
    usage = combined_usage(collected.finished)
    _record(state, collected.finished, started, collected.first_token_at)
    setattr(request.state, ACCESS_USAGE, usage)
    body = ChatCompletionResponse(model=state.model_name, choices=[],
                                  usage=usage_info(usage)).model_dump(exclude_none=True)
    body["choices"] = [_choice(index, parser, done, None if args.top_logprobs is None else collected.entries[index])
                       for index, (parser, done) in enumerate(zip(parsers, collected.finished))]
    scored = collected.finished[0].continuation_scores
    if args.reply.prompt_logprobs is not None and scored is not None:
        body["prompt_logprobs"] = prompt_logprobs_field(scored, usage["prompt_tokens"], texts)
    return JSONResponse(body)


async def _collect(state: ServerState, handles: list[Any], request: Request,
                   parsers: list[AssistantOutputParser], texts: TokenTexts | None) -> _Collected | None:
    """Every choice's text fed to its parser until all have ended; None if the client left."""
    first_token_at = None
    finished: dict[int, Finished] = {}
    entries: list[list[TokenLogprobEntry]] = [[] for _ in handles]
    try:
        async for index, event in state.loop.choice_events(handles, request.is_disconnected):
            if isinstance(event, Failed):
                raise engine_failure(event)
            if isinstance(event, Finished):
                finished[index] = event
                continue
            first_token_at = first_token_at or time.monotonic()
            parsers[index].feed(event.text)
            if texts is not None and event.logprob is not None:
                entries[index].append(texts.entry(event.logprob))
    except ClientGone:
        return None
    finally:
        _cancel(handles)   # the other choices of a failed one stop now, not when the generator is collected
    if len(finished) != len(handles):
        raise RuntimeError("the engine ended a request without a final event")
    return _Collected([finished[index] for index in range(len(handles))], entries, first_token_at)


def _choice(index: int, parser: AssistantOutputParser, finished: Finished,
            entries: list[TokenLogprobEntry] | None) -> dict[str, Any]:
    """One choice of a response, in OpenAI's key order, `content` and `logprobs` as explicit nulls
    when empty (clients index them directly)."""
    _, message = parser.finish(cut=finished.finish_reason == FINISH_LENGTH)
    choice = Choice(index=index, finish_reason=finish_reason(message, finished),
                    message=ResponseMessage(content=message.content, tool_calls=message.tool_calls,
                                            reasoning_content=message.reasoning)).model_dump(exclude_none=True)
    body = {"index": index, "message": {"role": "assistant", "content": None, **choice["message"]},
            "logprobs": None if entries is None else choice_logprobs(entries),
            "finish_reason": choice["finish_reason"]}
    if finished.attribution is not None:
        body["attribution"] = attribution_field(finished.attribution)
    return body


async def _stream(state: ServerState, handles: list[Any], request: Request, stream: ChunkStream,
                  started: float) -> AsyncIterator[str]:
    first_token_at = None
    finished: dict[int, Finished] = {}
    ended = False
    try:
        yield stream.role_chunk()
        async for index, event in state.loop.choice_events(handles, request.is_disconnected):
            if isinstance(event, Failed):
                ended = True
                error = engine_failure(event)
                state.metrics.count_request("chat", "rejected" if error.status < 500 else "failed")
                yield stream.error_chunk(error)
                return
            if isinstance(event, Finished):
                finished[index] = event
                for chunk in stream.choice_end(event, index):
                    yield chunk
                if len(finished) == len(handles):
                    ended = True
                    done = [finished[i] for i in range(len(handles))]
                    _record(state, done, started, first_token_at)
                    setattr(request.state, ACCESS_USAGE, combined_usage(done))
                    for chunk in stream.end(combined_usage(done)):
                        yield chunk
                continue
            first_token_at = first_token_at or time.monotonic()
            chunk = stream.delta_chunk(event.text, index, event.logprob)
            if chunk:
                yield chunk
    except ClientGone:
        pass  # counted below; there is nobody left to send an error to
    finally:
        # Starlette cancels this generator when the client leaves mid-stream.
        _cancel(handles)
        if not ended:
            state.metrics.count_request("chat", "disconnected")


def _cancel(handles: list[Any]) -> None:
    """End every choice's engine request (a no-op for those that have finished)."""
    for handle in handles:
        handle.cancel()


def engine_failure(event: Failed) -> APIError:
    """The error a request the engine ended gets: a 400 if the pool can never hold it, else a 500."""
    if event.code == ERROR_KV_CAPACITY:
        message = event.message if event.message.startswith("messages:") else f"messages: {event.message}"
        return APIError(message, param="messages", code=ERROR_KV_CAPACITY)
    return APIError(f"the engine failed while serving this request ({event.message}); other requests "
                    "were not affected", status=500, type="server_error", code=event.code)


def _record(state: ServerState, finished: list[Finished], started: float,
            first_token_at: float | None) -> None:
    """One request served: its tokens are every choice's (the engine's work, each choice's prompt too)."""
    now = time.monotonic()
    state.metrics.count_request("chat", "ok")
    for done in finished:
        state.metrics.count_tokens(done.usage)
    state.metrics.request_latency.observe(now - started)
    state.metrics.time_to_first_token.observe((first_token_at or now) - started)
