"""One chat request under the policy: its AKV fields added (kv mode) or its history edited (text mode).

The policy counts tokens with the embedded model's chat tokenizer, as in the harness, so an
evolved policy decides behind the proxy exactly as it did when it was scored. Text mode applies
the edits with the harness's own editor (`policy_dsl.editor.TextEditor`), the proxy asking the
upstream model for each summary.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence

from akv_core.client import ChatReply
from policy_dsl import CachePolicy, HistoryError
from policy_dsl.counter import message_text
from policy_dsl.editor import TEXT_PASSES, TextEditor

from akv_proxy.edits import EditedHistories, Message, prefix_digests

AKV_FIELDS = ("drop_message", "drop_rule", "reposition")


class RequestError(ValueError):
    """A request the policy cannot decide on; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Applied:
    """What the proxy forwards, and what the policy did to it."""

    body: dict[str, Any]
    passthrough: bool                  # the client sent AKV fields itself: forwarded untouched
    effects: tuple[str, ...] = ()      # drop, reposition, thinking_drop, cut, summarize, omit, strip_thinking
    dropped_tokens: int = 0            # tokens of the history hidden (kv) or edited away (text)
    summaries: int = 0                 # summary requests sent upstream for this request
    policy: str = ""                   # the name of the policy that served it


class SerializedCounter:
    """The chat tokenizer behind a lock: its per-message memo is not safe across threads.

    `count` (the policy's TokenCounter) and every other method the text editor calls go through
    the lock.
    """

    def __init__(self, counter: Any) -> None:
        self._counter, self._lock = counter, threading.Lock()

    def count(self, message: Mapping[str, Any]) -> int:
        with self._lock:
            return self._counter.count(message)

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._counter, name)
        if not callable(method):
            return method

        def locked(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                return method(*args, **kwargs)
        return locked


class SummaryClient(Protocol):
    """Writes summaries: the upstream's chat client (`akv_core.client.ChatClient`), or one that refuses."""

    def complete(self, messages: Sequence[Mapping[str, Any]], max_tokens: int) -> ChatReply:
        """The upstream's reply; ChatError when it could not write it."""


class PolicyStep:
    """Applies one compiled policy to chat request bodies; `summarizer(model)` is the upstream's client."""

    def __init__(self, policy: CachePolicy, counter: Any, summarizer: Any) -> None:
        self.policy = policy
        # One lock for the tokenizer, however many policies share it (a refining proxy serves several).
        self.counter = counter if isinstance(counter, SerializedCounter) else SerializedCounter(counter)
        self.summarizer = summarizer  # model name -> SummaryClient that writes summaries
        self.histories = EditedHistories()

    def apply(self, body: Mapping[str, Any]) -> Applied:
        """The body to forward; RequestError for a history the policy cannot read."""
        if any(name in body for name in AKV_FIELDS):
            return Applied(dict(body), passthrough=True)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages: expected a non-empty list of chat messages", "messages")
        try:
            if self.policy.mode == "text":
                return self._text(body, messages)
            return self._kv(body, messages)
        except HistoryError as err:
            raise RequestError(f"messages: {err}", "messages") from None

    def _kv(self, body: Mapping[str, Any], messages: list[Message]) -> Applied:
        decision = self.policy.decide(messages, self.counter)
        dropped = {j for ids in decision.drop_message.values() for j in ids}
        effects = [name for name, present in (("drop", dropped), ("reposition", decision.reposition),
                                              ("thinking_drop", decision.thinking_drop)) if present]
        if decision.kept:   # cut rules: the kept text goes as the messages, the history as full_messages
            body, effects = {**body, "messages": decision.sent_messages(messages)}, [*effects, "cut"]
        return Applied({**body, **decision.api_fields()}, False, tuple(effects),
                       sum(self.counter.count(messages[j]) for j in dropped))

    def _text(self, body: Mapping[str, Any], raw: list[Message]) -> Applied:
        digests = prefix_digests(raw)
        history = self.histories.continue_from(raw, digests)
        summaries = 0
        client = self._client(body)

        def write(_messages: Sequence[Message], prompt: list[Message], room: int, _step: int) -> str:
            nonlocal summaries
            reply = client.complete(prompt, room)
            summaries += 1
            return str(reply.message.get("content") or "").strip()

        editor = TextEditor(_task_prompt(raw), write, self.counter)
        effects: list[str] = []
        decision = self.policy.decide(history, self.counter)
        for _ in range(TEXT_PASSES):
            if not decision.text_edits:
                break
            effects += [e.kind for e in decision.text_edits if e.kind not in effects]
            history = editor.apply(history, decision.text_edits, step=0)
            decision = self.policy.decide(history, self.counter)
        if history != raw:
            self.histories.remember(digests[-1], history)
        removed = sum(map(self.counter.count, raw)) - sum(map(self.counter.count, history))
        return Applied({**body, "messages": history, **decision.api_fields()}, False, tuple(effects),
                       max(removed, 0), summaries)

    def _client(self, body: Mapping[str, Any]) -> SummaryClient:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise RequestError("model: a text-mode policy asks the upstream model for summaries; name it",
                               "model")
        return self.summarizer(model)


def _task_prompt(messages: list[Message]) -> str:
    """The first user message: what the summaries keep in view (the harness passes the task prompt)."""
    return next((message_text(m) for m in messages if isinstance(m, Mapping) and m.get("role") == "user"), "")
