"""A scripted archive-search agent that drives a proxy the way a tool-using agent does (the refining proxy's
tests and walk-through, docs/proxy.md).

Each conversation is an archive search: the agent looks a record up, each record names the next
one, and the agent's next call repeats that reference (a reuse of the latest tool result only);
the last step answers with the clerk the last record names. The client writes its own tool calls
(a 135M model does not call tools reliably) and keeps the model's reply text, as an agent loop on
the `openai` client does; every request is one real chat completion through the proxy. A policy
that keeps the latest record or two loses no reuse and reads less than `full` or the expert.

    python benchmarks/archive_agent.py http://127.0.0.1:30001 --seeds 17-20   # four conversations, in turn
"""
from __future__ import annotations

import argparse
import json
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import httpx

MODEL = "smollm2"
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "An archive record by reference.",
                                           "parameters": {"type": "object",
                                                          "properties": {"ref": {"type": "string"}}}}}]
FILLER = ("The record lists the shelf, the box, the date of entry and the clerk who signed it, with the "
          "condition of the paper and the hands it passed through. ")


def reference(rng: random.Random) -> str:
    return f"REF-{rng.randrange(10_000, 99_999)}"


class Agent:
    """One conversation of `steps` lookups and an answer, sent one request at a time (`step`)."""

    def __init__(self, client: httpx.Client, seed: int, steps: int = 6, filler: int = 2) -> None:
        self.client, self.seed, self.steps, self.filler = client, seed, steps, filler
        self.rng = random.Random(seed)
        self.ref = reference(self.rng)
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You search an archive with the lookup tool."},
            {"role": "user", "content": f"Who signed the record that the archive's entry {seed} leads to?"}]
        self.replies: list[httpx.Response] = []

    @property
    def done(self) -> bool:
        return len(self.replies) > self.steps

    def step(self) -> httpx.Response:
        """The next request (after the previous reply and its lookup's result); its reply."""
        if self.replies:
            self._lookup(self.replies[-1].json()["choices"][0]["message"].get("content") or "")
        reply = self.client.post("/v1/chat/completions", json={"model": MODEL, "messages": self.messages,
                                                               "tools": TOOLS, "max_tokens": 1, "temperature": 0})
        reply.raise_for_status()
        self.replies.append(reply)
        return reply

    def _lookup(self, text: str) -> None:
        call = {"id": f"call_{self.seed}_{len(self.replies) - 1}", "type": "function",
                "function": {"name": "lookup", "arguments": json.dumps({"ref": self.ref})}}
        looked_up, self.ref, clerk = self.ref, reference(self.rng), f"C-{self.rng.randrange(1000, 9999)}"
        record = f"Record {looked_up}: {FILLER * self.filler}Signed by {clerk}. Next: {self.ref}."
        self.messages += [{"role": "assistant", "content": text, "tool_calls": [call]},
                          {"role": "tool", "tool_call_id": call["id"], "name": "lookup", "content": record}]


def conversation(client: httpx.Client, seed: int, steps: int = 6) -> list[httpx.Response]:
    """A whole conversation through `client` (base URL: the proxy); its replies."""
    agent = Agent(client, seed, steps)
    while not agent.done:
        agent.step()
    return agent.replies


def drive(url: str, seeds: range | list[int], steps: int = 6, workers: int = 4) -> list[list[httpx.Response]]:
    """One conversation per seed through the proxy at `url`, `workers` at a time; their replies, in seed order."""
    with httpx.Client(base_url=url, timeout=120) as client, ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda seed: conversation(client, seed, steps), seeds))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", help="the proxy (or any OpenAI-compatible server): http://HOST:PORT")
    parser.add_argument("--seeds", default="1-4", help="FIRST-LAST: one conversation per seed (default 1-4)")
    parser.add_argument("--steps", type=int, default=6, help="lookups per conversation (default 6)")
    args = parser.parse_args(argv)
    first, _, last = args.seeds.partition("-")
    if not (first.isdigit() and (last or first).isdigit()):
        parser.exit(2, f"error: --seeds: expected FIRST-LAST, got {args.seeds!r}\n")
    for seed, replies in zip(range(int(first), int(last or first) + 1),
                             drive(args.url, range(int(first), int(last or first) + 1), args.steps, workers=1)):
        served = sorted({r.headers.get("x-akv-policy", "-") for r in replies})
        print(f"conversation {seed}: {len(replies)} requests, policy {', '.join(served)}, "
              f"x-akv-proxy {' '.join(r.headers.get('x-akv-proxy', '-') for r in replies)}")


if __name__ == "__main__":
    main()
