"""Semantic checks: numbers in range, names known, clauses that make sense together.

Every check raises a PolicyValidationError located at the offending node, so a policy written by
a model gets an answer it can act on.
"""
from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import Iterator

from policy_dsl import nodes as n
from policy_dsl.errors import PolicyValidationError, located
from policy_dsl.printer import format_reposition

TOKENS_MAX = 10_000_000
COUNT_MAX = 100_000

# (lowest, highest) accepted value of each numeric field, by node type and field name.
BOUNDS: dict[tuple[type, str], tuple[int, int]] = {
    (n.Every, "n"): (1, COUNT_MAX),
    (n.After, "n"): (1, COUNT_MAX),
    (n.After, "then"): (1, COUNT_MAX),
    (n.VisibleToolResponses, "threshold"): (1, COUNT_MAX),
    (n.CallersOutside, "n"): (1, COUNT_MAX),
    (n.TokensAbove, "threshold"): (1, TOKENS_MAX),
    (n.Age, "n"): (0, COUNT_MAX),
    (n.Idle, "n"): (0, COUNT_MAX),
    (n.Size, "n"): (0, TOKENS_MAX),
    (n.Covered, "share"): (1, 100),
    (n.Messages, "keep_last"): (0, COUNT_MAX),
    (n.Messages, "until_visible"): (0, TOKENS_MAX),
    (n.Summarize, "budget"): (16, TOKENS_MAX),
    (n.RepositionEvery, "n"): (1, COUNT_MAX),
    (n.RepositionAfter, "n"): (1, COUNT_MAX),
    (n.RepositionAfter, "then"): (1, COUNT_MAX),
    (n.RepositionGap, "threshold"): (1, TOKENS_MAX),
    (n.RepositionPositions, "threshold"): (1, TOKENS_MAX),
}
FIELD_WORDS = {
    "n": "count", "threshold": "token threshold", "keep_last": "keep last", "until_visible": "visible-token target",
    "budget": "summary budget", "then": "interval", "share": "covered share (percent)",
}


def validate(policy: n.Policy, filename: str = "<policy>") -> None:
    """Raise PolicyValidationError for the first problem found, in source order."""
    checker = _Checker(filename)
    checker.structure(policy)
    if policy.mode not in ("kv", "text"):
        raise checker.fail(f"unknown mode {policy.mode!r}; expected kv or text", policy)
    checker.numbers(policy)
    checker.names(policy)
    checker.calls(policy)
    if policy.mode == "kv":
        checker.kv(policy)
    else:
        checker.text(policy)
    checker.rules(policy)


def numbers_with_bounds(node: object, path: str = "") -> Iterator[tuple[str, n.Num, tuple[int, int], object]]:
    """Every Num below `node` with its stable path, its field bounds and its owner, in source order."""
    if isinstance(node, tuple):
        for i, item in enumerate(node):
            yield from numbers_with_bounds(item, f"{path}[{i}]")
        return
    if not is_dataclass(node) or isinstance(node, n.Num):
        return
    for f in fields(node):
        if f.name == "loc":
            continue
        value = getattr(node, f.name)
        child = f"{path}.{f.name}" if path else f.name
        if isinstance(value, n.Num):
            yield child, value, BOUNDS[(type(node), f.name)], node
        else:
            yield from numbers_with_bounds(value, child)


class _Checker:
    def __init__(self, filename: str) -> None:
        self.filename = filename

    def fail(self, message: str, node: object) -> PolicyValidationError:
        return located(PolicyValidationError, message, getattr(node, "loc", None), self.filename)  # type: ignore[return-value]

    def structure(self, policy: object) -> None:
        """Node types in their slots: ASTs built by program (mutation, crossover) may mix them up."""
        expect(self, policy, n.Policy, "a policy")
        if not isinstance(policy.rules, tuple):
            raise self.fail("rules must be a tuple of Rule", policy)
        for rule in policy.rules:
            expect(self, rule, n.Rule, "a rule")
            self.trigger_structure(rule.trigger)
            expect(self, rule.action, (n.Drop, n.Omit, n.Remove, n.Summarize, n.Cut),
                   "an action (drop, omit, remove, summarize, cut)")
            target = rule.action.target
            expect(self, target, (n.Messages, n.Thinking), "a target (messages or thinking)")
            if target.selector is not None:
                self.selector_structure(target.selector)
        expect(self, policy.reposition, (n.RepositionNever, n.RepositionEachDrop, n.RepositionEvery,
                                         n.RepositionAfter, n.RepositionGap, n.RepositionPositions),
               "a reposition rule")
        for node in walk(policy):
            for (kind, name) in BOUNDS:
                value = getattr(node, name, None) if type(node) is kind else None
                if value is not None:
                    expect(self, value, n.Num, f"a number for {FIELD_WORDS[name]}")

    def trigger_structure(self, trigger: object) -> None:
        expect(self, trigger, (n.Every, n.After, n.TokensAbove, n.VisibleToolResponses, n.DropContextCalled,
                               n.AllOf, n.AnyOf), "a trigger")
        for part in getattr(trigger, "parts", ()):
            self.trigger_structure(part)

    def selector_structure(self, selector: object) -> None:
        expect(self, selector, (n.AllMessages, n.Role, n.ToolName, n.Age, n.Idle, n.Size, n.Contains, n.NextTurnContains,
                                n.Requested, n.Superseded, n.Covered, n.CallContains, n.CallersOutside, n.Not, n.And,
                                n.Or), "a selector")
        for part in getattr(selector, "parts", ()) or ((selector.part,) if isinstance(selector, n.Not) else ()):
            self.selector_structure(part)

    def numbers(self, policy: n.Policy) -> None:
        for path, num, (low, high), owner in numbers_with_bounds(policy):
            what = FIELD_WORDS.get(path.rsplit(".", 1)[-1], "number")
            where = num.loc or getattr(owner, "loc", None)
            if not isinstance(num.value, int) or isinstance(num.value, bool):
                raise located(PolicyValidationError, f"{what} must be an integer", where, self.filename)
            if not low <= num.value <= high:
                raise located(PolicyValidationError, f"{what} {num.value} is out of range; expected {low}..{high}",
                              where, self.filename)
            if (num.lo is None) != (num.hi is None):
                raise located(PolicyValidationError, f"{what} range needs both ends", where, self.filename)
            if num.lo is not None and num.hi is not None:
                if not low <= num.lo <= num.hi <= high:
                    raise located(PolicyValidationError,
                                  f"{what} range {num.lo}..{num.hi} is invalid; expected lo <= hi within {low}..{high}",
                                  where, self.filename)
                if not num.lo <= num.value <= num.hi:
                    raise located(PolicyValidationError,
                                  f"{what} {num.value} is outside its range {num.lo}..{num.hi}", where, self.filename)

    def names(self, policy: n.Policy) -> None:
        for node in walk(policy):
            if isinstance(node, (n.Every, n.After, n.Age, n.Idle)) and node.unit not in n.COUNT_UNITS:
                raise self.fail(f"unknown unit {node.unit!r}; expected one of {', '.join(n.COUNT_UNITS)}", node)
            if isinstance(node, n.RepositionEvery) and node.unit not in n.REPOSITION_UNITS:
                raise self.fail(f"unknown unit {node.unit!r}; expected drops or tool_calls", node)
            if isinstance(node, n.Age) and node.text is not None and node.unit != "turns":
                raise self.fail(f"age ... with a text counts turns (the agent's messages), not {node.unit}", node)
            if isinstance(node, (n.Age, n.Idle, n.Size)) and node.op not in n.COMPARISONS:
                raise self.fail(f"unknown comparison {node.op!r}; expected >, >=, < or <=", node)
            if isinstance(node, n.Role) and node.role not in n.ROLES:
                raise self.fail(f"unknown role {node.role!r}; expected one of {', '.join(n.ROLES)}", node)
            if isinstance(node, (n.AnyOf, n.AllOf, n.And, n.Or)) and len(node.parts) < 2:
                raise self.fail("and/or needs at least two parts", node)
            if isinstance(node, n.Cut) and node.side not in n.CUT_SIDES:
                raise self.fail(f"unknown cut side {node.side!r}; expected after or before", node)
            if isinstance(node, (n.Contains, n.NextTurnContains, n.CallContains, n.ToolName, n.Cut)):
                text = getattr(node, {n.ToolName: "name", n.Cut: "marker"}.get(type(node), "text"))
                if not isinstance(text, str) or not 1 <= len(text) <= 256:
                    raise self.fail("pattern must be 1..256 characters", node)
            if isinstance(node, n.TokensAbove) and node.measure not in ("visible", "history"):
                raise self.fail(f"unknown measure {node.measure!r}; expected visible or history", node)

    def calls(self, policy: n.Policy) -> None:
        """`calls include ...` lines: flags, and controller prompts only where a position threshold reads them."""
        for name in ("user_observations", "controller_prompts"):
            if not isinstance(getattr(policy, name), bool):
                raise self.fail(f"{name} must be True or False", policy)
        if not policy.controller_prompts or isinstance(policy.reposition, n.RepositionPositions):
            return
        has = ("mode text never repositions" if policy.mode == "text"
               else f"this policy has `reposition {format_reposition(policy.reposition)}`")
        raise located(PolicyValidationError, "calls include controller_prompts: a call's controller prompt counts "
                      "toward `reposition when positions > T` only (upstream's prompt_end_message_ids beside "
                      f"reposition_trigger_tokens); expected that reposition rule, but {has}",
                      policy.controller_prompts_loc or policy.loc, self.filename)

    def kv(self, policy: n.Policy) -> None:
        self.cuts(policy)
        thinking_rule, message_rule = None, None
        for rule in policy.rules:
            action = rule.action
            if isinstance(action, n.Cut):
                continue
            if not isinstance(action, n.Drop):
                verb = {n.Omit: "omit", n.Remove: "remove"}.get(type(action), "summarize")
                raise self.fail(f"{verb} needs mode text; mode kv can only drop", action)
            if isinstance(action.target, n.Thinking):
                if action.target.selector is not None:
                    raise self.fail("in mode kv thinking is dropped for all assistant messages "
                                    "(the API's thinking_drop rule); remove 'where ...'", action.target)
                thinking_rule = thinking_rule or rule
            else:
                message_rule = message_rule or rule
            if thinking_rule and message_rule:
                later = max(thinking_rule, message_rule, key=policy.rules.index)
                raise self.fail("thinking drops cannot be combined with message drops in mode kv "
                                "(the API takes drop_rule or drop_message, not both)", later)
        if thinking_rule and not isinstance(policy.reposition, n.RepositionNever):
            raise self.fail("reposition needs message drops; this policy only drops thinking", policy.reposition)

    def cuts(self, policy: n.Policy) -> None:
        """Cut rules send keep_text_drop, which takes the place of drop_message and hides the cut
        text after the last message only: no drops beside them, and no gap for a reposition."""
        cuts = [rule for rule in policy.rules if isinstance(rule.action, n.Cut)]
        if not cuts:
            return
        for rule in cuts:
            if isinstance(rule.action.target, n.Thinking):
                raise self.fail("cut takes messages; use 'drop thinking' for reasoning", rule.action.target)
        others = [rule for rule in policy.rules if not isinstance(rule.action, n.Cut)]
        if others:
            raise self.fail("cut rules cannot be combined with drop rules in mode kv (a cut is the API's "
                            "keep_text_drop, which takes the place of drop_message)",
                            max(others[0], cuts[0], key=policy.rules.index))
        if not isinstance(policy.reposition, n.RepositionNever):
            raise self.fail("reposition needs message drops; a cut leaves attention after the last message only, "
                            "so there is no gap to close", policy.reposition)

    def text(self, policy: n.Policy) -> None:
        if not isinstance(policy.reposition, n.RepositionNever):
            raise self.fail("reposition needs mode kv; mode text rewrites the history instead", policy.reposition)
        for rule in policy.rules:
            action = rule.action
            if isinstance(action, (n.Drop, n.Cut)):
                verb = "drop" if isinstance(action, n.Drop) else "cut"
                raise self.fail(f"{verb} needs mode kv; mode text can omit, remove or summarize", action)
            target = action.target
            if isinstance(action, n.Summarize) and isinstance(target, n.Thinking):
                raise self.fail("summarize takes messages; use 'omit thinking' to strip reasoning", target)
            if isinstance(action, n.Remove) and isinstance(target, n.Thinking):
                raise self.fail("remove takes messages; use 'omit thinking' to strip reasoning", target)
            if isinstance(action, n.Summarize) and target.until_visible is not None:
                raise self.fail("summarize cannot take 'until visible_tokens'; select the messages to summarize",
                                target)

    def trigger_included(self, action: n.Action) -> None:
        """`trigger included` lets a drop down to a target take its trigger too (upstream's drop_target_tokens)."""
        target = action.target
        if not isinstance(target, n.Messages) or target.trigger_included is False:
            return
        if target.trigger_included is not True:
            raise self.fail("trigger_included must be True or False", target)
        if not isinstance(action, n.Drop):
            verb = {n.Omit: "omit", n.Remove: "remove", n.Cut: "cut"}.get(type(action), "summarize")
            raise self.fail(f"{verb} cannot take 'trigger included'; only drop (mode kv) may drop its trigger",
                            target)
        if target.until_visible is None:
            raise self.fail("'trigger included' goes with 'until visible_tokens <= T' (drop oldest first down to "
                            "T, the trigger last); add the until clause", target)

    def rules(self, policy: n.Policy) -> None:
        seen: dict[n.Rule, n.Rule] = {}
        for rule in policy.rules:
            if rule in seen:
                first = seen[rule].loc
                where = f" (same as line {first.line})" if first else ""
                raise self.fail(f"duplicate rule{where}", rule)
            seen[rule] = rule
            self.trigger_included(rule.action)
            uses_requested = any(isinstance(x, n.Requested) for x in walk(rule.action))
            if uses_requested and not any(isinstance(x, n.DropContextCalled) for x in walk(rule.trigger)):
                raise self.fail("'requested' selects the ids of a drop_context call; "
                                "the rule's trigger must include drop_context", rule.action)


def expect(checker: _Checker, node: object, kinds: type | tuple[type, ...], what: str) -> None:
    if not isinstance(node, kinds):
        raise checker.fail(f"expected {what}, got {type(node).__name__}", node)


def walk(node: object) -> Iterator[object]:
    """Every AST node below and including `node` (depth is bounded by the parser's nesting limit)."""
    if isinstance(node, tuple):
        for item in node:
            yield from walk(item)
        return
    if not is_dataclass(node):
        return
    yield node
    for f in fields(node):
        if f.name != "loc":
            yield from walk(getattr(node, f.name))
