"""The policy AST: frozen dataclasses, one per construct of the language.

A policy is a mode, an ordered list of rules and one reposition rule:

    Policy(mode, rules=(Rule(trigger, action), ...), reposition, user_observations=False,
           controller_prompts=False)

`user_observations`: a user message answering an assistant message that called no tool also
completes a call (a tool_calls unit and a batch end), as upstream's harness-named observation
boundaries do.
`controller_prompts`: a user message right after the end of a call is that call's controller
prompt, sent in the same request, so `RepositionPositions` measures the positions at its end
(upstream's prompt_end_message_ids); the reposition index is still the call's end.

Triggers (when a rule fires, evaluated at each message boundary):
    Every(n, unit) / After(n, unit, then)  unit: "tool_calls" | "turns" | "tool_responses"
                                           After with `then`: the n-th unit, then every `then` units
    TokensAbove(measure, threshold)        measure: "visible" | "history"
    VisibleToolResponses(threshold)        at least `threshold` tool responses still visible
    DropContextCalled()                    the model called the drop_context tool
    AllOf(parts) / AnyOf(parts)            two or more triggers

Actions (what a rule does) and their targets:
    Drop(target)  (kv)     Omit(target) / Remove(target)  (text)     Summarize(target, budget)  (text)
    Messages(selector, keep_last=None, until_visible=None, trigger_included=False)
    Thinking(selector=None)                the reasoning part of assistant messages

Selectors (which messages; protected messages are never selected):
    AllMessages() Role(role) ToolName(name) Age(op, n, unit) Size(op, n) Contains(text) Requested()
    Superseded()                           a tool response whose call was made again since
    Covered(share)                         at least `share` percent of its distinctive content is held by later
                                           visible messages (or the prompt)
    CallContains(text)                     the call behind a tool response (its name and arguments) contains text
    Idle(op, n, unit)                      units since the agent last reused the message's content
    NextTurnContains(text)                 the first assistant message after it (up to the boundary) contains text
    CallersOutside(n)                      assistant messages whose tool results left the last n
    Not(part) And(parts) Or(parts)

Reposition rules (each takes effect at the end of a tool batch):
    RepositionNever() RepositionEachDrop() RepositionEvery(n, unit)  unit: "drops" | "tool_calls"
    RepositionAfter(n, then)               call n, then every `then` calls, dropped or not
    RepositionGap(threshold) RepositionPositions(threshold)

Every number is a `Num`; one with a range (`12 in 4..32`) is tunable. Source locations are kept
for error messages but take no part in equality, so parse(format_policy(ast)) == ast.
A mutation operator may build, drop or swap any of these nodes; `validate` says whether the
result is a policy.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Union

from policy_dsl.errors import Loc

COMPARISONS: tuple[str, ...] = (">", ">=", "<", "<=")
COUNT_UNITS: tuple[str, ...] = ("tool_calls", "turns", "tool_responses")
ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")
REPOSITION_UNITS: tuple[str, ...] = ("drops", "tool_calls")


def _loc() -> Loc | None:
    return field(default=None, compare=False, repr=False)  # type: ignore[return-value]


@dataclass(frozen=True)
class Num:
    """An integer, optionally tunable within lo..hi (both inclusive)."""

    value: int
    lo: int | None = None
    hi: int | None = None
    loc: Loc | None = _loc()

    @property
    def tunable(self) -> bool:
        return self.lo is not None and self.hi is not None


# ---- triggers ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Every:
    n: Num
    unit: str
    loc: Loc | None = _loc()


@dataclass(frozen=True)
class After:
    n: Num
    unit: str
    then: Num | None = None  # after the n-th unit, every `then` units
    loc: Loc | None = _loc()


@dataclass(frozen=True)
class TokensAbove:
    measure: Literal["visible", "history"]
    threshold: Num
    loc: Loc | None = _loc()


@dataclass(frozen=True)
class VisibleToolResponses:
    threshold: Num
    loc: Loc | None = _loc()


@dataclass(frozen=True)
class DropContextCalled:
    loc: Loc | None = _loc()


@dataclass(frozen=True)
class AllOf:
    parts: tuple["Trigger", ...]
    loc: Loc | None = _loc()


@dataclass(frozen=True)
class AnyOf:
    parts: tuple["Trigger", ...]
    loc: Loc | None = _loc()


Trigger = Union[Every, After, TokensAbove, VisibleToolResponses, DropContextCalled, AllOf, AnyOf]


# ---- selectors ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class AllMessages:
    loc: Loc | None = _loc()


@dataclass(frozen=True)
class Role:
    role: str
    loc: Loc | None = _loc()


@dataclass(frozen=True)
class ToolName:
    name: str
    loc: Loc | None = _loc()


@dataclass(frozen=True)
class Age:
    """Messages with `op n` units completed after them, up to the boundary. With `text` (unit
    turns only), only the turns that contain it count: the agent's own milestones ("Found")."""

    op: str
    n: Num
    unit: str
    text: str | None = None
    loc: Loc | None = _loc()


@dataclass(frozen=True)
class Idle:
    """Messages with `op n` units completed since the agent last reused their content (or since
    they arrived, when no assistant message has reused it): a reuse is an assistant message that
    copies a distinctive string the message holds and only tool results hold (`policy_dsl/reuse.py`),
    so a tool result the agent quoted three turns ago is 3 turns idle, and one it never quoted is
    as idle as it is old."""

    op: str
    n: Num
    unit: str
    loc: Loc | None = _loc()


@dataclass(frozen=True)
class Size:
    op: str
    n: Num
    loc: Loc | None = _loc()


@dataclass(frozen=True)
class Contains:
    text: str
    loc: Loc | None = _loc()


@dataclass(frozen=True)
class NextTurnContains:
    """Messages whose next turn (the first assistant message after them, at or before the
    boundary) contains `text`: what the agent said about them, e.g. a tool result it then
    called irrelevant."""

    text: str
    loc: Loc | None = _loc()


@dataclass(frozen=True)
class Requested:
    loc: Loc | None = _loc()


@dataclass(frozen=True)
class Superseded:
    loc: Loc | None = _loc()


@dataclass(frozen=True)
class Covered:
    """Messages that hold distinctive content (paths, identifiers, ids, numbers, quoted phrases:
    `policy_dsl/reuse.py`) of which at least `share` percent is also held by a later message still
    visible at the boundary, or by the prompt: what they say, a newer message says again (a re-read
    of the same lines, a re-run of the same tests, a plan the agent then carried out). A message
    without distinctive content is never covered. `share` 100: all of it."""

    share: Num
    loc: Loc | None = _loc()


@dataclass(frozen=True)
class CallContains:
    """Tool responses whose call (the tool's name and its arguments' values, decoded from JSON:
    a shell command, a file path, a query) contains `text`; an assistant message matches on its
    own calls. What was asked tells what a result is: `cat` prints a file, `grep` lists places."""

    text: str
    loc: Loc | None = _loc()


@dataclass(frozen=True)
class CallersOutside:
    n: Num
    loc: Loc | None = _loc()


@dataclass(frozen=True)
class Not:
    part: "Selector"
    loc: Loc | None = _loc()


@dataclass(frozen=True)
class And:
    parts: tuple["Selector", ...]
    loc: Loc | None = _loc()


@dataclass(frozen=True)
class Or:
    parts: tuple["Selector", ...]
    loc: Loc | None = _loc()


Selector = Union[AllMessages, Role, ToolName, Age, Idle, Size, Contains, NextTurnContains, Requested, Superseded,
                 Covered, CallContains, CallersOutside, Not, And, Or]


# ---- targets and actions -----------------------------------------------------------------------

@dataclass(frozen=True)
class Messages:
    selector: Selector
    keep_last: Num | None = None
    until_visible: Num | None = None
    trigger_included: bool = False   # `until ... trigger included`: the trigger may be dropped too (last)
    loc: Loc | None = _loc()


@dataclass(frozen=True)
class Thinking:
    selector: Selector | None = None
    loc: Loc | None = _loc()


Target = Union[Messages, Thinking]


@dataclass(frozen=True)
class Drop:
    target: Target
    loc: Loc | None = _loc()


@dataclass(frozen=True)
class Omit:
    target: Target
    loc: Loc | None = _loc()


@dataclass(frozen=True)
class Remove:
    target: Target
    loc: Loc | None = _loc()


@dataclass(frozen=True)
class Summarize:
    target: Target
    budget: Num
    loc: Loc | None = _loc()


@dataclass(frozen=True)
class Cut:
    """Cut the text after (side "after") or before ("before") the first occurrence of `marker` in
    each picked message's content; the marker itself stays. Mode kv, as the API's keep_text_drop."""

    side: str
    marker: str
    target: Target
    loc: Loc | None = _loc()


CUT_SIDES = ("after", "before")
Action = Union[Drop, Omit, Remove, Summarize, Cut]


# ---- reposition --------------------------------------------------------------------------------

@dataclass(frozen=True)
class RepositionNever:
    loc: Loc | None = _loc()


@dataclass(frozen=True)
class RepositionEachDrop:
    loc: Loc | None = _loc()


@dataclass(frozen=True)
class RepositionEvery:
    n: Num
    unit: str
    loc: Loc | None = _loc()


@dataclass(frozen=True)
class RepositionAfter:
    n: Num
    then: Num | None = None
    loc: Loc | None = _loc()


@dataclass(frozen=True)
class RepositionGap:
    threshold: Num
    loc: Loc | None = _loc()


@dataclass(frozen=True)
class RepositionPositions:
    threshold: Num
    loc: Loc | None = _loc()


RepositionRule = Union[RepositionNever, RepositionEachDrop, RepositionEvery, RepositionAfter, RepositionGap,
                       RepositionPositions]


# ---- the policy --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rule:
    trigger: Trigger
    action: Action
    loc: Loc | None = _loc()


@dataclass(frozen=True)
class Policy:
    mode: str
    rules: tuple[Rule, ...] = ()
    reposition: RepositionRule = field(default_factory=RepositionNever)
    user_observations: bool = False
    controller_prompts: bool = False
    loc: Loc | None = _loc()
    controller_prompts_loc: Loc | None = _loc()  # the `calls include controller_prompts` line
