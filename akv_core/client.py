"""A client of an OpenAI-compatible chat server (our `akv serve`, upstream AKV, a hosted API).

One chat request in; the assistant message, the usage's counters, the finish reason and (asked
with `return_attribution`) the reply's attention over its history out. AKV fields (`drop_message`,
`reposition`, `drop_rule`, `return_attribution`) go through `extra_body`. `score_final_message`
scores a recorded assistant reply teacher-forced (vLLM's `continue_final_message` with
`prompt_logprobs`), and `features` reads the AKV features a server lists in its model card.

The sandbox's HTTP backend runs its tasks through it and the proxy writes its summaries with it,
so both send the same request and fail with the same errors: `ServerUnavailable` when the server
did not answer (refused connection, timeout) or failed (HTTP 5xx), `ContextTooLong` for a request
past the model's context, `ChatError` for any other request it did not serve (HTTP 4xx, no usage
in the reply).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence
from urllib.parse import urlparse

if TYPE_CHECKING:
    import openai

TIMEOUT_S = 600.0  # a CPU server may take minutes for a long prefill
Message = dict[str, Any]


class ChatError(Exception):
    """A chat request the server did not serve (unreachable endpoint, rejected request)."""


class ServerUnavailable(ChatError):
    """The server did not answer (refused connection, timeout) or failed (HTTP 5xx): another may serve it."""


class ContextTooLong(ChatError):
    """The server refused the request as longer than its model's context (OpenAI's `context_length_exceeded`)."""


@dataclass(frozen=True)
class ChatReply:
    """The assistant message (content "" for none, tool calls), the usage's counters flattened (AKV's
    extension fields and `prompt_tokens_details` included), the finish reason and the choice's
    `attribution` object as sent (`akv_core.attribution.Attribution.from_dict` reads it), when it has one."""

    message: Message
    usage: dict[str, Any]
    finish_reason: str | None
    attribution: dict[str, Any] | None = None


def base_url(url: str) -> str:
    """The client's base URL: the endpoint's `/v1` root, added when the user gave the bare host."""
    url = url.rstrip("/")
    for suffix in ("/chat/completions", "/completions"):
        if url.endswith(suffix):
            url = url[: -len(suffix)]
    return url if urlparse(url).path.endswith("/v1") else url + "/v1"


class ChatClient:
    """Chat requests to the server at `url`; thread-safe.

    `api_key` is sent as the bearer token; None reads AKV_API_KEY, else OPENAI_API_KEY. `model`
    None asks the server for its first listed model on the first request.
    """

    def __init__(self, url: str, model: str | None = None, timeout_s: float = TIMEOUT_S, max_retries: int = 1,
                 api_key: str | None = None) -> None:
        import openai  # over a second to import: only a process that opens a client pays for it

        self.url = url
        self._model = model
        key = api_key or os.environ.get("AKV_API_KEY") or os.environ.get("OPENAI_API_KEY") or "none"
        # One retry only: an unreachable endpoint should fail its task quickly, not stall the run.
        self._client = openai.OpenAI(base_url=base_url(url), api_key=key, timeout=timeout_s,
                                     max_retries=max_retries)

    def complete(self, messages: Sequence[Mapping[str, Any]], max_tokens: int, temperature: float = 0.0,
                 tools: Sequence[Mapping[str, Any]] = (), tool_choice: str | Mapping[str, Any] | None = None,
                 seed: int | None = None, extra_body: Mapping[str, Any] | None = None) -> ChatReply:
        """The server's reply to one request; `tool_choice` goes with `tools` only."""
        response = self._create(messages, max_tokens, temperature, tools, tool_choice, seed, extra_body)
        choice = response.choices[0]
        found = (choice.model_extra or {}).get("attribution")
        return ChatReply(_assistant_message(choice.message), _usage_fields(response.usage), choice.finish_reason,
                         found if isinstance(found, dict) else None)

    def score_final_message(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = (),
                            extra_body: Mapping[str, Any] | None = None) -> tuple[float, ...]:
        """The natural-log probability of each token of the final (assistant) message after the messages
        before it, teacher-forced: vLLM's `continue_final_message` with `prompt_logprobs: 0`, read as AKV
        returns it (null for every token before the final message's; docs/server.md). The message is
        scored open, without its end-of-turn token. ChatError when the reply has no `prompt_logprobs`."""
        body = {**(extra_body or {}), "continue_final_message": True, "add_generation_prompt": False,
                "prompt_logprobs": 0}
        response = self._create(messages, 1, 0.0, tools, None, None, body)
        scored = (response.model_extra or {}).get("prompt_logprobs")
        if not isinstance(scored, list):
            raise ChatError(f"{self.url} returned no prompt_logprobs: it does not score a final assistant message")
        try:
            return tuple(float(next(iter(entry.values()))["logprob"]) for entry in scored if entry is not None)
        except (AttributeError, KeyError, StopIteration, TypeError, ValueError) as err:
            raise ChatError(f"{self.url} returned prompt_logprobs in an unknown shape ({err!r}); expected null "
                            "or {token id: {logprob, rank, decoded_token}} per prompt token") from None

    def features(self) -> dict[str, Any]:
        """The AKV features the served model's card lists (`akv`: drop_message, return_attribution,
        prompt_logprobs, ...; docs/server.md, Endpoints); {} for a server that lists none."""
        import openai

        name = self._model_name()
        try:
            cards = self._client.models.list().data
        except openai.APIConnectionError as err:
            raise ServerUnavailable(f"cannot reach {self.url}: {err}") from err
        except openai.APIStatusError as err:
            raise ChatError(f"{self.url} cannot list models (HTTP {err.status_code})") from err
        card = next((c for c in cards if c.id == name), None)
        found = (card.model_extra or {}).get("akv") if card is not None else None
        return dict(found) if isinstance(found, Mapping) else {}

    def _create(self, messages: Sequence[Mapping[str, Any]], max_tokens: int, temperature: float,
                tools: Sequence[Mapping[str, Any]], tool_choice: str | Mapping[str, Any] | None, seed: int | None,
                extra_body: Mapping[str, Any] | None) -> Any:
        """One chat completion; the server's refusals and failures as this module's errors."""
        import openai

        kwargs: dict[str, Any] = {
            "model": self._model_name(),
            "messages": list(messages),
            "max_tokens": max_tokens,
            "temperature": temperature,
            "extra_body": dict(extra_body or {}),
        }
        if tools:
            kwargs["tools"] = list(tools)
            if tool_choice is not None:
                kwargs["tool_choice"] = tool_choice
        if seed is not None:
            kwargs["seed"] = seed
        try:
            return self._client.chat.completions.create(**kwargs)
        except openai.APIConnectionError as err:  # refused, reset or timed out
            raise ServerUnavailable(f"cannot reach {self.url}: {err}") from err
        except openai.APIStatusError as err:
            kind = ServerUnavailable if err.status_code >= 500 else ChatError
            if err.status_code == 400 and _error_code(err) == "context_length_exceeded":
                kind = ContextTooLong
            raise kind(f"{self.url} answered HTTP {err.status_code}: {_error_text(err)}") from err

    def _model_name(self) -> str:
        """The model given by the user, else the endpoint's first listed model."""
        import openai

        if self._model is None:
            try:
                models = self._client.models.list().data
            except openai.APIConnectionError as err:
                raise ServerUnavailable(f"cannot reach {self.url}: {err}") from err
            except openai.APIStatusError as err:
                raise ChatError(f"{self.url} cannot list models (HTTP {err.status_code}); "
                                "pass --model NAME") from err
            if not models:
                raise ChatError(f"{self.url} lists no models; pass --model NAME")
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


def _error_code(err: openai.APIStatusError) -> str | None:
    """The error's `code` (OpenAI's shape: `{"error": {"code": ...}}`), None when it has none."""
    body = err.body
    inner = body.get("error", body) if isinstance(body, dict) else None
    return inner.get("code") if isinstance(inner, dict) else None


def _assistant_message(message: Any) -> Message:
    out: Message = {"role": "assistant", "content": message.content or ""}
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}
            for call in message.tool_calls
        ]
    return out


def _usage_fields(usage: Any) -> dict[str, Any]:
    """Flatten the OpenAI usage object, AKV's extension fields included."""
    if usage is None:
        raise ChatError("the endpoint returned no usage; AKV accounting needs it")
    details = usage.prompt_tokens_details
    fields: dict[str, Any] = {"prompt_tokens": usage.prompt_tokens,
                              "completion_tokens": usage.completion_tokens}
    fields.update({k: v for k, v in (usage.model_extra or {}).items() if isinstance(v, int)})
    if details is not None:
        fields.update(details.model_dump())
    return fields
