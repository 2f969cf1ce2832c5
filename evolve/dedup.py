"""Semantic de-duplication: two policies that make the same decisions are one candidate.

A candidate's identity has three keys, and sharing any one with a stored policy makes it a
duplicate of that policy (stored as such, never evaluated, never validated):

* `hash`: the canonical text (layout and comments do not count);
* `structure`: the canonical text with every tunable range removed, so `keep last 7 in 1..16`
  and `keep last 7 in 1..12` are one policy (a range only tells a search where it may look);
* `behaviour`: a fingerprint of the decisions (the API's cache fields and the text edits) the
  policy makes on a fixed set of recorded train histories: every agent request that `full` and
  the expert made on the first FINGERPRINT_TASKS train tasks, recorded with the suite's scripted
  agent on the replay backend. Those runs are deterministic, so every process of a run
  (a resume included) derives the same set; the fingerprint also hashes the histories, so two
  sets never mix. Two policies that differ only in a rule that never fires on those histories
  (a reposition rule that changes no decision there, say) are one candidate.

The fingerprint is a claim about the recorded histories only. A policy that reads `drop_context`
calls gets none: under it the harness offers the agent that tool, so its histories would not be
these ones; it is still de-duplicated by hash and structure.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from evolve.candidate import structure_hash
from policy_dsl import CachePolicy, Decision, canonical_hash, compile_policy, parse
from sandbox.backends import Message
from sandbox.backends.tokens import shared_tokenizer
from sandbox.runs.harness import reads_drop_context

FINGERPRINT_TASKS = 4  # train tasks whose histories fingerprint a policy's behaviour

History = Sequence[Sequence[Message]]  # one task: the messages of each of its agent requests, in order


@dataclass(frozen=True)
class Identity:
    hash: str
    structure: str
    behaviour: str | None  # None: no fingerprint (the policy reads drop_context calls)


class Fingerprints:
    """Identities of policies, against histories recorded once per run."""

    def __init__(self, histories: Sequence[History]) -> None:
        self.histories = [[tuple(request) for request in task] for task in histories if task]
        self.salt = hashlib.sha256(json.dumps(self.histories, sort_keys=True, default=str).encode()).digest()
        self.counter = shared_tokenizer()

    @property
    def requests(self) -> int:
        return sum(len(task) for task in self.histories)

    def identity(self, text: str) -> Identity:
        ast = parse(text)
        return Identity(canonical_hash(ast), structure_hash(ast), self.behaviour(text))

    def behaviour(self, text: str) -> str | None:
        policy = compile_policy(parse(text), name="fingerprint")
        if reads_drop_context(policy):
            return None
        digest = hashlib.sha256(self.salt)
        for task in self.histories:
            for record in self.decisions(policy, task):
                digest.update(json.dumps(record, sort_keys=True).encode())
        return digest.hexdigest()

    def decisions(self, policy: CachePolicy, task: Sequence[Sequence[Message]]) -> list[dict[str, Any]]:
        """The policy's decision for every request of one task, in one shape whatever the mode."""
        if policy.mode == "kv":
            final = policy.decide(task[-1], self.counter)
            if not final.thinking_drop and not final.text_edits and not final.kept:
                # kv decisions are cumulative: a request's decision is the final one cut to its triggers.
                return [_record(_cut(final, len(messages))) for messages in task]
        return [_record(policy.decide(messages, self.counter)) for messages in task]


def _cut(decision: Decision, n: int) -> Decision:
    """A kv decision restricted to the triggers among the first `n` messages."""
    return Decision({k: v for k, v in decision.drop_message.items() if int(k) < n},
                    [i for i in decision.reposition if i < n])


def _record(decision: Decision) -> dict[str, Any]:
    record = {**decision.api_fields(), "text_edits": [asdict(e) for e in decision.text_edits]}
    if decision.kept:   # a cut's kept text goes as the request's messages, not in an API field
        record["kept"] = sorted(decision.kept.items())
    return record
