"""What a policy decides for one history: the API's cache fields (kv) or text edits (text)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Sequence

from policy_dsl.counter import message_text

OMITTED_PREFIX = "[omitted "
SUMMARY_PREFIX = "[summary of earlier messages]\n"


@dataclass(frozen=True)
class TextEdit:
    """One rewrite of the text history, for the harness to apply (indices are inclusive).

    summarize: replace messages start..end with one summary of at most `budget_tokens` tokens.
    omit:      replace the content of message `start` with `placeholder`.
    remove:    delete message `start` from the history (upstream's text_drop).
    strip_thinking: remove `reasoning_content` from assistant message `start`.
    """

    kind: Literal["summarize", "omit", "remove", "strip_thinking"]
    start: int
    end: int
    budget_tokens: int | None = None
    placeholder: str | None = None


@dataclass(frozen=True)
class Decision:
    """A policy's answer for one history. Fields in kv mode are cumulative over the history.

    `kept` (cut rules): per cut message, the [start, end) characters of its content attention
    still sees. The request then sends the kept messages (`sent_messages`) with the API's
    `keep_text_drop` rule over the full history (`history`, the one decided on).
    """

    drop_message: dict[str, list[int]] = field(default_factory=dict)
    reposition: list[int] = field(default_factory=list)
    text_edits: tuple[TextEdit, ...] = ()
    thinking_drop: bool = False
    kept: dict[int, tuple[int, int]] = field(default_factory=dict)
    history: tuple[Mapping[str, Any], ...] = field(default=(), compare=False, repr=False)

    def api_fields(self) -> dict[str, Any]:
        """The request fields of the AKV API, empty ones left out."""
        out: dict[str, Any] = {}
        if self.thinking_drop:
            out["drop_rule"] = {"type": "thinking_drop"}
        elif self.kept:
            out["drop_rule"] = {"type": "keep_text_drop", "full_messages": [dict(m) for m in self.history]}
        elif self.drop_message:
            out["drop_message"] = {k: list(v) for k, v in self.drop_message.items()}
        if self.reposition:
            out["reposition"] = list(self.reposition)
        return out

    def sent_messages(self, history: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The messages the request carries: `history`, each cut message with its kept text only."""
        sent = [dict(m) for m in history]
        for index, (start, end) in self.kept.items():
            sent[index]["content"] = message_text(sent[index])[start:end]
        return sent


Summarizer = Callable[[Sequence[Mapping[str, Any]], int], str]


def apply_text_edits(messages: Sequence[Mapping[str, Any]], edits: Sequence[TextEdit],
                     summarize: Summarizer) -> list[dict[str, Any]]:
    """The history after `edits` (a reference for harnesses; `summarize(messages, budget)` writes summaries).

    A summary becomes one user message starting with SUMMARY_PREFIX. Edits never overlap.
    """
    out = [dict(m) for m in messages]
    for edit in sorted(edits, key=lambda e: e.start, reverse=True):  # back to front keeps indices valid
        if edit.kind == "omit":
            out[edit.start]["content"] = edit.placeholder
        elif edit.kind == "remove":
            del out[edit.start]
        elif edit.kind == "strip_thinking":
            out[edit.start].pop("reasoning_content", None)
        else:
            text = summarize(out[edit.start: edit.end + 1], edit.budget_tokens or 0)
            out[edit.start: edit.end + 1] = [{"role": "user", "content": SUMMARY_PREFIX + text}]
    return out
