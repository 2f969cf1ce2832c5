"""A read-only view of an OpenAI-format message history, with everything triggers and selectors ask.

Every fact about message i is computed from messages 0..i only, which is what makes decisions
cumulative: a longer history never changes what a prefix looked like.
"""
from __future__ import annotations

import functools
import json
import threading
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from policy_dsl.counter import TokenCounter, message_text
from policy_dsl.coverage import CoverageIndex
from policy_dsl.reuse import ReuseFinder

DROP_CONTEXT_TOOL = "drop_context"
MAX_ARGUMENT_CHARS = 65_536  # larger drop_context arguments are ignored, not parsed
SYSTEM_ROLES = ("system", "developer")
REUSE_FINDER = ReuseFinder()  # one for the process: its per-message memo makes each decision cheap
_FINDER_LOCK = threading.Lock()  # its memo is not safe to grow from two threads (a proxy decides in threads)


class HistoryError(ValueError):
    """The history is not a list of OpenAI-format messages; the message names the index."""


@dataclass(frozen=True)
class HistoryView:
    roles: tuple[str, ...]
    tokens: tuple[int, ...]
    texts: tuple[str, ...]
    tool_names: tuple[str | None, ...]   # tool messages: the tool that answered
    has_thinking: tuple[bool, ...]
    batch_end: tuple[bool, ...]           # the last tool message answering one assistant message
    tool_responses: tuple[int, ...]       # tool messages in 0..i
    turns: tuple[int, ...]                # assistant messages in 0..i
    tool_calls: tuple[int, ...]           # completed tool batches in 0..i
    protected: frozenset[int]             # system prompt and first user message (the latest is added per boundary)
    next_turn: tuple[int | None, ...]     # the first assistant message after each message (None: none yet)
    requests: Mapping[int, tuple[int, ...]]  # tool message -> ids its drop_context call asked to drop
    # tool message -> the next tool message answering the same call (tool and arguments), if any.
    # Rules compare it with the boundary, so a fact about message i still depends on 0..i only.
    answered_again: tuple[int | None, ...]
    # assistant messages: the last tool result of the first assistant message at or after it that has
    # results (where upstream's rolling assistant target retires it); None elsewhere
    results_end: tuple[int | None, ...] = ()
    # a user message right after the end of a call: that call's controller prompt (a harness's
    # prompt sent with the call's results, in the same request; see `prompt_ends`)
    controller_prompt: tuple[bool, ...] = ()
    # per message, the assistant messages after it that reuse its content (`policy_dsl/reuse.py`);
    # computed only for policies that ask (`idle`), empty tuples otherwise
    reused_by: tuple[tuple[int, ...], ...] = ()
    # the messages' distinctive items and their holders (`policy_dsl/coverage.py`); built only for
    # policies that ask (`covered`), None otherwise
    coverage: CoverageIndex | None = None
    # tool messages: the call they answer (its name and argument values); assistant messages: their
    # own calls; "" elsewhere
    call_texts: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.roles)

    def count(self, unit: str, i: int) -> int:
        """How many units (tool_calls, turns, tool_responses) happened in messages 0..i."""
        if i < 0:
            return 0
        return {"tool_calls": self.tool_calls, "turns": self.turns, "tool_responses": self.tool_responses}[unit][i]

    def prompt_ends(self) -> dict[int, int]:
        """Call end -> its controller prompt, for every call followed by one (upstream's prompt_end_message_ids).

        Each entry is a fact about the prompt (from messages 0..prompt); a policy that counts
        controller prompts reads it at the call's end, the one look past a boundary (policy.py).
        """
        return {i - 1: i for i, prompt in enumerate(self.controller_prompt) if prompt}

    def event(self, unit: str, i: int) -> bool:
        """Whether message i completes one unit."""
        if unit == "tool_calls":
            return self.batch_end[i]
        return self.roles[i] == ("assistant" if unit == "turns" else "tool")


def view_history(messages: Sequence[Mapping[str, Any]], counter: TokenCounter,
                 user_observations: bool = False, reuse: bool = False, coverage: bool = False) -> HistoryView:
    """Check the history's shape and precompute the per-message facts.

    With `user_observations`, a user message right after an assistant message that called no tool
    (not the first user message) also ends a call: the observation came back as user text. With
    `reuse`, which later assistant messages reused each message's content (`reused_by`); with
    `coverage`, which messages hold each message's distinctive items (`coverage`).
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise HistoryError("history must be a list of messages")
    roles: list[str] = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise HistoryError(f"message {i}: expected an object with a string 'role'")
        roles.append(m["role"])
    tokens = tuple(_token_count(counter, m, i) for i, m in enumerate(messages))
    tool_names, batch_end, requests, call_keys, call_texts = _tool_facts(messages, roles)
    protected = _protected(roles)
    if user_observations:
        batch_end = [end or _user_observation(messages, roles, i) for i, end in enumerate(batch_end)]
    return HistoryView(
        roles=tuple(roles),
        tokens=tokens,
        texts=tuple(message_text(m) for m in messages),
        tool_names=tuple(tool_names),
        has_thinking=tuple(bool(m.get("reasoning_content")) for m in messages),
        batch_end=tuple(batch_end),
        tool_responses=_running_count(r == "tool" for r in roles),
        turns=_running_count(r == "assistant" for r in roles),
        tool_calls=_running_count(batch_end),
        protected=protected,
        requests=requests,
        answered_again=_answered_again(call_keys),
        next_turn=_next_turns(roles),
        results_end=_results_end(roles),
        controller_prompt=tuple(role == "user" and i > 0 and batch_end[i - 1] for i, role in enumerate(roles)),
        reused_by=_reused_by(messages, roles) if reuse else ((),) * len(roles),
        coverage=_coverage(messages, protected) if coverage else None,
        call_texts=tuple(call_texts),
    )


def _reused_by(messages: Sequence[Mapping[str, Any]], roles: list[str]) -> tuple[tuple[int, ...], ...]:
    """Per message, the assistant messages that reuse a distinctive string only tool results hold
    (an at-risk reuse: content the agent's own words or the user's also hold is not lost when a
    result goes), counting every holder, not only the latest: a result the agent quoted is not
    idle, whichever copy it quoted from."""
    out: list[list[int]] = [[] for _ in roles]
    with _FINDER_LOCK:
        for k, role in enumerate(roles):
            if role != "assistant":
                continue
            for j in sorted({found.holders[-1] for found in REUSE_FINDER.reuses(messages, k) if found.at_risk}):
                out[j].append(k)
    return tuple(tuple(ks) for ks in out)


def call_texts(messages: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
    """Per message, the call it answers (tool messages) or makes (assistant messages) as `call
    contains` reads it; "" elsewhere. The history must have the shape `view_history` checks."""
    roles = [str(m.get("role")) for m in messages]
    return tuple(_tool_facts(messages, roles)[4])


def coverage_index(messages: Sequence[Mapping[str, Any]]) -> CoverageIndex:
    """The coverage index `covered` reads (`policy_dsl/coverage.py`) for a well-formed history."""
    return _coverage(messages, _protected([str(m.get("role")) for m in messages]))


def _coverage(messages: Sequence[Mapping[str, Any]], protected: frozenset[int]) -> CoverageIndex:
    """The coverage index, the prompt being the messages no policy hides (the leading system
    messages and the first user message): a later user message or system note can be dropped, so
    what it holds counts only while it is visible, as any other message's."""
    with _FINDER_LOCK:
        items = REUSE_FINDER.items_of(messages)
    return CoverageIndex(items, protected)


def _user_observation(messages: Sequence[Mapping[str, Any]], roles: list[str], i: int) -> bool:
    return roles[i] == "user" and i > 0 and roles[i - 1] == "assistant" and not _calls_of(messages[i - 1]) \
        and "user" in roles[:i]


def _results_end(roles: list[str]) -> tuple[int | None, ...]:
    """Per assistant message, the end of the next run of tool results at or after it (see HistoryView).

    An index beyond a boundary is never used there (a selector checks it is <= i), so the facts
    a boundary sees still come from the prefix alone.
    """
    out: list[int | None] = [None] * len(roles)
    pending: list[int] = []  # assistant messages waiting for one that has results
    for i, role in enumerate(roles):
        if role == "assistant":
            pending.append(i)
            continue
        run_ends = role == "tool" and (i + 1 == len(roles) or roles[i + 1] != "tool")
        start = i
        while run_ends and start > 0 and roles[start - 1] == "tool":
            start -= 1
        if run_ends and start > 0 and roles[start - 1] == "assistant":
            for j in pending:
                out[j] = i
            pending = []
    return tuple(out)


def _token_count(counter: TokenCounter, message: Mapping[str, Any], i: int) -> int:
    value = counter.count(message)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise HistoryError(f"message {i}: the token counter returned {value!r}; expected a count >= 0")
    return value


def _running_count(flags: Any) -> tuple[int, ...]:
    total, out = 0, []
    for flag in flags:
        total += bool(flag)
        out.append(total)
    return tuple(out)


def _next_turns(roles: list[str]) -> tuple[int | None, ...]:
    """For each message, the index of the first assistant message after it. Selectors read it
    only when that turn is at or before their boundary, so a prefix decides the same."""
    out: list[int | None] = [None] * len(roles)
    following: int | None = None
    for i in range(len(roles) - 1, -1, -1):
        out[i] = following
        if roles[i] == "assistant":
            following = i
    return tuple(out)


def _protected(roles: list[str]) -> frozenset[int]:
    protected = set()
    for i, role in enumerate(roles):
        if role not in SYSTEM_ROLES:
            break
        protected.add(i)
    if "user" in roles:
        protected.add(roles.index("user"))
    return frozenset(protected)


def _calls_of(message: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    calls = message.get("tool_calls")
    return [c for c in calls if isinstance(c, Mapping)] if isinstance(calls, list) else []


def _call_name(call: Mapping[str, Any]) -> str | None:
    function = call.get("function")
    name = function.get("name") if isinstance(function, Mapping) else None
    return name if isinstance(name, str) else None


def _tool_facts(messages: Sequence[Mapping[str, Any]], roles: list[str]):
    """Tool names, batch ends, drop_context requests and the calls' texts, each decided from the prefix alone."""
    tool_names: list[str | None] = []
    batch_end: list[bool] = []
    requests: dict[int, tuple[int, ...]] = {}
    call_keys: list[str | None] = []
    call_texts: list[str] = []
    parent: int | None = None  # the assistant message the current run of tool messages answers
    answered = 0
    for i, m in enumerate(messages):
        if roles[i] != "tool":
            parent, answered = (i, 0) if roles[i] == "assistant" else (None, 0)
            tool_names.append(None)
            batch_end.append(False)
            call_keys.append(None)
            call_texts.append("\n".join(_call_text(_call_name(c), c) for c in _calls_of(m)) if parent == i else "")
            continue
        answered += 1
        calls = _calls_of(messages[parent]) if parent is not None else []
        call = next((c for c in calls if c.get("id") == m.get("tool_call_id")), None)
        name = m.get("name") if isinstance(m.get("name"), str) else (_call_name(call) if call else None)
        tool_names.append(name)
        # A batch ends once every call of its assistant message has an answer (orphans end at once).
        batch_end.append(answered >= len(calls))
        if name == DROP_CONTEXT_TOOL:
            requests[i] = _requested_ids(call)
        call_keys.append(_call_key(name, call))
        call_texts.append(_call_text(name, call) if call else "")
    return tool_names, batch_end, requests, call_keys, call_texts


def _call_text(name: str | None, call: Mapping[str, Any]) -> str:
    """A call as `call contains` reads it: the tool's name, then its arguments' values (strings as
    they are, a line each; decoded from JSON when they parse, the raw text otherwise)."""
    function = call.get("function")
    arguments = function.get("arguments") if isinstance(function, Mapping) else None
    if isinstance(arguments, str):
        return _decoded_call_text(name or "", arguments)   # the same call is read at every request
    return "\n".join([name or "", *_values(arguments)])


@functools.lru_cache(maxsize=4096)
def _decoded_call_text(name: str, arguments: str) -> str:
    decoded: Any = arguments
    if len(arguments) <= MAX_ARGUMENT_CHARS:
        try:
            decoded = json.loads(arguments)
        except (ValueError, RecursionError):
            pass
    return "\n".join([name, *_values(decoded)])


def _values(node: Any) -> list[str]:
    if isinstance(node, Mapping):
        return [s for v in node.values() for s in _values(v)]
    if isinstance(node, (list, tuple)):
        return [s for v in node for s in _values(v)]
    return [] if node is None else [node if isinstance(node, str) else json.dumps(node)]


def _call_key(name: str | None, call: Mapping[str, Any] | None) -> str | None:
    """What a call asked (its tool and arguments, canonical JSON when they parse); None without a call."""
    function = call.get("function") if call else None
    if name is None or not isinstance(function, Mapping):
        return None
    arguments = function.get("arguments")
    if isinstance(arguments, str) and len(arguments) <= MAX_ARGUMENT_CHARS:
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            pass
    try:
        text = json.dumps(arguments, sort_keys=True)
    except (TypeError, ValueError, RecursionError):
        text = repr(arguments)
    return f"{name}\0{text}"


def _answered_again(keys: Sequence[str | None]) -> tuple[int | None, ...]:
    later: dict[str, int] = {}
    again: list[int | None] = [None] * len(keys)
    for i in range(len(keys) - 1, -1, -1):
        if keys[i] is not None:
            again[i] = later.get(keys[i])
            later[keys[i]] = i
    return tuple(again)


def _requested_ids(call: Mapping[str, Any] | None) -> tuple[int, ...]:
    """Message ids from drop_context arguments {"message_ids": [...]}; anything malformed asks for nothing."""
    function = call.get("function") if call else None
    arguments = function.get("arguments") if isinstance(function, Mapping) else None
    if isinstance(arguments, str):
        if len(arguments) > MAX_ARGUMENT_CHARS:
            return ()
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return ()
    ids = arguments.get("message_ids") if isinstance(arguments, Mapping) else None
    if not isinstance(ids, list):
        return ()
    return tuple(sorted({x for x in ids if isinstance(x, int) and not isinstance(x, bool)}))
