"""One `akv evolve` command: open the store, create or resume the run, evolve, validate,
export and print the comparison. User errors become EvolveError (one line, exit code 2);
a proposer that stops working leaves the run resumable (exit code 3)."""
from __future__ import annotations

import os

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from rich.console import Console

from evolve.config import (ConfigError, EvolveConfig, LLMProposerConfig, ValidationConfig, load_config,
                           stored_config)
from evolve.defaults import DefaultsError, chosen_defaults
from evolve.export import export_run
from evolve.fidelity import FidelityUnavailable, check_fidelity, describe_fidelity
from evolve.library import UnknownPolicy, library_texts, load_checked
from evolve.loop import Evolution, EvolutionResult
from evolve.pareto import Point
from evolve.proposers.base import Proposer, ProposerUnavailable
from evolve.report import comparison_rows, describe_selection, render_html, summary_line, text_table
from evolve.scoring import HarnessEvaluator, code_version
from evolve.validation import describe_heldout
from sandbox.runs.cost import cents
from sandbox.runs.progress import TaskDisplay
from sandbox.tables import Column, fitted_table
from store.database import normalize_url
from store import DuplicateRunName, RunInfo, Store, StoreError

RESUMABLE = ("running", "stopped")


class EvolveError(Exception):
    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def next_run_name(taken: set[str]) -> str:
    n = 1
    while f"evolve-{n:03d}" in taken:
        n += 1
    return f"evolve-{n:03d}"


RESUME_OVERRIDES = ("max_candidates", "llm.endpoint", "llm.model", "evaluation.concurrency")


def find_resumable(store: Store, name: str | None, include_finished: bool = False) -> RunInfo:
    """The named run, else the latest unfinished one (the latest run at all with include_finished)."""
    if name:
        return store.run(name)
    open_runs = [r for r in store.runs() if r.status in RESUMABLE or include_finished]
    if not open_runs:
        raise EvolveError("--resume: no unfinished run to resume (see `akv runs list`)")
    return open_runs[-1]


def resumed_config(run: RunInfo, overrides: Mapping[str, Any], console: Console) -> EvolveConfig:
    """The run's stored settings; only the budget and the proposer endpoint/model may change."""
    data = stored_config(run.config).model_dump(mode="json")
    for key, value in overrides.items():
        if value is None or key in ("run_name", "db"):
            continue
        if key not in RESUME_OVERRIDES:
            console.print(f"note: --{key.replace('_', '-')} is ignored on resume; the run keeps its stored setting")
            continue
        node = data
        *parents, last = key.split(".")
        for part in parents:
            node = node[part]
        node[last] = value
    try:
        return EvolveConfig.model_validate(data)
    except ValueError as err:
        raise EvolveError(f"--resume: {err}") from None


SELECTION = ("heldout_limit", "heldout_range", "heldout_seed")  # which held-out tasks: given together or not at all


def with_validation(stored: EvolveConfig, given: EvolveConfig, console: Console) -> EvolveConfig:
    """On resume, the validation settings of a `--config` file apply to the validation this process does
    (with --revalidate, a new round: the round records them); the run's other settings stay as stored.
    A file that names one held-out setting (`heldout_limit`, `heldout_range`, `heldout_seed`) chooses
    the held-out tasks anew: the stored ones of the others are dropped."""
    if "validation" not in given.model_fields_set:
        return stored
    named = given.validation.model_fields_set
    settings = stored.validation.model_dump(mode="json")
    if named & set(SELECTION):
        settings = {k: v for k, v in settings.items() if k not in SELECTION}
    settings |= given.validation.model_dump(mode="json", include=named)
    try:
        validation = ValidationConfig.model_validate(settings)
    except ValueError as err:
        raise EvolveError(f"--config: validation: {err}") from None
    changed = {k: v for k, v in validation.model_dump(mode="json").items()
               if v != stored.validation.model_dump(mode="json")[k]}
    if changed:
        console.print("validating with the --config file's settings: "
                      + ", ".join(f"validation.{k} {v}" for k, v in changed.items()), soft_wrap=True, markup=False)
    return stored.model_copy(update={"validation": validation})


def new_run(store: Store, config: EvolveConfig, suite_version: str) -> tuple[RunInfo, EvolveConfig]:
    name = config.run_name or next_run_name(store.run_names())
    config = config.model_copy(update={"run_name": name})
    # The database URL stays out of the stored config: it may carry a password, and it would be
    # copied into every exported provenance record.
    run = store.create_run(name, config.model_dump(mode="json", exclude={"db"}), config.seed, code_version(),
                           suite_version)
    return run, config


@contextmanager
def proposer_endpoint(config: EvolveConfig, console: Console) -> Iterator[LLMProposerConfig]:
    """The llm proposer's settings for this process: `llm.endpoint: embedded` serves the embedded model
    (evolve/proposers/embedded.py) until the run ends; any other endpoint is used as it is."""
    from evolve.proposers.embedded import EMBEDDED, served

    if "llm" not in config.proposers or config.llm.endpoint != EMBEDDED:
        yield config.llm
        return
    console.print("loading the embedded model for the llm proposer ...")
    with served(config.llm) as llm:
        console.print(f"llm proposer: the embedded model at {llm.endpoint}")
        yield llm


def make_proposers(config: EvolveConfig, store: Store, run: RunInfo,
                   llm: LLMProposerConfig | None = None) -> dict[str, Proposer]:
    """The run's proposers; `llm` replaces `config.llm` (the embedded model's served endpoint)."""
    from evolve.proposers.mutate import MutateProposer
    from evolve.proposers.optuna_search import OptunaProposer

    library = library_texts()
    proposers: dict[str, Proposer] = {}
    for name in dict.fromkeys(config.proposers):
        if name == "mutate":
            proposers[name] = MutateProposer(config.mutate, library)
        elif name == "optuna":
            proposers[name] = OptunaProposer(config.optuna, normalize_url(store.url), run.name, config.seed,
                                             config.validation.margin)
        elif name == "reflect":
            from evolve.proposers.reflect import ReflectProposer

            proposers[name] = ReflectProposer()
        elif name == "random":
            from evolve.proposers.random_sampler import RandomProposer

            proposers[name] = RandomProposer()
        else:
            from evolve.proposers.llm import LLMProposer

            spent = [p for p in store.policies(run.id) if p.proposer == "llm"]
            proposers[name] = LLMProposer(llm or config.llm, library[:3],
                                          spent_tokens=sum(p.prompt_tokens + p.completion_tokens for p in spent),
                                          spent_usd=sum(p.proposal_cost_usd for p in spent))
    return proposers


def run_command(config_path: Path | None, overrides: Mapping[str, Any], resume: bool,
                console: Console | None = None, revalidate: bool = False) -> EvolutionResult:
    """`akv evolve`: a new run, or (resume) the named or latest unfinished one; `revalidate` lets a
    finished run validate again (a new validation round), which a plain resume refuses to do."""
    console = console or Console()
    try:
        config = load_config(config_path, dict(overrides))
        store = Store.open(config.db)
    except (ConfigError, StoreError) as err:
        raise EvolveError(str(err)) from None
    if config.db:  # trace suites live in the run's database; task processes inherit this
        os.environ["AKV_DB"] = config.db
    try:
        return _run(store, config, dict(overrides), resume or revalidate, revalidate, console)
    except (StoreError, UnknownPolicy) as err:
        raise EvolveError(str(err)) from None
    finally:
        store.close()


def finished_already(store: Store, run: RunInfo, console: Console) -> EvolutionResult:
    """A plain resume of a finished run: say so, show what is stored, change nothing."""
    rounds = store.validation_rounds(run.id)
    validations = store.validations(run.id)
    console.print(f"run [bold]{run.name}[/] is finished ({len(rounds)} validation round"
                  f"{'s' if len(rounds) != 1 else ''}); nothing to do. To validate it again (a new round; "
                  f"earlier ones are kept): akv evolve --resume --revalidate --run-name {run.name}")
    if validations:
        print_comparison(console, validations)
        console.print(summary_line(validations))
    return EvolutionResult(validations, run.status_detail)


def _run(store: Store, config: EvolveConfig, overrides: dict[str, Any], resume: bool, revalidate: bool,
         console: Console) -> EvolutionResult:
    run, notes = None, []
    if resume:
        run = find_resumable(store, config.run_name, include_finished=revalidate)
        if run.status == "finished" and not revalidate:
            return finished_already(store, run, console)
        config = with_validation(resumed_config(run, overrides, console), config, console)
    else:
        try:
            chosen = chosen_defaults(config)
        except DefaultsError as err:
            raise EvolveError(str(err)) from None
        config, notes = chosen.config, chosen.notes
    if run is None and config.run_name and config.run_name in store.run_names():
        # Checked before the (slow) suite and backend start; create_run still guards races.
        raise DuplicateRunName(f"--run-name: a run named {config.run_name!r} already exists; pass --resume to "
                               "continue it or choose another name")
    named = [("seed_policies", n) for n in config.seed_policies]
    named += [(f"baselines.{role}", n) for role, n in config.baselines.model_dump().items()]
    for field, name in named:  # an unknown or invalid policy stops us before a run is created
        try:
            load_checked(name)
        except UnknownPolicy as err:
            raise EvolveError(f"{field}: {err}") from None
    display = TaskDisplay(console, task_lines=False)
    evaluator = open_evaluator(config, run, display, console)
    for note in notes:  # said once the run is sure to start: a refusal stays one line
        console.print(f"defaults: {note}", soft_wrap=True, markup=False, highlight=False)
    try:
        if run is None:
            run, config = new_run(store, config, evaluator.suite_version)
        else:
            store.set_run_status(run.id, "running")
        console.print(f"run [bold]{run.name}[/] in {store.display_url} "
                      f"({'resumed' if resume else 'new'}; proposers {', '.join(config.proposers)}; "
                      f"{config.max_candidates} candidate{'s' if config.max_candidates != 1 else ''})")
        try:
            with store.work.proposer_lock(run.id, run.name), proposer_endpoint(config, console) as llm:
                proposers = make_proposers(config, store, run, llm)
                result = Evolution(store, run, config, evaluator, proposers, _printer(console, store, run),
                                   display).run_all()
        except (ProposerUnavailable, FidelityUnavailable) as err:
            store.set_run_status(run.id, "stopped", str(err))
            again = "--revalidate " if isinstance(err, FidelityUnavailable) else ""
            raise EvolveError(f"{err}; resume with: akv evolve --resume {again}--run-name {run.name}", 3) from None
        except KeyboardInterrupt:
            store.set_run_status(run.id, "stopped", "interrupted")
            raise EvolveError(f"interrupted; resume with: akv evolve --resume --run-name {run.name}", 130) from None
    finally:
        evaluator.close()
        display.close()
    finish(store, store.run(run.id), result, console)
    return result


def open_evaluator(config: EvolveConfig, run: RunInfo | None, display: TaskDisplay,
                   console: Console) -> HarnessEvaluator:
    """The run's evaluator (suite, backend, lanes), and what validation will need of them checked before a
    run is made: `validation.fidelity` (a trace set; a scoring server that can score), EvolveError otherwise."""
    if config.backend == "embedded":
        display.phase("loading the model smollm2 (embedded backend)")
    try:
        evaluator = HarnessEvaluator(config.suite, config.agent, config.backend, config.seed,
                                     recorded_version=run.suite_version if run is not None else None,
                                     concurrency=config.evaluation.concurrency, precision=config.precision,
                                     heldout_seed=config.validation.heldout_seed,
                                     heldout_range=config.validation.heldout_range, agent_mode=config.agent_mode,
                                     use_records=config.evaluation.use_records)
    except ValueError as err:
        display.close()
        message = str(err)
        named = run is not None or message.startswith(("--", "validation.", "evaluation."))
        raise EvolveError(message if named else f"--suite/--backend: {err}") from None
    try:
        note = check_fidelity(config.validation, evaluator.suite, config.backend)
    except FidelityUnavailable as err:
        evaluator.close()
        display.close()
        raise EvolveError(str(err)) from None
    if note:
        console.print(f"note: {note}", soft_wrap=True, markup=False, highlight=False)
    return evaluator


def _printer(console: Console, store: Store, run: RunInfo):
    def show(message: str, front: Sequence[Point]) -> None:
        best = max(front, key=lambda p: (p.score, -p.cost), default=None)
        best_text = (f"best #{best.policy_id} score {best.score:.3f} cost {cents(best.cost)}¢/task" if best
                     else "no front yet")
        # One line per step, never broken by the console: a terminal wraps it whole, a pipe keeps it
        console.print(f"[dim]{run.name}[/] {message}  [cyan]({best_text}; front {len(front)})[/]", soft_wrap=True)
    return show


def finish(store: Store, run: RunInfo, result: EvolutionResult, console: Console) -> None:
    """Print the comparison, write the report and export the champion (or the best candidate)."""
    from akv_core.home import data_path

    print_comparison(console, result.validations)
    console.print(summary_line(result.validations))
    if result.stop_reason:
        console.print(f"proposing stopped early: {result.stop_reason}")
    report = data_path("reports", run.name, "report.html")
    report.write_text(render_html(store, run), encoding="utf-8")
    console.print(f"report: {report}")
    if not any(v.role == "candidate" for v in result.validations):
        console.print("nothing exported: no candidate reached held-out validation")
        return
    exported = export_run(store, run.id, allow_best=True)
    kind = "champion" if exported.champion else "best candidate (not a champion)"
    console.print(f"exported {kind} #{exported.policy_id}: {exported.policy_path} "
                  f"(provenance {exported.provenance_path})")


def print_comparison(console: Console, validations) -> None:
    """The held-out table, then which held-out tasks the round ran (`validation.describe_heldout`)."""
    _print_table(console, validations)
    source = next((v.stats["heldout"] for v in validations if isinstance(v.stats.get("heldout"), dict)), None)
    if source is not None:
        console.print(f"held-out: {describe_heldout(source)}", soft_wrap=True, markup=False, highlight=False)
    judged = describe_fidelity(validations)
    if judged is not None:
        console.print(judged, soft_wrap=True, markup=False, highlight=False)
    chosen = describe_selection(validations)
    if chosen is not None:  # a long line: wrapped at the terminal's width, as the verdict is
        console.print(chosen, markup=False, highlight=False)


def _print_table(console: Console, validations) -> None:
    rows = text_table(comparison_rows(validations))
    # Numbers whole; at a narrow width the comparisons with the weaker baselines are left out first.
    columns = [Column(rows[0][0], keep=9), Column(rows[0][1], True, 9)]
    columns += [Column(header, True, 8 - n) for n, header in enumerate(rows[0][2:])]
    console.print(fitted_table(columns, rows[1:], console.width, compact=True,
                               complete="akv compare RUN --json has every column",
                               title="held-out comparison (± half-width of the 95% bootstrap CI; per baseline: "
                                     "cost %, score points; vs expert: the champion rule's Holm p and score lower bound)"))
