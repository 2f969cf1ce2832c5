"""Upstream akvalgo's `AKVPolicy` options: our policies as its keyword arguments, and a reader of them.

    options = to_akvalgo(ast, filename="p.akvp")   # NotExpressible names the first construct it cannot map
    options.kwargs()                               # {"keep_tool_responses": 12, "mode": "kv_drop", ...}
    decision = decide_akvalgo(options, history, counter)   # what those options decide, as a Decision

The reader interprets the options as upstream documents them (docs/policy-dsl.md, "Upstream
akvalgo options"): with no drop trigger the window rolls on each new tool message (the (K+1)-th
drops the oldest visible one); drop triggers and repositions act only at the end of a tool batch
(a "call": the last tool message answering one assistant message); a scheduled reposition happens
even when nothing new was dropped; with no reposition option nothing is ever repositioned. Options
whose meaning upstream leaves open are refused by name rather than guessed.

The exporter maps a policy only where the reader decides exactly as our policy does on every
history, parallel tool batches included; everything else is refused with the reason.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping, Sequence

from policy_dsl import nodes as n
from policy_dsl.counter import ApproxTokenCounter, TokenCounter
from policy_dsl.decision import Decision
from policy_dsl.errors import Loc, PolicyError
from policy_dsl.history import HistoryView, view_history
from policy_dsl.printer import format_reposition, format_selector, format_target, format_trigger

MODES = ("kv_drop", "text_drop")
ROLLING_TARGETS = ("tool", "assistant", "both")
DROP_TRIGGERS = ("drop_after_call", "drop_trigger_tokens", "drop_trigger_responses")
TOKEN_OPTIONS = ("drop_trigger_tokens", "reposition_trigger_tokens", "drop_target_tokens")


class AkvalgoError(ValueError):
    """Options upstream would refuse, or that this reader does not interpret; the message names the option."""


class NotExpressible(PolicyError):
    """A policy construct with no exact akvalgo equivalent, located at that construct."""


@dataclass(frozen=True)
class AkvalgoOptions:
    """`AKVPolicy` keyword arguments (the token counter, an object, is passed to the reader instead)."""

    keep_tool_responses: int
    mode: str = "kv_drop"
    rolling_drop_target: str = "tool"
    reposition_after_call: int | None = None
    reposition_interval_calls: int | None = None
    reposition_trigger_tokens: int | None = None
    drop_after_call: int | None = None
    drop_interval_calls: int | None = None
    drop_trigger_tokens: int | None = None
    drop_trigger_responses: int | None = None
    drop_target_tokens: int | None = None

    def __post_init__(self) -> None:
        _check(self)

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> AkvalgoOptions:
        """Options from a keyword-argument mapping (e.g. exported JSON); AkvalgoError names a bad one."""
        known = {f.name for f in fields(cls)}
        for name in kwargs:
            if name == "token_counter":
                raise AkvalgoError("token_counter: a counter object, not an option value; pass it to the reader")
            if name not in known:
                raise AkvalgoError(f"{name}: not an AKVPolicy option; expected one of {', '.join(sorted(known))}")
        if "keep_tool_responses" not in kwargs:
            raise AkvalgoError("keep_tool_responses: required (an integer > 0)")
        return cls(**kwargs)

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments: the three basic ones always, the others when set."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        basic = ("keep_tool_responses", "mode", "rolling_drop_target")
        return {k: v for k, v in out.items() if k in basic or v is not None}

    @property
    def drop_trigger(self) -> str | None:
        return next((t for t in DROP_TRIGGERS if getattr(self, t) is not None), None)

    def needs_counter(self) -> bool:
        return any(getattr(self, t) is not None for t in TOKEN_OPTIONS)


def _check(o: AkvalgoOptions) -> None:
    """Upstream's documented constraints on the options."""
    for f in fields(o):
        value = getattr(o, f.name)
        if f.name in ("mode", "rolling_drop_target"):
            allowed = MODES if f.name == "mode" else ROLLING_TARGETS
            if value not in allowed:
                raise AkvalgoError(f"{f.name}: expected one of {', '.join(allowed)}, got {value!r}")
        elif value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise AkvalgoError(f"{f.name}: expected an integer > 0, got {value!r}")
    triggers = [t for t in DROP_TRIGGERS if getattr(o, t) is not None]
    if len(triggers) > 1:
        raise AkvalgoError(f"{triggers[1]}: mutually exclusive with {triggers[0]}")
    if o.drop_interval_calls is not None and o.drop_after_call is None:
        raise AkvalgoError("drop_interval_calls: needs drop_after_call")
    if triggers and (o.mode != "kv_drop" or o.rolling_drop_target != "tool"):
        raise AkvalgoError(f"{triggers[0]}: triggered drops need mode kv_drop and rolling_drop_target tool")
    repositions = [r for r in ("reposition_after_call", "reposition_interval_calls", "reposition_trigger_tokens")
                   if getattr(o, r) is not None]
    if repositions and o.mode != "kv_drop":
        raise AkvalgoError(f"{repositions[0]}: reposition needs mode kv_drop")


# ---- the reader ----------------------------------------------------------------------------------

def decide_akvalgo(options: AkvalgoOptions, history: Sequence[Mapping[str, Any]],
                   counter: TokenCounter | None = None) -> Decision:
    """What `options` decide for `history` (cumulative, like our kv policies); AkvalgoError when unsure."""
    _interpretable(options)
    if options.needs_counter() and counter is None:
        raise AkvalgoError(f"{next(t for t in TOKEN_OPTIONS if getattr(options, t) is not None)}: "
                           "token thresholds need a token_counter")
    view = view_history(history, counter or ApproxTokenCounter())
    gone: set[int] = set()
    live_tools: list[int] = []  # tool messages still visible, oldest first
    drop_message: dict[str, list[int]] = {}
    reposition: list[int] = []
    visible = positions = 0
    for i in range(len(view)):
        visible, positions = visible + view.tokens[i], positions + view.tokens[i]
        if view.roles[i] == "tool":
            live_tools.append(i)
        if _drop_fires(options, view, i, visible, len(live_tools)):
            picks, live_tools = live_tools[: -options.keep_tool_responses], live_tools[-options.keep_tool_responses:]
            gone.update(picks)
            visible -= sum(view.tokens[j] for j in picks)
            if picks:
                drop_message[str(i)] = picks
        if view.batch_end[i] and _reposition_fires(options, view.tool_calls[i], positions):
            reposition.append(i)
            positions = visible  # survivors now sit at 0..visible-1
    return Decision(drop_message=drop_message, reposition=reposition)


def _interpretable(o: AkvalgoOptions) -> None:
    """Refuse, by name, what upstream documents too loosely to decide the same for sure."""
    if o.mode != "kv_drop":
        raise AkvalgoError("mode: text_drop rewrites the text history; this reader decides kv_drop only")
    if o.rolling_drop_target != "tool":
        raise AkvalgoError(f"rolling_drop_target: {o.rolling_drop_target!r} is not interpreted by this reader "
                           "(upstream does not document which assistant messages a tool window rolls out)")
    if o.drop_target_tokens is not None:
        raise AkvalgoError("drop_target_tokens: not interpreted by this reader (upstream does not document how "
                           "it combines with keep_tool_responses)")


def _drop_fires(o: AkvalgoOptions, view: HistoryView, i: int, visible: int, live_tools: int) -> bool:
    """Rolling: every tool message beyond the window. Triggers: at a batch end, on their condition."""
    if o.drop_trigger is None:
        return view.roles[i] == "tool" and live_tools > o.keep_tool_responses
    if not view.batch_end[i]:
        return False
    if o.drop_after_call is not None:
        return _on_schedule(view.tool_calls[i], o.drop_after_call, o.drop_interval_calls)
    if o.drop_trigger_tokens is not None:
        return visible > o.drop_trigger_tokens
    return live_tools > o.drop_trigger_responses  # type: ignore[operator]


def _reposition_fires(o: AkvalgoOptions, call: int, positions: int) -> bool:
    """At the end of call number `call`: on the schedule (whether or not anything new was dropped), or
    when the next free position passes the threshold."""
    scheduled = (o.reposition_after_call is not None or o.reposition_interval_calls is not None) and \
        _on_schedule(call, o.reposition_after_call, o.reposition_interval_calls)
    over = o.reposition_trigger_tokens is not None and positions > o.reposition_trigger_tokens
    return scheduled or over


def _on_schedule(call: int, after: int | None, interval: int | None) -> bool:
    """Call `after`, then every `interval` calls after it; with no `after`, every `interval` calls."""
    if after is None:
        return interval is not None and call % interval == 0
    return call == after or (interval is not None and call > after and (call - after) % interval == 0)


# ---- the exporter ---------------------------------------------------------------------------------

def to_akvalgo(policy: n.Policy, filename: str = "<policy>") -> AkvalgoOptions:
    """The options that decide exactly as `policy`; NotExpressible at the first construct that has none."""
    def refuse(node: Any, construct: str, why: str) -> NotExpressible:
        loc = getattr(node, "loc", None) or Loc()
        return NotExpressible(f"{construct}: {why}", filename=filename, line=loc.line, column=loc.column)

    if policy.mode != "kv":
        raise refuse(policy, "mode text", "upstream's text_drop removes rolled-out text; this policy summarizes "
                     "or omits with placeholders, so akvalgo cannot decide the same")
    if not policy.rules:
        raise refuse(policy, "a policy with no rule", "it never drops, and AKVPolicy needs keep_tool_responses "
                     "> 0; send requests without a policy instead")
    if len(policy.rules) > 1:
        raise refuse(policy.rules[1], "a second rule", "AKVPolicy has one drop rule")
    rule = policy.rules[0]
    trigger = _trigger_options(rule.trigger, refuse)
    keep = _window(rule.action, refuse)
    options = AkvalgoOptions(keep_tool_responses=keep, **trigger)
    if not isinstance(policy.reposition, n.RepositionNever):
        raise _reposition_refusal(policy.reposition, options, refuse)
    return options


def _trigger_options(trigger: n.Trigger, refuse: Any) -> dict[str, int]:
    """The drop trigger: none (a rolling window), a call schedule, or a visible-token threshold."""
    text = format_trigger(trigger)
    if isinstance(trigger, n.Every) and trigger.unit == "tool_responses":
        if trigger.n.value == 1:
            return {}
        raise refuse(trigger, text, "upstream's window rolls on every tool response, not every "
                     f"{trigger.n.value}")
    if isinstance(trigger, n.Every) and trigger.unit == "tool_calls":
        return {"drop_after_call": trigger.n.value, "drop_interval_calls": trigger.n.value}
    if isinstance(trigger, n.After) and trigger.unit == "tool_calls":
        return {"drop_after_call": trigger.n.value}
    if isinstance(trigger, n.AllOf) and len(trigger.parts) == 2:
        batch = [p for p in trigger.parts if isinstance(p, n.Every) and p.unit == "tool_calls" and p.n.value == 1]
        tokens = [p for p in trigger.parts if isinstance(p, n.TokensAbove) and p.measure == "visible"]
        if batch and tokens:
            return {"drop_trigger_tokens": tokens[0].threshold.value}
    if isinstance(trigger, n.TokensAbove) and trigger.measure == "visible":
        raise refuse(trigger, text, "checked after every message; drop_trigger_tokens is checked at the end of "
                     "a tool batch (write `each tool_call and visible_tokens > T`)")
    raise refuse(trigger, text, "akvalgo drops on each tool response, on a tool-call schedule or above a "
                 "visible-token count at the end of a tool batch")


def _window(action: n.Action, refuse: Any) -> int:
    """keep_tool_responses: the action must drop tool responses beyond the last K (K >= 1), nothing else."""
    target = action.target
    if isinstance(target, n.Thinking):
        raise refuse(target, format_target(target), "akvalgo has no thinking drop")
    content = _first_contains(target.selector)
    if content is not None:
        raise refuse(content, format_selector(content), "a content-based selector; akvalgo options choose by "
                     "role and recency only, never by message content")
    if target.selector != n.Role("tool"):
        raise refuse(target.selector, format_selector(target.selector), "akvalgo rolls out tool responses "
                     "only (`role tool`)")
    if target.until_visible is not None:
        raise refuse(target.until_visible, "until visible_tokens", "upstream's drop_target_tokens may drop "
                     "the response that triggered it, which this policy never does")
    if target.keep_last is None or target.keep_last.value < 1:
        raise refuse(target, format_target(target), "AKVPolicy keeps keep_tool_responses > 0 tool responses; "
                     "write `keep last K` with K >= 1")
    return target.keep_last.value


def _first_contains(selector: n.Selector) -> n.Contains | None:
    if isinstance(selector, n.Contains):
        return selector
    parts = (selector.part,) if isinstance(selector, n.Not) else getattr(selector, "parts", ())
    return next((c for c in map(_first_contains, parts) if c is not None), None)


def _reposition_refusal(rule: n.RepositionRule, options: AkvalgoOptions, refuse: Any) -> NotExpressible:
    """Why a reposition rule of ours has no exact akvalgo option (every one but `never`, today)."""
    text = f"reposition {format_reposition(rule)}"
    after_drops = isinstance(rule, n.RepositionEachDrop) or (isinstance(rule, n.RepositionEvery)
                                                             and rule.unit == "drops")
    if after_drops:
        why = ("repositions right after a drop, inside a tool batch too; upstream repositions only at the end "
               "of a tool batch, on a call schedule or a position threshold")
        if options.drop_trigger is None:
            k = options.keep_tool_responses
            why += (f" (the nearest options, keep_tool_responses={k}, reposition_after_call={k + 1}, "
                    "reposition_interval_calls=1, decide the same only while every tool batch holds one call)")
        return refuse(rule, text, why)
    if isinstance(rule, n.RepositionEvery):
        return refuse(rule, text, "skips a scheduled reposition when no drop left a gap; upstream's "
                      "reposition_interval_calls repositions even when nothing new was dropped")
    if isinstance(rule, n.RepositionPositions):
        return refuse(rule, text, "checked after every message and only when a drop left a gap; "
                      "reposition_trigger_tokens is checked at the end of a tool batch")
    return refuse(rule, text, "no akvalgo option repositions on the size of the gap")
