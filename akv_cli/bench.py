"""`akv bench serving|cost|headroom|search|evolve|replay|scale|proposals|traces|attribution`: benchmarks, a table and ratios or one JSON object.

The benchmarks of `benchmarks/` ship with the source checkout (they are not part of the installed
packages), so they are imported from the checkout this command was installed from. `proposals`
measures the llm proposer, which lives in `evolve` (above what `benchmarks/` may import).
"""
from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

import typer

from akv_cli.errors import fail

bench = typer.Typer(help="Benchmarks measured side by side in one run (they take minutes, not seconds).",
                    no_args_is_help=True)

JSON_HELP = "Print the figures as one JSON object."
SUITES_HELP = "Comma-separated suites (a suite that cannot be loaded is left out with a note)."


def register(app: typer.Typer) -> None:
    """Add this group's commands to the root app."""
    app.add_typer(bench, name="bench")


@bench.command()
def serving(
    streams: int = typer.Option(8, min=1, help="Tasks per policy; concurrency c replays the first c."),
    steps: int = typer.Option(3, min=1, help="Agent steps recorded per task."),
    concurrency: str = typer.Option("1,4,8", help="Comma-separated numbers of concurrent streams."),
    max_tokens: int = typer.Option(4, min=1, help="Tokens generated per request."),
    kv_tokens: int | None = typer.Option(None, min=1, help="KV pool of the server (default: sized so that "
                                                          "Standard's streams do not fit together)."),
    suites: str = typer.Option("localcomp,localswe", help=SUITES_HELP),
    preview: bool = typer.Option(False, "--preview", help="Only the replay accounting's prefill in the pool, "
                                                         "requests served in turn (seconds, no server)."),
    context: int | None = typer.Option(None, help="Serve the model at this longer context (32768: RoPE "
                                       "stretched by YaRN) with the baselines scaled to it (default: the "
                                       "model's 8,192)."),
    without_text_engineering: bool = typer.Option(False, "--without-text-engineering",
                                                  help="AKV and Standard only (a shorter run)."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Replay recorded agent trajectories against `akv serve`: throughput, latency, prefill, attention."""
    module = _benchmark("serving")
    levels = _numbers(concurrency, "--concurrency")
    if context is not None and context not in module.LONG_CONTEXTS:
        fail(f"--context: expected one of {', '.join(map(str, module.LONG_CONTEXTS))} (the contexts with "
             f"scaled baselines), got {context}")
    settings = module.Settings(streams, steps, levels, max_tokens, kv_tokens, module.Settings.pool_fraction,
                               _names(suites), context=context, text_engineering=not without_text_engineering)
    if preview:
        figures = _guarded(lambda: module.preview(settings, progress=lambda text: typer.echo(text, err=True)))
        typer.echo(json.dumps(figures) if as_json else module.render_preview(figures))
        return
    _report(module, settings, as_json)


@bench.command()
def cost(
    tasks: int = typer.Option(40, min=0, help="localcomp held-out tasks (0: the whole split)."),
    swe_tasks: int = typer.Option(4, min=0, help="localswe held-out tasks (0: the whole split)."),
    resamples: int = typer.Option(2000, min=100, help="Bootstrap resamples."),
    seed: int = typer.Option(0, help="Seed of the resampling."),
    suites: str = typer.Option("localcomp,localswe", help=SUITES_HELP),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Score and cost per policy on the held-out splits: intervals, paired tests of the expert against
    Standard, Text Engineering and full, and the champion rule of every other policy against the expert."""
    module = _benchmark("cost")
    settings = module.Settings(tasks or None, swe_tasks or None, resamples, seed, _names(suites))
    _report(module, settings, as_json)


@bench.command()
def headroom(
    suites: str = typer.Option("localcomp,localswe", help=SUITES_HELP),
    splits: str = typer.Option("train,heldout", help="Comma-separated splits."),
    limit: int = typer.Option(40, min=0, help="localcomp tasks per split (0: the whole split)."),
    swe_limit: int = typer.Option(8, min=0, help="localswe tasks per split (0: the whole split)."),
    policies: str | None = typer.Option(None, help="Comma-separated hand-written kv policies to add for "
                                                      "every suite (built-in names or .akvp files; default: each "
                                                      "suite's own, research for localcomp, drop-settled for "
                                                      "localswe)."),
    margin: float | None = typer.Option(None, help="The champion rule's score margin (default: its own)."),
    alpha: float = typer.Option(0.05, help="The champion rule's significance level."),
    seed: int = typer.Option(0, help="The suites' build seed (another seed: other bugs and documents, fresh splits)."),
    workers: int = typer.Option(2, min=1, help="Processes running tasks (each task's policies in one of them)."),
    agent: str = typer.Option("scripted", help="scripted (replay backend) or llm (the embedded model in tools "
                              "mode, one per worker; minutes per task on a CPU: pass a small --limit)."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Per suite and split: full, Standard, Text Engineering, the expert, hand-written built-ins and the oracle."""
    module = _benchmark("headroom")
    chosen = None if policies is None else tuple(p.strip() for p in policies.split(",") if p.strip())
    settings = module.Settings(_names(suites), _names(splits, "--splits"), limit or None, swe_limit or None, chosen,
                               margin, alpha, seed=seed, workers=workers, agent=agent)
    _report(module, settings, as_json)


@bench.command()
def search(
    suite: str = typer.Option("localcomp", help="Suite whose train split is searched."),
    tasks: int = typer.Option(6, min=1, help="The first N train tasks score every policy."),
    budget: int = typer.Option(16, min=1, help="Proposals per search run (duplicates and rejections count)."),
    repeats: int = typer.Option(8, min=1, help="Search runs per mix, with seeds 0, 1, ..."),
    mixes: str = typer.Option("random,tpe,nsga2,mutate+tpe", help="Comma-separated proposer mixes: random, tpe, "
                              "nsga2, mutate, mutate+tpe, llm+mutate+tpe (needs --proposer-endpoint)."),
    structure: Optional[Path] = typer.Option(None, help="A .akvp policy whose tunable ranges span the grid "
                                             "(default: a two-tunable window with a search-result age)."),
    margin: float = typer.Option(0.02, min=0.0, help="A policy counts when its mean score is within this of the "
                                 "grid's best."),
    proposer_endpoint: Optional[str] = typer.Option(None, help="OpenAI-compatible base URL for the llm mix "
                                                    "(default: $AKV_PROPOSER_ENDPOINT, then $OPENAI_BASE_URL)."),
    proposer_model: Optional[str] = typer.Option(None, help="Model name for the llm mix (default: llm.model's "
                                                 "default)."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Regret curves of proposer mixes against the optimum of an exhaustive grid over a structure's tunables."""
    from evolve.search import MIXES, Searcher

    module = _benchmark("search")
    names = _names(mixes, "--mixes")
    unknown = [m for m in names if m not in MIXES]
    if unknown:
        fail(f"--mixes: unknown mix {unknown[0]!r}; expected one of {', '.join(MIXES)}")
    text = module.STRUCTURE
    if structure is not None:
        try:
            text = structure.read_text(encoding="utf-8")
        except OSError as err:
            fail(f"--structure: cannot read {structure}: {err.strerror}")
    llm = {k: v for k, v in (("endpoint", proposer_endpoint), ("model", proposer_model)) if v}
    if any(m.startswith("llm") for m in names) and not (llm.get("endpoint") or _proposer_env()):
        fail("--mixes: the llm mix needs --proposer-endpoint (or AKV_PROPOSER_ENDPOINT)")
    settings = module.Settings(suite, tasks, budget, repeats, margin, text, names)

    def measure() -> Any:
        searcher = Searcher(suite, tasks, llm)
        try:
            return module.measure(settings, searcher, progress=lambda line: typer.echo(line, err=True))
        finally:
            searcher.close()
    figures = _guarded(measure)
    typer.echo(json.dumps(figures) if as_json else module.render(figures))


@bench.command()
def evolve(
    suite: str = typer.Option("localcomp", help="Suite whose train split evolves and held-out split judges."),
    seeds: int = typer.Option(6, help="Runs per arm, with seeds 0, 1, ... (fewer than 6 cannot give a paired "
                              "p < 0.05)."),
    budget: int = typer.Option(12, help="Candidates per run, the same for every arm (duplicates and rejections "
                               "count)."),
    arms: str = typer.Option("mix,random,reflect,optuna,mutate", help="Comma-separated arms: mix (reflect, optuna, "
                             "mutate: make evolve's without llm), random, reflect, optuna, mutate."),
    train_limit: int = typer.Option(20, help="The first N train tasks score the candidates."),
    subset_size: int = typer.Option(6, help="Train tasks of the cascade's first stage."),
    heldout_limit: int = typer.Option(60, help="The first N held-out tasks judge the finalists."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Proposer arms at equal budget: each arm's held-out saving vs the expert over seeds, mix vs random."""
    from evolve.arms import LoopRunner

    module = _benchmark("evolve_arms")
    settings = module.Settings(suite, seeds, budget, _names(arms, "--arms"), heldout_limit, train_limit, subset_size)
    figures = _guarded(lambda: module.measure(settings, progress=lambda text: typer.echo(text, err=True),
                                              runner=_guarded(lambda: LoopRunner(suite))))
    typer.echo(json.dumps(figures) if as_json else module.render(figures))


def _proposer_env() -> str | None:
    import os

    return os.environ.get("AKV_PROPOSER_ENDPOINT") or os.environ.get("OPENAI_BASE_URL")


@bench.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
               add_help_option=False)
def replay(ctx: typer.Context) -> None:
    """Requests per second of the replay accounting (the per-candidate work of evolution); --help for options."""
    module = _benchmark("replay")
    _guarded(lambda: module.main(list(ctx.args), prog="akv bench replay"))


@bench.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
               add_help_option=False)
def scale(ctx: typer.Context) -> None:
    """Replay evaluations/s with 1 and 2 workers sharing a run (PostgreSQL), llm and multi-step tasks/s against
    akv serve at concurrency 1, 4, 8; --help for options."""
    module = _benchmark("scale")
    _guarded(lambda: module.main(list(ctx.args)))


@bench.command()
def proposals(
    endpoint: str = typer.Option(..., help="OpenAI-compatible base URL (…/v1), e.g. an `akv serve`."),
    model: str = typer.Option("smollm2", help="Model name sent with each request."),
    constrain: str = typer.Option("lark,off", help="Comma-separated llm.constrain settings, surveyed in turn."),
    count: int = typer.Option(100, min=1, help="Proposals per setting."),
    workers: int = typer.Option(8, min=1, help="Proposals asked at once (the server batches them)."),
    max_tokens: int = typer.Option(256, min=16, help="llm.max_tokens of each request."),
    temperature: float = typer.Option(0.7, min=0.0, max=2.0, help="llm.temperature."),
    diagnosis_chars: int = typer.Option(600, min=40, help="llm.diagnosis_chars: the longest diagnosis (the "
                                        "grammar's bound, as far as --max-tokens leaves room)."),
    parent: str = typer.Option("expert-8k", help="Built-in policy whose prompt is sent."),
    suite: str = typer.Option("localcomp", help="Suite whose first train tasks give the parent's results."),
    tasks: int = typer.Option(20, min=1, help="Train tasks the parent is scored on (replay backend)."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Validity of llm proposals on the real proposer prompt, with and without the policy grammar."""
    from evolve.config import LLMProposerConfig
    from evolve.proposal_survey import parent_candidate, render, survey
    from evolve.proposers.base import ProposerUnavailable

    settings = _names(constrain, "--constrain")
    if any(s not in ("auto", "lark", "off") for s in settings):
        fail(f"--constrain expects auto, lark or off separated by commas, got {constrain!r}")
    candidate = _guarded(lambda: parent_candidate(parent, suite, tasks))
    surveys = []
    for setting in settings:
        config = LLMProposerConfig(endpoint=endpoint, model=model, constrain=setting, max_tokens=max_tokens,
                                   temperature=temperature, diagnosis_chars=diagnosis_chars, timeout_s=3600,
                                   max_usd=1e9)
        typer.echo(f"surveying constrain={setting}: {count} proposals, {workers} at a time", err=True)
        try:
            surveys.append(survey(config, candidate, count, workers))
        except ProposerUnavailable as err:
            fail(str(err))
    if as_json:
        typer.echo(json.dumps([{**vars(s), "valid_rate": s.valid_rate} for s in surveys]))
    else:
        typer.echo(render(surveys))


@bench.command()
def traces(
    suite: Optional[str] = typer.Option(None, "--suite", help="A trace set (`akv traces list`; required "
                                        "unless --synthetic)."),
    split: str = typer.Option("all", help="all, train or heldout."),
    policy: list[str] = typer.Option([], "--policy", help="Another policy to score (built-in name or .akvp "
                                     "file); repeat for more."),
    seed: int = typer.Option(0, help="The split's seed."),
    synthetic: int = typer.Option(0, min=0, help="Instead of --suite: this many generated code-repair traces "
                                  "of 68 requests up to ~160K prompt tokens (the scoring speed; default 0)."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Every built-in policy, the oracle and yours on recorded traffic: score, lost reuses, cost, speed."""
    module = _benchmark("traces")
    _report(module, module.Settings(suite, split, tuple(policy), seed, synthetic), as_json)


@bench.command()
def attribution(
    tokens: int = typer.Option(64, min=1, help="New tokens per decode request."),
    rounds: int = typer.Option(3, min=1, help="Rounds of the decode and scoring measurements (their median)."),
    streams: str = typer.Option("1,8", help="Comma-separated numbers of concurrent decode requests."),
    score_tokens: int = typer.Option(256, min=2, help="Tokens of the scored reply."),
    trace_steps: int = typer.Option(8, min=1, help="Assistant steps scored per sample trace."),
    window: int = typer.Option(3000, min=256, help="History tokens a trace step shows (the model's context is 8,192)."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Attribution's decode cost at 1 and 8 streams, teacher-forced scoring against a prefill, and attention
    use records against reuse-inferred ones on the sample traces."""
    module = _benchmark("attribution")
    settings = module.Settings(tokens, rounds, _numbers(streams, "--streams"), score_tokens, trace_steps, window)
    _report(module, settings, as_json)


def _report(module: ModuleType, settings: Any, as_json: bool) -> None:
    figures = _guarded(lambda: module.measure(settings, progress=lambda text: typer.echo(text, err=True)))
    typer.echo(json.dumps(figures) if as_json else module.render(figures))


def _guarded(run: Any) -> Any:
    """Run a benchmark; a setting the user got wrong ends with one line, not a traceback."""
    try:
        return run()
    except ValueError as err:
        fail(str(err))


def _benchmark(name: str) -> ModuleType:
    """`benchmarks.<name>` from the checkout next to this package."""
    root = Path(__file__).resolve().parents[1]
    if not (root / "benchmarks" / f"{name}.py").is_file():
        fail(f"akv bench {name} needs benchmarks/{name}.py, which only the source checkout has (the installed "
             f"package does not ship benchmarks/): run it from a clone installed with `pip install -e .`")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module(f"benchmarks.{name}")


def _numbers(text: str, option: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        fail(f"{option} expects positive integers separated by commas, got {text!r}")
    return values


def _names(text: str, option: str = "--suites") -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    if not names:
        fail(f"{option} expects at least one name")
    return names
