"""Likelihood fidelity: how much less likely a policy makes the recorded replies of a trace.

The model-free fidelity (`suite.py`) counts the strings a policy hid before the agent copied
them. This one asks a model: for each recorded request of a trace (the history before an
assistant message), the recorded reply is scored teacher-forced after the history as the
policy sends it (its cache fields: drop_message, reposition, a drop_rule; a text policy's
edits) and after the history as `full` sends it, and the two log-likelihoods are compared:

    change = sum over scored requests (log p_policy - log p_full) / reply tokens scored

in nats per token: 0 for `full` (exactly: an identical request is scored once), below 0 when
the policy hid what the model needed to write the replies. The requests are the ones a run
makes: the trace replayed under the policy on the replay backend, which takes the policy's
decisions without a model (a text policy's summaries are then the replay backend's
extractive ones). The scoring backend is the embedded engine or a server URL (`score_reply`).

Cost and its limits: each request costs a teacher-forced pass of the reply after its history,
whose KV comes from the scoring backend's prefix cache as for any request, so a request pays
for the tokens its cache has not seen (the last reply and what answered it) and its reply. A
request the policy sends as `full` does is scored once. A request whose history and reply do
not fit the model (its context, its KV pool) under `full` or under the policy is left out on
both sides; a trace none of whose requests fit has change 0 and says so (`scored` 0).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from sandbox.backends import Backend, BackendRequest, Message, ReplyTooLong, open_backend
from sandbox.runs.harness import resolve_policy, run_task, select_tasks
from sandbox.traces.suite import TraceSuite, split_key, split_of


@dataclass(frozen=True)
class TraceLikelihood:
    """One trace under one policy: the mean log-likelihood change per reply token against `full`
    (nats per token, policy - full), the reply tokens it averages over, the recorded requests with a
    reply and how many of them were scored under both."""

    trace_id: str
    change: float
    tokens: int
    requests: int
    scored: int


class LikelihoodFidelity:
    """Scores policies on the traces of `suite` with `scorer` (a backend with `score_reply`).

    The requests of `full` (`full_policy`) and every scored request are kept for the scorer's life
    (memo by content), so validating several policies pays for `full` once, and for each policy
    only the requests that differ from one already scored.
    """

    def __init__(self, suite: TraceSuite, scorer: Backend, full_policy: Any = "full", seed: int = 0) -> None:
        if not callable(getattr(scorer, "score_reply", None)):
            raise ValueError(f"the {scorer.name} backend cannot score a recorded reply (no model)")
        self.suite, self.scorer, self.seed = suite, scorer, seed
        self._full = resolve_policy(full_policy)
        self._replay = open_backend("replay")
        self._full_requests: dict[str, list[BackendRequest]] = {}
        self._scored: dict[str, tuple[float, int] | None] = {}   # request digest -> (log-likelihood, tokens)

    def score(self, policy: Any, task_ids: Sequence[str]) -> list[TraceLikelihood]:
        """Per trace of `task_ids` (in order), the policy's likelihood change against `full`."""
        policy = resolve_policy(policy)
        return [self.trace(policy, trace_id) for trace_id in task_ids]

    def trace(self, policy: Any, trace_id: str) -> TraceLikelihood:
        """One trace: its requests under the policy and under `full`, paired step by step."""
        if trace_id not in self._full_requests:
            self._full_requests[trace_id] = self._requests(self._full, trace_id)
        full, mine = self._full_requests[trace_id], self._requests(policy, trace_id)
        trace = self.suite.trace(trace_id)
        replies = [trace.messages[i] for i in trace.assistant_indices()]
        change, tokens, scored = 0.0, 0, 0
        for theirs, ours, reply in zip(full, mine, replies):
            base = self._likelihood(theirs, reply)
            own = self._likelihood(ours, reply) if base is not None else None
            if own is None or own[1] != base[1]:   # the same reply has the same tokens after any history
                continue
            change += own[0] - base[0]
            tokens, scored = tokens + base[1], scored + 1
        return TraceLikelihood(trace_id, change / tokens if tokens else 0.0, tokens, len(replies), scored)

    def _requests(self, policy: Any, trace_id: str) -> list[BackendRequest]:
        """The agent requests a run of the trace makes under `policy`, in order (replay backend, no model;
        a run that fails part way, as its held-out run would, gives the requests made until then)."""
        split = split_of(split_key(self.suite.trace(trace_id)), self.suite.seed)
        [task] = select_tasks(self.suite, split, [trace_id])
        _result, trajectory = run_task(task, self.suite, policy, self.suite.scripted_agent(task), self._replay,
                                       seed=self.seed)
        return [ex.request for ex in trajectory.exchanges if ex.purpose == "agent"]

    def _likelihood(self, request: BackendRequest, reply: Message) -> tuple[float, int] | None:
        """The reply's log-likelihood after the request and its tokens (None when it does not fit the model)."""
        key = _request_key(request, reply)
        if key not in self._scored:
            try:
                logprobs = self.scorer.score_reply(request, reply)
                self._scored[key] = (float(sum(logprobs)), len(logprobs))
            except ReplyTooLong:
                self._scored[key] = None
        return self._scored[key]

    def close(self) -> None:
        self._replay.close()


def _request_key(request: BackendRequest, reply: Mapping[str, Any]) -> str:
    """A digest of what the scorer sees: the history, tools, cache fields and the reply."""
    blob = json.dumps([list(request.messages), list(request.tools), request.api_fields(), dict(reply)],
                      sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()
