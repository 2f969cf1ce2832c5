"""Configuration of an evolution run: pydantic models, loadable from YAML.

Unknown fields and wrong types are rejected; `load_config` reports them as
`FILE:LINE: field.path: message`, one line each.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from akv_core.model.precisions import PRECISIONS
from sandbox.agents.llm import AGENT_MODES, USE_RECORDS


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LLMProposerConfig(Strict):
    endpoint: Optional[str] = Field(
        None, description="Base URL of an OpenAI-compatible API (…/v1), or `embedded`: the embedded model, "
        "served in-process for the run (the model name is then its own). Default: $AKV_PROPOSER_ENDPOINT, "
        "then $OPENAI_BASE_URL, then embedded (with a 4K-token request: evolve/defaults.py EMBEDDED_LLM).")
    model: str = Field("MiniMax-M2.7", description="Model name sent with each request.")
    api_key_env: str = Field("OPENAI_API_KEY", description="Environment variable holding the API key "
                             "(a local server needs none).")
    temperature: float = Field(0.7, ge=0.0, le=2.0, description="Sampling temperature of proposals.")
    max_tokens: int = Field(1024, ge=16, description="Completion tokens allowed per proposal request.")
    timeout_s: float = Field(120.0, gt=0, description="Timeout of one request, seconds.")
    retries: int = Field(3, ge=0, description="Retries of a failing request before the run stops (resumable).")
    backoff_s: float = Field(1.0, ge=0, description="First retry delay; doubles on each retry.")
    max_total_tokens: int = Field(2_000_000, ge=0, description="Token budget (prompt + completion) for the "
                                  "whole run; proposing stops when it is spent.")
    max_usd: float = Field(5.0, ge=0, description="USD budget of proposal requests for the whole run.")
    price_input_per_m: float = Field(0.30, ge=0, description="USD per million prompt tokens (MiniMax-M2 list "
                                     "price, see docs/evolve.md).")
    price_output_per_m: float = Field(1.20, ge=0, description="USD per million completion tokens.")
    inspirations: int = Field(2, ge=0, description="Pareto-front policies shown besides the parent.")
    context_tokens: int = Field(8192, ge=512, description="The model's context window: the request (system "
                                "prompt, prompt, max_tokens) never exceeds it; the trajectory digests get what "
                                "the rest leaves (8192: the embedded model; raise it for large models).")
    digest_tasks: int = Field(2, ge=0, description="The parent's worst and (as many again) most expensive train "
                              "tasks whose trajectory digests the prompt carries.")
    diagnosis_chars: int = Field(600, ge=40, description="Longest diagnosis kept (characters): the answer's text "
                                 "before its policy block.")
    repair: bool = Field(True, description="Send a parse or validation error back once for repair.")
    constrain: Literal["auto", "lark", "off"] = Field(
        "auto", description="Decode the answer under the policy grammar, sent as the `lark` field: auto "
        "(fall back once, with a note, to unconstrained on a 400 naming the field), lark (always; such a "
        "400 stops the run) or off.")


class OptunaProposerConfig(Strict):
    sampler: Literal["tpe", "nsga2", "random"] = Field(
        "tpe", description="TPE or NSGA-II for the two objectives; random samples the ranges uniformly "
        "(the baseline of `akv bench search`).")
    startup_trials: int = Field(4, ge=1, description="TPE: completed trials of a study (population points "
                                "included) before it models them instead of sampling at random.")
    population_size: int = Field(8, ge=2, description="NSGA-II: trials per generation of a study.")


class MutateProposerConfig(Strict):
    crossover_rate: float = Field(0.25, ge=0.0, le=1.0, description="Share of proposals that cross two "
                                  "front parents instead of editing one.")
    max_edits: int = Field(2, ge=1, le=8, description="Most grammar-aware edits applied to one child.")
    attempts: int = Field(20, ge=1, description="Edits tried before giving up on producing a new valid policy.")


class CascadeConfig(Strict):
    subset_size: int = Field(6, ge=1, description="Train tasks of the first, cheap stage.")
    train_limit: Optional[int] = Field(20, ge=1, description="Use only the first N train tasks (the paper "
                                       "evolved on 20); null for the whole train split.")
    promote_margin: float = Field(0.0, ge=0.0, description="A candidate is pruned after the subset stage "
                                  "when a front policy dominates it there, scoring at least this much higher.")


class ValidationConfig(Strict):
    top_k: int = Field(2, ge=1, description="Front policies validated on the held-out split.")
    parents: bool = Field(True, description="Validate each finalist's parents too (those scored on the whole "
                          "train split): a child chosen over its parent on the train tasks may only fit them, "
                          "and the held-out split then chooses between them.")
    heldout_limit: Optional[int] = Field(60, ge=2, description="Use only the first N held-out tasks (60 keeps "
                                         "`make evolve` within minutes; the paper used 100); null for all. "
                                         "With heldout_range and no heldout_limit of its own: null.")
    heldout_range: Optional[tuple[int, int]] = Field(
        None, description="[start, stop): the held-out tasks by index, start included, stop not (60-169 of the "
        "split: [60, 170]); tasks beyond the ones earlier figures looked at.")
    heldout_seed: Optional[int] = Field(
        None, ge=0, description="Draw the held-out tasks from a build of the suite with this seed, under the data "
        "folder's fresh/SUITE-seedN/ (a suite that can build with a seed: localcomp, localswe); null: the run's own "
        "build.")
    alpha: float = Field(0.05, gt=0.0, lt=1.0, description="Significance level of the champion rule: of the "
                         "one-sided cost test (after Holm-Bonferroni) and of the score's non-inferiority bound.")
    margin: float = Field(0.02, ge=0.0, le=1.0, description="Non-inferiority margin of the score, in the unit of "
                          "`fidelity`: points of the 0..1 score (0.02 = 2 points) with references, nats per reply "
                          "token with likelihood (0.02: replies up to 2% less likely per token, exp(0.02) = 1.02). "
                          "The lower bound of the score difference vs the expert must exceed -margin.")
    fidelity: Literal["references", "likelihood"] = Field(
        "references", description="The score the champion rule judges: references, the suite's own score (on a "
        "trace set the model-free fidelity, 1 - lost/reuses); likelihood (trace sets only), the mean change "
        "in log-likelihood per reply token of the recorded assistant replies under the policy against full, scored "
        "teacher-forced by the model of `likelihood_backend` (nats/token; 0 for full).")
    fidelity_fallback: Optional[Literal["references"]] = Field(
        None, description="With fidelity likelihood: when the scoring server lacks teacher-forced scoring, judge on "
        "the model-free fidelity instead and say so in the round's records; null: stop with an error.")
    likelihood_backend: Optional[str] = Field(
        None, description="The model that scores likelihood fidelity: embedded or one server URL (akv serve); null: "
        "the run's backend when it has a model (the first server of a list), else embedded.")
    resamples: int = Field(2000, ge=100, description="Bootstrap resamples per confidence interval.")
    permutations: int = Field(10000, ge=100, description="Sign flips drawn when the sample is too large "
                              "to enumerate.")

    @model_validator(mode="before")
    @classmethod
    def _a_range_replaces_the_default_limit(cls, data: Any) -> Any:
        """A range given without a limit of its own takes all of its tasks, not the default first 60."""
        if isinstance(data, dict) and data.get("heldout_range") is not None and "heldout_limit" not in data:
            return {**data, "heldout_limit": None}
        return data

    @field_validator("likelihood_backend")
    @classmethod
    def _a_model_that_scores(cls, spec: str | None) -> str | None:
        if spec is None or spec == "embedded":
            return spec
        if not spec.startswith(("http://", "https://")) or "," in spec:
            raise ValueError(f"expected embedded or one http(s):// server URL (akv serve), got {spec!r}")
        return spec

    @field_validator("heldout_range")
    @classmethod
    def _a_range_is_ordered_and_not_negative(cls, span: tuple[int, int] | None) -> tuple[int, int] | None:
        if span is None:
            return span
        start, stop = span
        if start < 0:
            raise ValueError(f"start {start} is negative: task indices count from 0")
        if start >= stop:
            raise ValueError(f"[{start}, {stop}) holds no task: start must be below stop")
        return span


class EvaluationConfig(Strict):
    concurrency: int = Field(1, ge=1, le=256, description="Tasks of a candidate run at once in each process "
                             "(threads against a server URL, processes on replay; the embedded backend: 1).")
    lease_s: float = Field(60.0, ge=1.0, description="A task taken by a worker of a shared run (PostgreSQL) "
                           "returns to the queue if the worker has not renewed it for this long (it died).")
    use_records: Literal[USE_RECORDS] = Field(
        "references", description="Where the use records of an agent that keeps none (the llm agent) come from: "
        "the strings its messages reuse (references), the model's attention mass per message (attention: a "
        "backend with attribution), or both.")


class BaselineConfig(Strict):
    standard: str = Field("standard-8k", description="Built-in policy playing Standard.")
    text_engineering: str = Field("text-engineering-8k", description="Built-in policy playing Text Engineering.")
    expert: str = Field("expert-8k", description="Built-in expert policy: the reference a champion must beat.")
    full: str = Field("full", description="Built-in policy that does nothing (full attention, no drop).")


class EvolveConfig(Strict):
    run_name: Optional[str] = Field(None, description="Name of the run; default: the next free evolve-NNN.")
    seed: int = Field(0, description="Seed of proposers, task order and statistics.")
    suite: str = Field("localcomp", description="Task suite.")
    agent: str = Field("scripted", description="Agent that runs each task (scripted or llm).")
    agent_mode: Literal[AGENT_MODES] = Field(
        "tools", description="The llm agent's steps: tools (each step a tool call under tool_choice required, "
        "final_answer ends the task) or free (a reply without tool calls is the answer).")
    backend: str = Field("replay", description="Backend: replay, embedded or an AKV server URL.")
    precision: Optional[Literal[PRECISIONS]] = Field(
        None, description="The embedded backend's weight precision: float32 (the default, exact), fp16, mixed, "
        "int8 or int4 (docs/engine-model.md); only with backend: embedded.")
    proposers: list[Literal["llm", "optuna", "mutate", "reflect", "random"]] = Field(
        default_factory=lambda: ["reflect", "optuna", "llm", "mutate"], min_length=1,
        description="Proposers asked for new candidates, in the order `schedule` says (default: make evolve's "
        "mix; on a trace set reflect, optuna and mutate, with llm where an endpoint is given: evolve/defaults.py).")
    schedule: Literal["lead", "round-robin"] = Field(
        "lead", description="lead: the first proposer is asked until it is spent (`lead_patience` proposals in a "
        "row that did not reach the whole train split), then the others in turn; round-robin: all in turn.")
    lead_patience: int = Field(3, ge=1, description="Failed proposals in a row after which the lead proposer "
                               "hands over (lead schedule only).")
    seed_policies: list[str] = Field(
        default_factory=lambda: ["expert-8k"], min_length=1,
        description="Built-in policies (or .akvp files) that start the population.")
    max_candidates: int = Field(20, ge=1, description="New candidates proposed (rejected ones included).")
    db: Optional[str] = Field(None, description="Database URL; default $AKV_DB, then the data folder's SQLite file.")
    baselines: BaselineConfig = Field(default_factory=BaselineConfig, description="Baseline policies.")
    cascade: CascadeConfig = Field(default_factory=CascadeConfig, description="Cascade evaluation.")
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig, description="How tasks are run: "
                                         "concurrency, and the leases of workers sharing a run.")
    validation: ValidationConfig = Field(default_factory=ValidationConfig, description="Held-out validation.")
    llm: LLMProposerConfig = Field(default_factory=LLMProposerConfig, description="The llm proposer.")
    optuna: OptunaProposerConfig = Field(default_factory=OptunaProposerConfig, description="The optuna proposer.")
    mutate: MutateProposerConfig = Field(default_factory=MutateProposerConfig, description="The mutate proposer.")


    @field_validator("precision")
    @classmethod
    def _precision_needs_the_embedded_backend(cls, precision: str | None, info: ValidationInfo) -> str | None:
        backend = info.data.get("backend")   # validated before precision (field order)
        if precision is not None and backend != "embedded":
            raise ValueError(f"applies to backend: embedded only, not {backend!r} (replay has no model; a "
                             "server's precision is `akv serve --precision`)")
        return precision


def stored_config(data: dict[str, Any]) -> EvolveConfig:
    """A run's stored settings, validated. A run stored before a setting existed keeps the behaviour it had:
    the llm agent free (a reply without tool calls was the answer) before `agent_mode`, the proposers in
    turn before `schedule`, no parents validated before `validation.parents`."""
    if data.get("agent") == "llm" and "agent_mode" not in data:
        data = {**data, "agent_mode": "free"}
    if "schedule" not in data:   # stored before schedules: its proposers were asked in turn
        data = {**data, "schedule": "round-robin"}
    if "parents" not in data.get("validation", {"parents": True}):   # ... and only the top_k were validated
        data = {**data, "validation": {**data["validation"], "parents": False}}
    return EvolveConfig.model_validate(data)


class ConfigError(Exception):
    """A configuration the user must fix; the message is one located line per problem."""


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> EvolveConfig:
    """Read YAML (if given), apply command-line overrides (dotted keys), validate."""
    data: dict[str, Any] = {}
    lines: dict[tuple[str, ...], int] = {}
    name = str(path) if path else "<command line>"
    if path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as err:
            raise ConfigError(f"--config: cannot read {path}: {err.strerror}") from None
        try:
            data = yaml.safe_load(text) or {}
            lines = _key_lines(yaml.compose(text))
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f"{name}:{mark.line + 1}" if mark else name
            raise ConfigError(f"{where}: not valid YAML: {getattr(err, 'problem', err)}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{name}:1: expected a mapping of settings at the top level")
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        node = data
        *parents, last = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    try:
        return EvolveConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_located(err, name, lines)) from None


def _located(err: ValidationError, name: str, lines: dict[tuple[str, ...], int]) -> str:
    out = []
    for e in err.errors():
        loc = tuple(str(p) for p in e["loc"])
        line = next((lines[loc[:i]] for i in range(len(loc), 0, -1) if loc[:i] in lines), None)
        where = f"{name}:{line}" if line else name
        field = ".".join(loc) or "(top level)"
        message = "unknown field" if e["type"] == "extra_forbidden" else e["msg"]
        out.append(f"{where}: {field}: {message}")
    return "\n".join(out)


def _key_lines(node: Any, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], int]:
    """Map each key path of a composed YAML document to its 1-based line."""
    found: dict[tuple[str, ...], int] = {}
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            path = prefix + (str(key.value),)
            found[path] = key.start_mark.line + 1
            found.update(_key_lines(value, path))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            found[prefix + (str(i),)] = item.start_mark.line + 1
            found.update(_key_lines(item, prefix + (str(i),)))
    return found
