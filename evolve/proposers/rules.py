"""Rules over recorded timelines: which messages a candidate cache rule would drop, and when.

The model the reflect proposer and hindsight distillation (`evolve/proposers/hindsight.py`) share:
a timeline's droppable messages (`Result`: size, arrival, the requests that read it, the agent
turns after it, the call behind it, when later messages said it again) and a candidate rule
(`Rule`: a selector and the event that drops what it picks), with the first request that no
longer shows a message under a rule (`Rule.drop_at`). A rule prints as the policy language writes
it, so what is scored here is what a proposal says.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from evolve.reflection import COVER_SHARES

MIN_SHARE = 0.15        # a phrase must occur in this share of the texts it is looked for in
WORD = re.compile(r"[A-Za-z][A-Za-z'-]*[A-Za-z]")  # words of letters: no ids, numbers or codes


@dataclass(frozen=True)
class Result:
    """One message of a recorded timeline that a rule may drop (a tool result, unless `role` says
    otherwise), as the rules see it."""

    task: int             # which timeline
    tool: str | None      # the tool that answered (tool results), else None
    tokens: int
    arrived: int          # the first request that shows it
    last_read: int        # the last request that read it (arrived - 1: never read)
    turns: tuple[tuple[int, str], ...]  # (the request that first shows it, text) of each later agent turn
    steps: int            # requests of the task
    uses: tuple[int, ...] = ()  # every request that read it
    role: str = "tool"
    call: str = ""        # the call behind a tool result (`call contains`)
    covered: tuple[int | None, ...] = ()  # per COVER_SHARES: the step `covered >= P percent` drops it
    later_tools: tuple[int, ...] = ()  # the first request that shows each later tool result, in order
    group: str = ""       # the agent of its task, where the timeline names one
    index: int = -1       # its position in the task's messages
    # the requests whose copied strings `idle` credits it with: where only tool results held a string,
    # the latest of them (`policy_dsl.history`); None where the timeline has no holders (then `uses`)
    credits: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Rule:
    """A candidate rule: which messages it picks and the event that drops them.

    Picks: role `role`, with tool results narrowed by `tool` (its name) or `call` (a phrase of the
    call behind them), and any role by size (`min_tokens`). Events: the next turn saying a phrase
    (verdict), the n-th turn saying one (milestone), n turns (turns), n turns without a reuse
    (idle), later messages saying n percent of it again (covered), or n newer tool results (window:
    `keep last n`, tool results only).
    """

    tool: str | None
    min_tokens: int       # 0: any size
    event: str            # "verdict", "milestone", "turns", "idle", "covered" or "window"
    phrase: str | None
    n: int
    role: str = "tool"
    call: str | None = None

    def text(self) -> str:
        parts = [f"tool_name {json.dumps(self.tool)}"] if self.tool is not None else [f"role {self.role}"]
        if self.call is not None:
            parts.append(f"call contains {json.dumps(self.call)}")
        if self.min_tokens:
            parts.append(f"tokens > {self.min_tokens} in {max(1, self.min_tokens // 4)}..{self.min_tokens * 3}")
        if self.event == "window":
            return f"on each tool_response: drop {' and '.join(parts)} keep last {self.n} in 2..{max(48, 2 * self.n)}"
        if self.event == "verdict":
            parts.append(f"next_turn contains {json.dumps(self.phrase)}")
        elif self.event == "idle":
            parts.append(f"idle >= {self.n} in 1..{max(16, 2 * self.n)} turns")
        elif self.event == "milestone":
            parts.append(f"age >= {self.n} in 1..{max(8, 2 * self.n)} turns with {json.dumps(self.phrase)}")
        elif self.event == "covered":
            parts.append(f"covered >= {self.n} in 50..100 percent")
        else:
            parts.append(f"age >= {self.n} in 1..{max(16, 2 * self.n)} turns")
        return "on each turn: drop " + " and ".join(parts)

    def picks(self, r: Result) -> bool:
        """Whether the rule's selector, less its event, takes `r`."""
        return (r.role == self.role and (self.tool is None or r.tool == self.tool) and r.tokens > self.min_tokens
                and (self.call is None or self.call in r.call))

    def drop_at(self, r: Result) -> int | None:
        """The first request that no longer shows `r` under this rule, or None."""
        if not self.picks(r):
            return None
        if self.event == "verdict":
            return r.turns[0][0] if r.turns and self.phrase in r.turns[0][1] else None
        if self.event == "idle":
            return _idle_drop(r, self.n)
        if self.event == "covered":
            return r.covered[COVER_SHARES.index(self.n)] if r.covered else None
        if self.event == "window":
            return r.later_tools[self.n - 1] if len(r.later_tools) >= self.n else None  # the n-th newer one
        seen = 0
        for shown, said in r.turns:
            if self.event == "turns" or self.phrase in said:
                seen += 1
                if seen >= self.n:
                    return shown
        return None



def results_of(timeline: Mapping[str, Any], task: int = 0, roles: Sequence[str] = ("tool",)) -> list[Result]:
    """The messages of `roles` in one timeline (tool results: those with a tool; never the system
    prompt or the task) with the agent turns after each (the timeline's `said`)."""
    messages = timeline.get("messages") or []
    steps = int(timeline.get("steps") or 0)
    turns = [(m["i"], int(m["arrived"]), str(m.get("said") or "")) for m in messages if m.get("role") == "assistant"]
    tools = [(m["i"], int(m["arrived"])) for m in messages if m.get("role") == "tool"]
    first_user = next((m["i"] for m in messages if m.get("role") == "user"), -1)
    credits = _idle_credits(timeline)
    out = []
    for m in messages:
        role = m.get("role")
        if role not in roles or role == "tool" and not m.get("tool") or role in ("system", "developer") \
                or m["i"] == first_user:
            continue
        after = tuple((shown, said) for i, shown, said in turns if i > m["i"])
        out.append(Result(task, str(m["tool"]).split()[0] if role == "tool" else None, int(m["tokens"]),
                          int(m["arrived"]), max(m.get("uses") or [int(m["arrived"]) - 1]), after, steps,
                          tuple(int(u) for u in m.get("uses") or ()), str(role), str(m.get("call") or ""),
                          tuple(m.get("covered") or ()), tuple(shown for i, shown in tools if i > m["i"]),
                          str(timeline.get("group") or ""), int(m["i"]),
                          None if credits is None else tuple(credits.get(int(m["i"]), ()))))
    return out


def _idle_credits(timeline: Mapping[str, Any]) -> dict[int, list[int]] | None:
    """Per message, the requests at which `idle` counts it reused: a string only tool results held,
    credited to the latest of them, as the policy language reads a history (None without holders)."""
    if "reuses" not in timeline:
        return None
    roles = {int(m["i"]): m.get("role") for m in timeline.get("messages") or ()}
    out: dict[int, list[int]] = {}
    for step, found in timeline["reuses"]:
        for holders in found:
            if holders and all(roles.get(int(h)) == "tool" for h in holders):
                out.setdefault(int(max(holders)), []).append(int(step))
    return out



NEVER = 1 << 30  # a drop step: never


def _idle_drop(r: Result, n: int) -> int | None:
    """Where `idle >= n turns` drops `r`, deciding as a deployed policy would, without the future:
    each turn that reuses it (written at a request that read it) starts the count again."""
    uses, seen = set(r.uses if r.credits is None else r.credits), 0
    for shown, _said in r.turns:
        if shown - 1 in uses:   # this turn was written by a request that read r: a reuse
            seen = 0
            continue
        seen += 1
        if seen >= n:
            return shown
    return None


def drop_steps(rule: Rule, results: Sequence[Result]) -> list[int]:
    return [NEVER if (d := rule.drop_at(r)) is None else d for r in results]



def lost_reads(drops: Sequence[int], results: Sequence[Result]) -> int:
    """Reads that came after their result's drop: what a recorded agent would have lost."""
    return sum(sum(1 for use in r.uses if use >= drop) for drop, r in zip(drops, results))



def round_size(tokens: int) -> int:
    return max(100, int(round(tokens / 100.0)) * 100)


def by_task(results: Sequence[Result]) -> list[list[Result]]:
    tasks: dict[int, list[Result]] = {}
    for r in results:
        tasks.setdefault(r.task, []).append(r)
    return list(tasks.values())


def phrases(tasks: Sequence[Sequence[str]], support: int, line_starts: bool = False) -> list[str]:
    """Phrases of the agent's wording: found in at least `support` tasks and in at least MIN_SHARE of
    all the texts (each task a list of texts). Word 2- and 3-grams of each line, or (line_starts)
    the first word of each line. The share keeps out names a few hops happen to share."""
    in_tasks: dict[str, int] = {}
    in_texts: dict[str, int] = {}
    for texts in tasks:
        seen: set[str] = set()
        for text in texts:
            found: set[str] = set()
            for line in text.splitlines():
                words = WORD.findall(line)
                if line_starts:
                    found |= {words[0]} if words and line.strip().startswith(words[0]) else set()
                else:
                    found |= {" ".join(words[i:i + k]) for k in (2, 3) for i in range(len(words) - k + 1)}
            for phrase in found:
                in_texts[phrase] = in_texts.get(phrase, 0) + 1
            seen |= found
        for phrase in seen:
            in_tasks[phrase] = in_tasks.get(phrase, 0) + 1
    total = sum(len(texts) for texts in tasks)
    return sorted(p for p, c in in_tasks.items() if c >= support and in_texts[p] >= MIN_SHARE * total)
