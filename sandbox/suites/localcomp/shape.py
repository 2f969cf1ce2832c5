"""The shape of localcomp's research trajectories, measured: dead ends, long-range uses, sizes.

Each task of a split is researched by the scripted agent seeing everything (no policy), and
its use records (`AgentAction.used`) say which messages each step read. From them:

- dead-end reads: documents it opened and ruled out (its verdict notes), as a share of all
  the documents it opened;
- long-range uses: for each tool result, how many steps after it was read its last use
  came; and the distance of the final answer's oldest use (a fact of the first leg);
- sizes: tokens of search result pages, short lookups and long articles (smollm2 template).

    python -m sandbox.suites.localcomp.shape --split heldout [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from akv_stats.paired import percentile
from policy_dsl.counter import CHARS_PER_TOKEN
from sandbox.suites.localcomp.context import read_context
from sandbox.suites.localcomp.walkthrough import chat_tokenizer, walk

SHORT_LOOKUP_TOKENS = 400  # a document under this many tokens is a short lookup, else a long article


class _Recording:
    def __init__(self, agent: Any) -> None:
        self.agent, self.name, self.used = agent, agent.name, []

    def act(self, view: Any) -> Any:
        action = self.agent.act(view)
        self.used.append(action.used)
        return action


def measure_shape(suite: Any, split: str, limit: int | None = None) -> dict[str, Any]:
    """Figures over the split's tasks (the first `limit` of them)."""
    tokenizer = chat_tokenizer()
    sizes: dict[str, list[int]] = {"search page": [], "short lookup": [], "long article": []}
    opened = dead = 0
    distances: list[int] = []
    final_reach: list[int] = []
    steps: list[int] = []
    for task in suite.tasks(split)[:limit]:
        agent = _Recording(suite.scripted_agent(task))
        run = walk(task, suite.open(task), agent)
        steps.append(run.steps)
        dead_ends = read_context(run.messages, [True] * len(run.messages)).dead_ends
        read_at = _read_steps(run.messages)
        last = {i: k for k, used in enumerate(agent.used) for i in used}
        for i, message in enumerate(run.messages):
            if message["role"] != "tool":
                continue
            tokens = tokenizer.count(message) if tokenizer else len(message["content"]) // CHARS_PER_TOKEN
            if message.get("name") == "search":
                sizes["search page"].append(tokens)
            else:
                opened += 1
                dead += message["content"][1:9] in dead_ends
                sizes["short lookup" if tokens < SHORT_LOOKUP_TOKENS else "long article"].append(tokens)
            distances.append(last.get(i, read_at[i]) - read_at[i])
        final = len(agent.used) - 1
        final_reach.append(max(final - read_at[i] for i in agent.used[-1] if run.messages[i]["role"] == "tool"))
    return {
        "split": split, "tasks": len(steps), "steps": _spread(steps),
        "documents_opened": opened, "dead_end_reads": dead,
        "dead_end_share": round(dead / opened, 4) if opened else 0.0,
        "last_use_distance": _spread(distances),
        "final_answer_reach": _spread(final_reach),
        "sizes": {kind: {"count": len(v), **_spread(v)} for kind, v in sizes.items()},
    }


def _read_steps(messages: Any) -> dict[int, int]:
    """Message index -> the step whose tool calls produced it (the step that reads it first is the next)."""
    out, step = {}, -1
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            step += 1
        out[i] = step + 1
    return out


def _spread(values: list[int]) -> dict[str, float]:
    if not values:
        return {"min": 0, "median": 0, "p90": 0, "max": 0}
    ordered = sorted(values)
    return {"min": ordered[0], "median": statistics.median(ordered), "p90": percentile(ordered, 90, nearest_below=True),
            "max": ordered[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--split", default="heldout")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from akv_core.home import akv_home
    from sandbox.suites import get_suite

    suite = get_suite("localcomp")
    suite.build(akv_home(), 0)
    shape = {"edition": suite.edition, **measure_shape(suite, args.split, args.limit)}
    if args.json:
        print(json.dumps(shape))
        return
    print(f"localcomp edition {shape['edition']}, {args.split}: {shape['tasks']} tasks, steps {shape['steps']}")
    print(f"dead-end reads: {shape['dead_end_reads']} of {shape['documents_opened']} documents opened "
          f"({100 * shape['dead_end_share']:.1f}%)")
    print(f"steps from a tool result to its last use: {shape['last_use_distance']}")
    print(f"steps from the final answer back to the oldest result it uses: {shape['final_answer_reach']}")
    for kind, figures in shape["sizes"].items():
        print(f"{kind}: {figures}")


if __name__ == "__main__":
    main()
