"""Policy text -> AST: size limits, the lark grammar, and a tree builder with located errors.

`parse` also runs the validator, so every AST it returns is a policy that compiles.
"""
from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources

import lark
from lark import Token, Tree
from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken

from policy_dsl import nodes as n
from policy_dsl.errors import Loc, PolicyLimitError, PolicySyntaxError, located
from policy_dsl.validator import validate

MAX_SOURCE_BYTES = 64 * 1024
MAX_NESTING = 32       # parentheses and `not` chains; keeps every recursive walk shallow
MAX_NUMBER_DIGITS = 12  # larger numbers mean nothing here and int() of huge strings is slow
MAX_STRING_CHARS = 256  # content patterns and tool names

UNIT_WORDS = {
    "tool_call": "tool_calls", "tool_calls": "tool_calls",
    "turn": "turns", "turns": "turns",
    "tool_response": "tool_responses", "tool_responses": "tool_responses",
}
CALL_WORDS = ("user_observations", "controller_prompts")  # `calls include WORD`
REPOSITION_UNIT_WORDS = {"drops": "drops", "tool_call": "tool_calls", "tool_calls": "tool_calls"}
_TERMINAL_WORDS = {
    "NAME": "a name", "INT": "a number", "STRING": "a quoted string",
"$END": "end of file",
}


@lru_cache(maxsize=1)
def lark_parser() -> lark.Lark:
    """The source grammar compiled by lark (LALR, basic lexer); the constrained variant reads its rules."""
    grammar = resources.files("policy_dsl").joinpath("grammar.lark").read_text(encoding="utf-8")
    return lark.Lark(grammar, parser="lalr", lexer="basic", propagate_positions=True, maybe_placeholders=True)


def parse(text: str | bytes, filename: str = "<policy>") -> n.Policy:
    """Parse and validate policy text (or UTF-8 bytes); raises PolicyError (with file, line and column)."""
    if isinstance(text, bytes):
        text = decode_source(text, filename)
    policy = parse_unvalidated(text, filename)
    validate(policy, filename)
    return policy


def parse_unvalidated(text: str, filename: str = "<policy>") -> n.Policy:
    """Parse policy text into an AST without the semantic checks (for tools that report both)."""
    _check_limits(text, filename)
    try:
        tree = lark_parser().parse(text)
    except UnexpectedInput as err:
        raise _syntax_error(err, text, filename) from None
    return _Builder(filename).policy(tree)


def decode_source(data: bytes, filename: str) -> str:
    """Bytes of a policy file -> text, with a located error for sizes and bad UTF-8."""
    if len(data) > MAX_SOURCE_BYTES:
        raise PolicyLimitError(f"policy is {len(data)} bytes; the limit is {MAX_SOURCE_BYTES}",
                               filename=filename)
    try:
        return data.decode("utf-8").removeprefix("\ufeff")  # editors may add a byte-order mark
    except UnicodeDecodeError as err:
        before = data[: err.start]
        line = before.count(b"\n") + 1
        column = len(before) - (before.rfind(b"\n") + 1) + 1
        raise PolicySyntaxError(f"not UTF-8 text (byte 0x{data[err.start]:02x})",
                                filename=filename, line=line, column=column) from None


def _check_limits(text: str, filename: str) -> None:
    size = len(text.encode("utf-8", errors="replace"))
    if size > MAX_SOURCE_BYTES:
        raise PolicyLimitError(f"policy is {size} bytes; the limit is {MAX_SOURCE_BYTES}", filename=filename)
    if not text.strip() or all(line.strip().startswith("#") or not line.strip() for line in text.splitlines()):
        raise PolicySyntaxError("empty policy: expected 'mode kv' or 'mode text'", filename=filename)


def _describe_terminal(name: str) -> str:
    if name in _TERMINAL_WORDS:
        return _TERMINAL_WORDS[name]
    try:
        pattern = lark_parser().get_terminal(name).pattern
    except KeyError:
        return name.lower()
    return f"'{pattern.value}'"


def _expected(names: set[str] | frozenset[str]) -> str:
    words = sorted({_describe_terminal(x) for x in names})
    return ", ".join(words) if words else "nothing"


def _syntax_error(err: UnexpectedInput, text: str, filename: str) -> PolicySyntaxError:
    line, column = max(err.line, 1), max(err.column, 1)
    if isinstance(err, UnexpectedCharacters):
        char = text[err.pos_in_stream] if 0 <= err.pos_in_stream < len(text) else ""
        message = f"unexpected character {char!r}"
    elif isinstance(err, UnexpectedToken) and err.token.type == "$END":
        message = f"unexpected end of file; expected {_expected(err.expected)}"
        line, column = _end_position(text)
    elif isinstance(err, UnexpectedToken) and err.token.type == "CALLS":
        message = "a 'calls include ...' line goes right after the mode line, before the rules"
    elif isinstance(err, UnexpectedToken):
        token = err.token
        what = "unknown keyword" if token.type == "NAME" else "unexpected"
        message = f"{what} {str(token)!r}; expected {_expected(err.expected)}"
    else:
        message = "unexpected input"
    return PolicySyntaxError(message, filename=filename, line=line, column=column)


def _end_position(text: str) -> tuple[int, int]:
    body = text.rstrip()
    line = body.count("\n") + 1
    return line, len(body) - (body.rfind("\n") + 1) + 1


def _loc(item: Tree | Token) -> Loc | None:
    if isinstance(item, Token):
        return Loc(item.line or 1, item.column or 1)
    meta = item.meta
    if getattr(meta, "empty", True):
        return None
    return Loc(meta.line, meta.column)


class _Builder:
    """Turns the lark tree into AST nodes; names and units are checked here, where tokens are."""

    def __init__(self, filename: str) -> None:
        self.filename = filename

    def fail(self, message: str, item: Tree | Token | None) -> PolicySyntaxError:
        return located(PolicySyntaxError, message, _loc(item) if item is not None else None,
                       self.filename)  # type: ignore[return-value]

    # ---- structure ----

    def policy(self, tree: Tree) -> n.Policy:
        mode_stmt, *rest = tree.children
        mode_token = mode_stmt.children[0]
        if str(mode_token) not in ("kv", "text"):
            raise self.fail(f"unknown mode {str(mode_token)!r}; expected kv or text", mode_token)
        calls = self.calls([c for c in rest if isinstance(c, Tree) and c.data == "calls_stmt"])
        rules = tuple(self.rule(c) for c in rest if isinstance(c, Tree) and c.data == "rule")
        tails = [c for c in rest if isinstance(c, Tree) and c.data not in ("rule", "calls_stmt")]
        reposition = self.reposition(tails[0]) if tails else n.RepositionNever()
        return n.Policy(str(mode_token), rules, reposition, user_observations="user_observations" in calls,
                        controller_prompts="controller_prompts" in calls,
                        controller_prompts_loc=calls.get("controller_prompts"), loc=_loc(tree))

    def calls(self, lines: list[Tree]) -> dict[str, Loc | None]:
        """The `calls include WORD` lines (each word once, in any order) -> word: location of its line."""
        out: dict[str, Loc | None] = {}
        for line in lines:
            word = line.children[0]
            if str(word) not in CALL_WORDS:
                raise self.fail(f"unknown call boundary {str(word)!r}; expected one of {', '.join(CALL_WORDS)}", word)
            if str(word) in out:
                raise self.fail(f"duplicate line 'calls include {word}'", line)
            out[str(word)] = _loc(line)
        return out

    def rule(self, tree: Tree) -> n.Rule:
        trigger, action = tree.children
        return n.Rule(self.trigger(trigger, 0), self.action(action), loc=_loc(tree))

    def number(self, tree: Tree) -> n.Num:
        value, lo, hi = tree.children
        return n.Num(self.integer(value), None if lo is None else self.integer(lo),
                     None if hi is None else self.integer(hi), loc=_loc(tree))

    def integer(self, token: Token) -> int:
        if len(token) > MAX_NUMBER_DIGITS:
            raise self.fail(f"number {str(token)[:16]}... is too large (at most {MAX_NUMBER_DIGITS} digits)", token)
        return int(token)

    def unit(self, token: Token, words: dict[str, str]) -> str:
        if str(token) not in words:
            choices = ", ".join(sorted(words))  # singular and plural, as both are accepted
            raise self.fail(f"unknown unit {str(token)!r}; expected one of {choices}", token)
        return words[str(token)]

    def string(self, token: Token) -> str:
        try:
            value = json.loads(str(token))
        except ValueError:
            raise self.fail("bad escape in string; use JSON escapes such as \\\" or \\n", token) from None
        if not value:
            raise self.fail("empty string; expected at least one character", token)
        if len(value) > MAX_STRING_CHARS:
            raise self.fail(f"string of {len(value)} characters; the limit is {MAX_STRING_CHARS}", token)
        return value

    def check_depth(self, item: Tree, depth: int) -> None:
        if depth > MAX_NESTING:
            raise located(PolicyLimitError, f"expression nested deeper than {MAX_NESTING} levels",
                          _loc(item), self.filename)

    # ---- triggers ----

    def trigger(self, tree: Tree, depth: int) -> n.Trigger:
        self.check_depth(tree, depth)
        kind, kids, loc = tree.data, tree.children, _loc(tree)
        if kind == "trigger":
            return n.AnyOf(tuple(self.trigger(k, depth + 1) for k in kids), loc=loc)
        if kind == "trig_and":
            return n.AllOf(tuple(self.trigger(k, depth + 1) for k in kids), loc=loc)
        if kind == "each":
            return n.Every(n.Num(1, loc=loc), self.unit(kids[0], UNIT_WORDS), loc=loc)
        if kind == "every":
            return n.Every(self.number(kids[0]), self.unit(kids[1], UNIT_WORDS), loc=loc)
        if kind == "after":
            then = None if kids[2] is None else self.number(kids[2])
            return n.After(self.number(kids[0]), self.unit(kids[1], UNIT_WORDS), then, loc=loc)
        if kind == "visible_responses":
            return n.VisibleToolResponses(self.number(kids[0]), loc=loc)
        if kind == "visible_above":
            return n.TokensAbove("visible", self.number(kids[0]), loc=loc)
        if kind == "history_above":
            return n.TokensAbove("history", self.number(kids[0]), loc=loc)
        if kind == "drop_context":
            return n.DropContextCalled(loc=loc)
        raise self.fail(f"unexpected trigger {kind}", tree)

    # ---- actions ----

    def action(self, tree: Tree) -> n.Action:
        kind, kids, loc = tree.data, tree.children, _loc(tree)
        if kind in ("cut_after", "cut_before"):
            return n.Cut(kind[len("cut_"):], self.string(kids[0]), self.target(kids[1]), loc=loc)
        target = self.target(kids[0])
        if kind == "drop":
            return n.Drop(target, loc=loc)
        if kind == "omit":
            return n.Omit(target, loc=loc)
        if kind == "remove":
            return n.Remove(target, loc=loc)
        return n.Summarize(target, self.number(kids[1]), loc=loc)

    def target(self, tree: Tree) -> n.Target:
        kids, loc = tree.children, _loc(tree)
        if tree.data == "thinking_target":
            return n.Thinking(None if kids[0] is None else self.selector(kids[0], 0), loc=loc)
        selector, keep, until, trigger_too = kids
        return n.Messages(
            self.selector(selector, 0),
            keep_last=None if keep is None else self.number(keep.children[0]),
            until_visible=None if until is None else self.number(until.children[0]),
            trigger_included=trigger_too is not None,
            loc=loc,
        )

    def selector(self, item: Tree, depth: int) -> n.Selector:
        self.check_depth(item, depth)
        kind, kids, loc = item.data, item.children, _loc(item)
        if kind == "selector":
            return n.Or(tuple(self.selector(k, depth + 1) for k in kids), loc=loc)
        if kind == "sel_and":
            return n.And(tuple(self.selector(k, depth + 1) for k in kids), loc=loc)
        if kind == "not_":
            return n.Not(self.selector(kids[0], depth + 1), loc=loc)
        if kind == "all":
            return n.AllMessages(loc=loc)
        if kind == "role":
            role = str(kids[0])
            if role not in n.ROLES:
                raise self.fail(f"unknown role {role!r}; expected one of {', '.join(n.ROLES)}", kids[0])
            return n.Role(role, loc=loc)
        if kind == "tool":
            return n.ToolName(self.string(kids[0]), loc=loc)
        if kind in ("age", "age_with"):  # age_with: only the turns that contain the text count
            said = self.string(kids[3]) if kind == "age_with" else None
            return n.Age(str(kids[0].children[0]), self.number(kids[1]), self.unit(kids[2], UNIT_WORDS), said, loc=loc)
        if kind == "idle":
            return n.Idle(str(kids[0].children[0]), self.number(kids[1]), self.unit(kids[2], UNIT_WORDS), loc=loc)
        if kind == "size":
            return n.Size(str(kids[0].children[0]), self.number(kids[1]), loc=loc)
        if kind == "contains":
            return n.Contains(self.string(kids[0]), loc=loc)
        if kind == "next_turn_contains":
            return n.NextTurnContains(self.string(kids[0]), loc=loc)
        if kind == "requested":
            return n.Requested(loc=loc)
        if kind == "superseded":
            return n.Superseded(loc=loc)
        if kind == "covered":
            return n.Covered(n.Num(100), loc=loc)
        if kind == "covered_share":
            return n.Covered(self.number(kids[0]), loc=loc)
        if kind == "call_contains":
            return n.CallContains(self.string(kids[0]), loc=loc)
        if kind == "callers_outside":
            return n.CallersOutside(self.number(kids[0]), loc=loc)
        raise self.fail(f"unexpected selector {kind}", item)

    # ---- reposition ----

    def reposition(self, tree: Tree) -> n.RepositionRule:
        kind, kids, loc = tree.data, tree.children, _loc(tree)
        if kind == "never":
            return n.RepositionNever(loc=loc)
        if kind == "each_drop":
            return n.RepositionEachDrop(loc=loc)
        if kind == "every_n":
            return n.RepositionEvery(self.number(kids[0]), self.unit(kids[1], REPOSITION_UNIT_WORDS), loc=loc)
        if kind == "after_n":
            if self.unit(kids[1], REPOSITION_UNIT_WORDS) != "tool_calls":
                raise self.fail(f"reposition after N {kids[1]}: expected tool_calls (a call schedule)", kids[1])
            then = None if kids[2] is None else self.number(kids[2])
            return n.RepositionAfter(self.number(kids[0]), then, loc=loc)
        if kind == "positions":
            return n.RepositionPositions(self.number(kids[0]), loc=loc)
        return n.RepositionGap(self.number(kids[0]), loc=loc)
