"""What a new `akv evolve` run uses where the user named nothing: defaults that depend on the suite.

Every suite: the proposers of `make evolve` (reflect first, then optuna, llm and mutate), the llm
proposer on the embedded model when no endpoint is given (with the small request that model
needs: `EMBEDDED_LLM`), and the suite's own baselines where it names them.

A trace set of real traffic (a suite with recorded runs): the full-scale baselines (`expert`,
`standard`, `text-engineering`) and the expert as the seed; the reflect-led mix without a model
(`reflect`, `optuna`, `mutate`; `llm` too when an endpoint is given: a strong model gets the same
evidence reflect reads); every train and every held-out trace; a score margin of half a point
(TRACE_MARGIN); and a candidate budget that fits the
suite: a policy scores a recorded request in milliseconds on replay, so the budget is the number
of candidates whose train runs replay about TRACE_REQUESTS requests, at least TRACE_CANDIDATES[0]
and at most TRACE_CANDIDATES[1]. `chosen_defaults` says what it chose, one line each.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from evolve.config import EvolveConfig
from evolve.proposers.embedded import EMBEDDED

MAKE_EVOLVE_PROPOSERS = ["reflect", "optuna", "llm", "mutate"]
TRACE_PROPOSERS = ["reflect", "optuna", "mutate"]
TRACE_REQUESTS = 60_000          # train requests a default trace run replays over all its candidates
TRACE_CANDIDATES = (20, 100)
# The score a trace set's champion may lose against the expert: its fidelity is near 1 (the expert
# itself loses a fraction of a point), so half a point, not the two points of a task suite's score.
TRACE_MARGIN = 0.005
MIN_SIDE = 2                     # traces a trace set needs on each side of its split
# The embedded model's request: a 4K-token prompt and a short constrained answer (decoding on a
# CPU is the slow part), and a long timeout for a busy CPU (evolve.yaml spells the same).
EMBEDDED_LLM: dict[str, Any] = {"context_tokens": 4096, "max_tokens": 320, "diagnosis_chars": 240,
                                "timeout_s": 600.0, "retries": 1}


class DefaultsError(ValueError):
    """The suite cannot be evolved on as it is; the message names what is missing."""


@dataclass(frozen=True)
class Chosen:
    config: EvolveConfig
    notes: tuple[str, ...]   # what was chosen for the user, one line each


def chosen_defaults(config: EvolveConfig) -> Chosen:
    """`config` with the defaults of its suite filled in where the user named nothing (module docstring)."""
    from sandbox.suites import get_suite

    try:
        suite = get_suite(config.suite)
    except ValueError:
        return Chosen(with_llm_endpoint(config), ())  # an unknown suite is reported where it is opened
    notes: list[str] = []
    scaled = getattr(suite, "baselines", None)
    if scaled:
        config = _with_baselines(config, scaled)
    if hasattr(suite, "scored_reuses"):
        config, note = _trace_defaults(config, suite)
        notes.append(note)
    elif "proposers" not in config.model_fields_set:
        config = config.model_copy(update={"proposers": list(MAKE_EVOLVE_PROPOSERS)})
    from evolve.proposers.llm import endpoint_of

    named = endpoint_of(config.llm) is not None
    config = with_llm_endpoint(config)
    if "llm" in config.proposers and not named:
        notes.append("llm proposer: the embedded model (no endpoint given: --proposer-endpoint URL or "
                     "AKV_PROPOSER_ENDPOINT names another)")
    return Chosen(config, tuple(notes))


def with_llm_endpoint(config: EvolveConfig) -> EvolveConfig:
    """The llm proposer's endpoint resolved: the one given (llm.endpoint, $AKV_PROPOSER_ENDPOINT,
    $OPENAI_BASE_URL), else the embedded model; on the embedded model, its small request where the
    user set no other. A run stores the result, so a resume asks the same endpoint."""
    from evolve.proposers.llm import endpoint_of

    if "llm" not in config.proposers:
        return config
    llm = config.llm
    if endpoint_of(llm) is None:
        llm = llm.model_copy(update={"endpoint": EMBEDDED})
    if llm.endpoint == EMBEDDED:
        given = _given_llm(config)
        llm = llm.model_copy(update={k: v for k, v in EMBEDDED_LLM.items() if k not in given})
    return config.model_copy(update={"llm": llm})


def _given_llm(config: EvolveConfig) -> set[str]:
    return _given(config, "llm")


def _given(config: EvolveConfig, section: str) -> set[str]:
    """The fields of a section (llm, cascade, validation) the user set."""
    return set(getattr(config, section).model_fields_set) if section in config.model_fields_set else set()


def _with_baselines(config: EvolveConfig, scaled: dict[str, str]) -> EvolveConfig:
    """The suite's baselines where the user named none, and its expert as the seed."""
    given = config.baselines.model_fields_set
    baselines = config.baselines.model_copy(update={k: v for k, v in scaled.items() if k not in given})
    seeds = config.seed_policies if "seed_policies" in config.model_fields_set else [baselines.expert]
    return config.model_copy(update={"baselines": baselines, "seed_policies": seeds})


def _trace_defaults(config: EvolveConfig, suite: Any) -> tuple[EvolveConfig, str]:
    """The defaults of a trace set (module docstring), and the line that says what they are."""
    from evolve.proposers.llm import endpoint_of

    suite.build(None, config.seed)   # fixes the split's seed; the traces are in the store
    train, heldout = suite.tasks("train"), suite.tasks("heldout")
    if len(train) < MIN_SIDE or len(heldout) < MIN_SIDE:
        raise DefaultsError(f"--suite {config.suite}: {len(train)} train and {len(heldout)} held-out traces (split "
                            f"seed {config.seed}); evolution needs at least {MIN_SIDE} on each side: import more runs "
                            f"(akv traces import FILE... --name {config.suite})")
    requests = sum(task.max_steps or 0 for task in train)
    update: dict[str, Any] = {}
    if "proposers" not in config.model_fields_set:
        update["proposers"] = TRACE_PROPOSERS + (["llm"] if endpoint_of(config.llm) else [])
    if "max_candidates" not in config.model_fields_set:
        low, high = TRACE_CANDIDATES
        update["max_candidates"] = min(high, max(low, TRACE_REQUESTS // max(1, requests)))
    if "train_limit" not in _given(config, "cascade"):
        update["cascade"] = config.cascade.model_copy(update={"train_limit": None})
    validation, named = config.validation, _given(config, "validation")
    chosen: dict[str, Any] = {}
    if not named & {"heldout_limit", "heldout_range"}:
        chosen["heldout_limit"] = None
    if "margin" not in named and validation.fidelity == "references":
        chosen["margin"] = TRACE_MARGIN
    if chosen:
        update["validation"] = validation.model_copy(update=chosen)
    config = config.model_copy(update=update)
    limit, held = config.cascade.train_limit, config.validation.heldout_limit
    note = (f"trace set {config.suite}: {len(train)} train traces ({requests} requests) and {len(heldout)} held out; "
            f"proposers {', '.join(config.proposers)}; {config.max_candidates} candidates; "
            f"{'every' if limit is None else f'the first {limit}'} train and "
            f"{'every' if held is None else f'the first {held}'} held-out trace; {config.validation.top_k} finalists; "
            f"score margin {100 * config.validation.margin:g} points; baselines "
            f"{config.baselines.expert}, {config.baselines.standard}, {config.baselines.text_engineering}, "
            f"{config.baselines.full}")
    return config, note
