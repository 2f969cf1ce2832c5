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

from evolve.context import Candidate
from evolve.proposers.rules import NEVER, Result, Rule, by_task, drop_steps, phrases, results_of, round_size
from evolve.reflection import COVER_SHARES

MAX_RULES = 4            # rules added to a base window
SIZE_CLASSES = 8         # messages over each eighth of a role's sizes (and all of them)
COUNTS = tuple(range(1, 24, 2))   # turn counts tried (age, idle)
WINDOWS = (4, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32)  # keep last N tool results
MIN_SUPPORT = 3          # a phrase or a call word must occur in this many tasks ...
CALL_SHARE = 0.15        # ... and in this share of the tasks with tool results
TOOL_SHARE = 0.5         # a tool is named only when this share of the tasks with tool results call it
CALL_WORDS = 12          # most call words kept (by the tasks they occur in)
MIN_GAIN = 0.005         # a rule is added only for at least this share of what the oracle saves
_SEGMENT = re.compile(r"&&|\|\||[|;]")
_COMMAND = re.compile(r"[A-Za-z_][\w.-]*(?: -[A-Za-z]+)?")


@dataclass(frozen=True)
class Composition:
    """A rule set (a base: the parent's own rules, a window or none; then the rules added) with what it
    does on the timelines."""

    rules: tuple[Rule, ...]
    saved: float     # visible tokens no longer paid for, summed over the requests
    lost: int        # copied strings lost (reads, without reuses)
    loss: float      # what they cost the score (`Table.loss`)
    budget: float    # the loss it was chosen within
    base: tuple[str, ...] = ()   # the parent's own rule lines, kept as they are ahead of `rules`

    def texts(self) -> list[str]:
        return [*self.base, *(rule.text() for rule in self.rules)]


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
    step that copied them (`lost`), and what they cost the fidelity score, the mean over the `tasks`
    traces of each one's share of its copied strings lost (`loss`, 0..1: what the champion rule
    judges); without, the reads (use records) that came after their message's drop, both ways. A
    holder that is not among `results` (the prompt) is never hidden.
    """

    def __init__(self, results: Sequence[Result], reuses: Sequence[Reuse] | None = None, tasks: int = 1) -> None:
        self.results = list(results)
        self.tasks = max(1, tasks)
        self.tokens = np.array([r.tokens for r in results], dtype=np.float64)
        self.steps = np.array([r.steps for r in results], dtype=np.int64)
        self.never = np.full(len(results), NEVER, dtype=np.int64)
        self._drops: dict[Rule, np.ndarray] = {}
        tools: dict[int, list[int]] = {}   # per task, its tool results in order (what a window counts)
        for k, r in enumerate(results):
            if r.role == "tool":
                tools.setdefault(r.task, []).append(k)
        self._tools = [sorted(ks, key=lambda k: results[k].index) for ks in tools.values()]
        self.unit = 1.0   # the loss of one copied string, on average: what `efficient` counts in
        self._grouped = reuses is not None
        if reuses is None:   # reads: each use record of a message
            owners = [(k, u) for k, r in enumerate(results) for u in r.uses]
            self.use_owner = np.array([k for k, _u in owners], dtype=np.int64)
            self.use_step = np.array([u for _k, u in owners], dtype=np.int64)
        else:                # copied strings: each one's holders, one run after another
            position = {(r.task, r.index): k for k, r in enumerate(results)}
            copied: dict[int, int] = {}   # per task, every copied string: the score's denominator
            for task, _step, _holders in reuses:
                copied[task] = copied.get(task, 0) + 1
            holders_of, starts, steps, weights, owners = [], [], [], [], []
            for task, step, holders in reuses:
                found = [position.get((task, h)) for h in holders]
                if holders and None not in found:   # a holder no rule hides keeps it
                    starts.append(len(holders_of))
                    holders_of += found
                    steps.append(step)
                    weights.append(1.0 / (copied[task] * max(1, tasks)))
                    owners.append(task)
            self._entry_task = np.array(owners, dtype=np.int64)
            self.use_owner = np.array(holders_of, dtype=np.int64)
            self._starts = np.array(starts, dtype=np.int64)
            self._entry_step = np.array(steps, dtype=np.int64)
            self._weight = np.array(weights, dtype=np.float64)
            self.unit = float(np.mean(self._weight)) if weights else 1.0

    def drops(self, rule: Rule) -> np.ndarray:
        """The step each message stops being shown under `rule` alone (NEVER: kept), computed once."""
        if rule not in self._drops:
            self._drops[rule] = np.array(drop_steps(rule, self.results), dtype=np.int64)
        return self._drops[rule]

    def window(self, n: int, others: np.ndarray) -> np.ndarray:
        """`others` with a window of the n latest visible tool results laid over it, as the language runs
        `on each tool_response: drop role tool keep last n` ahead of the other rules: at each tool result's
        arrival the window keeps the n newest still visible, so what the other rules dropped leaves room
        for an older result (the rule-by-rule drops of `drops` cannot see that)."""
        out = others.copy()
        for ordered in self._tools:
            visible: list[int] = []
            for k in ordered:
                shown = self.results[k].arrived
                visible = [j for j in visible if out[j] > shown] + [k]
                for j in visible[:-n] if len(visible) > n else ():
                    out[j] = min(out[j], shown)
                visible = visible[-n:]
        return out

    def saved(self, drops: np.ndarray) -> float:
        return float(np.sum(self.tokens * np.clip(self.steps - drops, 0, None)))

    def lost(self, drops: np.ndarray) -> int:
        if not self.use_owner.size:
            return 0
        if not self._grouped:
            return int(np.sum(self.use_step >= drops[self.use_owner]))
        return int(np.sum(self._lost(drops)))

    def task_loss(self, drops: np.ndarray) -> np.ndarray:
        """Per task, what its losses cost the score (with reuses; without, zeros)."""
        if not self._grouped or not self.use_owner.size:
            return np.zeros(self.tasks)
        lost = self._lost(drops)
        return np.bincount(self._entry_task[lost], self._weight[lost], minlength=self.tasks)

    def loss(self, drops: np.ndarray) -> float:
        """What the losses cost the score (with reuses; without, the reads lost)."""
        if not self._grouped or not self.use_owner.size:
            return float(self.lost(drops))
        return float(np.sum(self._weight[self._lost(drops)]))

    def _lost(self, drops: np.ndarray) -> np.ndarray:
        latest = np.maximum.reduceat(drops[self.use_owner], self._starts)   # the last holder to go
        return latest <= self._entry_step

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


def compose(table: Table, rules: Sequence[Rule], budget: float) -> list[Composition]:
    """Rule sets whose losses cost the score at most `budget` (`Table.loss`), the most saving first: for
    each base (no window, or each window), rules added greedily, each for the tokens it adds (and, as a
    second path, for what it adds per loss)."""
    drops = {rule: table.drops(rule) for rule in rules}
    windows = [rule for rule in rules if rule.event == "window"]
    others = _distinct([rule for rule in rules if rule.event != "window"], drops, table)
    found: dict[tuple[str, ...], Composition] = {}
    floor = MIN_GAIN * table.oracle_saved()
    bases = [((), table.never)] + [((w,), drops[w]) for w in windows]
    for kept, start in bases:
        if table.loss(start) > budget:
            continue
        for efficient in (False, True):
            chosen = _greedy(table, drops, others, budget, start, efficient, floor)
            if not chosen and not kept:
                continue
            current = start
            for rule in chosen:
                current = np.minimum(current, drops[rule])
            made = Composition(kept + tuple(chosen), table.saved(current), table.lost(current), table.loss(current),
                               budget)
            found.setdefault(tuple(made.texts()), made)
    return sorted(found.values(), key=lambda c: (-c.saved, c.lost, c.texts()))


def _distinct(rules: Sequence[Rule], drops: dict[Rule, np.ndarray], table: Table) -> list[Rule]:
    """The rules that drop anything, one per set of drop steps (the shortest text stands for rules that
    drop the same messages at the same steps), the most saving alone first: the greedy search then
    meets a good rule early and skips the many that cannot beat it."""
    same: dict[bytes, Rule] = {}
    for rule in rules:
        if not np.any(drops[rule] < table.steps):
            continue
        key = drops[rule].tobytes()
        if key not in same or (len(rule.text()), rule.text()) < (len(same[key].text()), same[key].text()):
            same[key] = rule
    return sorted(same.values(), key=lambda r: (-table.saved(drops[r]), r.text()))


def _greedy(table: Table, drops: dict[Rule, np.ndarray], rules: Sequence[Rule], budget: float, start: np.ndarray,
            efficient: bool, floor: float = 0.0) -> list[Rule]:
    current, saved, lost, chosen = start, table.saved(start), table.loss(start), []
    for _ in range(MAX_RULES):
        best: tuple[float, str, Rule, np.ndarray, float, float] | None = None
        for rule in rules:
            if rule in chosen:
                continue
            merged = np.minimum(current, drops[rule])
            more = table.saved(merged) - saved
            if more <= floor or best is not None and more < best[0]:   # a value is never above what it saves
                continue
            losing = table.loss(merged)
            if losing > budget:
                continue
            value = more / (1 + max(0.0, losing - lost) / table.unit) if efficient else more
            if best is None or (-value, rule.text()) < (-best[0], best[1]):
                best = (value, rule.text(), rule, merged, saved + more, losing)
        if best is None:
            break
        chosen.append(best[2])
        current, saved, lost = best[3], best[4], best[5]
    return chosen


ROLES = ("tool", "assistant", "user")   # what a rule may drop: never the prompt
BUDGET_SHARES = (1.0, 0.5, 0.25, 0.0)   # of the parent's losses: as many, half, a quarter, none
Option = tuple[list[str], str, dict[str, Any]]   # rule lines, the edit note, what the timelines predict


def hindsight_options(timelines: Sequence[Mapping[str, Any]], parent: Sequence[Mapping[str, Any]],
                      said: Sequence[Sequence[str]], reuses: Sequence[Reuse],
                      parent_rules: Sequence[str] = ()) -> list[Option]:
    """Proposals distilled from `timelines` (`full`'s, where nothing was hidden) against a parent that
    ran the same histories (`parent`, task by task; `parent_rules` its rule lines): the rule sets that
    save more than the parent while their losses cost the score as much as the parent's did, half, a
    quarter and nothing. First the parent tightened (`_tightened`: its rules kept and rules added, no
    trace losing more than under it, then within its whole loss), then those no other set beats in
    both (the most saving first), then the others, then the best with one rule left out."""
    results = [r for n, t in enumerate(timelines) for r in results_of(t, n, roles=ROLES)]
    table = Table(results, reuses, len(timelines))
    own = parent_drops(results, parent)
    budget, lost, saved, ceiling = table.loss(own), table.lost(own), table.saved(own), table.oracle_saved() or 1.0
    rules = hindsight_rules(results, said)
    found: dict[tuple[str, ...], Composition] = {}
    for share in BUDGET_SHARES:
        for c in compose(table, rules, budget * share):
            if c.saved > saved:
                found.setdefault(tuple(c.texts()), c)
    tightened = [c for c in _tightened(table, rules, parent_rules, own, budget) if c.saved > saved]
    kept = {tuple(c.texts()) for c in tightened}
    chosen = tightened + _undominated([c for c in found.values() if tuple(c.texts()) not in kept])
    options: list[Option] = []
    for c in chosen:
        note = (f"hindsight: {len(c.rules)} rules losing {c.lost} copied strings, {100 * c.loss:.2f} points of "
                f"score, on the train timelines (the parent {lost}, {100 * budget:.2f} points): "
                f"{c.saved / ceiling:.0%} of the oracle's saving, the parent {saved / ceiling:.0%}")
        options.append((c.texts(), note, {"predicted": {
            "lost": c.lost, "score_points": round(100 * c.loss, 3), "budget_points": round(100 * c.budget, 3),
            "parent_lost": lost, "parent_points": round(100 * budget, 3),
            "saved_share": round(c.saved / ceiling, 4), "parent_share": round(saved / ceiling, 4)}}))
    if chosen and len(chosen[0].rules) > 1:
        best = chosen[0].texts()
        options += [(best[:i] + best[i + 1:], f"hindsight: the best set without rule {i + 1}", {})
                    for i in range(len(best))]
    return options


_WINDOW = re.compile(r"^on each tool_responses?: drop role tool keep last (\d+)")


PRICES = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)   # what a loss costs in saved tokens, in TIGHTEN_RATE units
TIGHTEN_RULES = 150                        # candidate rules the tightening looks at (the most saving alone)


def _tightened(table: Table, rules: Sequence[Rule], parent_rules: Sequence[str], own: np.ndarray,
               budget: float) -> list[Composition]:
    """The parent's rules kept and rules added: first while no trace loses more than it did under the
    parent (the score can only rise, trace by trace, and no trace costs more); then, for each price
    of a loss in saved tokens (PRICES, in units of what the oracle saves beyond the parent per loss of
    the parent's), the rules that add the most saving net of that price, kept when the set loses no
    more than the parent in all. The parent's window (`keep last N` over tool results, when its first
    rule is one) is laid over the added rules at every step: what they drop leaves the window room
    for older results, so a rule can even lose less than none, which `compose` cannot see."""
    if not parent_rules:
        return []
    found = _WINDOW.match(parent_rules[0])
    drops = {r: table.drops(r) for r in rules}
    candidates = _distinct([r for r in rules if r.event != "window"], drops, table)[:TIGHTEN_RULES]
    out: dict[tuple[str, ...], Composition] = {}
    if not found:
        return _tighten(table, candidates, drops, tuple(parent_rules), own, budget, lambda added: np.minimum(own, added))
    beyond = _beyond_window(own, parent_rules, table)
    n = int(found.group(1))
    for wider in dict.fromkeys((n, n + 4, n + 8, 2 * n)):   # the parent's window, then loosened
        line = parent_rules[0] if wider == n else \
            f"on each tool_response: drop role tool keep last {wider} in 2..{max(48, 2 * wider)}"

        def dropped(added: np.ndarray, keep: int = wider) -> np.ndarray:
            return table.window(keep, np.minimum(added, beyond))

        for made in _tighten(table, candidates, drops, (line, *parent_rules[1:]), own, budget, dropped):
            out.setdefault(tuple(made.texts()), made)
    return sorted(out.values(), key=lambda c: (-c.saved, c.loss, c.texts()))


def _tighten(table: Table, candidates: Sequence[Rule], drops: Mapping[Rule, np.ndarray], lines: tuple[str, ...],
             own: np.ndarray, budget: float, dropped: Any) -> list[Composition]:
    """Rules added to the rule `lines` (whose drops, with what is added, `dropped` gives) for each
    price of a loss, and first while no trace loses more than under the parent (`own`)."""
    ceiling, floor = table.task_loss(own) + 1e-12, MIN_GAIN * table.oracle_saved()
    rate = max(table.oracle_saved() - table.saved(own), floor) / max(table.loss(own), table.unit)
    out: dict[tuple[str, ...], Composition] = {}
    for price in (None, *PRICES):
        chosen: list[Rule] = []
        added, current = table.never, dropped(table.never)
        for _ in range(MAX_RULES):
            best: tuple[float, Rule, np.ndarray, np.ndarray] | None = None
            saved, loss = table.saved(current), table.loss(current)
            for rule in candidates:
                if rule in chosen:
                    continue
                merged = np.minimum(added, drops[rule])
                trial = dropped(merged)
                more = table.saved(trial) - saved
                if price is None:   # safe: no trace may lose more than under the parent
                    value = more if not np.any(table.task_loss(trial) > ceiling) else -1.0
                else:
                    value = more - price * rate * (table.loss(trial) - loss)
                if value > floor and (best is None or value > best[0]):
                    best = (value, rule, merged, trial)
            if best is None:
                break
            chosen.append(best[1])
            added, current = best[2], best[3]
        for rule in list(chosen):   # a rule the others make redundant goes: the same drops without it
            rest = [r for r in chosen if r is not rule]
            if rest and np.array_equal(dropped(_union(rest, drops, table)), current):
                chosen = rest
        if table.loss(current) <= budget + 1e-12:
            made = Composition(tuple(chosen), table.saved(current), table.lost(current), table.loss(current), budget,
                               lines)
            out.setdefault(tuple(made.texts()), made)
    return list(out.values())


def _union(rules: Sequence[Rule], drops: Mapping[Rule, np.ndarray], table: Table) -> np.ndarray:
    out = table.never
    for rule in rules:
        out = np.minimum(out, drops[rule])
    return out


def _beyond_window(own: np.ndarray, parent_rules: Sequence[str], table: Table) -> np.ndarray:
    """The drops of the parent's rules after its window (none for the expert): the parent's drops of
    messages other than tool results, where its window cannot have made them."""
    if len(parent_rules) == 1:
        return table.never
    return np.where(np.array([r.role != "tool" for r in table.results]), own, NEVER)


def _undominated(found: Sequence[Composition]) -> list[Composition]:
    """The rule sets no other saves as much at no more losses, the most saving first; then the rest, so
    a later proposal still has somewhere to go."""
    def dominated(c: Composition) -> bool:
        return any(o.saved >= c.saved and o.loss <= c.loss and (o.saved, -o.loss) != (c.saved, -c.loss)
                   for o in found)

    order = sorted(found, key=lambda c: (-c.saved, c.loss, c.texts()))
    return [c for c in order if not dominated(c)] + [c for c in order if dominated(c)]


def needs_of(population: Sequence[Candidate]) -> Candidate | None:
    """The evaluated policy whose timelines show the agent's needs best: use records on every step, no
    summary rewriting the history (its timeline covers only the steps after the last rewrite), the
    highest score, then the fewest drops: `full` when it is a baseline."""
    recorded = [c for c in population if c.timelines and all(t.get("uses_recorded") and not t.get("rewrites")
                                                             for t in c.timelines.values())]

    def drops(c: Candidate) -> int:
        return sum(1 for t in c.timelines.values() for m in t["messages"] if m.get("dropped") is not None)

    return min(recorded, key=lambda c: (-c.score, drops(c), c.policy_id), default=None)


def parent_drops(results: Sequence[Result], parent: Sequence[Mapping[str, Any]]) -> np.ndarray:
    """The step at which the parent dropped each of `results` (NEVER where it kept it), from its timelines."""
    dropped = {(n, int(m["i"])): int(m["dropped"]) for n, t in enumerate(parent) for m in t["messages"]
               if m.get("dropped") is not None}
    return np.array([dropped.get((r.task, r.index), NEVER) for r in results], dtype=np.int64)


EVIDENCE_RULES = 6   # single rules the evidence names


def evidence(needs: Candidate, parent: Candidate) -> list[str]:
    """What reflect reads in the train timelines, as lines for a model's prompt: how much the
    hindsight oracle would save and how much of it the parent gets at what losses, where the tokens
    paid after their last read are (by role and by the call behind a tool result), and the single
    rules a deployed policy could run that save the most within the parent's losses, with what they
    save and lose there. Empty unless the timelines are of recorded traces the parent ran too."""
    timelines = [needs.timelines[t] for t in sorted(needs.timelines)]
    reuses = reuses_of(timelines)
    if reuses is None or any(t not in parent.timelines for t in needs.timelines):
        return []
    results = [r for n, t in enumerate(timelines) for r in results_of(t, n, roles=ROLES)]
    said = [[str(m.get("said") or "") for m in t["messages"] if m.get("role") == "assistant"] for t in timelines]
    table = Table(results, reuses, len(timelines))
    own = parent_drops(results, [parent.timelines[t] for t in sorted(needs.timelines)])
    budget, lost, ceiling = table.loss(own), table.lost(own), table.oracle_saved() or 1.0
    lines = [f"the hindsight oracle (each message dropped right after its last read) saves {ceiling:,.0f} visible "
             f"token-requests on the train traces; the parent saves {table.saved(own) / ceiling:.0%} of that and "
             f"loses {lost} copied strings (reuses whose every holder it had hidden), {100 * budget:.2f} points "
             "of the mean fidelity score"]
    wasted = _wasted(results, own)
    total = sum(wasted.values()) or 1.0
    kinds = sorted(wasted.items(), key=lambda item: -item[1])[:8]
    lines.append("tokens the parent keeps visible after their last read, by kind: "
                 + "; ".join(f"{kind} {share / total:.0%}" for kind, share in kinds))
    same: dict[bytes, tuple[float, int, str]] = {}   # rules that drop the same messages: the shortest stands
    for rule in hindsight_rules(results, said):
        drops = np.minimum(own, table.drops(rule))
        key, text = drops.tobytes(), rule.text()
        if table.loss(drops) <= budget and (key not in same or len(text) < len(same[key][2])):
            same[key] = (table.saved(drops) / ceiling, -table.lost(drops), text)
    best = sorted(same.values(), key=lambda s: (-s[0], -s[1], len(s[2]), s[2]))[:EVIDENCE_RULES]
    lines += [f"added to the parent, `{text}` saves {share:.0%} of the oracle's saving and loses {-more - lost} "
              "more copied strings" for share, more, text in best]
    return lines


def _wasted(results: Sequence[Result], drops: np.ndarray) -> dict[str, float]:
    """Visible token-requests after the last read that `drops` still pays for, by role (tool results
    also by the first command word of their call)."""
    out: dict[str, float] = {}
    for r, drop in zip(results, drops):
        paid = max(0, min(int(drop), r.steps) - max(r.last_read + 1, r.arrived)) * r.tokens
        if not paid:
            continue
        word = _COMMAND.match((r.call.splitlines()[1:] or [""])[0].strip()) if r.role == "tool" else None
        kind = {"tool": "tool results", "assistant": "the agent's messages", "user": "user turns"}[r.role]
        key = f"{kind} (call `{word.group()}`)" if word else kind
        out[key] = out.get(key, 0.0) + paid
    return out
