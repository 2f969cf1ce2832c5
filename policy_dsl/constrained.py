"""The policy grammar for constrained decoding: a Lark text llguidance accepts, from grammar.lark.

llguidance reads the source grammar as it is, but a sampler under it may still write what the
tree builder or the validator refuses: a keyword glued to a name ("modelx", since llguidance
lexes lazily), an unknown mode, role or unit, endless whitespace or comments, numbers out of
range, `omit` in mode kv. This variant expresses those checks in the grammar itself:

- layout is the canonical one (`format_policy`): single spaces, one statement per line, no
  comments; so a keyword is always followed by a separator and output cannot grow in place;
- names are the accepted words (`UNIT_WORDS`, `ROLES`, ...), never a free NAME;
- each number accepts only its field's bounds (`validator.BOUNDS`), as a digit regex;
- a tunable number `V in L..H` is written so that L <= V <= H holds by construction: V picks a
  block (its exact value below 100, its length and first digit above), L ends at or below the
  block's start and H starts at or above its end (`range_blocks`);
- strings are JSON strings of 1..STRING_CHARS characters;
- the statement level follows the validator's mode rules: mode kv drops or cuts, and either
  message drops with any reposition, or thinking drops with none, or cuts with none; mode text
  omits or summarizes (messages only, without `until`); `trigger included` only after a drop's
  `until`; `requested` only under a `drop_context` trigger;
- at most `max_rules` rules (default 1: then no two can be duplicates), and/or chains of at most
  MAX_CHAIN + 1 parts, parentheses and `not` at most MAX_DEPTH levels deep: the language is
  finite, so an answer cannot grow without end.

The expression level (triggers, selectors, numbers, reposition) is generated from the source
grammar's rules, so a change there reaches this variant. With one rule every text the variant
accepts is a valid policy; with more, duplicate rules are left to the validator (tests sample the
variant and parse and validate every sample).
"""
from __future__ import annotations

import json
import re
from functools import lru_cache

from lark.grammar import NonTerminal, Rule, Terminal

from policy_dsl import nodes as n
from policy_dsl.parser import REPOSITION_UNIT_WORDS, UNIT_WORDS, lark_parser
from policy_dsl.validator import BOUNDS

MAX_DEPTH = 1
MAX_CHAIN = 1        # "a or b": a repeated `("or" x)*` part appears at most this often
STRING_CHARS = 48    # content patterns and tool names (the parser takes up to 256)
EXACT_BELOW = 100    # tunable values below this get a block of their own
_REPEAT = re.compile(r"__\w+_(star|plus)_\d+")   # lark's helper rules for `x*` and `x+`
# The source rules the statement level below refers to; everything they reach is generated.
ROOTS = ("trigger", "trig_and", "selector", "sel_not", "keep", "until", "reposition_stmt")
# Alternatives the statement level spells itself.
MOVED = {("sel_atom", "requested")}
# Which words a NAME stands for, by the rule and alternative it appears in.
NAME_WORDS: dict[tuple[str, str | None], tuple[str, ...]] = {
    ("trig_atom", "each"): tuple(UNIT_WORDS), ("trig_atom", "every"): tuple(UNIT_WORDS),
    ("trig_atom", "after"): tuple(UNIT_WORDS), ("sel_atom", "age"): tuple(UNIT_WORDS),
    ("sel_atom", "idle"): tuple(UNIT_WORDS),
    ("sel_atom", "age_with"): ("turn", "turns"),  # a text counts the agent's turns only
    ("sel_atom", "role"): n.ROLES, ("reposition_stmt", "every_n"): tuple(REPOSITION_UNIT_WORDS),
    ("reposition_stmt", "after_n"): ("tool_call", "tool_calls"),
}
# Which AST field each `number` fills, by the rule and alternative it appears in.
NUMBER_FIELDS: dict[tuple[str, str | None], tuple[type, str]] = {
    ("trig_atom", "every"): (n.Every, "n"), ("trig_atom", "after"): (n.After, "n"),
    ("trig_atom", "visible_above"): (n.TokensAbove, "threshold"),
    ("trig_atom", "history_above"): (n.TokensAbove, "threshold"),
    ("sel_atom", "age"): (n.Age, "n"), ("sel_atom", "age_with"): (n.Age, "n"), ("sel_atom", "size"): (n.Size, "n"),
    ("sel_atom", "idle"): (n.Idle, "n"), ("sel_atom", "covered_share"): (n.Covered, "share"),
    ("keep", None): (n.Messages, "keep_last"), ("until", None): (n.Messages, "until_visible"),
    ("action", "summarize"): (n.Summarize, "budget"),
    ("reposition_stmt", "every_n"): (n.RepositionEvery, "n"),
    ("reposition_stmt", "gap"): (n.RepositionGap, "threshold"),
    ("reposition_stmt", "positions"): (n.RepositionPositions, "threshold"),
    # The schedules' `then every M` shares the bounds of their first number.
    ("trig_atom", "visible_responses"): (n.VisibleToolResponses, "threshold"),
    ("sel_atom", "callers_outside"): (n.CallersOutside, "n"),
    ("reposition_stmt", "after_n"): (n.RepositionAfter, "n"),
}
TIGHT_AFTER = {"(", ".."}         # no space after these literals
TIGHT_BEFORE = {")", ":", ".."}   # nor before these

# llguidance lexes greedily: a literal that is a prefix of another one allowed at the same place
# (": drop " and ": drop thinking") would swallow the next word, so such literals stay split.
STATEMENTS = """\
{start}: "mode kv" kv_body | "mode text" text_body
kv_body: ("\\n" kv_rule){0,%RULES%} ("\\n" reposition_stmt)?
    | ("\\n" kv_thinking_rule){1,%RULES%} ("\\nreposition never")?
    | ("\\n" kv_cut_rule){1,%RULES%} ("\\nreposition never")?
kv_rule: "on " trigger ": drop " drop_target | "on " drop_context_trigger ": drop " drop_requested_target
kv_thinking_rule: "on " trigger ": drop " "thinking"
kv_cut_rule: "on " trigger ": cut " ("after " | "before ") JSON_STRING " from " message_target
text_body: ("\\n" text_rule){0,%RULES%}
text_rule: "on " trigger ": omit " (message_target | thinking_target)
    | "on " drop_context_trigger ": omit " requested_target
    | "on " trigger ": summarize " selector (" " keep)? " within " {budget} " tokens"
message_target: selector (" " keep)? (" " until)?
drop_target: selector (" " keep)? (" " until (" " "trigger included")?)?
thinking_target: "thinking" (" where " selector)?
requested_target: "requested" ((" and " | " or ") sel_not){0,%CHAIN%} (" " keep)? (" " until)?
drop_requested_target: "requested" ((" and " | " or ") sel_not){0,%CHAIN%} (" " keep)? (" " until (" " "trigger included")?)?
drop_context_trigger: "drop_context" (" or " trig_and){0,%CHAIN%}
"""


def constrained_grammar(start: str = "start", max_rules: int = 1) -> str:
    """The Lark text (llguidance's dialect) of every policy a constrained sampler may write.

    `start` names the top rule, so a caller can embed the policy in a larger answer grammar
    (`start: "```akvp\\n" policy "\\n```"` plus `constrained_grammar("policy")`).
    """
    if max_rules < 1:
        raise ValueError(f"max_rules: expected at least 1, got {max_rules}")
    return _grammar_body(max_rules).replace("{start}", start, 1)


@lru_cache(maxsize=4)
def _grammar_body(max_rules: int) -> str:
    emitter = _Emitter(lark_parser().rules, {t.name: t for t in lark_parser().terminals})
    statements = (STATEMENTS.replace("{budget}", emitter.number(("action", "summarize")))
                  .replace("%RULES%", str(max_rules)).replace("%CHAIN%", str(MAX_CHAIN)))
    for root in ROOTS:
        emitter.rule(root, 0)
    return "\n".join([statements, *emitter.lines, *emitter.terminal_lines]) + "\n"


class _Emitter:
    """Writes the source's BNF rules in llguidance Lark with canonical spacing and exact words."""

    def __init__(self, rules: list[Rule], terminals: dict) -> None:
        self.rules: dict[str, list[Rule]] = {}
        for rule in rules:
            self.rules.setdefault(rule.origin.name, []).append(rule)
        self.terminals = terminals
        self.lines: list[str] = []
        self.terminal_lines: list[str] = [f"JSON_STRING: {_json_string_regex()}"]
        self.done: set[str] = set()

    def rule(self, name: str, depth: int) -> str:
        """Emit source rule `name` at nesting `depth` (once) and return the name it has here."""
        emitted = _rule_name(name, depth)
        if emitted in self.done:
            return emitted
        self.done.add(emitted)
        if name not in self.rules:
            raise KeyError(f"grammar.lark has no rule {name!r}, which the constrained variant uses")
        if _REPEAT.fullmatch(name):
            self.lines.append(f"{emitted}: {self.repetition(name, depth)}")
            return emitted
        alternatives = []
        for rule in self.rules[name]:
            if (name, rule.alias) in MOVED:
                continue
            nests = any(s.name in ("LPAR", "NOT") for s in rule.expansion)
            if nests and depth >= MAX_DEPTH:
                continue
            alternatives.append(self.expansion(rule, depth + 1 if nests else depth))
        self.lines.append(f"{emitted}: " + " | ".join(alternatives))
        return emitted

    def repetition(self, name: str, depth: int) -> str:
        """Lark's left-recursive helper `h: x | h x` as `x (" " x){0,MAX_CHAIN-1}`."""
        [base] = [r for r in self.rules[name] if r.expansion[0].name != name]
        item = self.expansion(base, depth)
        return f'{item} (" " {item}){{0,{MAX_CHAIN - 1}}}' if MAX_CHAIN > 1 else item

    def expansion(self, rule: Rule, depth: int, integers: tuple[str, ...] = ()) -> str:
        """One alternative with its separators; `integers` replace its INT terminals in order."""
        context = (rule.origin.name, rule.alias)
        items: list[str] = []
        previous: str | None = None
        ints = iter(integers)
        for position, symbol in enumerate(rule.expansion):
            literal = self.literal(symbol)
            if position and previous not in TIGHT_AFTER and literal not in TIGHT_BEFORE:
                items.append('" "')
            items.append(next(ints) if integers and symbol.name == "INT" else self.symbol(symbol, context, depth))
            previous = literal
        return " ".join(items)

    def literal(self, symbol: NonTerminal | Terminal) -> str | None:
        """The fixed text of a keyword or punctuation terminal, else None."""
        if not isinstance(symbol, Terminal):
            return None
        pattern = self.terminals[symbol.name].pattern
        return pattern.value if pattern.type == "str" else None

    def symbol(self, symbol: NonTerminal | Terminal, context: tuple[str, str | None], depth: int) -> str:
        if isinstance(symbol, NonTerminal):
            if symbol.name == "number":
                return self.number(context)
            return self.rule(symbol.name, depth)
        literal = self.literal(symbol)
        if literal is not None:
            return json.dumps(literal)
        if symbol.name == "NAME":
            return "(" + " | ".join(json.dumps(word) for word in NAME_WORDS[context]) + ")"
        if symbol.name == "STRING":
            return "JSON_STRING"
        raise KeyError(f"the constrained variant has no rule for terminal {symbol.name} in {context}")

    def number(self, context: tuple[str, str | None]) -> str:
        """The `number` rule for the field `context` fills: its bounds, and ranges that hold V."""
        low, high = BOUNDS[NUMBER_FIELDS[context]]
        name = f"number_{low}_{high}"
        if name not in self.done:
            self.done.add(name)
            alternatives = []
            for rule in self.rules["number"]:
                ints = sum(s.name == "INT" for s in rule.expansion)
                if ints == 1:
                    alternatives.append(self.expansion(rule, 0, (self.integer(low, high),)))
                    continue
                for first, last in range_blocks(low, high):   # value, range low, range high
                    bounds = ((first, last), (low, first), (last, high))
                    alternatives.append(self.expansion(rule, 0, tuple(self.integer(a, b) for a, b in bounds)))
            self.lines.append(f"{name}: " + "\n    | ".join(alternatives))
        return name

    def integer(self, low: int, high: int) -> str:
        """A terminal for the integers low..high (a literal when low == high)."""
        if low == high:
            return json.dumps(str(low))
        terminal = f"INT_{low}_{high}"
        if terminal not in self.done:
            self.done.add(terminal)
            self.terminal_lines.append(f"{terminal}: /{integer_regex(low, high)}/")
        return terminal


def range_blocks(low: int, high: int) -> list[tuple[int, int]]:
    """Blocks covering low..high: each value below EXACT_BELOW alone, then one per length and first digit.

    A tunable `V in L..H` with V in block (first, last), L <= first and H >= last holds L <= V <= H.
    """
    blocks = [(v, v) for v in range(low, min(high, EXACT_BELOW - 1) + 1)]
    for digits in range(len(str(EXACT_BELOW)), len(str(high)) + 1):
        for lead in range(1, 10):
            first = max(low, lead * 10 ** (digits - 1))
            last = min(high, (lead + 1) * 10 ** (digits - 1) - 1)
            if first <= last:
                blocks.append((first, last))
    return blocks


def _rule_name(name: str, depth: int) -> str:
    base = name.lstrip("_")
    return base if depth == 0 else f"{base}_{depth}"


def _json_string_regex() -> str:
    """A JSON string literal of 1..STRING_CHARS characters (simple escapes only)."""
    char = r'[^"\\\x00-\x1f]|\\["\\\/bfnrt]'   # `\/` is a slash inside Lark's /.../
    return f'/"(?:{char}){{1,{STRING_CHARS}}}"/'


def integer_regex(low: int, high: int) -> str:
    """A regex matching exactly the decimal integers low..high, without leading zeros."""
    if not 0 <= low <= high:
        raise ValueError(f"expected 0 <= low <= high, got {low}..{high}")
    parts: list[str] = []
    for digits in range(len(str(low)), len(str(high)) + 1):
        first = max(low, 10 ** (digits - 1) if digits > 1 else 0)
        last = min(high, 10 ** digits - 1)
        if first <= last:
            parts += _same_length(str(first), str(last))
    return "|".join(parts)


def _same_length(low: str, high: str) -> list[str]:
    """Alternation-free regexes covering low..high, two numerals with as many digits."""
    if low == high:
        return [low]
    if len(low) == 1:
        return [f"[{low}-{high}]"]
    if low[0] == high[0]:
        return [low[0] + part for part in _same_length(low[1:], high[1:])]
    rest = len(low) - 1
    out: list[str] = []
    first, last = int(low[0]), int(high[0])
    if low[1:] != "0" * rest:
        out += [low[0] + part for part in _same_length(low[1:], "9" * rest)]
        first += 1
    if high[1:] != "9" * rest:
        last -= 1
    if first <= last:
        out.append(f"[{first}-{last}][0-9]{{{rest}}}")
    if high[1:] != "9" * rest:
        out += [high[0] + part for part in _same_length("0" * rest, high[1:])]
    return out
