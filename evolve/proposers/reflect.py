"""The reflect proposer: cache rules distilled from the train trajectories' use records.

GEPA's reflective mutation reads the parent's traces before rewriting it; here the traces are the
message timelines of `evolve/reflection.py`, with the use records (which step read which message:
recorded by the scripted agents, inferred from what each message reuses for the others, traces
included). Reflect asks of them, for each kind of tool result (its tool, and optionally only
results over a size): after which event that a deployed policy can see does the agent never read
such a result again? The events are the selectors that speak of what happened after a
message: the agent's next turn saying a phrase (`next_turn contains P`), a count of the agent's
turns that say a phrase (`age >= N turns with P`, its milestones), a plain count of turns, or a
count of turns since the agent last reused the result (`idle >= N turns`). The
phrases are mined from the agent's own messages in the timelines (word n-grams of next turns,
first words of lines), never taken from a list or from another policy.

Each candidate rule is scored on the timelines in the cost model's units (cached-input tokens):
the visible tokens it stops paying for after their last read, against what its early drops cost
(a result dropped before a read is fetched again: one more request with its context, the result
prefilled again, the agent's message). Rules are chosen greedily, each one for what it adds to
those already chosen. Where the parent ran the very same histories (recorded traces), a second
distillation comes first: the rules that save the most visible tokens while losing no more reads
than the parent itself lost (`distil_within`), since a trace's agent never fetches a lost result
again and the champion rule asks for a cheaper policy at a non-inferior score. The child is the
distilled policy; later asks vary it (a rule replaced by
its runner-up, a rule left out, the parent's own rules added). Numbers carry tunable ranges, so
the optuna proposer tunes the structure reflect found. Deterministic: the same timelines give the
same proposals.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from evolve.candidate import Checked, check_policy
from evolve.context import Candidate, ProposerContext
from evolve.proposers.base import Proposer
from evolve.proposers.hindsight import Option, hindsight_options, needs_of, reuses_of
from evolve.proposers.rules import NEVER, Result, Rule, by_task, drop_steps, phrases, results_of, round_size
from policy_dsl import PolicyError
from store.records import Proposal

MAX_RULES = 4           # rules of a distilled policy
SIZE_CLASSES = 8       # results over each of these quantiles of a tool's sizes (and all of them)
MAX_AGE = 6             # longest milestone / turn count tried
MIN_SUPPORT = 3         # a phrase must occur in this many tasks of the timelines
# A re-fetch costs more than its one request: the agent spends a turn on it, which moves every count
# after it, and the re-read copy is dropped by the same rule, so early drops come back in chains.
REFETCH_WEIGHT = 3.0


@dataclass(frozen=True)
class Prices:
    """The cost model's ratios to the cached-input price, and a task's typical request."""

    prefill: float   # uncached input / cached input
    output: float    # output / cached input
    context: float   # tokens of a typical request's context
    reply: float     # tokens of a typical agent message


def net_saving(drops: Sequence[int], results: Sequence[Result], prices: Prices) -> float:
    """Cached-token units saved by dropping each result at its step: idle tokens not paid, minus the
    re-fetches caused by the results dropped before a read (one more request each)."""
    total = 0.0
    for drop, r in zip(drops, results):
        if drop >= r.steps:
            continue
        if drop > r.last_read:   # gone after its last read: every later request is spared it
            total += r.tokens * (r.steps - drop)
        else:                    # read again after the drop: fetched again
            total += r.tokens * (r.last_read - drop) - REFETCH_WEIGHT * (
                prices.context + prices.prefill * r.tokens + prices.output * prices.reply)
    return total


def candidate_rules(results: Sequence[Result], said: Sequence[Sequence[str]]) -> list[Rule]:
    """Every rule worth scoring: per tool and size class, each verdict phrase (word n-grams of the
    next turns of that tool's results), each milestone (a word that starts a line of the agent's
    messages, `said` per task) counted 1..MAX_AGE times, and plain turn counts. A phrase must occur
    in at least half of the tasks (and MIN_SUPPORT of them): a name met in a few tasks is no rule."""
    support = max(MIN_SUPPORT, (len(said) + 1) // 2)
    milestones = phrases(said, support, line_starts=True)
    rules: list[Rule] = []
    for tool in sorted({r.tool for r in results}):
        mine = [r for r in results if r.tool == tool]
        sizes = sorted(r.tokens for r in mine)
        classes = sorted({0, *(round_size(sizes[len(sizes) * q // SIZE_CLASSES]) for q in range(1, SIZE_CLASSES))})
        verdicts = phrases([[r.turns[0][1] for r in task if r.turns] for task in by_task(mine)], support)
        for size in classes:
            rules += [Rule(tool, size, "verdict", p, 1) for p in verdicts]
            rules += [Rule(tool, size, "milestone", p, k) for p in milestones for k in range(1, MAX_AGE + 1)]
            rules += [Rule(tool, size, "turns", None, k) for k in range(1, 4 * MAX_AGE + 1, 2)]
            rules += [Rule(tool, size, "idle", None, k) for k in range(1, 4 * MAX_AGE + 1, 2)]
    return rules


def distil(results: Sequence[Result], said: Sequence[Sequence[str]], prices: Prices) -> list[tuple[Rule, Rule | None]]:
    """Rules chosen greedily for what each adds to the ones before (at most MAX_RULES, each saving
    something), each with its runner-up at that step."""
    rules = candidate_rules(results, said)
    table = {rule: drop_steps(rule, results) for rule in rules}
    current = [NEVER] * len(results)
    base = 0.0
    chosen: list[tuple[Rule, Rule | None]] = []
    for _ in range(MAX_RULES):
        scored = sorted(((net_saving([min(a, b) for a, b in zip(current, table[rule])], results, prices), rule)
                         for rule in rules if rule not in (c for c, _r in chosen)),
                        key=lambda x: (-x[0], x[1].text()))
        if not scored or scored[0][0] <= base:
            break
        gain, best = scored[0]
        runner = next((r for g, r in scored[1:] if g > base and (r.tool, r.min_tokens) == (best.tool, best.min_tokens)
                       and r.event != best.event), None)  # the same results, dropped on another kind of event
        chosen.append((best, runner))
        current = [min(a, b) for a, b in zip(current, table[best])]
        base = gain
    return chosen


def prices_for(timelines: Iterable[Mapping[str, Any]]) -> Prices:
    """The default price table's ratios, with the context and reply sizes of `timelines` (the parent's)."""
    from sandbox.runs.cost import price_table

    table = price_table()
    contexts, replies = [], []
    for t in timelines:
        messages, steps = t.get("messages") or [], int(t.get("steps") or 0)
        for step in range(steps):
            contexts.append(sum(m["tokens"] for m in messages if m["arrived"] <= step and
                                (m.get("dropped") is None or m["dropped"] > step)))
        replies += [m["tokens"] for m in messages if m.get("role") == "assistant"]
    return Prices(table.input / table.cached_input, table.output / table.cached_input,
                  sum(contexts) / max(1, len(contexts)), sum(replies) / max(1, len(replies)))


class ReflectProposer(Proposer):
    """Distils cache rules from the population's train timelines (module docstring)."""

    name = "reflect"
    reads_timelines = True

    def __init__(self) -> None:
        self._options: dict[tuple[int, int], list[Option]] = {}  # (needs, parent) -> proposals in order

    def ask(self, context: ProposerContext) -> Proposal:
        needs = needs_of(context.population)
        parents = _parents(context, needs)
        if needs is None or not parents:
            return self._reject(context.pick_parent(), "no train timeline with use records to reflect on")
        reflected = False
        for parent in parents:
            key = (needs.policy_id, parent.policy_id)
            if key not in self._options:
                self._options[key] = self._distil(needs, parent)
            reflected = reflected or bool(self._options[key])
            for rules, note, predicted in self._options[key]:
                checked = _checked(rules, parent)
                if checked is None or checked.hash in context.known_hashes or \
                        checked.structure in context.known_structures:
                    continue
                return Proposal(self.name, raw_text=checked.text, parent_ids=(parent.policy_id,),
                                generation=parent.generation + 1, text=checked.text, hash=checked.hash,
                                meta={"edits": [note], "reflected_on": needs.policy_id, **predicted})
        if not reflected:
            return self._reject(parents[0], f"no rule saves anything on the timelines of #{needs.policy_id}")
        return self._reject(parents[0], "every variant of the distilled rules is already known")

    def _distil(self, needs: Candidate, parent: Candidate) -> list[Option]:
        """The proposals for one parent: distilled within its own losses where it ran the very same
        histories (recorded traces: `evolve/proposers/hindsight.py`), else distilled for what they save
        net of re-fetches and then varied."""
        timelines = [needs.timelines[t] for t in sorted(needs.timelines)]
        said = [[str(m.get("said") or "") for m in t["messages"] if m.get("role") == "assistant"] for t in timelines]
        reuses = reuses_of(timelines)
        if reuses is not None and _same_histories(needs.timelines, parent.timelines):
            mine = [parent.timelines[t] for t in sorted(needs.timelines)]
            own = [line for line in _canonical_lines(parent.text) if line.startswith("on ")]
            return hindsight_options(timelines, mine, said, reuses, own)
        results = [r for n, t in enumerate(timelines) for r in results_of(t, n)]
        chosen = distil(results, said, prices_for(parent.timelines.values()))
        return [(rules, note, {}) for rules, note in _variants(chosen, parent)] if chosen else []

    def _reject(self, parent: Candidate, why: str) -> Proposal:
        return Proposal(self.name, raw_text=None, parent_ids=(parent.policy_id,), generation=parent.generation + 1,
                        rejection_reason=f"reflect: {why}")


def _parents(context: ProposerContext, needs: Candidate | None) -> list[Candidate]:
    """Whom to reflect on. On recorded traces, in order: the expert first (the bar every proposal is
    judged against, so its losses are the budget), then the train front in the proposal's own order.
    Elsewhere one parent drawn from the front."""
    if needs is None or reuses_of(list(needs.timelines.values())) is None:
        parent = context.pick_parent()
        return [parent] if parent.timelines else []
    front = list(context.front)
    context.rng.shuffle(front)
    reference = context.reference
    first = [reference] if reference is not None and reference.timelines else []
    return first + [c for c in front if c.timelines and c is not reference]


def _same_histories(needs: Mapping[str, Mapping[str, Any]], parent: Mapping[str, Mapping[str, Any]]) -> bool:
    """Whether the parent ran the very histories `needs` shows (recorded traces do, whatever the policy)."""
    return all(t in parent and [m["role"] for m in parent[t]["messages"]] == [m["role"] for m in needs[t]["messages"]]
               for t in needs)


def _variants(chosen: Sequence[tuple[Rule, Rule | None]], parent: Candidate) -> Iterable[tuple[list[str], str]]:
    """The distilled rules, then each with one rule swapped for its runner-up, or left out, then
    the parent's own rules with them."""
    rules = [rule.text() for rule, _runner in chosen]
    yield rules, f"distilled {len(rules)} rules"
    for i, (_rule, runner) in enumerate(chosen):
        if runner is not None:
            yield rules[:i] + [runner.text()] + rules[i + 1:], f"rule {i + 1} -> its runner-up"
    for i in range(len(rules)):
        if len(rules) > 1:
            yield rules[:i] + rules[i + 1:], f"without rule {i + 1}"
    own = [line for line in _canonical_lines(parent.text) if line.startswith("on ")]
    if own:
        yield own + rules, "the parent's rules and the distilled ones"


@functools.lru_cache(maxsize=64)
def _canonical_lines(text: str) -> tuple[str, ...]:
    """A policy's canonical lines, parsed once per text (each variant of a proposal reads its parent's)."""
    return tuple(check_policy(text).text.splitlines())


def _checked(rules: Sequence[str], parent: Candidate) -> Checked | None:
    """The rules as a kv policy with the parent's reposition rule (after each drop if it has none)."""
    lines = _canonical_lines(parent.text)
    reposition = next((line for line in lines if line.startswith("reposition")), "reposition after each drop")
    if reposition == "reposition never" or not lines[0].startswith("mode kv"):
        reposition = "reposition after each drop"
    try:
        return check_policy("\n".join(["mode kv", *dict.fromkeys(rules), reposition]) + "\n")
    except PolicyError:
        return None
