"""The reflect proposer: rules distilled from recorded timelines (constructed ones: no run, seconds)."""
from __future__ import annotations

import random

from evolve.context import Candidate, ProposerContext
from evolve.library import SUITE_SPECIFIC, library_texts
from evolve.proposers.reflect import Prices, ReflectProposer, distil
from evolve.proposers.rules import results_of
from policy_dsl import builtin_source, parse


def research_timeline(task: str, hops: int = 3) -> dict:
    """A research agent's timeline: per hop a search page, a dead end it calls not relevant, then the
    document it settles the hop with ("Found"), which the whole next hop still reads."""
    messages = [{"i": 0, "role": "system", "tool": None, "tokens": 50, "arrived": 0, "dropped": None, "uses": []},
                {"i": 1, "role": "user", "tool": None, "tokens": 80, "arrived": 0, "dropped": None, "uses": []}]

    def add(role: str, step: int, tokens: int, tool: str, said: str | None = None) -> dict:
        m = {"i": len(messages), "role": role, "tool": tool, "tokens": tokens, "arrived": step, "dropped": None,
             "uses": []}
        if said is not None:
            m["said"] = said
        messages.append(m)
        return m

    step, found, opening = 0, None, "Searching for hop 0."
    for hop in range(hops):    # a hop takes 3 requests: open the dead end, open the right one, settle it
        add("assistant", step + 1, 10, "calls search", opening)
        page = add("tool", step + 1, 500, f'search {{"query": "{task} {hop}"}}')
        add("assistant", step + 2, 10, "calls get_document", f"Checking whether lc-{hop}0 fits hop {hop}.")
        dead = add("tool", step + 2, 600, f'get_document {{"docid": "{task}-{hop}0"}}')
        add("assistant", step + 3, 20, "calls get_document",
            f"lc-{hop}0 is not relevant to hop {hop}: wrong year.\nChecking whether lc-{hop}1 fits hop {hop}.")
        right = add("tool", step + 3, 700, f'get_document {{"docid": "{task}-{hop}1"}}')
        page["uses"] = [step + 1, step + 2]
        dead["uses"] = [step + 2]
        right["uses"] = [step + 3]
        if found is not None:
            found["uses"] += [step + 1, step + 2, step + 3]
        found, opening = right, f"Found hop {hop}: lc-{hop}1\nSearching for hop {hop + 1}."
        step += 3
    add("assistant", step + 1, 10, None, opening.splitlines()[0] + "\nAnswer: 1999")
    return {"task_id": task, "split": "train", "status": "ok", "score": 1.0, "cost_usd": 0.001, "requests": step + 1,
            "steps": step + 1, "rewrites": [], "uses_recorded": True, "reason": None, "messages": messages}


TIMELINES = {f"t{k}": research_timeline(f"t{k}") for k in range(4)}


def test_distil_drops_each_result_after_its_last_read_on_the_agents_own_words() -> None:
    timelines = list(TIMELINES.values())
    results = [r for n, t in enumerate(timelines) for r in results_of(t, n)]
    said = [[m.get("said", "") for m in t["messages"] if m["role"] == "assistant"] for t in timelines]
    chosen = [rule for rule, _runner in distil(results, said, Prices(10, 40, 2000, 20))]
    drops = [min((d for d in (rule.drop_at(r) for rule in chosen) if d is not None), default=None) for r in results]
    assert all(d is None or d > r.last_read for d, r in zip(drops, results))   # no re-fetch caused
    idle = sum(r.tokens * (r.steps - r.last_read - 1) for r in results)
    spared = sum(r.tokens * (r.steps - d) for d, r in zip(drops, results) if d is not None)
    assert spared > 0.8 * idle
    # the dead ends go at the verdict, whose words set them apart; no phrase carries an id or a number
    assert any(r.event == "verdict" and r.tool == "get_document" for r in chosen)
    assert all(r.phrase is None or r.phrase.replace(" ", "").isalpha() for r in chosen)
    for rule in chosen:   # each renders as valid language with tunable numbers
        parse(f"mode kv\n{rule.text()}\n")


def test_reflect_proposes_the_distilled_policy_then_its_variants() -> None:
    full = Candidate(1, "mode kv\n", 0, 1.0, 0.01, (), TIMELINES)
    expert = Candidate(2, builtin_source("expert-8k"), 0, 1.0, 0.008, (), TIMELINES)
    # a summarizing baseline drops nothing but rewrites the history: its timelines do not show the needs
    summarized = Candidate(0, builtin_source("standard-8k"), 0, 0.0, 0.03, (),
                           {k: dict(v, rewrites=[3]) for k, v in TIMELINES.items()})
    proposer, known, texts = ReflectProposer(), set(), []
    for index in range(3):
        context = ProposerContext((expert,), (summarized, full, expert), frozenset(known), random.Random(index), index)
        proposal = proposer.ask(context)
        assert proposal.rejection_reason is None and proposal.text not in texts
        assert proposal.meta["reflected_on"] == 1   # the timelines with no drops show the needs
        known.add(proposal.hash)
        texts.append(proposal.text)
    assert "with \"Found\"" in texts[0] and "reposition after each drop" in texts[0]


def test_reflect_without_use_records_says_why() -> None:
    blind = {k: dict(v, uses_recorded=False) for k, v in TIMELINES.items()}
    parent = Candidate(1, "mode kv\n", 0, 1.0, 0.01, (), blind)
    proposal = ReflectProposer().ask(ProposerContext((parent,), (parent,), frozenset(), random.Random(0)))
    assert proposal.text is None and "use records" in proposal.rejection_reason


def test_the_donor_pool_leaves_out_the_suite_specific_built_ins() -> None:
    pool = library_texts()
    for name in SUITE_SPECIFIC:
        assert parse(builtin_source(name)) not in [parse(t) for t in pool]
    assert any("keep last 4" in t for t in pool)   # the expert's window stays a donor
