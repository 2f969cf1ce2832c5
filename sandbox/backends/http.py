"""A backend for any OpenAI-compatible endpoint (our `akv serve`, upstream AKV, a hosted API).

AKV fields go through `extra_body`; the key comes from AKV_API_KEY or OPENAI_API_KEY.
"""
from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlparse

import openai

from sandbox.backends import BackendError, BackendReply, BackendRequest, Message, ServerUnavailable
from sandbox.cost import Usage

_TIMEOUT_S = 600.0  # a CPU server may take minutes for a long prefill


def base_url(url: str) -> str:
    """The client's base URL: the endpoint's `/v1` root, added when the user gave the bare host."""
    url = url.rstrip("/")
    for suffix in ("/chat/completions", "/completions"):
        if url.endswith(suffix):
            url = url[: -len(suffix)]
    return url if urlparse(url).path.endswith("/v1") else url + "/v1"


class HttpBackend:
    generates = True
    parallel = "threads"  # the client is thread-safe; the server batches what the lanes send at once

    def __init__(self, url: str, model: str | None = None, timeout_s: float = _TIMEOUT_S, max_retries: int = 1) -> None:
        self.name = url
        self._model = model
        key = os.environ.get("AKV_API_KEY") or os.environ.get("OPENAI_API_KEY") or "none"
        # One retry only: an unreachable endpoint should fail its task quickly, not stall the run.
        self._client = openai.OpenAI(base_url=base_url(url), api_key=key, timeout=timeout_s,
                                     max_retries=max_retries)

    def start_task(self) -> None:
        """Nothing to reset: the server's cache is shared across tasks, as in production."""

    def lane(self) -> HttpBackend:
        """The backend a lane thread uses: this one (the client is thread-safe)."""
        return self

    def complete(self, request: BackendRequest) -> BackendReply:
        kwargs: dict[str, Any] = {
            "model": self._model_name(),
            "messages": list(request.messages),
            "max_tokens": request.max_tokens,
            "temperature": request.temperature,
            "extra_body": request.api_fields(),
        }
        if request.tools:
            kwargs["tools"] = list(request.tools)
        if request.seed is not None:
            kwargs["seed"] = request.seed
        try:
            response = self._client.chat.completions.create(**kwargs)
        except openai.APIConnectionError as err:  # refused, reset or timed out
            raise ServerUnavailable(f"cannot reach {self.name}: {err}") from err
        except openai.APIStatusError as err:
            kind = ServerUnavailable if err.status_code >= 500 else BackendError
            raise kind(f"{self.name} answered HTTP {err.status_code}: {_error_text(err)}") from err
        choice = response.choices[0]
        return BackendReply(_assistant_message(choice.message), _usage(response.usage), choice.finish_reason)

    def _model_name(self) -> str:
        """The model given by the user, else the endpoint's first listed model."""
        if self._model is None:
            try:
                models = self._client.models.list().data
            except openai.APIConnectionError as err:
                raise ServerUnavailable(f"cannot reach {self.name}: {err}") from err
            except openai.APIStatusError as err:
                raise BackendError(f"{self.name} cannot list models (HTTP {err.status_code}); "
                                   "pass --model NAME") from err
            if not models:
                raise BackendError(f"{self.name} lists no models; pass --model NAME")
            self._model = models[0].id
        return self._model

    def close(self) -> None:
        self._client.close()


def _error_text(err: openai.APIStatusError) -> str:
    body = err.body
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
    return str(err.message)


def _assistant_message(message: Any) -> Message:
    out: Message = {"role": "assistant", "content": message.content or ""}
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}
            for call in message.tool_calls
        ]
    return out


def _usage(usage: Any) -> Usage:
    """Flatten the OpenAI usage object, AKV's extension fields included."""
    if usage is None:
        raise BackendError("the endpoint returned no usage; AKV accounting needs it")
    details = usage.prompt_tokens_details
    fields: dict[str, Any] = {"prompt_tokens": usage.prompt_tokens,
                              "completion_tokens": usage.completion_tokens}
    fields.update({k: v for k, v in (usage.model_extra or {}).items() if isinstance(v, int)})
    if details is not None:
        fields.update(details.model_dump())
    return Usage.from_fields(fields)
