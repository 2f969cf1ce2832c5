"""Parsing, the canonical printer, located errors for bad input, and tunable numbers."""
from __future__ import annotations

import pytest

from policy_dsl import (
    PolicyError, PolicyLimitError, PolicySyntaxError, PolicyValidationError, builtin_names, builtin_source,
    canonical_hash, format_policy, load_policy, parse, tunables, with_tunables, without_ranges,
)
from policy_dsl import nodes as n

EXPERT = "mode kv\non each tool_response: drop role tool keep last 12 in 2..48\nreposition after each drop\n"


@pytest.mark.parametrize("name", builtin_names())
def test_builtins_round_trip_through_the_canonical_form(name: str) -> None:
    ast = parse(builtin_source(name), filename=name)
    text = format_policy(ast)
    assert parse(text) == ast
    assert format_policy(parse(text)) == text
    assert load_policy(name).source == text


def test_layout_and_comments_do_not_change_the_canonical_form_or_hash() -> None:
    messy = "# the expert\n  mode   kv\non each tool_responses :\n drop role tool\n keep last 12 in 2..48  # window\n" \
            "reposition after each drop"
    assert format_policy(parse(messy)) == EXPERT
    assert canonical_hash(parse(messy)) == canonical_hash(parse(EXPERT))
    assert canonical_hash(parse(EXPERT.replace("12 in", "11 in"))) != canonical_hash(parse(EXPERT))


def test_every_construct_parses_to_its_node() -> None:
    ast = parse('mode kv\non (every 3 tool_calls or after 2 turns) and visible_tokens > 900: '
                'drop not role user and (age >= 4 tool_responses or tokens < 10 or contains "x\\"y") '
                'keep last 1 until visible_tokens <= 50\non drop_context: drop requested or tool_name "run"\n'
                'on each tool_response: drop superseded\nreposition when gap > 100\n')
    first, second, third = ast.rules
    assert first.trigger == n.AllOf((n.AnyOf((n.Every(n.Num(3), "tool_calls"), n.After(n.Num(2), "turns"))),
                                     n.TokensAbove("visible", n.Num(900))))
    assert first.action == n.Drop(n.Messages(
        n.And((n.Not(n.Role("user")), n.Or((n.Age(">=", n.Num(4), "tool_responses"), n.Size("<", n.Num(10)),
                                             n.Contains('x"y'))))),
        keep_last=n.Num(1), until_visible=n.Num(50)))
    assert second == n.Rule(n.DropContextCalled(), n.Drop(n.Messages(n.Or((n.Requested(), n.ToolName("run"))))))
    assert third == n.Rule(n.Every(n.Num(1), "tool_responses"), n.Drop(n.Messages(n.Superseded())))
    assert ast.reposition == n.RepositionGap(n.Num(100))
    assert parse(format_policy(ast)) == ast
    judged = parse('mode kv\non each turn: drop role tool and next_turn contains "not relevant"\n')
    assert judged.rules[0].action.target.selector == n.And((n.Role("tool"), n.NextTurnContains("not relevant")))
    assert parse(format_policy(judged)) == judged
    milestone = parse('mode kv\non each turn: drop role tool and age >= 2 in 1..6 turn with "Found"\n')
    assert milestone.rules[0].action.target.selector.parts[1] == n.Age(">=", n.Num(2, 1, 6), "turns", "Found")
    assert parse(format_policy(milestone)) == milestone


@pytest.mark.parametrize("written, node, canonical", [
    ("covered", n.Covered(n.Num(100)), "covered"),
    ("covered >= 100 percent", n.Covered(n.Num(100)), "covered"),  # all of it: the short form
    ("covered >= 80 percent", n.Covered(n.Num(80)), "covered >= 80 percent"),
    ("covered   >=  80 in 50..100\n percent", n.Covered(n.Num(80, 50, 100)), "covered >= 80 in 50..100 percent"),
    ("covered >= 100 in 50..100 percent", n.Covered(n.Num(100, 50, 100)), "covered >= 100 in 50..100 percent"),
    ('call contains "cat "', n.CallContains("cat "), 'call contains "cat "'),
    ('call contains "grep -n \\"def \\""', n.CallContains('grep -n "def "'), 'call contains "grep -n \\"def \\""'),
])
def test_covered_and_call_contains_parse_and_print_canonically(written: str, node: object, canonical: str) -> None:
    ast = parse(f"mode kv\non each tool_response: drop role tool and not {written} keep last 2\n")
    assert ast.rules[0].action.target.selector == n.And((n.Role("tool"), n.Not(node)))
    text = format_policy(ast)
    assert f"drop role tool and not {canonical} keep last 2\n" in text
    assert parse(text) == ast and format_policy(parse(text)) == text


def test_a_covered_share_is_tunable() -> None:
    ast = parse("mode kv\non each turn: drop role tool and covered >= 80 in 50..100 percent\n")
    [share] = tunables(ast)
    assert (share.path, share.value, share.lo, share.hi, share.kind) == (
        "rules[0].action.target.selector.parts[1].share", 80, 50, 100, "int")
    tuned = with_tunables(ast, {share.path: 95})
    assert "covered >= 95 in 50..100 percent" in format_policy(tuned) and parse(format_policy(tuned)) == tuned
    assert "covered >= 80 percent" in format_policy(without_ranges(ast))
    with pytest.raises(PolicyValidationError, match="outside its range 50..100"):
        with_tunables(ast, {share.path: 40})


def test_call_lines_parse_in_any_order_and_print_in_one() -> None:
    body = "on each tool_response: drop role tool keep last 2\nreposition when positions > 600\n"
    both = parse(f"mode kv\ncalls include controller_prompts\ncalls include user_observations\n{body}")
    assert (both.user_observations, both.controller_prompts) == (True, True)
    assert format_policy(both) == ("mode kv\ncalls include user_observations\ncalls include controller_prompts\n"
                                   f"on each tool_response: drop role tool keep last 2\n{body.splitlines()[1]}\n")
    assert parse(format_policy(both)) == both
    prompts = parse(f"mode kv\ncalls include controller_prompts\n{body}")
    assert (prompts.user_observations, prompts.controller_prompts) == (False, True)
    assert prompts != parse(f"mode kv\n{body}") and parse(format_policy(prompts)) == prompts


BAD_INPUT = [
    # (source, line, column, class, words in the message)
    ("", 1, 1, PolicySyntaxError, "empty policy"),
    ("# only a comment\n\n", 1, 1, PolicySyntaxError, "empty policy"),
    ("mode kv\non each tool_response: drop role tool keepx last 3\n", 2, 39, PolicySyntaxError,
     "unknown keyword 'keepx'"),
    ("mode kv\non each tool_response: discard role tool\n", 2, 24, PolicySyntaxError, "expected 'cut', 'drop', 'omit'"),
    ("mode kv\non each tool_response: drop role tool keep last\n", 2, 48, PolicySyntaxError,
     "unexpected end of file"),
    ("mode kv\non each tool_response:\n", 2, 23, PolicySyntaxError, "unexpected end of file"),
    ("mode kvm\n", 1, 6, PolicySyntaxError, "unknown mode 'kvm'"),
    ("mode kv\non each reply: drop all\n", 2, 9, PolicySyntaxError, "unknown unit 'reply'"),
    ("mode kv\non each turn: drop role robot\n", 2, 25, PolicySyntaxError, "unknown role 'robot'"),
    ("mode kv\non every 0 turns: drop all\n", 2, 10, PolicyValidationError, "count 0 is out of range"),
    ("mode kv\non each turn: drop all keep last 40 in 1..8\n", 2, 34, PolicyValidationError,
     "outside its range 1..8"),
    ("mode kv\non each turn: drop all keep last 4 in 9..8\n", 2, 34, PolicyValidationError, "range 9..8 is invalid"),
    ("mode kv\non each turn: drop all keep last 1234567890123\n", 2, 34, PolicySyntaxError, "too large"),
    ("mode text\non each turn: omit all\nreposition after each drop\n", 3, 1, PolicyValidationError,
     "reposition needs mode kv"),
    ("mode kv\non each turn: omit all\n", 2, 15, PolicyValidationError, "omit needs mode text"),
    ("mode text\non each turn: drop all\n", 2, 15, PolicyValidationError, "drop needs mode kv"),
    ("mode kv\non each turn: drop thinking\non each tool_response: drop role tool\n", 3, 1,
     PolicyValidationError, "cannot be combined with message drops"),
    ("mode kv\non each turn: drop thinking where age > 2 turns\n", 2, 20, PolicyValidationError,
     "remove 'where ...'"),
    ("mode kv\non each turn: drop all\non each turn: drop all\n", 3, 1, PolicyValidationError,
     "duplicate rule (same as line 2)"),
    ("mode kv\non each turn: drop requested\n", 2, 15, PolicyValidationError, "must include drop_context"),
    ("mode text\non each turn: summarize all until visible_tokens <= 5 within 100 tokens\n", 2, 25,
     PolicyValidationError, "summarize cannot take 'until visible_tokens'"),
    ("mode kv\non each turn: drop role tool trigger included\n", 2, 20, PolicyValidationError,
     "'trigger included' goes with 'until visible_tokens <= T'"),
    ("mode text\non each turn: omit all until visible_tokens <= 9 trigger included\n", 2, 20, PolicyValidationError,
     "omit cannot take 'trigger included'"),
    ('mode kv\non each turn: drop contains "a\\qb"\n', 2, 29, PolicySyntaxError, "bad escape"),
    ('mode kv\non each turn: drop contains ""\n', 2, 29, PolicySyntaxError, "empty string"),
    ('mode kv\non each turn: drop next_turn "x"\n', 2, 30, PolicySyntaxError, "expected 'contains'"),
    ('mode kv\non each turn: drop age > 1 tool_calls with "Found"\n', 2, 20, PolicyValidationError,
     "with a text counts turns"),
    ("mode kv\non each turn: drop covered >= 0 percent\n", 2, 31, PolicyValidationError,
     "covered share (percent) 0 is out of range; expected 1..100"),
    ("mode kv\non each turn: drop covered >= 101 percent\n", 2, 31, PolicyValidationError,
     "covered share (percent) 101 is out of range; expected 1..100"),
    ("mode kv\non each turn: drop covered >= 80 in 50..120 percent\n", 2, 31, PolicyValidationError,
     "covered share (percent) range 50..120 is invalid"),
    ("mode kv\non each turn: drop covered >= 80\n", 2, 33, PolicySyntaxError, "unexpected end of file; expected 'percent'"),
    ("mode kv\non each turn: drop covered >= 80 keep last 2\n", 2, 34, PolicySyntaxError, "expected 'percent'"),
    ("mode kv\non each turn: drop covered > 80 percent\n", 2, 28, PolicySyntaxError, "unexpected '>'"),
    ('mode kv\non each turn: drop call "cat"\n', 2, 25, PolicySyntaxError, "expected 'contains'"),
    ('mode kv\non each turn: drop call contains ""\n', 2, 34, PolicySyntaxError, "empty string"),
    ('mode kv\non each turn: drop call contains "' + "x" * 257 + '"\n', 2, 34, PolicySyntaxError,
     "string of 257 characters; the limit is 256"),
    ("mode kv\ncalls include controller_prompts\non each tool_response: drop role tool keep last 2\n"
     "reposition after each drop\n", 2, 1, PolicyValidationError, "expected that reposition rule, but this "
     "policy has `reposition after each drop`"),
    ("mode kv\non each tool_response: drop role tool keep last 2\ncalls include controller_prompts\n", 3, 1,
     PolicySyntaxError, "a 'calls include ...' line goes right after the mode line"),
    ("mode text\ncalls include controller_prompts\non each turn: omit all\n", 2, 1, PolicyValidationError,
     "mode text never repositions"),
    ("mode kv\ncalls include controller_prompts\ncalls include controller_prompts\n"
     "reposition when positions > 9\n", 3, 1, PolicySyntaxError, "duplicate line 'calls include controller_prompts'"),
    ("mode kv\ncalls include prompts\n", 2, 15, PolicySyntaxError,
     "unknown call boundary 'prompts'; expected one of user_observations, controller_prompts"),
    ("mode kv\non each turn: drop all\n\x00\x01garbage", 3, 1, PolicySyntaxError, "unexpected character '\\x00'"),
    ("mode kv\non each turn: drop " + "not " * 40 + "all\n", 2, 0, PolicyLimitError, "nested deeper than 32"),
]


@pytest.mark.parametrize("source,line,column,kind,words", BAD_INPUT)
def test_bad_input_gets_a_one_line_located_error(source: str, line: int, column: int, kind: type, words: str) -> None:
    with pytest.raises(kind) as caught:
        parse(source, filename="p.akvp")
    err = caught.value
    assert words in err.message
    assert (err.filename, err.line) == ("p.akvp", line)
    if column:
        assert err.column == column, str(err)
    assert str(err) == f"p.akvp:{err.line}:{err.column}: {err.message}"
    assert "\n" not in str(err)


def test_a_megabyte_file_is_refused_before_parsing(tmp_path) -> None:
    big = tmp_path / "big.akvp"
    big.write_bytes(b"mode kv\n" + b"# padding\n" * 110_000)
    with pytest.raises(PolicyLimitError, match=r"big.akvp:1:1: policy is 1100008 bytes; the limit is 65536"):
        load_policy(str(big))
    with pytest.raises(PolicyLimitError):
        parse("mode kv\n" + "#" * 70_000)


def test_binary_garbage_is_located_at_the_first_bad_byte(tmp_path) -> None:
    junk = tmp_path / "junk.akvp"
    junk.write_bytes(b"mode kv\n\x89PNG\xff\xfe")
    with pytest.raises(PolicySyntaxError, match=r"junk.akvp:2:1: not UTF-8 text \(byte 0x89\)"):
        load_policy(str(junk))


def test_a_byte_order_mark_is_accepted(tmp_path) -> None:
    path = tmp_path / "bom.akvp"
    path.write_bytes(b"\xef\xbb\xbf" + EXPERT.encode())
    assert load_policy(str(path)).source == EXPERT


def test_unknown_policy_name_lists_the_builtins() -> None:
    with pytest.raises(PolicyError, match="no built-in policy and no file named 'nope'.*expert"):
        load_policy("nope")


def test_tunables_list_ranged_numbers_and_with_tunables_sets_them() -> None:
    ast = load_policy("token-based").ast
    assert [(t.path, t.value, t.lo, t.hi, t.kind) for t in tunables(ast)] == [
        ("rules[0].trigger.threshold", 64000, 8000, 128000, "int"),
        ("rules[0].action.target.until_visible", 32000, 4000, 96000, "int"),
    ]
    tuned = with_tunables(ast, {"rules[0].trigger.threshold": 20000, "rules[0].action.target.until_visible": 9000.0})
    assert "visible_tokens > 20000 in 8000..128000" in format_policy(tuned)
    assert "until visible_tokens <= 9000 in 4000..96000" in format_policy(tuned)
    assert parse(format_policy(tuned)) == tuned
    assert tunables(ast)[0].value == 64000  # the original is untouched


@pytest.mark.parametrize("name", builtin_names())
def test_without_ranges_keeps_every_value_and_drops_every_range(name: str) -> None:
    ast = load_policy(name).ast
    plain = without_ranges(ast)
    assert tunables(plain) == []
    assert without_ranges(with_tunables(ast, {})) == plain and parse(format_policy(plain)) == plain
    values = {t.path: t.value for t in tunables(ast)}
    assert format_policy(with_tunables(ast, values)) == format_policy(ast)  # the original is untouched
    if values:
        assert canonical_hash(plain) != canonical_hash(ast)


def test_range_variants_print_the_same_without_ranges() -> None:
    narrow = parse(EXPERT.replace("2..48", "2..16"))
    assert canonical_hash(narrow) != canonical_hash(parse(EXPERT))
    assert format_policy(without_ranges(narrow)) == format_policy(without_ranges(parse(EXPERT)))
    assert "keep last 12\n" in format_policy(without_ranges(narrow))


@pytest.mark.parametrize("values,words", [
    ({"rules[0].trigger.threshold": 200_000}, "outside its range 8000..128000"),
    ({"rules[0].trigger.threshold": 9000.5}, "expected an integer"),
    ({"rules[9].trigger.threshold": 9000}, "no tunable number at 'rules[9].trigger.threshold'"),
])
def test_with_tunables_rejects_bad_values(values: dict, words: str) -> None:
    with pytest.raises(PolicyValidationError, match=words.replace("[", r"\[").replace("]", r"\]")):
        with_tunables(load_policy("token-based").ast, values)


def test_programmatic_asts_with_misplaced_nodes_are_rejected() -> None:
    from dataclasses import replace

    from policy_dsl import compile_policy

    ast = load_policy("expert").ast
    rule = ast.rules[0]
    swapped = replace(ast, rules=(replace(rule, trigger=n.Role("tool")),))
    with pytest.raises(PolicyValidationError, match="expected a trigger, got Role"):
        compile_policy(swapped)
    nested = replace(ast, rules=(replace(rule, action=n.Drop(n.Messages(n.And((n.Role("tool"), n.Every(n.Num(1),
                                                                                                     "turns")))))),))
    with pytest.raises(PolicyValidationError, match="expected a selector, got Every"):
        compile_policy(nested)
    bare = replace(ast, rules=(replace(rule, action=n.Drop(n.Messages(n.Role("tool"), keep_last=12))),))
    with pytest.raises(PolicyValidationError, match="expected a number for keep last, got int"):
        compile_policy(bare)
    with pytest.raises(PolicyValidationError, match="controller_prompts must be True or False"):
        compile_policy(replace(ast, controller_prompts="yes"))
