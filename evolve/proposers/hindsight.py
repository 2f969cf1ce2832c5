"""Hindsight distillation: the cache rules a recorded trace set's own use records say are safe.

On recorded traffic every policy runs the very same requests, so the timelines of `full` say, for
every message the agent could have had hidden, which later requests read it (its use records)
and how many tokens it kept visible after its last read: the hindsight oracle drops each message
right there, and the gap between the oracle and a policy is the visible tokens that policy paid
for in vain. Distillation asks which rules of the language a deployed policy could run (it sees
only the past) remove the most of those tokens while losing no more reads than a budget, the
parent's own losses: the champion rule's question (cheaper, at a score no worse) asked of the
train traces.

The rules looked at are every selector the timelines can tell apart (`hindsight_rules`): tool
results, the agent's own messages and the user's turns, narrowed by size (the eighths of each
role's sizes), by the call behind a tool result (a command word the train traces share), by the
tool's name (only where most train traces call it: a trace set of several agents shares few),
each with an event that drops what they pick: later messages saying P percent of it again
(`covered`), n turns without a reuse (`idle`), n turns (`age`), the agent's next turn saying a
phrase, or the n-th turn that says one; and windows over tool results (`keep last N`).

Two ways at once, as a person reads a policy's timelines: what the parent lost is loosened (its
window widened, or none) and what it kept that nobody read again is tightened (the rules added
to that base), within the budget; `compose` tries every base. Scoring is vectorized over every
message of the timelines, so a trace set of a few thousand messages distils in seconds.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from evolve.proposers.rules import NEVER, Result, Rule, by_task, drop_steps, phrases, round_size
from evolve.reflection import COVER_SHARES

MAX_RULES = 4            # rules added to a base window
SIZE_CLASSES = 8         # messages over each eighth of a role's sizes (and all of them)
COUNTS = tuple(range(1, 24, 2))   # turn counts tried (age, idle)
WINDOWS = (4, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32)  # keep last N tool results
MIN_SUPPORT = 3          # a phrase or a call word must occur in this many tasks ...
CALL_SHARE = 0.15        # ... and in this share of the tasks with tool results
TOOL_SHARE = 0.5         # a tool is named only when this share of the tasks with tool results call it
CALL_WORDS = 12          # most call words kept (by the tasks they occur in)
_SEGMENT = re.compile(r"&&|\|\||[|;]")
_COMMAND = re.compile(r"[A-Za-z_][\w.-]*(?: -[A-Za-z]+)?")


@dataclass(frozen=True)
class Composition:
    """A rule set (a base window or none, then the rules added) with what it does on the timelines."""

    rules: tuple[Rule, ...]
    saved: float     # visible tokens no longer paid for, summed over the requests
    lost: int        # reads that came after the drop of what they read
    budget: int      # the losses it was chosen within

    def texts(self) -> list[str]:
        return [rule.text() for rule in self.rules]


Reuse = tuple[int, int, tuple[int, ...]]  # (task, step, the messages holding the copied string)


def reuses_of(timelines: Sequence[Mapping[str, Any]]) -> list[Reuse] | None:
    """Every copied string of the timelines (their `reuses`), by task number; None unless all have them."""
    if not timelines or any("reuses" not in t for t in timelines):
        return None
    return [(n, int(step), tuple(int(h) for h in holders)) for n, t in enumerate(timelines)
            for step, found in t["reuses"] for holders in found]


class Table:
    """The timelines' messages as arrays: what a set of drop steps saves and loses, at once.

    Losses, with `reuses` (recorded traces): the copied strings whose every holder was hidden at the
    step that copied them, as the fidelity score counts them; without, the reads (use records) that
    came after their message's drop. A holder that is not among `results` (the prompt) is never hidden.
    """

    def __init__(self, results: Sequence[Result], reuses: Sequence[Reuse] | None = None) -> None:
        self.results = list(results)
        self.tokens = np.array([r.tokens for r in results], dtype=np.float64)
        self.steps = np.array([r.steps for r in results], dtype=np.int64)
        self.never = np.full(len(results), NEVER, dtype=np.int64)
        if reuses is None:
            owners = [(k, u) for k, r in enumerate(results) for u in r.uses]
        else:
            position = {(r.task, r.index): k for k, r in enumerate(results)}
            owners = []
            for task, step, holders in reuses:
                found = [position.get((task, h)) for h in holders]
                if holders and None not in found:   # a holder no rule hides keeps it
                    owners += [(k, step) for k in found]
                    owners.append((-1, -1))   # the end of one copied string's holders
        self._grouped = reuses is not None
        self.use_owner = np.array([k for k, _u in owners], dtype=np.int64)
        self.use_step = np.array([u for _k, u in owners], dtype=np.int64)
        if self._grouped:
            ends = np.flatnonzero(self.use_owner < 0)
            self._starts = np.concatenate(([0], ends[:-1] + 1)) if ends.size else np.zeros(0, dtype=np.int64)
            self._entry_step = self.use_step[ends - 1] if ends.size else np.zeros(0, dtype=np.int64)

    def drops(self, rule: Rule) -> np.ndarray:
        return np.array(drop_steps(rule, self.results), dtype=np.int64)

    def saved(self, drops: np.ndarray) -> float:
        return float(np.sum(self.tokens * np.clip(self.steps - drops, 0, None)))

    def lost(self, drops: np.ndarray) -> int:
        if not self.use_owner.size:
            return 0
        if not self._grouped:
            return int(np.sum(self.use_step >= drops[self.use_owner]))
        shown = np.where(self.use_owner >= 0, drops[np.maximum(self.use_owner, 0)], 0)
        latest = np.maximum.reduceat(shown, self._starts)   # the last holder to go: gone from then on
        return int(np.sum(latest <= self._entry_step))

    def oracle_saved(self) -> float:
        """What dropping every message right after its last read saves: the ceiling of `saved`."""
        last = np.array([r.last_read + 1 for r in self.results], dtype=np.int64)
        return self.saved(np.maximum(last, np.array([r.arrived for r in self.results], dtype=np.int64)))


def hindsight_rules(results: Sequence[Result], said: Sequence[Sequence[str]]) -> list[Rule]:
    """Every candidate rule over `results` (module docstring); `said` is the agent's texts per task."""
    rules: list[Rule] = []
    support = max(MIN_SUPPORT, (len(said) + 1) // 2)
    milestones = phrases(said, support, line_starts=True)
    for role in sorted({r.role for r in results}):
        mine = [r for r in results if r.role == role]
        for scope in _scopes(role, mine):
            picked = [r for r in mine if scope.picks(r)]
            if not picked:
                continue
            rules += [_with(scope, "covered", None, share) for share in COVER_SHARES]
            rules += [_with(scope, "turns", None, n) for n in COUNTS]
            if role == "tool":   # `idle` counts reuses only tool results held: the others are as idle as old
                rules += [_with(scope, "idle", None, n) for n in COUNTS]
                verdicts = phrases([[r.turns[0][1] for r in task if r.turns] for task in by_task(picked)], support)
                rules += [_with(scope, "verdict", p, 1) for p in verdicts]
            rules += [_with(scope, "milestone", p, k) for p in milestones for k in (1, 2, 4, 6)]
            if role == "tool" and scope.tool is None and scope.call is None and not scope.min_tokens:
                rules += [_with(scope, "window", None, n) for n in WINDOWS]
    return rules


def _with(scope: Rule, event: str, phrase: str | None, n: int) -> Rule:
    return Rule(scope.tool, scope.min_tokens, event, phrase, n, scope.role, scope.call)


def _scopes(role: str, mine: Sequence[Result]) -> Iterable[Rule]:
    """The selectors of `role` worth an event: all of it, each size class, and for tool results the
    calls' command words and the tool names the train traces share."""
    sizes = sorted(r.tokens for r in mine)
    classes = sorted({0, *(round_size(sizes[len(sizes) * q // SIZE_CLASSES]) for q in range(1, SIZE_CLASSES))})
    yield from (Rule(None, size, "", None, 0, role) for size in classes)
    if role != "tool":
        return
    for word in call_words(mine):
        yield Rule(None, 0, "", None, 0, role, word)
    for tool in shared_tools(mine):
        yield from (Rule(tool, size, "", None, 0, role) for size in classes)


def _tasks_by_group(results: Sequence[Result]) -> dict[str, set[int]]:
    """The tasks with tool results, per agent (one group when the timelines name none)."""
    groups: dict[str, set[int]] = {}
    for r in results:
        groups.setdefault(r.group, set()).add(r.task)
    return groups


def call_words(results: Sequence[Result]) -> list[str]:
    """The commands the calls behind tool results start with (each segment of a shell line: `cat `,
    `sed -n`, `git diff`), kept when enough of one agent's tasks share them (another agent's calls
    simply never contain them), written with a space after a bare word so that `cat ` does not match
    `category`."""
    in_tasks: dict[str, set[int]] = {}
    for r in results:
        for line in r.call.splitlines()[1:]:   # the first line is the tool's name
            for segment in _SEGMENT.split(line):
                found = _COMMAND.match(segment.strip())
                if found:
                    word = found.group() if " " in found.group() else found.group() + " "
                    in_tasks.setdefault(word, set()).add(r.task)
    tools = {r.tool for r in results}
    groups = _tasks_by_group(results)
    kept = [w for w, tasks in in_tasks.items() if w.strip() not in tools and len(tasks) >= MIN_SUPPORT
            and any(len(tasks & mine) >= CALL_SHARE * len(mine) for mine in groups.values())]
    return sorted(kept, key=lambda w: (-len(in_tasks[w]), w))[:CALL_WORDS]


def shared_tools(results: Sequence[Result]) -> list[str]:
    """Tool names most of every agent's tasks with tool results call: a rule that names a tool one
    agent of the set has says nothing of the others."""
    in_tasks: dict[str, set[int]] = {}
    for r in results:
        if r.tool:
            in_tasks.setdefault(r.tool, set()).add(r.task)
    groups = _tasks_by_group(results)
    return sorted(t for t, tasks in in_tasks.items()
                  if all(len(tasks & mine) >= TOOL_SHARE * len(mine) for mine in groups.values()))


def compose(results: Sequence[Result], rules: Sequence[Rule], budget: int,
            reuses: Sequence[Reuse] | None = None) -> list[Composition]:
    """Rule sets that lose at most `budget` (copied strings with `reuses`, else reads), the most saving
    first: for each base (no window, or each window), rules added greedily, each for the tokens it adds
    (and, as a second path, for what it adds per loss)."""
    table = Table(results, reuses)
    drops = {rule: table.drops(rule) for rule in rules}
    windows = [rule for rule in rules if rule.event == "window"]
    others = [rule for rule in rules if rule.event != "window" and np.any(drops[rule] < table.steps)]
    found: dict[tuple[str, ...], Composition] = {}
    for base in [None, *windows]:
        start = drops[base] if base is not None else table.never
        if table.lost(start) > budget:
            continue
        for efficient in (False, True):
            chosen = _greedy(table, drops, others, budget, start, efficient)
            rules_of = tuple([base] if base is not None else []) + tuple(chosen)
            if not rules_of:
                continue
            current = start
            for rule in chosen:
                current = np.minimum(current, drops[rule])
            made = Composition(rules_of, table.saved(current), table.lost(current), budget)
            found.setdefault(tuple(made.texts()), made)
    return sorted(found.values(), key=lambda c: (-c.saved, c.lost, c.texts()))


def _greedy(table: Table, drops: dict[Rule, np.ndarray], rules: Sequence[Rule], budget: int, start: np.ndarray,
            efficient: bool) -> list[Rule]:
    current, saved, lost, chosen = start, table.saved(start), table.lost(start), []
    for _ in range(MAX_RULES):
        best: tuple[float, str, Rule, np.ndarray, float, int] | None = None
        for rule in rules:
            if rule in chosen:
                continue
            merged = np.minimum(current, drops[rule])
            more = table.saved(merged) - saved
            if more <= 0:
                continue
            losing = table.lost(merged)
            if losing > budget:
                continue
            value = more / (1 + losing - lost) if efficient else more
            if best is None or (-value, rule.text()) < (-best[0], best[1]):
                best = (value, rule.text(), rule, merged, saved + more, losing)
        if best is None:
            break
        chosen.append(best[2])
        current, saved, lost = best[3], best[4], best[5]
    return chosen
