"""The kv decision as a walk over message boundaries, and a cache that lets a walk go on.

`KvWalk` decides boundary after boundary from the start of the history, firing rules on the state
so far; each boundary reads facts of messages 0..i only, so the state after a prefix is the state
any extension of it has there. `WalkCache` keeps the walks of recent histories: the next request of
a conversation (the same messages and a few new ones) walks only its new boundaries, which makes a
policy's decisions over a conversation linear in its length instead of quadratic.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

from policy_dsl import nodes as n
from policy_dsl.counter import TokenCounter
from policy_dsl.decision import Decision
from policy_dsl.evaluate import Boundary, fires, on_schedule, prefilter, select_messages
from policy_dsl.history import HistoryView

WALKS_KEPT = 64  # walks remembered per policy: enough for the conversations a proxy serves at once


@dataclass
class KvWalk:
    """The kv decision walked up to a boundary: everything the next boundary reads of the ones before.

    A walk over a history can go on over any extension of it: each boundary reads facts of messages
    0..i only, so the state after a prefix is the state the longer history has there (`WalkCache`).
    """

    rules: int
    gone: set[int] = field(default_factory=set)
    candidates: list[list[int]] = field(default_factory=list)  # per rule: live messages passing its prefilter
    history_tokens: int = 0
    visible: int = 0
    positions: int = 0
    drop_events: int = 0
    responses: int = 0
    drop_message: dict[str, list[int]] = field(default_factory=dict)
    reposition: list[int] = field(default_factory=list)
    thinking_drop: bool = False
    wanted: bool = False
    walked: int = 0  # boundaries 0..walked-1 are decided

    def __post_init__(self) -> None:
        self.candidates = self.candidates or [[] for _ in range(self.rules)]

    def copy(self) -> KvWalk:
        return replace(self, gone=set(self.gone), candidates=[list(c) for c in self.candidates],
                       drop_message={k: list(v) for k, v in self.drop_message.items()},
                       reposition=list(self.reposition))

    def decision(self) -> Decision:
        return Decision(drop_message=dict(self.drop_message), reposition=list(self.reposition),
                        thinking_drop=self.thinking_drop)

    def advance(self, policy: n.Policy, view: HistoryView) -> None:
        """Decide the boundaries from `walked` to the end of `view`."""
        masks = [None if isinstance(r.action.target, n.Thinking) else prefilter(r.action.target.selector, view)
                 for r in policy.rules]
        for i in range(self.walked, len(view)):
            self._boundary(policy, view, masks, i)
        self.walked = len(view)

    def _boundary(self, policy: n.Policy, view: HistoryView, masks: list[list[bool] | None], i: int) -> None:
        t, gone = view.tokens[i], self.gone
        self.history_tokens, self.visible, self.positions = self.history_tokens + t, self.visible + t, self.positions + t
        self.responses += view.roles[i] == "tool"
        for mask, live in zip(masks, self.candidates):
            if mask is None or mask[i]:
                live.append(i)
        b = Boundary(view, i, gone, self.visible, self.history_tokens, self.responses)
        dropped_here: list[int] = []
        for r, rule in enumerate(policy.rules):
            if not fires(rule.trigger, b):
                continue
            target = rule.action.target
            if isinstance(target, n.Thinking):
                self.thinking_drop = True
                continue
            self.candidates[r] = [j for j in self.candidates[r] if j not in gone]  # forget what other rules dropped
            picks = select_messages(target, b, self.candidates[r], lambda j: view.tokens[j])
            for j in picks:
                gone.add(j)
                b.visible_tokens -= view.tokens[j]
                b.visible_responses -= view.roles[j] == "tool"
            dropped_here += picks
        self.visible, self.responses = b.visible_tokens, b.visible_responses
        if dropped_here:
            self.drop_message[str(i)] = sorted(dropped_here)
            self.drop_events += 1
        self.wanted = self.wanted or _repositions(policy.reposition, view, i, bool(dropped_here), self.drop_events,
                                                  self.positions + _prompt_tokens(policy, view, i),
                                                  self.positions - self.visible)
        if self.wanted and view.batch_end[i]:
            self.reposition.append(i)
            self.positions, self.wanted = self.visible, False  # survivors now sit at 0..visible-1


def _prompt_tokens(policy: n.Policy, view: HistoryView, i: int) -> int:
    """With `calls include controller_prompts`: the tokens of the controller prompt right after call
    end i. It goes out in the same request as the call's results, so the positions a threshold
    measures at i run to its end: the one decision that reads the message after its boundary."""
    if policy.controller_prompts and i + 1 < len(view) and view.controller_prompt[i + 1]:
        return view.tokens[i + 1]
    return 0


def _repositions(rule: n.RepositionRule, view: HistoryView, i: int, dropped: bool, drop_events: int,
                 positions: int, gap: int) -> bool:
    """Whether the rule asks to compact positions after message i (done at the end of i's tool batch).

    `positions` is the next free position; `gap` the positions freed by drops since the last compaction.
    Between compactions both only grow, so a threshold passed inside a batch still holds at its end.
    """
    if isinstance(rule, n.RepositionEachDrop):
        return dropped
    if isinstance(rule, n.RepositionEvery) and rule.unit == "drops":
        return dropped and drop_events % rule.n.value == 0
    if isinstance(rule, n.RepositionEvery):
        # Compacting with no gap would be a no-op that still costs a cache record.
        return view.batch_end[i] and view.tool_calls[i] % rule.n.value == 0 and gap > 0
    if isinstance(rule, n.RepositionAfter):
        # upstream's call schedule: it repositions even when nothing new was dropped
        return view.batch_end[i] and on_schedule(view.tool_calls[i], rule.n.value,
                                                 None if rule.then is None else rule.then.value)
    if isinstance(rule, n.RepositionGap):
        return gap > rule.threshold.value
    if isinstance(rule, n.RepositionPositions):
        return positions > rule.threshold.value and gap > 0
    return False


class WalkCache:
    """The walks of recent histories of one policy, by a digest of each history (and the counter).

    A history whose first m messages equal a remembered history of m messages resumes that walk. A
    policy reading the message after a boundary (`calls include controller_prompts`) is never
    resumed: its last boundary may change when the history grows. Safe to share between threads; a
    copy (a policy pickled for another process) starts empty, as the walks only save time.
    """

    def __init__(self, kept: int = WALKS_KEPT) -> None:
        self._walks: OrderedDict[tuple[int, int], tuple[TokenCounter, KvWalk]] = OrderedDict()
        self._kept = kept
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, int]:
        return {"kept": self._kept}

    def __setstate__(self, state: dict[str, int]) -> None:
        self.__init__(state["kept"])  # type: ignore[misc]

    def walk(self, policy: n.Policy, view: HistoryView, history: Sequence[Mapping[str, Any]],
             counter: TokenCounter) -> KvWalk:
        """The walk over all of `view`, resumed from the longest remembered prefix of `history`."""
        if policy.controller_prompts:
            walk = KvWalk(len(policy.rules))
            walk.advance(policy, view)
            return walk
        digests = _prefix_digests(history)
        walk = self._resumable(digests, counter) or KvWalk(len(policy.rules))
        walk.advance(policy, view)
        if digests:
            with self._lock:
                self._walks[(len(digests), digests[-1])] = (counter, walk.copy())
                while len(self._walks) > self._kept:
                    self._walks.popitem(last=False)
        return walk

    def _resumable(self, digests: Sequence[int], counter: TokenCounter) -> KvWalk | None:
        with self._lock:
            for m in range(len(digests), 0, -1):
                found = self._walks.get((m, digests[m - 1]))
                if found is not None and found[0] is counter:
                    self._walks.move_to_end((m, digests[m - 1]))
                    return found[1].copy()
        return None


def _prefix_digests(history: Sequence[Mapping[str, Any]]) -> list[int]:
    """Per prefix 0..k, a digest of its messages (the whole message, every field)."""
    out, digest = [], 0
    for message in history:
        digest = hash((digest, json.dumps(message, sort_keys=True, default=str)))
        out.append(digest)
    return out
