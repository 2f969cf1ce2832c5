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
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from policy_dsl import nodes as n
from policy_dsl.counter import ApproxTokenCounter, TokenCounter
from policy_dsl.decision import OMITTED_PREFIX, SUMMARY_PREFIX, Decision, TextEdit
from policy_dsl.evaluate import Boundary, fires, matches, prefilter, select_messages
from policy_dsl.history import HistoryView, view_history
from policy_dsl.kv_walk import WalkCache
from policy_dsl.printer import format_policy
from policy_dsl.validator import validate, walk

DEFAULT_COUNTER = ApproxTokenCounter()  # the counter of a decision asked without one


@dataclass(frozen=True)
class CachePolicy:
    name: str
    ast: n.Policy
    source: str  # canonical text
    # kv walks of recent histories, so that a history extending one decided before (the next request
    # of a conversation) walks only its new boundaries; each policy object has its own (not an
    # argument: `dataclasses.replace` with another AST gets a fresh one)
    _walks: WalkCache = field(default_factory=WalkCache, init=False, compare=False, repr=False)

    @property
    def mode(self) -> str:
        return self.ast.mode

    def decide(self, history: Sequence[Mapping[str, Any]], counter: TokenCounter | None = None) -> Decision:
        """The decision for `history` (OpenAI-format messages); raises HistoryError on malformed input."""
        counter = counter or DEFAULT_COUNTER  # one object, so that walks resume without a counter too
        view = view_history(history, counter, self.ast.user_observations, reuse=_reads(self.ast, n.Idle),
                            coverage=_reads(self.ast, n.Covered))
        if self.ast.mode == "kv" and any(isinstance(rule.action, n.Cut) for rule in self.ast.rules):
            return _decide_cuts(self.ast, view, history, counter)
        if self.ast.mode == "kv":
            return self._walks.walk(self.ast, view, history, counter).decision()
        return _decide_text(self.ast, view, history, counter)


@functools.lru_cache(maxsize=256)
def _reads(ast: n.Policy, kind: type) -> bool:
    """Whether a selector of the policy is of `kind` (`idle` and `covered` read facts that cost time)."""
    return any(isinstance(node, kind) for node in walk(ast))


def compile_policy(ast: n.Policy, name: str = "policy") -> CachePolicy:
    """Validate an AST and make it executable; raises PolicyError."""
    validate(ast, filename=name)
    return CachePolicy(name=name, ast=ast, source=format_policy(ast))


# ---- kv ------------------------------------------------------------------------------------------

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
