"""Triggers and selectors evaluated at one message boundary.

A boundary is "right after message i". `Boundary` carries what the rules may look at there:
the history view, i, the messages already dropped (kv) or edited (text) and the token totals.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable

from policy_dsl import nodes as n
from policy_dsl.history import HistoryView

_COMPARE: dict[str, Callable[[int, int], bool]] = {
    ">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le,
}


@dataclass
class Boundary:
    view: HistoryView
    i: int
    gone: set[int]        # dropped (kv) or already edited in this decision (text)
    visible_tokens: int   # tokens of messages 0..i that attention still sees
    history_tokens: int   # tokens of messages 0..i
    visible_responses: int = 0  # tool messages of 0..i that attention still sees

    def protected(self, j: int, trigger: bool = True) -> bool:
        """Never picked: the leading system messages, the first user message, later messages and (unless
        `trigger` is False: `trigger included`) the message at this boundary."""
        return j in self.view.protected or j > self.i or (trigger and j == self.i)


def fires(trigger: n.Trigger, b: Boundary) -> bool:
    """Whether `trigger` fires at boundary b."""
    if isinstance(trigger, n.Every):
        return b.view.event(trigger.unit, b.i) and b.view.count(trigger.unit, b.i) % trigger.n.value == 0
    if isinstance(trigger, n.After):
        return b.view.event(trigger.unit, b.i) and on_schedule(b.view.count(trigger.unit, b.i), trigger.n.value,
                                                               None if trigger.then is None else trigger.then.value)
    if isinstance(trigger, n.VisibleToolResponses):
        return b.visible_responses >= trigger.threshold.value
    if isinstance(trigger, n.TokensAbove):
        total = b.visible_tokens if trigger.measure == "visible" else b.history_tokens
        return total > trigger.threshold.value
    if isinstance(trigger, n.DropContextCalled):
        return b.i in b.view.requests
    if isinstance(trigger, n.AllOf):
        return all(fires(p, b) for p in trigger.parts)
    return any(fires(p, b) for p in trigger.parts)


def on_schedule(count: int, first: int, then: int | None) -> bool:
    """Whether unit number `count` is the `first`, or (with `then`) one of every `then` after it."""
    if count == first:
        return True
    return then is not None and count > first and (count - first) % then == 0


def matches(selector: n.Selector, j: int, b: Boundary) -> bool:
    """Whether message j (before boundary b) is picked by `selector`; protection is applied elsewhere."""
    view = b.view
    if isinstance(selector, n.AllMessages):
        return True
    if isinstance(selector, n.Role):
        return view.roles[j] == selector.role
    if isinstance(selector, n.ToolName):
        return view.tool_names[j] == selector.name
    if isinstance(selector, n.Age):
        if selector.text is not None:  # only the turns that say it count (the validator: unit turns)
            age = sum(1 for k in range(j + 1, b.i + 1) if view.roles[k] == "assistant" and selector.text in view.texts[k])
            return _COMPARE[selector.op](age, selector.n.value)
        age = view.count(selector.unit, b.i) - view.count(selector.unit, j)
        return _COMPARE[selector.op](age, selector.n.value)
    if isinstance(selector, n.Idle):  # units since the last reuse at or before the boundary
        last = max((k for k in view.reused_by[j] if k <= b.i), default=j)
        return _COMPARE[selector.op](view.count(selector.unit, b.i) - view.count(selector.unit, last), selector.n.value)
    if isinstance(selector, n.Size):
        return _COMPARE[selector.op](view.tokens[j], selector.n.value)
    if isinstance(selector, n.Contains):
        return selector.text in view.texts[j]
    if isinstance(selector, n.NextTurnContains):
        k = view.next_turn[j]  # a turn after the boundary has not been said yet
        return k is not None and k <= b.i and selector.text in view.texts[k]
    if isinstance(selector, n.Requested):
        return j in view.requests.get(b.i, ())
    if isinstance(selector, n.Superseded):  # the same call answered again at or before the boundary
        again = view.answered_again[j]
        return again is not None and again <= b.i
    if isinstance(selector, n.Covered):
        return view.coverage is not None and view.coverage.covered(j, b.i, b.gone, selector.share.value)
    if isinstance(selector, n.CallContains):
        return selector.text in view.call_texts[j]
    if isinstance(selector, n.CallersOutside):
        end = view.results_end[j]
        return end is not None and end <= b.i and \
            view.count("tool_responses", b.i) - view.count("tool_responses", end) >= selector.n.value
    if isinstance(selector, n.Not):
        return not matches(selector.part, j, b)
    if isinstance(selector, n.And):
        return all(matches(p, j, b) for p in selector.parts)
    return any(matches(p, j, b) for p in selector.parts)


def prefilter(selector: n.Selector, view: HistoryView) -> list[bool] | None:
    """Per message, a necessary condition for `selector` built from facts that never change: facts of
    the message itself and the ones before it, never of later ones (a walk resumed on a longer
    history keeps the candidates it chose on the shorter one, `policy_dsl/kv_walk.py`).

    None means no restriction. Rules keep only the messages that pass as their candidates, so a
    firing looks at the few tool responses still visible instead of the whole history.
    """
    if isinstance(selector, (n.Role, n.ToolName, n.Size, n.Contains, n.CallContains)):
        return [_static_matches(selector, j, view) for j in range(len(view))]
    if isinstance(selector, n.Covered) and view.coverage is not None:  # holds distinctive content: necessary
        return [bool(items) for items in view.coverage.items]
    if isinstance(selector, n.Superseded):  # a tool response (whether a later one answers its call again
        return [role == "tool" for role in view.roles]  # is a fact of the messages after it)
    if isinstance(selector, n.CallersOutside):
        return [role == "assistant" for role in view.roles]
    if isinstance(selector, n.Not) and _is_static(selector.part):
        return [not _static_matches(selector.part, j, view) for j in range(len(view))]
    if isinstance(selector, (n.And, n.Or)):
        masks = [prefilter(p, view) for p in selector.parts]
        known = [m for m in masks if m is not None]
        if isinstance(selector, n.And) and known:
            return [all(column) for column in zip(*known)]
        if isinstance(selector, n.Or) and len(known) == len(masks):
            return [any(column) for column in zip(*known)]
    return None


def _is_static(selector: n.Selector) -> bool:
    if isinstance(selector, (n.Age, n.Idle, n.Requested, n.Superseded, n.Covered, n.NextTurnContains,
                             n.CallersOutside)):
        return False
    if isinstance(selector, n.Not):
        return _is_static(selector.part)
    if isinstance(selector, (n.And, n.Or)):
        return all(_is_static(p) for p in selector.parts)
    return True


def _static_matches(selector: n.Selector, j: int, view: HistoryView) -> bool:
    """`matches` for selectors that do not depend on the boundary."""
    return matches(selector, j, Boundary(view, j, set(), 0, 0))


def select_messages(target: n.Messages, b: Boundary, live: list[int],
                    token_cost: Callable[[int], int]) -> list[int]:
    """Messages the target picks at b, oldest first.

    `live` lists, in order, the messages 0..i not yet gone that may match (all of them, or those
    passing the selector's prefilter). keep_last N spares the N most recent live
    matches (the trigger message and protected ones count among them); until_visible takes picks
    oldest first only while visible tokens exceed the target, each pick saving token_cost(j); with
    trigger_included the trigger (the newest pick) may be taken too, last.
    """
    picked = [j for j in live if matches(target.selector, j, b)]
    if target.keep_last is not None:
        keep = target.keep_last.value
        picked = picked[: max(len(picked) - keep, 0)]
    picked = [j for j in picked if not b.protected(j, trigger=not target.trigger_included)]
    if target.until_visible is None:
        return picked
    goal, visible, chosen = target.until_visible.value, b.visible_tokens, []
    for j in picked:
        if visible <= goal:
            break
        chosen.append(j)
        visible -= token_cost(j)
    return chosen
