"""The random sampler of the policy language, and the random proposer built on it."""
from __future__ import annotations

import dataclasses
import inspect
import json
import math
import random
from collections import defaultdict
from functools import lru_cache
from typing import Any, get_args

import pytest

from evolve.candidate import check_policy
from evolve.context import ProposerContext
from evolve.library import library_texts
from evolve.proposers import random_sampler
from evolve.proposers.random_sampler import RandomProposer
from policy_dsl import canonical_hash, compile_policy, format_policy, parse
from policy_dsl import nodes as n
from policy_dsl.sample import CALLS, draw_policy, sample_policy
from policy_dsl.validator import BOUNDS, numbers_with_bounds, walk

DRAWS = 2000


@lru_cache(maxsize=None)
def drawn(seed: int = 0) -> tuple[tuple[n.Policy, int], ...]:
    rng = random.Random(seed)
    return tuple(draw_policy(rng) for _ in range(DRAWS))


def policies(seed: int = 0) -> list[n.Policy]:
    return [policy for policy, _ in drawn(seed)]


def test_every_draw_is_valid_and_round_trips():
    for policy in policies():
        assert parse(format_policy(policy)) == policy, format_policy(policy)


def test_almost_every_draw_is_valid_at_the_first_try():
    tries = [count for _, count in drawn()]
    assert sum(count == 1 for count in tries) / len(tries) > 0.9


def node_classes() -> set[type]:
    """Every construct a policy can hold: the members of the AST's unions and every other node class."""
    unions = (n.Trigger, n.Selector, n.Target, n.Action, n.RepositionRule)
    members = {cls for union in unions for cls in get_args(union)}
    defined = {cls for _, cls in inspect.getmembers(n, inspect.isclass)
               if dataclasses.is_dataclass(cls) and cls.__module__ == n.__name__}
    return members | defined


def features(policy: n.Policy) -> set[Any]:
    """The node classes and the variants of a policy that a sampler of the language must reach."""
    found: set[Any] = {("mode", policy.mode), ("reposition", type(policy.reposition).__name__)}
    found |= {flag for flag in ("user_observations", "controller_prompts") if getattr(policy, flag)}
    for node in walk(policy):
        found.add(type(node))
        found |= {("tunable", type(node).__name__) for num in vars(node).values()
                  if isinstance(num, n.Num) and num.tunable}
        for name in ("unit", "op", "role", "measure", "side"):
            if hasattr(node, name):
                found.add((type(node).__name__, name, getattr(node, name)))
        found |= _variants(node, policy.mode)
    return found


def _variants(node: object, mode: str) -> set[Any]:
    out: set[Any] = set()
    if isinstance(node, n.Every):
        out.add("each" if node.n == n.Num(1) else "every N")
    if isinstance(node, (n.After, n.RepositionAfter)) and node.then is not None:
        out.add((type(node).__name__, "then"))
    if isinstance(node, n.Age) and node.text is not None:
        out.add("age with")
    if isinstance(node, n.Messages):
        out |= {name for name in ("keep_last", "until_visible", "trigger_included") if getattr(node, name)}
    if isinstance(node, n.Thinking):
        out.add(("thinking", mode, node.selector is not None))
    if isinstance(node, n.Covered):
        out.add("covered" if node.share == n.Num(100) else "covered >= P percent")
    if isinstance(node, n.CallContains):
        out.add(("call contains", node.text))
    return out


def test_every_construct_appears():
    seen = set().union(*(features(policy) for policy in policies()))
    assert node_classes() - seen == set()
    reposition = {cls.__name__ for cls in get_args(n.RepositionRule)}
    expected = {("mode", "kv"), ("mode", "text"), "user_observations", "controller_prompts", "each", "every N",
                ("After", "then"), ("RepositionAfter", "then"), "age with", "keep_last", "until_visible",
                "trigger_included", ("thinking", "kv", False), ("thinking", "text", False),
                ("thinking", "text", True), "covered", "covered >= P percent"}
    expected |= {("call contains", text) for text in CALLS}
    expected |= {("reposition", name) for name in reposition}
    expected |= {(kind, "unit", unit) for kind in ("Every", "After", "Age", "Idle") for unit in n.COUNT_UNITS}
    expected |= {("RepositionEvery", "unit", unit) for unit in n.REPOSITION_UNITS}
    expected |= {(kind, "op", op) for kind in ("Age", "Idle", "Size") for op in n.COMPARISONS}
    expected |= {("Role", "role", role) for role in n.ROLES}
    expected |= {("TokensAbove", "measure", m) for m in ("visible", "history")}
    expected |= {("Cut", "side", side) for side in n.CUT_SIDES}
    expected |= {("tunable", owner.__name__) for owner, _ in BOUNDS}
    assert expected - seen == set()


def test_numbers_spread_over_their_bounds():
    values: dict[tuple[type, str], list[int]] = defaultdict(list)
    for policy in policies():
        for path, num, _, owner in numbers_with_bounds(policy):
            if isinstance(owner, n.Every) and num == n.Num(1) or isinstance(owner, n.Covered) and num == n.Num(100):
                continue  # `each U` and `covered` (all of it): constructs of their own, not drawn numbers
            values[(type(owner), path.rsplit(".", 1)[-1])].append(num.value)
    assert set(values) == set(BOUNDS)
    for key, (low, high) in BOUNDS.items():
        seen, scale = values[key], math.log1p(high - low)
        assert min(seen) == low and max(seen) - low > 0.8 * (high - low), key  # both ends of the range
        below = sum(math.log1p(v - low) < scale / 2 for v in seen) / len(seen)
        assert 0.3 < below < 0.7, (key, below)  # each order of magnitude about as likely


def test_the_same_seed_draws_the_same_policies():
    again = random.Random(0)
    assert [sample_policy(again) for _ in range(200)] == policies()[:200]
    assert policies(1)[:200] != policies()[:200]


def test_a_mode_can_be_asked_for():
    rng = random.Random(3)
    assert {sample_policy(rng, "text").mode for _ in range(50)} == {"text"}
    assert {sample_policy(rng, "kv").mode for _ in range(50)} == {"kv"}
    with pytest.raises(ValueError):
        sample_policy(rng, "json")


def call(call_id: str, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def tool(call_id: str, name: str, content: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "name": name, "content": content}


def research_history() -> list[dict]:
    """A research agent: searches, a document it calls not relevant, a repeated search, a drop_context call."""
    return [
        {"role": "system", "content": "You are a research agent."},
        {"role": "user", "content": "Who founded the lab?"},
        {"role": "assistant", "content": "Searching.", "reasoning_content": "Start broad.",
         "tool_calls": [call("a", "search", {"q": "lab"}), call("b", "search", {"q": "founder"})]},
        tool("a", "search", "1. Lab history (doc-17)\n2. Annual report"),
        tool("b", "search", "1. Founders of labs"),
        {"role": "assistant", "content": "Opening doc-17.", "tool_calls": [call("c", "get_document", {"id": 17})]},
        tool("c", "get_document", "The lab was founded in 1952 by Ada Quill. " * 20),
        {"role": "assistant", "content": "Found: Ada Quill. The report is not relevant.",
         "reasoning_content": "Check once more.", "tool_calls": [call("d", "search", {"q": "lab"})]},
        tool("d", "search", "1. Lab history (doc-17)\n2. Annual report"),
        {"role": "assistant", "content": "Dropping old pages.",
         "tool_calls": [call("e", "drop_context", {"message_ids": [3, 4]})]},
        tool("e", "drop_context", "dropped"),
        {"role": "assistant", "content": "Ada Quill founded it in 1952."},
    ]


def coding_history() -> list[dict]:
    """A coding agent: failing tests, a fix, passing tests, and an observation sent back as user text."""
    return [
        {"role": "user", "content": "Fix the failing test."},
        {"role": "assistant", "content": None, "tool_calls": [call("t1", "bash", {"cmd": "pytest"})]},
        tool("t1", "bash", "Traceback (most recent call last):\n  error: assert 1 == 2\n1 failed"),
        {"role": "assistant", "content": "The error is in add().", "tool_calls": [call("o", "open", {"path": "m.py"})]},
        tool("o", "open", "def add(a, b):\n    return a - b\n"),
        {"role": "assistant", "content": "Editing add()."},
        {"role": "user", "content": "edit applied"},
        {"role": "assistant", "content": None, "tool_calls": [call("t2", "bash", {"cmd": "pytest"})]},
        tool("t2", "bash", "1 passed"),
        {"role": "user", "content": "2 steps left"},
    ]


def test_drawn_policies_decide_on_agent_histories():
    histories = [research_history(), coding_history(), research_history()[:7]]
    decided, reading = set(), set()
    for policy in policies():
        compiled = compile_policy(policy)
        for history in histories:
            decision = compiled.decide(history)
            acted = bool(decision.drop_message or decision.text_edits or decision.thinking_drop or decision.kept)
            decided.add(acted)
            if acted:
                reading |= {type(node) for node in walk(policy) if isinstance(node, (n.Covered, n.CallContains))}
    assert decided == {True, False}  # some policies act on these histories and some do not
    assert reading == {n.Covered, n.CallContains}  # policies with the new selectors among those that act


def context(seed: int, known: frozenset[str] = frozenset()) -> ProposerContext:
    return ProposerContext((), (), known, random.Random(seed), seed)


def test_random_proposer_asks_for_new_canonical_policies_without_parents():
    proposer = RandomProposer()
    builtins = set(library_texts())
    proposals = [proposer.ask(context(seed)) for seed in range(30)]
    for proposal in proposals:
        assert proposal.rejection_reason is None and proposal.proposer == "random"
        checked = check_policy(proposal.text)
        assert checked.text == proposal.text == proposal.raw_text and proposal.text not in builtins
        assert proposal.hash == checked.hash == canonical_hash(parse(proposal.text))
        assert proposal.parent_ids == () and proposal.generation == 0 and proposal.meta["draws"] >= 1
    assert len({p.hash for p in proposals}) == len(proposals)
    assert proposer.ask(context(7)) == proposals[7]  # seeded by the context: a resumed run draws the same


def test_random_proposer_skips_known_policies_and_gives_up_when_all_are_known(monkeypatch):
    first = RandomProposer().ask(context(5))
    assert RandomProposer().ask(context(5, frozenset({first.hash}))).hash != first.hash
    fixed = parse(first.text)
    monkeypatch.setattr(random_sampler, "draw_policy", lambda rng: (fixed, 1))
    refused = RandomProposer(attempts=3).ask(context(5, frozenset({first.hash})))
    assert refused.text is None and "already known" in refused.rejection_reason
