"""CachePolicy: a compiled policy that turns a message history into a Decision.

kv mode walks the history boundary by boundary from the start, firing rules on the state so far,
so the decision for a prefix is contained unchanged in the decision for any extension (one
documented exception: with `calls include controller_prompts`, a call's position threshold counts
the controller prompt after it, so a prefix that ends at that call, before its prompt, may lack
the call's reposition; no request ends there, as the prompt goes out with the call's results). Repositions
take effect only at the end of a tool batch (never with a tool message after them, as upstream
requires); one wanted inside a batch waits for its end.
text mode looks at the latest boundary only: its edits are applied by the harness at once, and the
next call sees the edited history.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from policy_dsl import nodes as n
from policy_dsl.counter import ApproxTokenCounter, TokenCounter
from policy_dsl.decision import OMITTED_PREFIX, SUMMARY_PREFIX, Decision, TextEdit
from policy_dsl.evaluate import Boundary, fires, matches, on_schedule, prefilter, select_messages
from policy_dsl.history import HistoryView, view_history
from policy_dsl.printer import format_policy
from policy_dsl.validator import validate, walk


@dataclass(frozen=True)
class CachePolicy:
    name: str
    ast: n.Policy
    source: str  # canonical text

    @property
    def mode(self) -> str:
        return self.ast.mode

    def decide(self, history: Sequence[Mapping[str, Any]], counter: TokenCounter | None = None) -> Decision:
        """The decision for `history` (OpenAI-format messages); raises HistoryError on malformed input."""
        counter = counter or ApproxTokenCounter()
        view = view_history(history, counter, self.ast.user_observations, reuse=_reads_reuse(self.ast))
        if self.ast.mode == "kv" and any(isinstance(rule.action, n.Cut) for rule in self.ast.rules):
            return _decide_cuts(self.ast, view, history, counter)
        if self.ast.mode == "kv":
            return _decide_kv(self.ast, view)
        return _decide_text(self.ast, view, history, counter)


@functools.lru_cache(maxsize=256)
def _reads_reuse(ast: n.Policy) -> bool:
    """Whether a selector of the policy asks how long messages have been idle (reuse facts cost time)."""
    return any(isinstance(node, n.Idle) for node in walk(ast))


def compile_policy(ast: n.Policy, name: str = "policy") -> CachePolicy:
    """Validate an AST and make it executable; raises PolicyError."""
    validate(ast, filename=name)
    return CachePolicy(name=name, ast=ast, source=format_policy(ast))


# ---- kv ------------------------------------------------------------------------------------------

def _decide_kv(policy: n.Policy, view: HistoryView) -> Decision:
    gone: set[int] = set()
    masks = [None if isinstance(r.action.target, n.Thinking) else prefilter(r.action.target.selector, view)
             for r in policy.rules]
    candidates: list[list[int]] = [[] for _ in policy.rules]  # per rule: live messages passing its prefilter
    history_tokens = visible = positions = drop_events = responses = 0
    drop_message: dict[str, list[int]] = {}
    reposition: list[int] = []
    thinking_drop = wanted = False
    for i in range(len(view)):
        t = view.tokens[i]
        history_tokens, visible, positions = history_tokens + t, visible + t, positions + t
        responses += view.roles[i] == "tool"
        for mask, live in zip(masks, candidates):
            if mask is None or mask[i]:
                live.append(i)
        b = Boundary(view, i, gone, visible, history_tokens, responses)
        dropped_here: list[int] = []
        for r, rule in enumerate(policy.rules):
            if not fires(rule.trigger, b):
                continue
            target = rule.action.target
            if isinstance(target, n.Thinking):
                thinking_drop = True
                continue
            candidates[r] = [j for j in candidates[r] if j not in gone]  # forget what other rules dropped
            picks = select_messages(target, b, candidates[r], lambda j: view.tokens[j])
            for j in picks:
                gone.add(j)
                b.visible_tokens -= view.tokens[j]
                b.visible_responses -= view.roles[j] == "tool"
            dropped_here += picks
        visible, responses = b.visible_tokens, b.visible_responses
        if dropped_here:
            drop_message[str(i)] = sorted(dropped_here)
            drop_events += 1
        wanted = wanted or _repositions(policy.reposition, view, i, bool(dropped_here), drop_events,
                                        positions + _prompt_tokens(policy, view, i), positions - visible)
        if wanted and view.batch_end[i]:
            reposition.append(i)
            positions, wanted = visible, False  # survivors now sit at 0..visible-1
    return Decision(drop_message=drop_message, reposition=reposition, thinking_drop=thinking_drop)


def _prompt_tokens(policy: n.Policy, view: HistoryView, i: int) -> int:
    """With `calls include controller_prompts`: the tokens of the controller prompt right after call
    end i. It goes out in the same request as the call's results, so the positions a threshold
    measures at i run to its end: the one decision that reads the message after its boundary."""
    if policy.controller_prompts and i + 1 < len(view) and view.controller_prompt[i + 1]:
        return view.tokens[i + 1]
    return 0


def _decide_cuts(policy: n.Policy, view: HistoryView, history: Sequence[Mapping[str, Any]],
                 counter: TokenCounter) -> Decision:
    """Cut rules, boundary by boundary as the drops are: a message's cut, once decided, stays.

    A rule picks among the messages not cut yet whose content holds its marker (and that its
    selector takes); the cut saves the tokens of the text it takes away.
    """
    kept: dict[int, tuple[int, int]] = {}
    masks = [prefilter(rule.action.target.selector, view) for rule in policy.rules]
    candidates: list[dict[int, tuple[int, int]]] = [{} for _ in policy.rules]  # per rule: cuttable -> kept span
    history_tokens = visible = responses = 0

    def saving(j: int, span: tuple[int, int]) -> int:
        shorter = {"role": view.roles[j], "content": view.texts[j][span[0]:span[1]]}
        return max(view.tokens[j] - counter.count(shorter), 0)

    for i in range(len(view)):
        history_tokens, visible = history_tokens + view.tokens[i], visible + view.tokens[i]
        responses += view.roles[i] == "tool"
        for rule, mask, live in zip(policy.rules, masks, candidates):
            span = _kept_span(rule.action, view.texts[i]) if mask is None or mask[i] else None
            if span is not None:
                live[i] = span
        b = Boundary(view, i, set(), visible, history_tokens, responses)   # a cut message stays visible
        for rule, live in zip(policy.rules, candidates):
            if not fires(rule.trigger, b):
                continue
            for j in [j for j in live if j in kept]:
                del live[j]   # cut by another rule
            for j in select_messages(rule.action.target, b, list(live), lambda j: saving(j, live[j])):
                kept[j] = live.pop(j)
                b.visible_tokens -= saving(j, kept[j])
        visible = b.visible_tokens
    return Decision(kept=kept, history=tuple(history) if kept else ())


def _kept_span(cut: n.Cut, text: str) -> tuple[int, int] | None:
    """The characters a cut keeps of `text` (the marker stays), or None where it takes nothing."""
    at = text.find(cut.marker)
    if at < 0:
        return None
    span = (0, at + len(cut.marker)) if cut.side == "after" else (at, len(text))
    return None if span == (0, len(text)) else span


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


# ---- text ----------------------------------------------------------------------------------------

def _decide_text(policy: n.Policy, view: HistoryView, history: Sequence[Mapping[str, Any]],
                 counter: TokenCounter) -> Decision:
    if len(view) == 0:
        return Decision()
    i = len(view) - 1
    total = sum(view.tokens)
    edited: set[int] = set()
    responses = sum(role == "tool" and not text.startswith(OMITTED_PREFIX) for role, text in zip(view.roles, view.texts))
    b = Boundary(view, i, edited, total, total, responses)
    edits: list[TextEdit] = []
    for rule in policy.rules:
        if not fires(rule.trigger, b):
            continue
        action = rule.action
        if isinstance(action.target, n.Thinking):
            edits += _strip_thinking(action.target, b)
        elif isinstance(action, n.Omit):
            edits += _omit(action.target, b, counter)
        elif isinstance(action, n.Remove):
            edits += _remove(action.target, b)
        else:
            edits += _summarize(action.target, action.budget.value, b)
        for e in edits:
            edited.update(range(e.start, e.end + 1))
    return Decision(text_edits=tuple(sorted(edits, key=lambda e: e.start)))


def _strip_thinking(target: n.Thinking, b: Boundary) -> list[TextEdit]:
    view = b.view
    return [
        TextEdit("strip_thinking", j, j)
        for j in range(b.i)
        if view.roles[j] == "assistant" and view.has_thinking[j] and j not in b.gone and not b.protected(j)
        and (target.selector is None or matches(target.selector, j, b))
    ]


def _placeholder(view: HistoryView, j: int) -> str:
    return f"{OMITTED_PREFIX}{view.roles[j]} message of {view.tokens[j]} tokens]"


def _omit(target: n.Messages, b: Boundary, counter: TokenCounter) -> list[TextEdit]:
    view = b.view
    live = [j for j in range(b.i + 1) if j not in b.gone and not view.texts[j].startswith(OMITTED_PREFIX)]

    def saving(j: int) -> int:
        return view.tokens[j] - counter.count({"role": view.roles[j], "content": _placeholder(view, j)})

    picks = select_messages(target, b, live, saving)
    for j in picks:
        b.visible_tokens -= saving(j)
        b.visible_responses -= view.roles[j] == "tool"
    return [TextEdit("omit", j, j, placeholder=_placeholder(view, j)) for j in picks]


def _remove(target: n.Messages, b: Boundary) -> list[TextEdit]:
    """Upstream's text_drop: the picked messages leave the text history altogether."""
    view = b.view
    live = [j for j in range(b.i + 1) if j not in b.gone]
    picks = select_messages(target, b, live, lambda j: view.tokens[j])
    for j in picks:
        b.visible_tokens -= view.tokens[j]
        b.visible_responses -= view.roles[j] == "tool"
    return [TextEdit("remove", j, j) for j in picks]


def _summarize(target: n.Messages, budget: int, b: Boundary) -> list[TextEdit]:
    view = b.view
    live = [j for j in range(b.i + 1) if j not in b.gone]
    picks = select_messages(target, b, live, lambda j: view.tokens[j])
    edits = []
    for start, end in _whole_groups(_runs(picks), view):
        already_summary = start == end and view.texts[start].startswith(SUMMARY_PREFIX)
        if already_summary and view.tokens[start] <= budget:
            continue
        edits.append(TextEdit("summarize", start, end, budget_tokens=budget))
        b.visible_tokens -= sum(view.tokens[start: end + 1]) - budget
    return edits


def _runs(picks: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for j in picks:
        if runs and runs[-1][1] == j - 1:
            runs[-1] = (runs[-1][0], j)
        else:
            runs.append((j, j))
    return runs


def _whole_groups(runs: list[tuple[int, int]], view: HistoryView) -> list[tuple[int, int]]:
    """Trim runs so a summary never separates an assistant message from its tool responses."""
    out = []
    for start, end in runs:
        while start <= end and view.roles[start] == "tool":
            start += 1
        while end >= start and end + 1 < len(view) and view.roles[end + 1] == "tool":
            end -= 1
        if start <= end:
            out.append((start, end))
    return out
