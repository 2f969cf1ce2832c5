"""AST -> canonical text, and the canonical hash used for de-duplication.

The canonical form is one statement per line, single spaces, plural units, JSON-quoted strings,
parentheses around every nested and/or/not group, and no comments; parse(format_policy(a)) == a.
"""
from __future__ import annotations

import hashlib
import json

from policy_dsl import nodes as n

_SINGULAR = {"tool_calls": "tool_call", "turns": "turn", "tool_responses": "tool_response"}


def format_policy(policy: n.Policy) -> str:
    """The canonical text of a policy (ends with a newline)."""
    lines = [f"mode {policy.mode}"] + (["calls include user_observations"] if policy.user_observations else [])
    lines += ["calls include controller_prompts"] if policy.controller_prompts else []
    lines += [f"on {format_trigger(r.trigger)}: {format_action(r.action)}" for r in policy.rules]
    if policy.mode == "kv":
        lines.append(f"reposition {format_reposition(policy.reposition)}")
    return "\n".join(lines) + "\n"


def canonical_hash(policy: n.Policy) -> str:
    """Hex SHA-256 of the canonical text: equal policies (up to layout and comments) share it."""
    return hashlib.sha256(format_policy(policy).encode("utf-8")).hexdigest()


def format_num(num: n.Num) -> str:
    if num.lo is None or num.hi is None:
        return str(num.value)
    return f"{num.value} in {num.lo}..{num.hi}"


def format_trigger(trigger: n.Trigger, nested: bool = False) -> str:
    if isinstance(trigger, (n.AnyOf, n.AllOf)):
        word = " or " if isinstance(trigger, n.AnyOf) else " and "
        text = word.join(format_trigger(p, nested=True) for p in trigger.parts)
        return f"({text})" if nested else text
    if isinstance(trigger, n.Every):
        if trigger.n == n.Num(1):
            return f"each {_SINGULAR[trigger.unit]}"
        return f"every {format_num(trigger.n)} {trigger.unit}"
    if isinstance(trigger, n.After):
        then = "" if trigger.then is None else f" then every {format_num(trigger.then)}"
        return f"after {format_num(trigger.n)} {trigger.unit}{then}"
    if isinstance(trigger, n.VisibleToolResponses):
        return f"visible_tool_responses >= {format_num(trigger.threshold)}"
    if isinstance(trigger, n.TokensAbove):
        return f"{trigger.measure}_tokens > {format_num(trigger.threshold)}"
    return "drop_context"


def format_action(action: n.Action) -> str:
    if isinstance(action, n.Drop):
        return f"drop {format_target(action.target)}"
    if isinstance(action, n.Omit):
        return f"omit {format_target(action.target)}"
    if isinstance(action, n.Remove):
        return f"remove {format_target(action.target)}"
    if isinstance(action, n.Cut):
        return f"cut {action.side} {json.dumps(action.marker)} from {format_target(action.target)}"
    return f"summarize {format_target(action.target)} within {format_num(action.budget)} tokens"


def format_target(target: n.Target) -> str:
    if isinstance(target, n.Thinking):
        return "thinking" if target.selector is None else f"thinking where {format_selector(target.selector)}"
    text = format_selector(target.selector)
    if target.keep_last is not None:
        text += f" keep last {format_num(target.keep_last)}"
    if target.until_visible is not None:
        text += f" until visible_tokens <= {format_num(target.until_visible)}"
    if target.trigger_included:
        text += " trigger included"
    return text


def format_selector(selector: n.Selector, nested: bool = False) -> str:
    if isinstance(selector, (n.And, n.Or)):
        word = " and " if isinstance(selector, n.And) else " or "
        text = word.join(format_selector(p, nested=True) for p in selector.parts)
        return f"({text})" if nested else text
    if isinstance(selector, n.Not):
        inner = format_selector(selector.part, nested=True)
        return f"not {inner}"
    if isinstance(selector, n.AllMessages):
        return "all"
    if isinstance(selector, n.Role):
        return f"role {selector.role}"
    if isinstance(selector, n.ToolName):
        return f"tool_name {json.dumps(selector.name)}"
    if isinstance(selector, n.Age):
        said = "" if selector.text is None else f" with {json.dumps(selector.text)}"
        return f"age {selector.op} {format_num(selector.n)} {selector.unit}{said}"
    if isinstance(selector, n.Idle):
        return f"idle {selector.op} {format_num(selector.n)} {selector.unit}"
    if isinstance(selector, n.Size):
        return f"tokens {selector.op} {format_num(selector.n)}"
    if isinstance(selector, n.Contains):
        return f"contains {json.dumps(selector.text)}"
    if isinstance(selector, n.Superseded):
        return "superseded"
    if isinstance(selector, n.Covered):
        whole = selector.share.value == 100 and selector.share.lo is None
        return "covered" if whole else f"covered >= {format_num(selector.share)} percent"
    if isinstance(selector, n.CallContains):
        return f"call contains {json.dumps(selector.text)}"
    if isinstance(selector, n.NextTurnContains):
        return f"next_turn contains {json.dumps(selector.text)}"
    if isinstance(selector, n.CallersOutside):
        return f"callers outside last {format_num(selector.n)}"
    return "requested"


def format_reposition(rule: n.RepositionRule) -> str:
    if isinstance(rule, n.RepositionEachDrop):
        return "after each drop"
    if isinstance(rule, n.RepositionEvery):
        return f"every {format_num(rule.n)} {rule.unit}"
    if isinstance(rule, n.RepositionAfter):
        then = "" if rule.then is None else f" then every {format_num(rule.then)}"
        return f"after {format_num(rule.n)} tool_calls{then}"
    if isinstance(rule, n.RepositionGap):
        return f"when gap > {format_num(rule.threshold)}"
    if isinstance(rule, n.RepositionPositions):
        return f"when positions > {format_num(rule.threshold)}"
    return "never"
