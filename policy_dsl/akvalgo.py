"""Upstream akvalgo's `AKVPolicy` options: our policies as its keyword arguments, and a reader of them.

    options = to_akvalgo(ast, filename="p.akvp")   # NotExpressible names the first construct it cannot map
    options.kwargs()                               # {"keep_tool_responses": 12, "mode": "kv_drop", ...}
    decision = decide_akvalgo(options, history, counter)   # what those options decide, as a Decision

The reader interprets the options as upstream documents and implements them (docs/policy-dsl.md,
"Upstream akvalgo options"): with no drop trigger the window rolls on each new tool message (the
(K+1)-th drops the oldest visible one); drop triggers and repositions act only at the end of a tool
batch (its last tool message answering one assistant message); a scheduled reposition happens even
when nothing new was dropped; with no reposition option nothing is ever repositioned.

The exporter maps a policy only where the reader decides exactly as our policy does on every
history upstream decides, parallel tool batches included; everything else is refused with the
reason. Where that takes more than the options (a token counter, requests that end at their last
call), `options.conditions()` says so, and the export states it beside the options.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Mapping, Sequence

from policy_dsl import nodes as n
from policy_dsl.counter import ApproxTokenCounter, TokenCounter
from policy_dsl.decision import Decision, TextEdit
from policy_dsl.evaluate import on_schedule
from policy_dsl.errors import Loc, PolicyError
from policy_dsl.history import HistoryView, view_history
from policy_dsl.printer import format_reposition, format_selector, format_target, format_trigger

MODES = ("kv_drop", "text_drop")
ROLLING_TARGETS = ("tool", "assistant", "both")
DROP_TRIGGERS = ("drop_after_call", "drop_trigger_tokens", "drop_trigger_responses")
TOKEN_OPTIONS = ("drop_trigger_tokens", "reposition_trigger_tokens", "drop_target_tokens")
REPOSITION_OPTIONS = ("reposition_after_call", "reposition_trigger_tokens")
RECOVERED_TOOL_CALLS_KEY = "contextualize_recovered_tool_calls"  # upstream's client metadata for text calls
# Selectors on what no AKVPolicy option reads, refused wherever they stand, with the reason.
UNREADABLE: dict[type, str] = {
    n.Covered: "no AKVPolicy option reads whether other messages say a message's content again (content "
               "coverage); upstream rolls tool responses out by recency only",
    n.CallContains: "no AKVPolicy option reads the call behind a tool response (its tool and arguments: a "
                    "command, a path); upstream rolls tool responses out by recency only",
}


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

    def conditions(self) -> list[str]:
        """What besides the options the harness must hold to for them to decide as the exported
        policy: upstream's token options need its token_counter, and it decides token repositions
        for a request that ends at its last call only. Empty: the options alone decide the same."""
        out = []
        if self.reposition_trigger_tokens == 1:
            out.append("reposition_trigger_tokens=1 repositions at the end of every call that left a drop "
                       "since the last reposition (what `reposition after each drop` does): AKVPolicy needs a "
                       "token_counter for it, and any counter that counts each message as at least one token "
                       "decides the same")
        counted = [self.drop_trigger_tokens, self.drop_target_tokens,
                   None if self.reposition_trigger_tokens == 1 else self.reposition_trigger_tokens]
        if any(t is not None for t in counted):
            out.append("token thresholds: AKVPolicy's token_counter must count as the policy's counter did "
                       "(upstream's counts the rendered prompt, tool declarations and generation header "
                       "included; ours sums the messages)")
        if self.drop_trigger is not None or any(getattr(self, r) is not None for r in REPOSITION_OPTIONS):
            out.append("call boundaries: the policy counts an assistant message's tool_calls; upstream also counts "
                       "calls a client recovered from its text (contextualize_recovered_tool_calls), so the two "
                       "agree on histories without recovered calls")
        if self.reposition_trigger_tokens is not None:
            out.append("reposition_trigger_tokens: upstream decides a request only when it ends at its last "
                       "call (the call's tool results, or its controller prompt named in "
                       "prompt_end_message_ids; reasoning alone may follow); it refuses others, e.g. a user "
                       "message after a call, which the policy decides")
        return out


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
    if o.drop_target_tokens is not None and not triggers:
        raise AkvalgoError("drop_target_tokens: needs a drop trigger")
    if o.drop_target_tokens is not None and o.drop_trigger_tokens is not None and \
            o.drop_target_tokens >= o.drop_trigger_tokens:
        raise AkvalgoError("drop_target_tokens: must be below drop_trigger_tokens")
    if o.drop_trigger_responses is not None and o.drop_target_tokens is None and \
            o.drop_trigger_responses <= o.keep_tool_responses:
        raise AkvalgoError("drop_trigger_responses: must exceed keep_tool_responses")
    if o.reposition_interval_calls is not None and o.reposition_after_call is None:
        raise AkvalgoError("reposition_interval_calls: needs reposition_after_call")
    if o.reposition_trigger_tokens is not None and o.reposition_after_call is not None:
        raise AkvalgoError("reposition_trigger_tokens: use either token or call-based reposition "
                           "(reposition_after_call is set)")
    repositions = [r for r in ("reposition_after_call", "reposition_interval_calls", "reposition_trigger_tokens")
                   if getattr(o, r) is not None]
    if repositions and o.mode != "kv_drop":
        raise AkvalgoError(f"{repositions[0]}: reposition needs mode kv_drop")


# ---- the reader ----------------------------------------------------------------------------------

def decide_akvalgo(options: AkvalgoOptions, history: Sequence[Mapping[str, Any]],
                   counter: TokenCounter | None = None, user_observations: bool = False,
                   prompt_end_message_ids: Mapping[int, int] | None = None) -> Decision:
    """What `options` decide for `history` (cumulative, like our kv policies); AkvalgoError when unsure.

    In `text_drop` the history is the full one the caller keeps, and the decision's text edits
    remove what upstream leaves out of the messages it sends. `user_observations`: the harness
    names every user observation as a call boundary (adapt_request's completed_call_message_ids);
    as upstream, drop triggers are refused only where one of them is among the call ends. Calls a
    client recovered from an assistant message's text (RECOVERED_TOOL_CALLS_KEY) count as its calls.
    `prompt_end_message_ids`: call end b -> b + 1, the controller prompt the harness sends right
    after that call's results (`controller_prompt_ids`); `reposition_trigger_tokens` then measures
    the positions at the prompt's end. With token repositions the history must end at its last
    call (or that call's named prompt), as upstream decides them for the current request only.
    """
    if options.needs_counter() and counter is None:
        raise AkvalgoError(f"{next(t for t in TOKEN_OPTIONS if getattr(options, t) is not None)}: "
                           "token thresholds need a token_counter")
    view = _view(history, counter or ApproxTokenCounter(), user_observations)
    observed = next((i for i in range(len(view)) if view.batch_end[i] and view.roles[i] == "user"), None)
    if observed is not None and options.drop_trigger is not None:
        raise AkvalgoError(f"{options.drop_trigger}: triggered drops need tool-batch boundaries; upstream refuses "
                           f"user observations among them (message {observed})")
    prompts = _check_prompt_ends(prompt_end_message_ids or {}, view)
    if options.reposition_trigger_tokens is not None:
        _check_current_call(view, history, prompts)
    state = _Walk(prompts)
    for i in range(len(view)):
        state.step(options, view, i)
    if options.mode == "text_drop":
        gone = sorted(j for picks in state.drop_message.values() for j in picks)
        return Decision(text_edits=tuple(TextEdit("remove", j, j) for j in gone))
    return Decision(drop_message=state.drop_message, reposition=state.reposition)


def _view(history: Sequence[Mapping[str, Any]], counter: TokenCounter, user_observations: bool) -> HistoryView:
    """The history as upstream reads it: an assistant message without `tool_calls` whose calls the
    client recovered from its text (RECOVERED_TOOL_CALLS_KEY) calls them, so their results form one
    batch; the tokens stay those of the messages as sent (upstream leaves the recovered calls out)."""
    view = view_history(history, counter, user_observations)
    calls = [_recovered_calls(m) for m in history]
    if not any(calls):
        return view
    called = [{**m, "tool_calls": c} if c else m for m, c in zip(history, calls)]
    return replace(view_history(called, counter, user_observations), tokens=view.tokens)


def _recovered_calls(message: Mapping[str, Any]) -> list[Any]:
    """Upstream's `history_tool_calls` where it differs from ours: `tool_calls` when there are any,
    else the recovered ones."""
    recovered = message.get(RECOVERED_TOOL_CALLS_KEY)
    if message.get("tool_calls") or not isinstance(recovered, Mapping):
        return []
    calls = recovered.get("tool_calls")
    return list(calls) if isinstance(calls, list) else []


def controller_prompt_ids(history: Sequence[Mapping[str, Any]], user_observations: bool = False) -> dict[int, int]:
    """The `prompt_end_message_ids` a harness passes when the user message right after each call
    is that call's controller prompt: what `calls include controller_prompts` reads from the messages."""
    return _view(history, ApproxTokenCounter(), user_observations).prompt_ends()


def _check_prompt_ends(prompts: Mapping[int, int], view: HistoryView) -> dict[int, int]:
    """Upstream's rule for prompt_end_message_ids: each call end b maps to b + 1, a user message."""
    for b, end in prompts.items():
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (b, end)):
            raise AkvalgoError(f"prompt_end_message_ids: {b!r} -> {end!r}: expected message ids (integers)")
        if not 0 <= b < len(view) or not view.batch_end[b]:
            raise AkvalgoError(f"prompt_end_message_ids: {b}: not the end of a call in this history (the last "
                               "tool response of a batch, or a user observation)")
        if end != b + 1 or end >= len(view) or view.roles[end] != "user":
            raise AkvalgoError(f"prompt_end_message_ids: {b} -> {end}: expected {b + 1}, a user message right "
                               "after the call (its controller prompt)")
    return dict(prompts)


def _check_current_call(view: HistoryView, history: Sequence[Mapping[str, Any]], prompts: Mapping[int, int]) -> None:
    """Upstream decides token repositions for the current request only: after the end of the last
    call (its controller prompt, when named) only assistant messages holding reasoning alone may follow."""
    ends = [i for i in range(len(view)) if view.batch_end[i]]
    if not ends:
        return
    end = prompts.get(ends[-1], ends[-1])
    for j in range(end + 1, len(history)):
        m = history[j]
        if m.get("role") == "assistant" and not m.get("content") and not m.get("tool_calls") and \
                str(m.get("reasoning_content") or "").strip():
            continue
        hint = " (a controller prompt? name it in prompt_end_message_ids)" if view.controller_prompt[j] else ""
        raise AkvalgoError(f"reposition_trigger_tokens: message {j} ({m.get('role')}) follows the end of the last "
                           f"call (message {end}){hint}; upstream's token repositions need the current generation "
                           "boundary, a history that ends with its last call")


class _Walk:
    """The reader's state after each message: visible tool responses and callers, tokens, positions."""

    def __init__(self, prompts: Mapping[int, int]) -> None:
        self.prompts = prompts             # call end -> its controller prompt (prompt_end_message_ids)
        self.live_tools: list[int] = []    # tool messages still visible, oldest first
        self.callers: list[int] = []       # assistant messages still visible
        self.drop_message: dict[str, list[int]] = {}
        self.reposition: list[int] = []
        self.visible = self.positions = 0

    def step(self, o: AkvalgoOptions, view: HistoryView, i: int) -> None:
        self.visible, self.positions = self.visible + view.tokens[i], self.positions + view.tokens[i]
        if view.roles[i] == "tool":
            self.live_tools.append(i)
        elif view.roles[i] == "assistant":
            self.callers.append(i)
        fired = _drop_fires(o, view, i, self.visible, len(self.live_tools))
        rolled = self._tool_picks(o, view) if fired else []
        self.live_tools = [j for j in self.live_tools if j not in rolled]  # the window rolls on
        picks = [] if o.rolling_drop_target == "assistant" else rolled
        if o.rolling_drop_target != "tool":
            picks = picks + self._retired_callers(o, view, i)
        self.visible -= sum(view.tokens[j] for j in picks)
        if picks:
            self.drop_message[str(i)] = sorted(picks)
        # the positions at the end of the request: the call's controller prompt, when named, counts
        ahead = sum(view.tokens[i + 1: self.prompts.get(i, i) + 1])
        if view.batch_end[i] and _reposition_fires(o, view.tool_calls[i], self.positions + ahead,
                                                   self.positions - self.visible):
            self.reposition.append(i)
            self.positions = self.visible  # survivors now sit at 0..visible-1

    def _tool_picks(self, o: AkvalgoOptions, view: HistoryView) -> list[int]:
        """The rolled-out tool responses: beyond the last K, or oldest first down to drop_target_tokens
        (the response that triggered it included)."""
        if o.drop_target_tokens is None:
            return self.live_tools[: -o.keep_tool_responses]
        picks, visible = [], self.visible
        for j in self.live_tools:
            if visible <= o.drop_target_tokens:
                break
            picks.append(j)
            visible -= view.tokens[j]
        return picks

    def _retired_callers(self, o: AkvalgoOptions, view: HistoryView, i: int) -> list[int]:
        """Assistant messages whose whole tool batch has left the window of the last K tool responses."""
        def retired(j: int) -> bool:
            end = view.results_end[j]
            return end is not None and end <= i and \
                view.count("tool_responses", i) - view.count("tool_responses", end) >= o.keep_tool_responses
        out = [j for j in self.callers if retired(j)]
        self.callers = [j for j in self.callers if j not in out]
        return out


def _drop_fires(o: AkvalgoOptions, view: HistoryView, i: int, visible: int, live_tools: int) -> bool:
    """Rolling: every tool message beyond the window. Triggers: at a batch end, on their condition."""
    if o.drop_trigger is None:
        return view.roles[i] == "tool" and live_tools > o.keep_tool_responses
    if not view.batch_end[i]:
        return False
    if o.drop_after_call is not None:
        return on_schedule(view.tool_calls[i], o.drop_after_call, o.drop_interval_calls)
    if o.drop_trigger_tokens is not None:
        return visible > o.drop_trigger_tokens
    return live_tools >= o.drop_trigger_responses  # type: ignore[operator]


def _reposition_fires(o: AkvalgoOptions, call: int, positions: int, gap: int) -> bool:
    """At the end of call number `call`: on the call schedule (whether or not anything new was
    dropped), or when the next free position passes the threshold and a drop left a gap."""
    if o.reposition_after_call is not None:
        return on_schedule(call, o.reposition_after_call, o.reposition_interval_calls)
    return o.reposition_trigger_tokens is not None and positions > o.reposition_trigger_tokens and gap > 0


# ---- the exporter ---------------------------------------------------------------------------------

def to_akvalgo(policy: n.Policy, filename: str = "<policy>") -> AkvalgoOptions:
    """The options that decide exactly as `policy`; NotExpressible at the first construct that has none."""
    def refuse(node: Any, construct: str, why: str) -> NotExpressible:
        loc = (node if isinstance(node, Loc) else getattr(node, "loc", None)) or Loc()  # a node, or a line's place
        return NotExpressible(f"{construct}: {why}", filename=filename, line=loc.line, column=loc.column)

    if not policy.rules:
        raise refuse(policy, "a policy with no rule", "it never drops, and AKVPolicy needs keep_tool_responses "
                     "> 0; send requests without a policy instead")
    if policy.user_observations:
        raise refuse(policy, "calls include user_observations", "not an AKVPolicy option: upstream's harness "
                     "names them per request (adapt_request's completed_call_message_ids); export the policy "
                     "without this line and pass the boundaries there")
    if policy.controller_prompts:
        raise refuse(policy.controller_prompts_loc or policy, "calls include controller_prompts", "not an AKVPolicy "
                     "option: upstream's harness names them per request (prompt_end_message_ids, which "
                     "controller_prompt_ids lists); export the policy without this line and pass them there")
    cut = next((rule.action for rule in policy.rules if isinstance(rule.action, n.Cut)), None)
    if cut is not None:
        raise refuse(cut, "cut", "AKVPolicy drops whole messages only; a cut is the API's keep_text_drop, "
                     "which upstream's server takes from the client directly")
    unread = _first_unreadable(policy)
    if unread is not None:
        raise refuse(unread, format_selector(unread), UNREADABLE[type(unread)])
    if policy.mode == "text":
        return _text_drop_options(policy, refuse)
    target, rules = _rolling_target(policy.rules, refuse)
    if target != "tool":
        options = AkvalgoOptions(keep_tool_responses=rules, rolling_drop_target=target)
    else:
        options = _tool_rule_options(policy.rules[0], refuse)
        if len(policy.rules) > 1:  # named after the first rule's own constructs, which say more
            raise refuse(policy.rules[1], "a second rule", "AKVPolicy has one drop rule (two only for "
                         "rolling_drop_target both: the tool window, then `drop callers outside last K`)")
    return _with_reposition(policy.reposition, options, refuse)


def _tool_rule_options(rule: n.Rule, refuse: Any) -> AkvalgoOptions:
    """The options of one rule that rolls out tool responses. Its selector is checked before its
    trigger: a trigger has near forms that map, a selector by name, size, age or content has none."""
    window = _window(rule.action, refuse)
    trigger = _trigger_options(rule.trigger, refuse)
    _check_response_trigger(rule, {**window, **trigger}, refuse)
    _check_target(rule, {**window, **trigger}, refuse)
    return AkvalgoOptions(**window, **trigger)


def _rolling_target(rules: tuple[n.Rule, ...], refuse: Any) -> tuple[str, int]:
    """rolling_drop_target from the rules' shape: `drop callers outside last K` alone (assistant) or
    after the tool window of the same K (both); one tool rule otherwise (tool)."""
    rolling = n.Every(n.Num(1), "tool_responses")
    callers = [r for r in rules if isinstance(r.action.target, n.Messages)
               and isinstance(r.action.target.selector, n.CallersOutside)]
    if not callers:
        return "tool", 0  # one rule: the caller refuses a second one after naming the first one's constructs
    rule = callers[0]
    k = rule.action.target.selector.n.value
    if _bare(rule) != n.Rule(rolling, n.Drop(n.Messages(n.CallersOutside(n.Num(k))))):
        raise refuse(rule, "callers outside", "upstream retires callers on each tool response, with no other "
                     "selector or modifier: write `on each tool_response: drop callers outside last K`")
    if len(rules) == 1:
        return "assistant", k
    window = n.Rule(rolling, n.Drop(n.Messages(n.Role("tool"), keep_last=n.Num(k))))
    if len(rules) > 2 or _bare(rules[0]) != window or rules[1] is not rule:
        raise refuse(rules[0], "rules beside callers outside", "rolling_drop_target both is the tool window "
                     f"`on each tool_response: drop role tool keep last {k}` followed by the callers rule")
    return "both", k


def _bare(rule: n.Rule) -> n.Rule:
    """The rule without ranges on its numbers (a range only guides a search)."""
    from policy_dsl.tunables import without_ranges
    return without_ranges(n.Policy("kv", (rule,))).rules[0]


def _text_drop_options(policy: n.Policy, refuse: Any) -> AkvalgoOptions:
    """mode text_drop: `on visible_tool_responses >= K+1: remove role tool keep last K`, the one text form
    that removes what upstream's text_drop leaves out of the history, on the history as sent."""
    rule = policy.rules[0]
    target = rule.action.target
    if not isinstance(rule.action, n.Remove):
        raise refuse(rule.action, "mode text", "upstream's text_drop removes rolled-out messages; this policy "
                     "summarizes or omits with placeholders")
    if len(policy.rules) > 1:
        raise refuse(policy.rules[1], "a second rule", "text_drop exports one `remove role tool keep last K`")
    keep = target.keep_last.value if isinstance(target, n.Messages) and target.keep_last else 0
    shape = n.Rule(n.VisibleToolResponses(n.Num(keep + 1)), n.Remove(n.Messages(n.Role("tool"),
                                                                                   keep_last=n.Num(keep))))
    if keep < 1 or _bare(rule) != shape:
        raise refuse(rule, "mode text", "text_drop is exported from `on visible_tool_responses >= K+1: "
                     "remove role tool keep last K` (K >= 1) only")
    return AkvalgoOptions(keep_tool_responses=keep, mode="text_drop")


def _trigger_options(trigger: n.Trigger, refuse: Any) -> dict[str, int]:
    """The drop trigger: none (a rolling window), a call schedule, or a visible-token or response threshold."""
    text = format_trigger(trigger)
    if isinstance(trigger, n.Every) and trigger.unit == "tool_responses":
        if trigger.n.value == 1:
            return {}
        raise refuse(trigger, text, "upstream's window rolls on every tool response, not every "
                     f"{trigger.n.value}")
    if isinstance(trigger, n.Every) and trigger.unit == "tool_calls":
        return {"drop_after_call": trigger.n.value, "drop_interval_calls": trigger.n.value}
    if isinstance(trigger, n.After) and trigger.unit == "tool_calls":
        then = {} if trigger.then is None else {"drop_interval_calls": trigger.then.value}
        return {"drop_after_call": trigger.n.value, **then}
    if isinstance(trigger, n.AllOf) and len(trigger.parts) == 2:
        batch = [p for p in trigger.parts if isinstance(p, n.Every) and p.unit == "tool_calls" and p.n.value == 1]
        tokens = [p for p in trigger.parts if isinstance(p, n.TokensAbove) and p.measure == "visible"]
        responses = [p for p in trigger.parts if isinstance(p, n.VisibleToolResponses)]
        if batch and tokens:
            return {"drop_trigger_tokens": tokens[0].threshold.value}
        if batch and responses:
            return {"drop_trigger_responses": responses[0].threshold.value}
    if isinstance(trigger, (n.TokensAbove, n.VisibleToolResponses)):
        raise refuse(trigger, text, "checked after every message; upstream's thresholds are checked at the end "
                     f"of a tool batch (write `each tool_call and {text}`)")
    raise refuse(trigger, text, "akvalgo drops on each tool response, on a tool-call schedule or above a "
                 "visible-token or tool-response count at the end of a tool batch")


def _window(action: n.Action, refuse: Any) -> dict[str, int]:
    """keep_tool_responses (K >= 1): the action must pick tool responses only."""
    target = action.target
    if isinstance(target, n.Thinking):
        raise refuse(target, format_target(target), "akvalgo has no thinking drop")
    content = _first_contains(target.selector)
    if content is not None:
        raise refuse(content, format_selector(content), "a content-based selector; akvalgo options choose by "
                     "role and recency only, never by message content")
    if target.selector != n.Role("tool"):
        raise refuse(target.selector, format_selector(target.selector), "akvalgo rolls out tool responses "
                     "only (`role tool`), by recency (`keep last K`); no option selects by tool name, size, "
                     "age, content, the agent's words or its requests")
    if target.until_visible is not None and not target.trigger_included:
        raise refuse(target.until_visible, "until visible_tokens", "upstream's drop_target_tokens may drop the "
                     "response that triggered it, which this form never does: write `until visible_tokens <= "
                     f"{target.until_visible.value} trigger included`")
    if target.until_visible is not None:
        if target.keep_last is not None:
            raise refuse(target.keep_last, "keep last", "with drop_target_tokens upstream keeps no window: it "
                         "drops oldest first down to the target; write the rule without `keep last`")
        # keep_tool_responses is required (> 0) but decides nothing beside drop_target_tokens.
        return {"keep_tool_responses": 1, "drop_target_tokens": target.until_visible.value}
    if target.keep_last is None or target.keep_last.value < 1:
        raise refuse(target, format_target(target), "AKVPolicy keeps keep_tool_responses > 0 tool responses; "
                     "write `keep last K` with K >= 1")
    return {"keep_tool_responses": target.keep_last.value}


def _check_response_trigger(rule: n.Rule, options: dict[str, int], refuse: Any) -> None:
    responses, keep = options.get("drop_trigger_responses"), options["keep_tool_responses"]
    if responses is not None and responses <= keep and "drop_target_tokens" not in options:
        raise refuse(rule.trigger, format_trigger(rule.trigger), "upstream needs drop_trigger_responses "
                     f"above keep_tool_responses ({keep})")


def _check_target(rule: n.Rule, options: dict[str, int], refuse: Any) -> None:
    """drop_target_tokens needs a drop trigger, and a target below a token trigger's threshold."""
    target = options.get("drop_target_tokens")
    if target is None:
        return
    if not any(t in options for t in DROP_TRIGGERS):
        raise refuse(rule.trigger, format_trigger(rule.trigger), "upstream drops down to drop_target_tokens only "
                     "on a drop trigger (a call schedule, or `each tool_call and visible_tokens > T` or "
                     "`... and visible_tool_responses >= R`)")
    if target >= options.get("drop_trigger_tokens", target + 1):
        raise refuse(rule.action.target.until_visible, "until visible_tokens", "upstream needs drop_target_tokens "
                     f"below drop_trigger_tokens ({options['drop_trigger_tokens']})")


def _first_contains(selector: n.Selector) -> n.Contains | None:
    return _first_of(selector, (n.Contains,))  # type: ignore[return-value]


def _first_unreadable(policy: n.Policy) -> n.Selector | None:
    """The first `covered` or `call contains` of the policy's rules, in rule order."""
    for rule in policy.rules:
        selector = getattr(rule.action.target, "selector", None)
        found = None if selector is None else _first_of(selector, tuple(UNREADABLE))
        if found is not None:
            return found
    return None


def _first_of(selector: n.Selector, kinds: tuple[type, ...]) -> n.Selector | None:
    if isinstance(selector, kinds):
        return selector
    parts = (selector.part,) if isinstance(selector, n.Not) else getattr(selector, "parts", ())
    return next((c for c in (_first_of(p, kinds) for p in parts) if c is not None), None)


def _with_reposition(rule: n.RepositionRule, options: AkvalgoOptions, refuse: Any) -> AkvalgoOptions:
    """The reposition options of our rule, or why it has none."""
    if isinstance(rule, n.RepositionNever):
        return options
    if isinstance(rule, n.RepositionAfter):
        then = None if rule.then is None else rule.then.value
        return replace(options, reposition_after_call=rule.n.value, reposition_interval_calls=then)
    if isinstance(rule, n.RepositionPositions):
        return replace(options, reposition_trigger_tokens=rule.threshold.value)
    each_drop = isinstance(rule, n.RepositionEachDrop) or \
        (isinstance(rule, n.RepositionEvery) and rule.unit == "drops" and rule.n.value == 1)
    if each_drop:
        # Upstream's token repositions fire at a call's end when the next free position exceeds T and
        # a drop since the last reposition left a gap. With T=1 only the gap is left to test, and as
        # ours repositions at the end of every call that dropped, a drop since then is one in this call.
        return replace(options, reposition_trigger_tokens=1)
    text = f"reposition {format_reposition(rule)}"
    if isinstance(rule, n.RepositionEvery) and rule.unit == "drops":
        raise refuse(rule, text, "counts drop events; upstream repositions on a call schedule or a position "
                     "threshold (`reposition after each drop` maps, as reposition_trigger_tokens=1)")
    if isinstance(rule, n.RepositionEvery):
        raise refuse(rule, text, "skips a scheduled reposition when no drop left a gap; upstream's schedule "
                     f"repositions even when nothing new was dropped (write `reposition after {rule.n.value} "
                     f"tool_calls then every {rule.n.value}`)")
    raise refuse(rule, text, "no akvalgo option repositions on the size of the gap")
