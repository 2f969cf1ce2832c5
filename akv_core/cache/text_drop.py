"""The `drop_rule` types that drop parts of messages: `text_drop` and `keep_text_drop`.

Both name characters of message contents; the cache key turns them into token ranges
through the chat renderer's provenance (`Rendered.content_tokens`): a token leaves
attention when it lies wholly inside the dropped characters, so a token that straddles
a boundary stays. A message whose whole content is dropped leaves as a whole (its role
header and end marker too), exactly as the same message under `message_drop`.

- `text_drop`: `drop_messages` is aligned with `messages`; each entry is null or
  `{"role", "content", "occurrence"}`, naming substrings of that message's content
  (`content` a string or a list of strings; `occurrence`, 1-based, picks among
  overlapping matches, one per string). The drop takes effect after the latest user
  message, so only messages up to it can be cut.
- `keep_text_drop`: the client sends the messages it keeps (`messages`, possibly
  shortened) and the full history (`full_messages`). Each kept message is matched, in
  order and from the end, to a full message of the same role and protocol fields whose
  content holds it (its latest occurrence); everything else of the full history is
  dropped after its last message. The prompt is the full history. With `force`, a
  projection that fails serves the kept messages as they are, without drops.

These are upstream's rules (its limits too: 4,096 messages, 1,024 selectors per
message); checking happens here, once, for the server and the replay simulator alike.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from akv_core.cache.ops import OperationError, TextCut, TextDrop
from akv_core.cache.ranges import merge_ranges
from akv_core.chat import InvalidText, content_text

MAX_MESSAGES = 4096
MAX_SELECTORS = 1024
_ENTRY_KEYS = frozenset({"role", "content", "occurrence"})


@dataclass(frozen=True)
class KeptHistory:
    """A `keep_text_drop` resolved: the prompt to render and what of it to drop (None: nothing)."""

    messages: list[dict[str, Any]]
    drop: TextDrop | None


def parse_text_drop(drop_messages: Any, messages: Sequence[Mapping[str, Any]]) -> TextDrop | None:
    """`drop_rule.drop_messages` of a `text_drop` checked against `messages`; raises OperationError.

    None when no entry selects anything.
    """
    field = "drop_rule.drop_messages"
    if isinstance(drop_messages, (str, bytes, Mapping)) or not isinstance(drop_messages, Sequence):
        raise OperationError(field, "expected a list aligned with messages (one entry or null per message)")
    if len(drop_messages) > MAX_MESSAGES:
        raise OperationError(field, f"at most {MAX_MESSAGES} entries, got {len(drop_messages)}")
    if len(drop_messages) != len(messages):
        raise OperationError(field, f"expected one entry per message ({len(messages)}), got {len(drop_messages)}")
    trigger = next((i for i in range(len(messages) - 1, -1, -1) if messages[i].get("role") == "user"), None)
    cuts = []
    for index, (entry, message) in enumerate(zip(drop_messages, messages)):
        cut = _entry_cut(entry, message, index, f"{field}[{index}]")
        if cut is None:
            continue
        if trigger is None:
            raise OperationError("drop_rule", "text_drop takes effect after the latest user message, "
                                              "and the history has none")
        if index > trigger:
            raise OperationError(f"{field}[{index}]", f"message {index} comes after the latest user message "
                                 f"({trigger}), where text_drop takes effect; only messages up to it can be cut")
        cuts.append(cut)
    return TextDrop(trigger, tuple(cuts)) if cuts else None


def _entry_cut(entry: Any, message: Mapping[str, Any], index: int, field: str) -> TextCut | None:
    """One `drop_messages` entry: the characters it cuts from `message`, None if it selects nothing."""
    if entry is None:
        return None
    if not isinstance(entry, Mapping):
        raise OperationError(field, "expected an object {role, content, occurrence} or null")
    unknown = sorted(str(key) for key in entry if key not in _ENTRY_KEYS)
    if unknown:
        raise OperationError(f"{field}.{unknown[0]}", "unknown key; an entry takes role, content and occurrence")
    role = message.get("role")
    if entry.get("role") != role:
        raise OperationError(f"{field}.role", f"must be the role of messages[{index}] ({role!r}), "
                                              f"got {entry.get('role')!r}")
    selectors = _selectors(entry.get("content"), f"{field}.content")
    if not selectors:
        if "occurrence" in entry:
            raise OperationError(f"{field}.occurrence", "an occurrence needs content to select")
        return None
    occurrences = _occurrences(entry, selectors, field)
    content = content_text(message)
    spans = []
    for number, (selector, occurrence) in enumerate(zip(selectors, occurrences)):
        starts = _match_starts(content, selector)
        if occurrence > len(starts):
            part = f"[{number}]" if isinstance(entry["content"], list) else ""
            if not starts:
                raise OperationError(f"{field}.content{part}", f"{selector!r} does not occur in "
                                                              f"messages[{index}].content")
            raise OperationError(f"{field}.occurrence{part}", f"{selector!r} occurs {len(starts)} time(s) in "
                                 f"messages[{index}].content; occurrence {occurrence} was asked for")
        start = starts[occurrence - 1]
        spans.append((start, start + len(selector)))
    chars = merge_ranges(spans)
    return TextCut(index, chars, whole=chars == ((0, len(content)),))


def remaining_text(content: str, chars: Sequence[tuple[int, int]]) -> str:
    """`content` without the characters `chars` (sorted, disjoint): what a reader still sees of it.

    A token that straddles a cut stays in attention, so the model may see a little more."""
    pieces, cursor = [], 0
    for start, end in chars:
        pieces.append(content[cursor:start])
        cursor = end
    pieces.append(content[cursor:])
    return "".join(pieces)


def _selectors(content: Any, field: str) -> list[str]:
    """The non-empty substrings an entry names: null, "", [] and [""] name none."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content] if content else []
    if not isinstance(content, list) or not all(isinstance(item, str) for item in content):
        raise OperationError(field, "expected null, a string or a list of strings")
    if len(content) > MAX_SELECTORS:
        raise OperationError(field, f"at most {MAX_SELECTORS} selectors per message, got {len(content)}")
    empty = [item == "" for item in content]
    if any(empty) and not all(empty):
        raise OperationError(field, "cannot mix empty and non-empty strings")
    return [] if all(empty) else list(content)


def _occurrences(entry: Mapping[str, Any], selectors: list[str], field: str) -> list[int]:
    """1-based occurrence per selector: one integer for a string, a list as long as a list."""
    if "occurrence" not in entry:
        return [1] * len(selectors)
    raw, where = entry["occurrence"], f"{field}.occurrence"
    if isinstance(entry["content"], str):
        return [_positive(raw, where)]
    if not isinstance(raw, list) or len(raw) != len(selectors):
        raise OperationError(where, f"expected a list of {len(selectors)} positive integers, one per selector")
    return [_positive(value, f"{where}[{number}]") for number, value in enumerate(raw)]


def _positive(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise OperationError(field, f"expected a positive integer (1 is the first match), got {value!r}")
    return value


def _match_starts(text: str, pattern: str) -> list[int]:
    """Every start of `pattern` in `text`, overlapping matches included, left to right."""
    starts, at = [], text.find(pattern)
    while at >= 0:
        starts.append(at)
        at = text.find(pattern, at + 1)
    return starts


# ------------------------------------------------------------------ keep_text_drop


def project_kept(full_messages: Any, kept: Sequence[Mapping[str, Any]], force: bool = False) -> KeptHistory:
    """A `keep_text_drop`: the full history to render and the parts of it `kept` leaves out.

    Raises OperationError when `kept` is not an ordered projection of `full_messages`
    (unless `force`, which serves `kept` itself without drops).
    """
    field = "drop_rule.full_messages"
    if isinstance(full_messages, (str, bytes, Mapping)) or not isinstance(full_messages, Sequence):
        raise OperationError(field, "expected the full history, a list of messages")
    if not full_messages:
        raise OperationError(field, "must not be empty")
    if len(full_messages) > MAX_MESSAGES:
        raise OperationError(field, f"at most {MAX_MESSAGES} messages, got {len(full_messages)}")
    full = [dict(message) for message in full_messages]
    for index, message in enumerate(full):
        _content_of(message, f"{field}[{index}]")
    try:
        matches = _projection(full, kept)
    except OperationError:
        if force:
            return KeptHistory([dict(message) for message in kept], None)
        raise
    cuts = []
    for index, message in enumerate(full):
        span = matches.get(index)
        if span is None:
            cuts.append(TextCut(index, (), whole=True))
            continue
        length = len(content_text(message))
        chars = tuple(part for part in ((0, span[0]), (span[1], length)) if part[0] < part[1])
        if chars:
            cuts.append(TextCut(index, chars))
    return KeptHistory(full, TextDrop(len(full) - 1, tuple(cuts)) if cuts else None)


def _content_of(message: Mapping[str, Any], field: str) -> str:
    if not isinstance(message, Mapping):
        raise OperationError(field, "expected a message object")
    try:
        return content_text(message)
    except InvalidText as error:
        raise OperationError(f"{field}.content", error.reason) from None


def _projection(full: list[dict[str, Any]], kept: Sequence[Mapping[str, Any]]) -> dict[int, tuple[int, int]]:
    """Full message index -> the [start, end) characters of its content a kept message keeps.

    Kept messages are matched from the last one back, each to the latest earlier full
    message with the same role and protocol fields whose content holds its content.
    """
    if len(kept) > len(full):
        raise OperationError("drop_rule.full_messages", f"the kept messages ({len(kept)}) outnumber the full "
                                                        f"history ({len(full)}); send every message in full_messages")
    full_keys = [_protocol(message) for message in full]
    matches: dict[int, tuple[int, int]] = {}
    source = len(full) - 1
    for index in range(len(kept) - 1, -1, -1):
        key, text = _protocol(kept[index]), _content_of(kept[index], f"messages[{index}]")
        while source >= 0:
            candidate, source = source, source - 1
            at = content_text(full[candidate]).rfind(text) if full_keys[candidate] == key else -1
            if at >= 0:
                matches[candidate] = (at, at + len(text))
                break
        else:
            raise OperationError("drop_rule.full_messages", f"messages[{index}] (role {kept[index].get('role')!r}) "
                                 "matches no message of full_messages in order: the kept messages must be the full "
                                 "history's messages, in order, each content a substring of its full one")
    return matches


def _protocol(message: Mapping[str, Any]) -> str:
    """What a kept message must share with its full one: role and protocol fields, not content."""
    role = message.get("role")
    fields: dict[str, Any] = {"role": role}
    if role == "assistant":
        fields["reasoning_content"] = message.get("reasoning_content")
        fields["tool_calls"] = message.get("tool_calls") or None
    elif role == "tool":
        fields["name"], fields["tool_call_id"] = message.get("name"), message.get("tool_call_id")
    elif message.get("name") is not None:
        fields["name"] = message.get("name")
    return json.dumps(fields, ensure_ascii=False, sort_keys=True)
