"""Random policies drawn from the whole language: the IID-sampling baseline of a policy search.

A search is only worth its budget if it beats drawing candidates independently at random from
the same language (Gideoni, Risi, Gal 2026 find such sampling competitive with code evolution).
`sample_policy` is that draw: every construct of the language can appear, in small combinations
(1-3 rules, nesting at most two levels deep), with no knowledge taken from the built-in policies.

Policies are built so that the validator's rules hold by construction (`requested` only under a
`drop_context` trigger, thinking drops and cuts alone in their policy, repositions only beside
message drops, controller prompts only beside a position threshold); the rare draw the validator
still refuses (a rule drawn twice) is drawn again. Numbers are drawn log-uniformly within the
validator's bounds (`BOUNDS`): uniformly on a linear scale, nearly every count would be in the
tens of thousands and every policy inert, where a log scale gives each order of magnitude the
same chance. Deterministic for a given `random.Random` state.
"""
from __future__ import annotations

import math
import random
from typing import Callable

from policy_dsl import nodes as n
from policy_dsl.errors import PolicyValidationError
from policy_dsl.validator import BOUNDS, validate, walk

MAX_DRAWS = 50          # draws of one policy before giving up (a refused draw is rare: see draw_policy)
RANGE_SHARE = 0.25      # numbers written tunable, `v in lo..hi`
TOOLS = ("search", "get_document", "bash", "open")
PHRASES = ("error", "Found", "passed", "Traceback", "is not relevant")
CALLS = ("cat ", "grep ", "pytest", "ls", "sed -n")  # what a call asks: commands, paths
MARKERS = ("\n", "Traceback", "Found", "error")
KV_SHAPES = (("messages", 8), ("thinking", 1), ("cut", 1))  # what a kv policy's rules do, with weights


def sample_policy(rng: random.Random, mode: str | None = None) -> n.Policy:
    """A random valid policy of `mode` ("kv", "text", or None: kv three times in four, as the API's
    cache operations are what a search is for, text the context-engineering baselines)."""
    return draw_policy(rng, mode)[0]


def draw_policy(rng: random.Random, mode: str | None = None) -> tuple[n.Policy, int]:
    """A random valid policy and the number of draws it took (1 unless the validator refused one)."""
    mode = mode or rng.choice(("kv", "kv", "kv", "text"))
    if mode not in ("kv", "text"):
        raise ValueError(f"unknown mode {mode!r}; expected kv or text")
    for draws in range(1, MAX_DRAWS + 1):
        policy = _kv_policy(rng) if mode == "kv" else _text_policy(rng)
        try:
            validate(policy)
        except PolicyValidationError:
            continue
        return policy, draws
    raise RuntimeError(f"no valid {mode} policy in {MAX_DRAWS} draws")  # a bug of this module, not bad luck


# ---- policies and rules --------------------------------------------------------------------------

def _kv_policy(rng: random.Random) -> n.Policy:
    shape = rng.choices([s for s, _ in KV_SHAPES], [w for _, w in KV_SHAPES])[0]
    make: Callable[[n.Trigger], n.Action] = {
        "messages": lambda trigger: n.Drop(_messages(rng, trigger, kv=True)),
        "thinking": lambda trigger: n.Drop(n.Thinking()),  # kv drops all thinking (the API's thinking_drop)
        "cut": lambda trigger: n.Cut(rng.choice(n.CUT_SIDES), rng.choice(MARKERS), _messages(rng, trigger)),
    }[shape]
    reposition = _reposition(rng) if shape == "messages" else n.RepositionNever()
    prompts = isinstance(reposition, n.RepositionPositions) and rng.random() < 0.5
    return n.Policy("kv", _rules(rng, make), reposition, user_observations=rng.random() < 0.25,
                    controller_prompts=prompts)


def _text_policy(rng: random.Random) -> n.Policy:
    def make(trigger: n.Trigger) -> n.Action:
        kind = rng.choice(("omit", "omit thinking", "remove", "summarize"))
        if kind == "omit thinking":
            return n.Omit(n.Thinking(_selector(rng, _requests(trigger)) if rng.random() < 0.5 else None))
        if kind == "summarize":
            return n.Summarize(_messages(rng, trigger, until=False), _num(rng, n.Summarize, "budget"))
        return (n.Omit if kind == "omit" else n.Remove)(_messages(rng, trigger))
    return n.Policy("text", _rules(rng, make), user_observations=rng.random() < 0.25)


def _rules(rng: random.Random, make: Callable[[n.Trigger], n.Action]) -> tuple[n.Rule, ...]:
    count = rng.choices((1, 2, 3), (5, 3, 2))[0]
    rules = []
    for _ in range(count):
        trigger = _trigger(rng)
        rules.append(n.Rule(trigger, make(trigger)))
    return tuple(rules)


def _messages(rng: random.Random, trigger: n.Trigger, kv: bool = False, until: bool = True) -> n.Messages:
    """A message target; `trigger included` only where the validator takes it (a kv drop down to a target)."""
    keep = _num(rng, n.Messages, "keep_last") if rng.random() < 0.3 else None
    goal = _num(rng, n.Messages, "until_visible") if until and rng.random() < 0.25 else None
    included = kv and goal is not None and rng.random() < 0.5
    return n.Messages(_selector(rng, _requests(trigger)), keep, goal, included)


def _requests(trigger: n.Trigger) -> bool:
    """Whether a rule with this trigger may select `requested` (the ids of a drop_context call)."""
    return any(isinstance(node, n.DropContextCalled) for node in walk(trigger))


# ---- triggers ------------------------------------------------------------------------------------

def _trigger(rng: random.Random, depth: int = 0) -> n.Trigger:
    if depth < 2 and rng.random() < 0.25:
        parts = tuple(_trigger(rng, depth + 1) for _ in range(rng.choice((2, 2, 3))))
        return rng.choice((n.AllOf, n.AnyOf))(parts)
    kind = rng.choice(("each", "every", "after", "visible", "history", "responses", "drop_context"))
    unit = rng.choice(n.COUNT_UNITS)
    if kind == "each":
        return n.Every(n.Num(1), unit)
    if kind == "every":
        return n.Every(_num(rng, n.Every, "n"), unit)
    if kind == "after":
        then = _num(rng, n.After, "then") if rng.random() < 0.5 else None
        return n.After(_num(rng, n.After, "n"), unit, then)
    if kind in ("visible", "history"):
        return n.TokensAbove(kind, _num(rng, n.TokensAbove, "threshold"))  # type: ignore[arg-type]
    if kind == "responses":
        return n.VisibleToolResponses(_num(rng, n.VisibleToolResponses, "threshold"))
    return n.DropContextCalled()


# ---- selectors -----------------------------------------------------------------------------------

def _selector(rng: random.Random, requests: bool, depth: int = 0) -> n.Selector:
    """A selector; under a drop_context trigger, half the time the ids it asked for."""
    if requests and depth == 0 and rng.random() < 0.5:
        return n.Requested()
    r = rng.random()
    if depth < 2 and r < 0.3:
        parts = tuple(_selector(rng, requests, depth + 1) for _ in range(rng.choice((2, 2, 3))))
        return rng.choice((n.And, n.Or))(parts)
    if depth < 2 and r < 0.4:
        return n.Not(_selector(rng, requests, depth + 1))
    return _selector_atom(rng, requests)


def _selector_atom(rng: random.Random, requests: bool) -> n.Selector:
    kinds = ["all", "role", "tool_name", "age", "idle", "tokens", "contains", "next_turn", "superseded", "covered",
             "call", "callers"]
    kind = rng.choice(kinds + ["requested"] * requests)
    if kind == "all":
        return n.AllMessages()
    if kind == "role":
        return n.Role(rng.choice(n.ROLES))
    if kind == "tool_name":
        return n.ToolName(rng.choice(TOOLS))
    if kind == "age":
        unit = rng.choice(n.COUNT_UNITS)
        said = rng.choice(PHRASES) if unit == "turns" and rng.random() < 0.4 else None
        return n.Age(rng.choice(n.COMPARISONS), _num(rng, n.Age, "n"), unit, said)
    if kind == "idle":
        return n.Idle(rng.choice(n.COMPARISONS), _num(rng, n.Idle, "n"), rng.choice(n.COUNT_UNITS))
    if kind == "tokens":
        return n.Size(rng.choice(n.COMPARISONS), _num(rng, n.Size, "n"))
    if kind == "contains":
        return n.Contains(rng.choice(PHRASES))
    if kind == "next_turn":
        return n.NextTurnContains(rng.choice(PHRASES))
    if kind == "superseded":
        return n.Superseded()
    if kind == "covered":  # `covered` (all of it) is a construct of its own, as `each U` is
        return n.Covered(n.Num(100) if rng.random() < 0.3 else _num(rng, n.Covered, "share"))
    if kind == "call":
        return n.CallContains(rng.choice(CALLS))
    if kind == "callers":
        return n.CallersOutside(_num(rng, n.CallersOutside, "n"))
    return n.Requested()


# ---- reposition and numbers ----------------------------------------------------------------------

def _reposition(rng: random.Random) -> n.RepositionRule:
    kind = rng.choice(("never", "each", "every", "after", "gap", "positions"))
    if kind == "never":
        return n.RepositionNever()
    if kind == "each":
        return n.RepositionEachDrop()
    if kind == "every":
        return n.RepositionEvery(_num(rng, n.RepositionEvery, "n"), rng.choice(n.REPOSITION_UNITS))
    if kind == "after":
        then = _num(rng, n.RepositionAfter, "then") if rng.random() < 0.5 else None
        return n.RepositionAfter(_num(rng, n.RepositionAfter, "n"), then)
    if kind == "gap":
        return n.RepositionGap(_num(rng, n.RepositionGap, "threshold"))
    return n.RepositionPositions(_num(rng, n.RepositionPositions, "threshold"))


def _num(rng: random.Random, owner: type, name: str) -> n.Num:
    """A number of `owner.name` within the validator's bounds, log-uniform; a quarter get a tunable range."""
    low, high = BOUNDS[(owner, name)]
    value = _log_uniform(rng, low, high)
    if rng.random() >= RANGE_SHARE:
        return n.Num(value)
    factor = rng.choice((2, 4))
    return n.Num(value, max(low, value // factor), min(high, max(value + 1, value * factor)))


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    """An integer in low..high whose offset from `low` (plus one) is log-uniform: each decade as likely."""
    offset = int(math.exp(rng.uniform(0.0, math.log(high - low + 1)))) - 1
    return min(high, low + max(0, offset))
