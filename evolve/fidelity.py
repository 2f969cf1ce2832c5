"""The score the champion rule judges finalists on: `validation.fidelity`.

`references` (the default) is the suite's own score; on a trace set, the model-free fidelity
(1 - lost / reuses, 0..1, the margin in points). `likelihood`, for trace sets only, is the
mean change in log-likelihood per reply token of the recorded assistant replies under the policy
against `full`, scored teacher-forced by a model (`sandbox/traces/likelihood.py`): 0 for `full`,
negative when a policy hid what the replies needed, and `validation.margin` is then in nats per
token. The model is `validation.likelihood_backend`: the embedded engine or an `akv serve` URL
(by default the run's backend when it has a model, else the embedded engine).

A server that does not score a final assistant message (its model card does not list AKV's
`prompt_logprobs`, or it answers without them) stops the run before it starts, and again at
validation, with an error naming `validation.fidelity`; with `validation.fidelity_fallback:
references` the round is judged on the model-free fidelity instead, and every record of the
round says so (`stats.fidelity.fallback`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from akv_core.client import ServerUnavailable
from akv_stats.champion import NATS_PER_TOKEN, POINTS
from akv_stats.paired import bootstrap_ci
from evolve.config import ValidationConfig
from sandbox.backends import BackendError, open_backend
from sandbox.traces.likelihood import LikelihoodFidelity, TraceLikelihood
from sandbox.traces.suite import TraceSuite
from store import PolicyInfo, TaskResult

FIELD = "validation.fidelity"
SCORED_FEATURE = "prompt_logprobs"  # the AKV feature a server lists when it scores a final assistant message


class FidelityUnavailable(ValueError):
    """Likelihood fidelity asked of a model that cannot give it, and no fallback allowed; names the field."""


def likelihood_spec(config: ValidationConfig, run_backend: str) -> str:
    """The backend that scores likelihood: `likelihood_backend`, else the run's own when it has a model
    (embedded, or the first server of a list), else the embedded engine."""
    if config.likelihood_backend:
        return config.likelihood_backend
    if run_backend.startswith(("http://", "https://")):
        return run_backend.split(",")[0].strip()
    return "embedded"


def check_fidelity(config: ValidationConfig, suite: Any, run_backend: str) -> str | None:
    """Before a run: FidelityUnavailable (a ValueError naming the field) for a suite without recorded
    replies, or a scoring server that lacks teacher-forced scoring and no fallback; the fallback's note
    when one applies, else None. Nothing is loaded (a server is asked for its model card only)."""
    if config.fidelity != "likelihood":
        return None
    check_trace_suite(suite)
    spec = likelihood_spec(config, run_backend)
    if spec == "embedded":
        return None
    server = open_backend(spec)
    try:
        missing = server.lacks(SCORED_FEATURE)
    finally:
        server.close()
    return fallback_note(config, missing) if missing else None


def check_trace_suite(suite: Any) -> TraceSuite:
    """The suite, when it is a trace set; FidelityUnavailable naming the field otherwise."""
    if not isinstance(suite, TraceSuite):
        raise FidelityUnavailable(f"{FIELD}: 'likelihood' scores the recorded assistant replies of a trace set; "
                                  f"suite {getattr(suite, 'name', suite)!r} has none (its tasks have their own "
                                  "grader): use references")
    return suite


def fallback_note(config: ValidationConfig, why: str) -> str:
    """The note of a fallback to the model-free fidelity; FidelityUnavailable when none is allowed."""
    message = (f"{FIELD}: 'likelihood' needs a model that scores a recorded reply teacher-forced (AKV's "
               f"continue_final_message with prompt_logprobs); {why}")
    if config.fidelity_fallback != "references":
        raise FidelityUnavailable(f"{message}. Set validation.likelihood_backend: embedded, or "
                                  "validation.fidelity_fallback: references to judge on the model-free fidelity")
    return f"{message}; judged on the model-free fidelity instead (validation.fidelity_fallback: references)"


class LikelihoodJudge:
    """The likelihood fidelity of the policies of one validation round. The scoring backend is opened
    on first use: the run's own when it is the one asked for (one model loaded, not two)."""

    def __init__(self, config: ValidationConfig, suite: TraceSuite, run_backend: str, run_backend_obj: Any,
                 full_text: str, seed: int = 0, precision: str | None = None) -> None:
        self.config, self.suite, self.seed = config, suite, seed
        self.spec = likelihood_spec(config, run_backend)
        self._reused = run_backend_obj if self.spec == run_backend else None
        self._precision = precision if run_backend == "embedded" else None
        self._full_text = full_text
        self._scorer: Any = None
        self._fidelity: LikelihoodFidelity | None = None
        self.note: str | None = None  # why the round fell back to the model-free fidelity, if it did

    def changes(self, policy_text: str, label: str, task_ids: Sequence[str]) -> list[TraceLikelihood] | None:
        """Per held-out trace, the policy's likelihood change against `full`; None once the round fell back
        (`note` says why). FidelityUnavailable when the model cannot score and no fallback is allowed."""
        if self.note is not None:
            return None
        try:
            fidelity = self._opened()
            return fidelity.score(_compiled(policy_text, label), task_ids) if fidelity is not None else None
        except ServerUnavailable as err:
            raise FidelityUnavailable(f"{FIELD}: the scoring server {self.spec} did not answer: {err}") from None
        except BackendError as err:
            self.note = fallback_note(self.config, f"{self.spec} answered: {err}")
            return None

    def _opened(self) -> LikelihoodFidelity | None:
        if self._fidelity is None:
            scorer = self._reused if callable(getattr(self._reused, "score_reply", None)) else None
            if scorer is None:
                scorer = self._scorer = open_backend(self.spec, None, self._precision)
            missing = scorer.lacks(SCORED_FEATURE) if callable(getattr(scorer, "lacks", None)) else None
            if missing:
                self.note = fallback_note(self.config, missing)
                return None
            self._fidelity = LikelihoodFidelity(self.suite, scorer, _compiled(self._full_text, "full"), self.seed)
        return self._fidelity

    def close(self) -> None:
        if self._fidelity is not None:
            self._fidelity.close()
        if self._scorer is not None:
            self._scorer.close()


def open_judge(config: ValidationConfig, evaluator: Any, run_backend: str, full_text: str, seed: int,
               precision: str | None = None) -> LikelihoodJudge | None:
    """The round's judge when `validation.fidelity` is likelihood (the evaluator's suite must be a trace set)."""
    if config.fidelity != "likelihood":
        return None
    suite = check_trace_suite(getattr(evaluator, "suite", None))
    return LikelihoodJudge(config, suite, run_backend, getattr(evaluator, "backend", None), full_text, seed, precision)


@dataclass(frozen=True)
class Judged:
    """Per policy, the held-out figures the champion rule judges (in `unit`), and what its record keeps
    under `stats.fidelity`."""

    scores: dict[int, list[float]]
    unit: str
    stats: dict[int, dict[str, Any]]


def judged_scores(policies: Sequence[PolicyInfo], runs: Mapping[int, Sequence[TaskResult]],
                  heldout_ids: Sequence[str], judge: LikelihoodJudge | None, resamples: int, seed: int) -> Judged:
    """The figures of every policy of `runs` by `validation.fidelity`: the results' own scores, or for
    `policies` (those the rule judges: the finalists and the expert; `full` costs nothing more) their
    likelihood changes from `judge`, or the scores again when it fell back."""
    references = {pid: [r.score for r in rows] for pid, rows in runs.items()}
    if judge is None:
        return Judged(references, POINTS, {pid: {"measure": "references"} for pid in runs})
    found: dict[int, list[TraceLikelihood]] = {}
    for info in policies:
        traces = judge.changes(info.text or "", info.label, heldout_ids)
        if traces is None:
            fallback = {"measure": "references", "asked": "likelihood", "fallback": judge.note}
            return Judged(references, POINTS, {pid: dict(fallback) for pid in runs})
        found[info.id] = traces
    stats = {pid: {"measure": "likelihood", "unit": NATS_PER_TOKEN, "change": None,
                   "note": "not scored: the champion rule judges the finalists against the expert"} for pid in runs}
    stats |= {pid: _likelihood_stats(traces, resamples, seed) for pid, traces in found.items()}
    scores = {**references, **{pid: [t.change for t in traces] for pid, traces in found.items()}}
    return Judged(scores, NATS_PER_TOKEN, stats)


def _likelihood_stats(traces: Sequence[TraceLikelihood], resamples: int, seed: int) -> dict[str, Any]:
    """A policy's likelihood fidelity as its record keeps it: the mean change over traces with its interval,
    and per trace the change, the reply tokens scored and the requests scored of those recorded."""
    changes = [t.change for t in traces]
    return {"measure": "likelihood", "unit": NATS_PER_TOKEN,
            "change": sum(changes) / len(changes) if changes else 0.0,
            "change_ci": bootstrap_ci(changes, resamples, seed=seed),
            "tokens": sum(t.tokens for t in traces), "requests": sum(t.requests for t in traces),
            "scored": sum(t.scored for t in traces),
            "traces": {t.trace_id: {"change": t.change, "tokens": t.tokens, "scored": t.scored,
                                    "requests": t.requests} for t in traces}}


def _compiled(text: str, label: str) -> Any:
    from policy_dsl import compile_policy, parse

    return compile_policy(parse(text), name=label)


def describe_fidelity(validations: Sequence[Any]) -> str | None:
    """One line on what the round's rule judged, when it was not the plain score: each scored policy's
    likelihood change (nats per reply token against full) and how many recorded requests fit the model,
    or the fallback's note."""
    found = [(v.label, v.stats.get("fidelity") or {}) for v in validations]
    fallback = next((f["fallback"] for _label, f in found if f.get("fallback")), None)
    if fallback:
        return f"fidelity: {fallback}"
    scored = [(label, f) for label, f in found if f.get("measure") == "likelihood" and f.get("change") is not None]
    if not scored:
        return None
    changes = ", ".join(f"{label} {f['change']:+.4f}" for label, f in scored)
    _label, first = scored[0]
    return (f"fidelity: likelihood, the mean change in log-likelihood per reply token against full (nats/token): "
            f"{changes}; {first['scored']} of {first['requests']} recorded requests fit the model and were scored")
