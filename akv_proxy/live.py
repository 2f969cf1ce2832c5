"""Which policy serves a request: the live one for a new conversation, the one it started with otherwise.

A refining proxy (`akv proxy --refine`) changes its live policy while it serves: a promotion or a
rollback, which it learns of by polling its `LiveSource` (the store, handed in by the command) off
the request path. The swap is one reference replaced, so a request sees the old policy or the new
one, whole. A conversation keeps the policy it started with: its drops are cumulative, and a new
policy in the middle of it would change what the model has already been shown.

A request continues a conversation by the recorder's rule (`sandbox/traces/recording.py`): an
earlier request's history is a prefix of its history, followed right there by an assistant
message (the agent's copy of the reply it got). The proxy remembers the history of each request
it served, by digest, with the policy that served it (the CONVERSATIONS most recent); a request
with no such prefix starts a conversation and takes the live policy.
"""
from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence

from policy_dsl import CachePolicy

from akv_proxy.edits import prefix_digests
from akv_proxy.step import Applied, PolicyStep, SerializedCounter

CONVERSATIONS = 16384  # remembered request histories; the least recently continued is forgotten first


@dataclass(frozen=True)
class ServedPolicy:
    """A policy the proxy serves, named as requests record it; `entry`: its lineage entry, when refining.

    `step` applies it (`Policies.serving` makes one per policy: a text policy's edited histories are its own)."""

    name: str
    policy: CachePolicy
    step: PolicyStep = field(compare=False, repr=False)
    entry: int | None = None


class PolicySavings(Protocol):
    """What a served policy's finished conversations cost, replayed under it, the expert and `full` (USD),
    as the refiner measured them (`store.records.PolicyTotals`, handed in by the command)."""

    policy: str
    conversations: int
    cost_usd: float
    expert_cost_usd: float
    full_cost_usd: float
    lost_reuses: int
    drops: int
    repositions: int
    skipped: int


@dataclass(frozen=True)
class LiveState:
    """What a refining proxy polls: the live policy (lineage entry, label, text) and the refinement's figures."""

    entry: int
    name: str
    text: str
    kind: str = "start"
    savings: Sequence[PolicySavings] = ()
    rounds: Mapping[str, int] = field(default_factory=dict)  # outcome -> refinement rounds
    refiner_pid: int | None = None  # the refiner process, while it runs


class LiveSource(Protocol):
    """Where a refining proxy learns its live policy (the store, through the command that starts it)."""

    def poll(self) -> LiveState:
        """The state now; any exception means the source cannot be reached (the proxy keeps serving)."""

    def text_of(self, name: str) -> str | None:
        """The text of the policy the lineage names `name` (None: no such policy, or no answer)."""

    def close(self) -> None:
        """Release what the source holds."""


class Policies:
    """The live policy and the policy of each conversation under way; thread-safe.

    Without `pinned` (a proxy whose policy never changes) conversations are not tracked at all.
    """

    def __init__(self, policy: CachePolicy, counter: Any, summarizer: Any, entry: int | None = None,
                 pinned: bool = False, capacity: int = CONVERSATIONS) -> None:
        self.counter, self.summarizer = SerializedCounter(counter), summarizer
        self._live = self.serving(policy.name, policy, entry)
        self._pinned, self._capacity = pinned, capacity
        self._conversations: OrderedDict[str, ServedPolicy] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def live(self) -> ServedPolicy:
        return self._live

    def serving(self, name: str, policy: CachePolicy, entry: int | None = None) -> ServedPolicy:
        """`policy` ready to serve under `name`."""
        return ServedPolicy(name, policy, PolicyStep(policy, self.counter, self.summarizer), entry)

    def swap(self, live: ServedPolicy) -> None:
        """New conversations take `live` from now on; those under way keep theirs."""
        self._live = live

    def apply(self, body: Mapping[str, Any]) -> Applied:
        """The request under its conversation's policy (PolicyStep.apply), named in `Applied.policy`."""
        messages = body.get("messages")
        served, digests = self.choose(messages if isinstance(messages, list) else [])
        applied = served.step.apply(body)
        if digests is not None:
            with self._lock:
                self._remember(digests[-1], served)
        return dataclasses.replace(applied, policy=served.name)

    def choose(self, messages: Sequence[Any]) -> tuple[ServedPolicy, list[str] | None]:
        """(the policy of the conversation `messages` continues, else the live one; the history's prefix digests)."""
        live = self._live
        if not self._pinned:
            return live, None
        digests = prefix_digests(messages)
        with self._lock:
            for k in range(len(messages) - 1, 0, -1):
                message = messages[k]
                if isinstance(message, Mapping) and message.get("role") == "assistant":
                    served = self._conversations.get(digests[k])
                    if served is not None:
                        self._conversations.move_to_end(digests[k])
                        return served, digests
        return live, digests

    def remember(self, history: Sequence[Mapping[str, Any]], served: ServedPolicy) -> None:
        """Note that `history` was served by `served` (a restarted proxy's conversations under way)."""
        if self._pinned:
            with self._lock:
                self._remember(prefix_digests(history)[-1], served)

    def _remember(self, digest: str, served: ServedPolicy) -> None:
        self._conversations[digest] = served
        self._conversations.move_to_end(digest)
        while len(self._conversations) > self._capacity:
            self._conversations.popitem(last=False)
