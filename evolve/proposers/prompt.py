"""The llm proposer's prompt, fitted to the model's context.

It holds the parent with its train results, on recorded traces the evidence the reflect proposer
reads (`evolve/proposers/hindsight.py`: what the hindsight oracle saves, where the parent pays for
tokens after their last read, the rules that save most within its losses), the digests of its
worst and its most expensive train tasks (evolve/reflection.py: what its drops cost and lost
there), and the Pareto front;
it asks first for a short diagnosis, then for the policy. The whole request, system prompt and
completion budget included, must fit `llm.context_tokens`: the digests get what the rest leaves
and are shortened to fit; then the front's texts go; a prompt that still does not fit is never
sent.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Sequence

from evolve.context import Candidate
from evolve.reflection import digests, pick_tasks

Count = Callable[[str], int]
MAX_RESULT_ROWS = 12  # the worst tasks first
# A bound, not policy_dsl's typical MESSAGE_OVERHEAD_TOKENS (4): the most a chat template adds around one
# message (SmolLM2's adds 5), so that a prompt fitted with it surely fits the model's context.
MOST_MESSAGE_OVERHEAD = 16
DIAGNOSIS = re.compile(r"^\W*diagnosis\W*", re.IGNORECASE)

INSTRUCTION = ("First write a short diagnosis, one paragraph that starts with \"Diagnosis:\", of what the parent's "
               "drops cost and lose on these tasks (re-fetches after a drop, tokens kept visible after their last "
               "use, failures). Then write one new policy that costs less than the parent without losing score "
               "(or scores higher at the same cost), in one fenced block.")


class PromptTooLong(Exception):
    """Even without digests and front texts the request would not fit the model's context."""


@dataclass(frozen=True)
class Prompt:
    text: str
    tokens: int  # the whole request: system and user messages with their template overhead
    digested: tuple[str, ...]  # task ids whose digest is in the prompt
    shortened: bool  # a digest was cut, or left out, to fit


def describe(candidate: Candidate, rows: int = MAX_RESULT_ROWS) -> str:
    worst = sorted(candidate.results, key=lambda r: (r.score, -r.cost_usd))[:rows]
    lines = [f"- {r.task_id}: status={r.status} score={r.score:.2f} cost=${r.cost_usd:.5f}"
             + (f" reason={r.error[:120]}" if r.error else "") for r in worst]
    return (f"train mean score {candidate.score:.3f}, mean cost ${candidate.cost:.5f} per task "
            f"over {len(candidate.results)} tasks; worst tasks:\n" + "\n".join(lines))


def build_prompt(parent: Candidate, inspirations: Sequence[Candidate], digest_texts: Sequence[str] = (),
                 front: Sequence[Candidate] = (), evidence: Sequence[str] = ()) -> str:
    parts = [f"Parent policy:\n```akvp\n{parent.text.strip()}\n```\nIts results: {describe(parent)}"]
    if evidence:
        parts.append("What the train timelines say in hindsight (scored as the champion rule scores: cost, and "
                     "copied strings lost):\n" + "\n".join(f"- {line}" for line in evidence))
    if digest_texts:
        parts.append("What happened in the parent's trajectories (its worst and its most expensive tasks):\n"
                     + "\n\n".join(digest_texts))
    if front:
        parts.append("The Pareto front on train (mean score, mean cost per task): " +
                     "; ".join(f"#{c.policy_id} {c.score:.3f} ${c.cost:.5f}" for c in front))
    for other in inspirations:
        parts.append(f"Another policy on the Pareto front (score {other.score:.3f}, cost ${other.cost:.5f}):\n"
                     f"```akvp\n{other.text.strip()}\n```")
    parts.append(INSTRUCTION)
    return "\n\n".join(parts)


def fit_prompt(system: str, parent: Candidate, inspirations: Sequence[Candidate], front: Sequence[Candidate],
               context_tokens: int, max_tokens: int, digest_tasks: int, count: Count,
               evidence: Sequence[str] = ()) -> Prompt:
    """The richest prompt whose request, with `max_tokens` to answer, fits `context_tokens`: the
    evidence before the other policies, both before the digests."""
    fixed = count(system) + 2 * MOST_MESSAGE_OVERHEAD + max_tokens
    for shown, told in ((list(inspirations), list(evidence)), ([], list(evidence)), ([], [])):
        bare = build_prompt(parent, shown, front=front, evidence=told)
        room = context_tokens - fixed - count(bare)
        if room >= 0:
            break
    else:
        raise PromptTooLong(f"the prompt needs {fixed + count(bare)} tokens with max_tokens {max_tokens}, "
                            f"over llm.context_tokens {context_tokens}")
    tasks = pick_tasks(parent.timelines, digest_tasks, digest_tasks)
    made = digests(parent.timelines, tasks, max(0, room - count("\n\n" * (len(tasks) + 2)) - 48), count)
    while True:
        text = build_prompt(parent, shown, [d.text for d in made], front, told)
        tokens = fixed - max_tokens + count(text)
        if tokens + max_tokens <= context_tokens or not made:
            break
        made = made[:-1]  # the count of a joined text may exceed the parts' sum by a token or two
    if tokens + max_tokens > context_tokens:
        raise PromptTooLong(f"the prompt needs {tokens + max_tokens} tokens, over llm.context_tokens "
                            f"{context_tokens}")
    shortened = len(made) < len(tasks) or any(d.shortened for d in made) or len(told) < len(evidence)
    return Prompt(text, tokens, tuple(d.task_id for d in made), shortened)


def extract_diagnosis(answer: str, limit: int) -> str | None:
    """The answer's text before its last fenced block, without a "Diagnosis:" label, cut to `limit` characters."""
    head = (answer or "").rsplit("```", 2)[0] if (answer or "").count("```") >= 2 else ""
    text = DIAGNOSIS.sub("", " ".join(head.split()))
    if not text:
        return None
    return text if len(text) <= limit else text[: limit - 1] + "…"
