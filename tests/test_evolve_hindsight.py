"""Hindsight distillation on recorded traces: its scores are the fidelity score's, and it finds a planted rule.

The traces are made here: an agent that acts through a shell reads files with `cat` (long outputs it
never quotes again) and searches with `grep` (short outputs whose paths it quotes at the very end).
The rule a person would write, `drop role tool and call contains "cat "` after a turn or two, is
what distillation must recover from the timelines of `full`, with the expert as the parent; and the
losses it predicts for a policy are the reuses the replay loses under it.
"""
from __future__ import annotations

import json
import random

import numpy as np
import pytest

from evolve.context import Candidate, ProposerContext
from evolve.proposers.hindsight import Table, hindsight_options, parent_drops, reuses_of
from evolve.proposers.reflect import ReflectProposer
from evolve.proposers.rules import results_of
from evolve.reflection import timeline_of
from sandbox.backends.replay import ReplayBackend
from sandbox.backends.tokens import shared_tokenizer
from sandbox.runs.harness import resolve_policy, run_task
from sandbox.traces.model import Trace, with_requests
from sandbox.traces.suite import TraceSuite

FILLER = "    return helper(value, options)  # unchanged since the first release\n" * 40
ROLES = ("tool", "assistant", "user")


def _step(n: int, command: str, output: str) -> list[dict]:
    call = {"id": f"c{n}", "type": "function", "function": {"name": "bash", "arguments": json.dumps({"command": command})}}
    return [{"role": "assistant", "content": f"Step {n}: looking further.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{n}", "name": "bash", "content": output}]


def shell_trace(k: int) -> Trace:
    """Eight `cat`s of files whose insides are never quoted, between `grep`s whose hits are quoted at the end."""
    messages = [{"role": "system", "content": "You repair code with the bash tool."},
                {"role": "user", "content": f"Fix issue {k} in the repository."}]
    hits = []
    for n in range(8):
        path = f"pkg_{k}/module_{n}/reader_{k}_{n}.py"
        messages += _step(2 * n, f"cat pkg_{k}/module_{n}/notes_{k}_{n}.txt",
                          f"class Widget{k}x{n}Factory:\n    token_{k}_{n}_alpha = 7{k}{n}31\n" + FILLER)
        messages += _step(2 * n + 1, f"grep -rn load_{k}_{n} pkg_{k}", f"{path}:12:def load_{k}_{n}(stream):")
        hits.append(path)
    messages.append({"role": "assistant", "content": "Fixed in " + ", ".join(hits) + "."})
    return with_requests(Trace(f"shell-{k}", tuple(messages), metadata={"agent": "shell"}))


@pytest.fixture(scope="module")
def timelines() -> dict[str, dict[str, dict]]:
    """The timelines of `full` and of the expert on every trace, as evolution stores them."""
    suite = TraceSuite("planted", traces=[shell_trace(k) for k in range(6)])
    tasks = suite.tasks("train") + suite.tasks("heldout")
    count = shared_tokenizer().count
    out: dict[str, dict[str, dict]] = {}
    for name in ("full", "expert", "rolling-3"):
        for task in tasks:
            result, trajectory = run_task(task, suite, resolve_policy(name), suite.scripted_agent(task), ReplayBackend())
            timeline = timeline_of(trajectory, count)
            timeline["lost"] = round((1 - result.score) * suite.scored_reuses(task.id))
            out.setdefault(name, {})[task.id] = timeline
    return out


def _ordered(found: dict[str, dict]) -> list[dict]:
    return [found[t] for t in sorted(found)]


def test_the_losses_it_scores_are_the_reuses_the_replay_loses(timelines) -> None:
    needs = _ordered(timelines["full"])
    reuses = reuses_of(needs)
    assert reuses is not None and all("group" in t and "covered" in t["messages"][3] for t in needs)
    results = [r for n, t in enumerate(needs) for r in results_of(t, n, roles=ROLES)]
    table = Table(results, reuses, len(needs))
    for policy in ("expert", "rolling-3"):
        drops = parent_drops(results, _ordered(timelines[policy]))
        assert table.lost(drops) == sum(t["lost"] for t in timelines[policy].values())
        # ... and what they cost is what the score lost: the mean over traces of 1 - score
        scores = [t["score"] for t in timelines[policy].values()]
        assert table.loss(drops) == pytest.approx(sum(1 - s for s in scores) / len(scores))
    assert table.lost(table.never) == 0 and table.loss(table.never) == 0.0 and table.saved(table.never) == 0.0
    assert sum(t["lost"] for t in timelines["rolling-3"].values()) > 0  # a window of three hides the grep hits


def test_distillation_recovers_the_planted_rule(timelines) -> None:
    needs = _ordered(timelines["full"])
    said = [[m.get("said", "") for m in t["messages"] if m["role"] == "assistant"] for t in needs]
    options = hindsight_options(needs, _ordered(timelines["rolling-3"]), said, reuses_of(needs))
    assert options
    best, note, predicted = options[0]
    assert any('call contains "cat "' in line for line in best), best
    assert not any('call contains "grep ' in line for line in best)
    assert predicted["predicted"]["score_points"] <= predicted["predicted"]["parent_points"]
    assert predicted["predicted"]["saved_share"] > predicted["predicted"]["parent_share"]
    assert "hindsight" in note


def test_reflect_on_traces_reflects_on_the_expert_first(timelines) -> None:
    full = Candidate(1, "mode kv\n", 0, 1.0, 0.02, (), timelines["full"])
    expert = Candidate(2, resolve_policy("expert").source, 0, 1.0, 0.015, (), timelines["expert"])
    window = Candidate(3, resolve_policy("rolling-3").source, 0, 0.6, 0.01, (), timelines["rolling-3"])
    context = ProposerContext((full, window), (full, expert, window), frozenset(), random.Random(0), reference_id=2)
    proposal = ReflectProposer().ask(context)
    assert proposal.rejection_reason is None and proposal.parent_ids == (2,)
    assert proposal.meta["reflected_on"] == 1 and "predicted" in proposal.meta
    assert np.isfinite(proposal.meta["predicted"]["saved_share"])


def test_the_llm_proposer_is_shown_the_same_evidence(timelines) -> None:
    from evolve.proposers.hindsight import evidence
    from evolve.proposers.prompt import fit_prompt

    full = Candidate(1, "mode kv\n", 0, 1.0, 0.02, (), timelines["full"])
    window = Candidate(3, resolve_policy("rolling-3").source, 0, 0.6, 0.01, (), timelines["rolling-3"])
    lines = evidence(full, window)
    assert "the parent saves" in lines[0] and "loses" in lines[0]
    assert "tool results (call `cat`)" in lines[1]
    assert "saves 80% of the oracle's saving and loses 0 more copied strings" in lines[2]   # the parent: 62%
    count = lambda text: len(text) // 3   # noqa: E731 - an estimate is enough here
    roomy = fit_prompt("system", window, [], [window], 8192, 256, 2, count, lines)
    assert "What the train timelines say in hindsight" in roomy.text and not roomy.shortened
    bare = fit_prompt("system", window, [], [window], 8192, 16, 0, count)
    tight = fit_prompt("system", window, [], [window], bare.tokens + 16 + 10, 16, 0, count, lines)
    assert "in hindsight" not in tight.text and tight.shortened   # the evidence goes before the parent does
    assert evidence(full, Candidate(4, "mode kv\n", 0, 1.0, 0.0, (), {})) == []   # another run's histories
