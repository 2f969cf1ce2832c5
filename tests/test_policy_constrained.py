"""The constrained policy grammar agrees with the parser (no model: byte-level random walks)."""
from __future__ import annotations

import dataclasses
import random
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policy_dsl import (PolicyError, PolicySyntaxError, builtin_names, builtin_source, compile_policy,
                        constrained_grammar, format_policy, parse)
from policy_dsl import nodes as n
from policy_dsl.constrained import MAX_CHAIN, integer_regex, range_blocks
from policy_dsl.parser import parse_unvalidated
from policy_dsl.validator import validate, walk
from test_grammar_support import accepts, matcher, random_walk

CANONICAL = [
    "mode kv\non each turn: drop thinking\nreposition never",
    "mode kv\non drop_context or each turn: drop requested and not role user keep last 2\nreposition every 3 drops",
    "mode kv\non (every 4 in 1..16 turns or after 2 tool_calls) and visible_tokens > 900: "
    "drop role tool and (age >= 3 turns or tokens > 500) until visible_tokens <= 400 in 100..800\n"
    "reposition when gap > 64",
    "mode kv\non each tool_call and visible_tokens > 6000: drop role tool until visible_tokens <= 3000 trigger included\n"
    "reposition after 1 tool_calls then every 1",
    "mode kv\non drop_context: drop requested until visible_tokens <= 900 trigger included\nreposition never",
    "mode kv\non each tool_response: drop tool_name \"search\" or contains \"a \\\"quoted\\\" \\\\ word\"\n"
    "reposition when positions > 4096",
    "mode text\non each turn: omit thinking where role assistant\n"
    "on history_tokens > 6000: summarize all keep last 2 within 512 in 128..2048 tokens",
    "mode text\non drop_context: omit requested",
    "mode kv\non each tool_response: drop role tool and covered >= 80 in 50..100 percent keep last 2\n"
    "reposition after each drop",
    "mode kv\non each turn: drop covered or call contains \"cat \"\nreposition never",
    "mode text\non each turn: omit not call contains \"pytest\" keep last 3",
    "mode kv\non each tool_response: cut after \"\\n--\" from role tool keep last 3\nreposition never",
    "mode kv\non visible_tokens > 4000: cut before \"Summary:\" from role assistant and tokens > 200\n"
    "reposition never",
    "mode text",
]


def _longest_chain(node) -> int:
    """The most parts of any and/or in a policy's AST."""
    if isinstance(node, (tuple, list)):
        return max((_longest_chain(x) for x in node), default=0)
    if not dataclasses.is_dataclass(node):
        return 0
    own = len(node.parts) if isinstance(node, (n.And, n.Or, n.AnyOf, n.AllOf)) else 0
    return max([own, *(_longest_chain(getattr(node, f.name)) for f in dataclasses.fields(node))])


@pytest.mark.parametrize("name", builtin_names())
def test_every_builtin_policy_in_canonical_form_is_in_the_variant_when_its_chains_fit(name):
    """The variant is finite on purpose (and/or chains of at most MAX_CHAIN + 1 parts): a built-in
    with its rule count is in it, unless a longer chain puts it out (the hand-written research and
    drop-stale policies), and then it is refused."""
    policy = parse(builtin_source(name))
    text = format_policy(policy).rstrip("\n")
    fits = _longest_chain(policy) <= MAX_CHAIN + 1
    assert accepts(constrained_grammar(max_rules=max(1, len(policy.rules))), text) == fits, text


@pytest.mark.parametrize("text", CANONICAL)
def test_canonical_policies_of_every_construct_are_in_the_variant(text):
    assert format_policy(parse(text)).rstrip("\n") == text
    assert accepts(constrained_grammar(max_rules=2), text)
    assert accepts(constrained_grammar(), text) == (text.count("\non ") <= 1)


@pytest.mark.parametrize("text, why", [
    ("mode kvx", "a glued keyword"),
    ("mode  kv", "free whitespace"),
    ("mode kv # note", "a comment"),
    ("mode fast", "an unknown mode"),
    ("mode kv\non each turn: drop role robot", "an unknown role"),
    ("mode kv\non each hour: drop all", "an unknown unit"),
    ("mode kv\non every 0 turns: drop all", "a count below its bound"),
    ("mode text\non each turn: summarize all within 8 tokens", "a summary budget below 16"),
    ("mode kv\non each turn: omit all", "omit in mode kv"),
    ("mode text\non each turn: drop all", "drop in mode text"),
    ("mode kv\non each turn: drop thinking\non each turn: drop role tool", "thinking mixed with messages in kv"),
    ("mode kv\non each turn: drop all\non each turn: drop all\non each turn: drop all", "more than two rules"),
    ("mode kv\non each turn: drop all keep last 5 in 6..9", "a value below its range"),
    ("mode kv\non each turn: drop all keep last 15 in 1..12", "a value above its range"),
    ("mode kv\non each turn: drop all keep last 512 in 100..550", "a range ending inside the value's block"),
    ("mode kv\non each turn or each turn or each turn or each turn: drop all", "an or chain of four"),
    ("mode kv\non each turn: drop requested", "requested without drop_context"),
    ("mode kv\non each turn: drop thinking where role user", "thinking where in kv"),
    ("mode text\non each turn: summarize all until visible_tokens <= 9 within 64 tokens", "summarize until"),
    ("mode kv\non each turn: drop not not not all", "nesting past MAX_DEPTH"),
    ('mode kv\non each turn: drop contains ""', "an empty string"),
    ('mode text\non each turn: cut after "x" from all', "cut in mode text"),
    ('mode kv\non each turn: cut after "x" from all\non each turn: drop all', "a cut beside a drop"),
    ('mode kv\non each turn: cut after "x" from all\nreposition after each drop', "a cut with a reposition"),
    ('mode kv\non each turn: cut after "x" from thinking', "a cut of thinking"),
    ("mode kv\non each turn: drop all trigger included", "trigger included without until"),
    ("mode kv\non each turn: drop covered >= 0 percent", "a covered share of 0"),
    ("mode kv\non each turn: drop covered >= 101 percent", "a covered share above 100"),
    ("mode kv\non each turn: drop covered >= 80", "a covered share without percent"),
    ("mode kv\non each turn: drop covered > 80 percent", "a covered share not compared with >="),
    ("mode kv\non each turn: drop covered >= 80 in 50..120 percent", "a covered share's range above 100"),
    ('mode kv\non each turn: drop call contains ""', "an empty call pattern"),
    ('mode kv\non each turn: drop call "x"', "call without contains"),
    ("mode kv\non each turn: drop all keep last 2 trigger included", "trigger included after keep, no until"),
    ('mode kv\non each turn: cut after "x" from all until visible_tokens <= 9 trigger included', "a cut of its trigger"),
    ("mode text\non each turn: omit all until visible_tokens <= 9 trigger included", "omit trigger included"),
])
def test_what_the_builder_or_validator_refuses_the_variant_cannot_write(text, why):
    assert not accepts(constrained_grammar(max_rules=2), text), why


def walks(grammar: str, count: int, seed: int) -> list[str]:
    rng, walker, texts = random.Random(seed), matcher(grammar), []
    for _ in range(count):
        walker.reset()
        text = random_walk(walker, rng)
        assert text is not None   # the language is finite: every walk ends
        texts.append(text)
    return texts


def test_random_walks_under_the_one_rule_variant_are_all_valid_policies():
    for text in walks(constrained_grammar(), 100, seed=7):
        compile_policy(parse(text, "walk.akvp"), name="walk")


@pytest.mark.parametrize("prefix, node", [
    ("mode kv\non each tool_response: drop covered", n.Covered),
    ("mode kv\non each tool_response: drop role tool and call contains ", n.CallContains),
    ("mode text\non each turn: omit not covered >= ", n.Covered),
])
def test_random_walks_through_covered_and_call_contains_are_valid_policies(prefix, node):
    """Walks that start in the new selectors and go on at random: each one parses, validates and holds it."""
    rng, grammar = random.Random(11), constrained_grammar()
    shares = set()
    for _ in range(40):
        walker = matcher(grammar)
        assert walker.consume_tokens(list(prefix.encode()))
        text = prefix + random_walk(walker, rng)
        policy = compile_policy(parse(text, "walk.akvp"), name="walk").ast
        found = [x for x in walk(policy) if isinstance(x, node)]
        assert found, text
        shares |= {x.share.value for x in found if isinstance(x, n.Covered)}
    assert node is n.CallContains or len(shares) > 5  # shares over the bounds, not one value


def test_with_more_rules_only_duplicate_rules_are_left_to_the_validator():
    duplicates = 0
    for text in walks(constrained_grammar(max_rules=3), 40, seed=8):
        policy = parse_unvalidated(text, "walk.akvp")   # syntax, names and limits: the grammar's job
        try:
            validate(policy, "walk.akvp")
        except PolicyError as err:
            assert "duplicate rule" in str(err), (text, err)
            duplicates += 1
    assert duplicates < 40


@pytest.mark.parametrize("low, high", [(0, 100_000), (1, 100_000), (16, 10_000_000), (3, 7), (150, 999)])
def test_range_blocks_partition_the_field_bounds(low, high):
    blocks = range_blocks(low, high)
    assert blocks[0][0] == low and blocks[-1][1] == high
    assert all(a <= b for a, b in blocks)
    assert all(prev[1] + 1 == nxt[0] for prev, nxt in zip(blocks, blocks[1:]))


def test_the_top_rule_can_be_renamed_to_embed_the_policy():
    embedded = 'start: "<" policy ">"\n' + constrained_grammar("policy")
    assert accepts(embedded, "<mode kv\nreposition never>")
    assert not accepts(embedded, "mode kv")


@given(st.integers(0, 10**8), st.integers(0, 10**8), st.integers(0, 2 * 10**8))
def test_integer_regex_matches_exactly_its_range(a, b, x):
    low, high = min(a, b), max(a, b)
    pattern = re.compile(f"(?:{integer_regex(low, high)})")
    assert bool(pattern.fullmatch(str(x))) == (low <= x <= high)
    assert not pattern.fullmatch("0" + str(x))   # no leading zeros


def test_integer_regex_refuses_an_empty_range():
    with pytest.raises(ValueError, match="low <= high"):
        integer_regex(5, 4)


def test_the_source_grammar_still_parses_what_the_variant_cannot_say():
    # The variant is a subset: layout, comments and double negation stay valid DSL.
    text = "mode kv  # a comment\non each turn: drop not not role tool\nreposition never"
    parse(text)
    with pytest.raises(PolicySyntaxError):
        parse("mode kvx")
