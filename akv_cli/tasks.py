"""`akv tasks build|list` and `akv run`: task suites and runs of an agent under a policy."""
from __future__ import annotations

import json
import sys
import time
from enum import Enum
from pathlib import Path
from typing import Any, Optional

import typer

from akv_cli.errors import USAGE, fail
from akv_cli.options import apply_unsafe_no_sandbox, unsafe_no_sandbox_option
from akv_cli.serve import Precision
from sandbox.agents.llm import AGENT_MODES

AgentMode = Enum("AgentMode", {name: name for name in AGENT_MODES}, type=str)
AGENT_MODE_HELP = ("The llm agent's steps: tools (each step a tool call, final_answer ends the run; needs a "
                   "backend that keeps tool_choice required) or free (a reply without calls is the answer).")

tasks_app = typer.Typer(help="Build and list the task suites.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    """Add `akv tasks ...` and `akv run` to the root app."""
    app.add_typer(tasks_app, name="tasks")
    app.command(name="run")(run)


def _suite(name: str) -> Any:
    from sandbox.suites import get_suite

    try:
        return get_suite(name)
    except ValueError as err:
        fail(str(err))
    except ImportError as err:
        fail(f"suite {name!r} is not available: {err}")


@tasks_app.command("build")
def build(suite: Optional[str] = typer.Option(None, help="Suite to build (default: every suite)."),
          seed: int = typer.Option(0, help="Seed of the generated tasks."),
          edition: Optional[int] = typer.Option(
              None, min=1, help="Generator edition (needs --suite); default: the edition already built, else the "
                                "newest."),
          unsafe_no_sandbox: bool = unsafe_no_sandbox_option()) -> None:
    """Create a suite's data under the data folder (idempotent)."""
    apply_unsafe_no_sandbox(unsafe_no_sandbox)
    import inspect

    from akv_core.home import akv_home
    from sandbox.suites import SuiteLoadError, get_suite, suite_names

    if edition is not None and not suite:
        fail("--edition needs --suite: editions are per suite")
    failed = []
    for name in [suite] if suite else suite_names():
        started = time.perf_counter()
        try:
            suite_obj = _suite(name) if suite else get_suite(name)
        except SuiteLoadError as err:  # building every suite: a broken plugin does not stop the others
            typer.echo(f"error: {err}", err=True)
            failed.append(name)
            continue
        options = {} if edition is None else {"edition": edition}
        if options and "edition" not in inspect.signature(suite_obj.build).parameters:
            fail(f"{name} has a single edition: drop --edition")
        before = _built_version(suite_obj)
        try:
            suite_obj.build(akv_home(), seed, **options)
        except ValueError as err:  # a data package missing, an archive unreachable or corrupt
            fail(f"{name}: {err}")
        version = suite_obj.version(akv_home())
        done = "already built" if version == before else f"built in {time.perf_counter() - started:.1f} s"
        typer.echo(f"{name}: {done} under {akv_home()} (version {version})")
    if failed:
        raise typer.Exit(code=USAGE)


def _built_version(suite_obj: object) -> str | None:
    """The version of what is built now; None when nothing (or not all of it) is (SuiteNotBuilt, a ValueError)."""
    from akv_core.home import akv_home

    try:
        return suite_obj.version(akv_home())
    except ValueError:
        return None


class ImportKind(str, Enum):
    retrieval = "retrieval"


@tasks_app.command("import")
def import_tasks(kind: ImportKind = typer.Argument(..., help="What the files hold: retrieval (documents and "
                                                   "questions, a deep-research suite)."),
                 corpus: Path = typer.Option(..., "--corpus", help="JSON Lines: {id, title, text} per document."),
                 queries: Path = typer.Option(..., "--queries", help="JSON Lines: {id, question, answer, "
                                              "evidence_ids, split} per question (optional aliases)."),
                 name: str = typer.Option(..., "--name", help="Name of the new suite (use it with --suite)."),
                 judge: Optional[str] = typer.Option(None, "--judge", help="OpenAI-compatible URL of a model that "
                                                     "grades answers exact match rejects (default: none)."),
                 judge_model: Optional[str] = typer.Option(None, "--judge-model", help="The judge's model name "
                                                           "(default: none; required with --judge)."),
                 replace: bool = typer.Option(False, "--replace", help="Rebuild a suite imported before.")) -> None:
    """Build a suite from your own files (docs/sandbox.md, "Your own corpus")."""
    from akv_core.home import akv_home
    from sandbox.suites import suite_entries
    from sandbox.suites.retrieval import import_suite
    from sandbox.suites.retrieval.grading import Judge

    if (judge is None) != (judge_model is None):
        fail("--judge and --judge-model go together: the endpoint and the model that grades")
    taken = {e.name for e in suite_entries() if e.factory is None}
    try:
        done = import_suite(name, corpus, queries, akv_home(), Judge(judge, judge_model) if judge else None,
                            replace=replace, taken=taken)
    except ValueError as err:
        fail(str(err))
    typer.echo(f"{done.name}: {done.documents} documents, "
               + ", ".join(f"{n} {split} tasks" for split, n in done.tasks.items()) + f" under {done.root}")


@tasks_app.command("list")
def list_tasks(suite: Optional[str] = typer.Option(None, help="Suite name, e.g. localcomp (required "
                                                                 "unless --suites)."),
               split: str = typer.Option("train", help="Split: train or heldout."),
               suites: bool = typer.Option(False, "--suites", help="List the registered suites and where "
                                           "each comes from, instead of a suite's tasks."),
               json_out: bool = typer.Option(False, "--json", help="One JSON object on stdout.")) -> None:
    """List the tasks of a split, or (--suites) the registered suites."""
    from rich.console import Console
    from rich.table import Table

    if suites:
        _list_suites(json_out)
        return
    if suite is None:
        fail("--suite: expected a suite name (or --suites to list the registered suites)")
    suite_obj = _suite(suite)
    try:
        tasks = suite_obj.tasks(split)  # never builds: a folder built with another seed stays as it is
    except ValueError as err:
        fail(str(err))
    if json_out:
        typer.echo(json.dumps({"suite": suite, "split": split,
                               "tasks": [{"id": t.id, "prompt": t.prompt} for t in tasks]}))
        return
    table = Table(title=f"{suite} / {split}: {len(tasks)} tasks")
    table.add_column("id")
    table.add_column("prompt", overflow="fold")
    for task in tasks:
        table.add_row(task.id, task.prompt if len(task.prompt) <= 160 else task.prompt[:157] + "...")
    Console().print(table)


def _list_suites(json_out: bool) -> None:
    """Each registered suite with its entry point, its package and whether it loads (the error if not)."""
    from rich.console import Console
    from rich.table import Table

    from sandbox.suites import ENTRY_POINT_GROUP, SuiteLoadError, load_suite, suite_entries

    rows = []
    for entry in suite_entries():
        try:
            load_suite(entry)
            error = None
        except SuiteLoadError as err:
            error = str(err)
        rows.append({"name": entry.name, "target": entry.target, "distribution": entry.distribution,
                     "error": error})
    if json_out:
        typer.echo(json.dumps({"group": ENTRY_POINT_GROUP, "suites": rows}))
        return
    table = Table(title=f"suites (entry-point group {ENTRY_POINT_GROUP})")
    for column in ("name", "entry point", "package", "status"):
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(row["name"], row["target"], row["distribution"], row["error"] or "ok")
    Console().print(table)


def run(suite: str = typer.Option(..., help="Suite name, e.g. localcomp."),
        split: str = typer.Option("train", help="Split: train or heldout."),
        policy: str = typer.Option(..., help="Built-in policy name or a .akvp file."),
        agent: str = typer.Option("scripted", help="scripted (the suite's navigator) or llm."),
        agent_mode: AgentMode = typer.Option(AgentMode.tools, help=AGENT_MODE_HELP),
        backend: str = typer.Option("replay", "--backend", "--endpoint",
                                    help="replay, embedded, or an OpenAI-compatible URL."),
        model: Optional[str] = typer.Option(None, help="Model name (URL backend; default: the "
                                            "server's first model) or smollm2|PATH (embedded; default smollm2)."),
        precision: Optional[Precision] = typer.Option(None, help="The embedded model's weight precision: float32 "
                                                      "(default, exact), fp16, mixed, int8 or int4 (--backend "
                                                      "embedded only; docs/engine-model.md)."),
        limit: Optional[int] = typer.Option(None, min=1, help="Run only the first N tasks (default: all)."),
        task: Optional[list[str]] = typer.Option(None, help="Run only this task id (repeatable; default: all)."),
        prices: Optional[str] = typer.Option(None, help="Price table (default: the model's, else gpt-oss-120b)."),
        max_steps: int = typer.Option(100, min=1, help="Agent requests per task before it gives up."),
        max_tokens: int = typer.Option(256, min=1, help="The llm agent's reply budget per step, in tokens."),
        seed: int = typer.Option(0, help="Seed for task building and sampling."),
        concurrency: int = typer.Option(1, min=1, help="Tasks run at once (threads against a server URL, "
                                        "processes on replay; embedded: 1)."),
        json_out: bool = typer.Option(False, "--json", help="Exactly one JSON object on stdout."),
        unsafe_no_sandbox: bool = unsafe_no_sandbox_option()) -> None:
    """Run an agent on a split's tasks under a cache policy and report score and cost."""
    from akv_core.home import data_path
    from sandbox.backends import check_backend_spec
    from sandbox.runs.harness import RunLimits, run_tasks
    from sandbox.runs.progress import TaskDisplay

    apply_unsafe_no_sandbox(unsafe_no_sandbox)
    suite_obj = _suite(suite)
    try:
        check_backend_spec(backend, concurrency)  # a malformed URL stops us before anything runs
    except ValueError as err:
        fail(str(err))
    out_dir = data_path("runs", f"{time.strftime('%Y%m%d-%H%M%S')}-{suite}-{split}-{_slug(policy)}")
    with TaskDisplay() as display:
        try:
            report = run_tasks(suite_obj, split, policy, agent=agent, backend=backend, limit=limit,
                               task_ids=task, seed=seed, out_dir=out_dir, model=model, prices=prices,
                               limits=RunLimits(max_steps=max_steps, max_tokens=max_tokens),
                               concurrency=concurrency, display=display,
                               precision=precision.value if precision else None, agent_mode=agent_mode.value)
        except ValueError as err:
            display.close()
            fail(str(err))
    if json_out:
        sys.stdout.write(json.dumps(report.to_dict()) + "\n")
    else:
        _print_report(report)


def _slug(policy: str) -> str:
    name = policy.replace("\\", "/").rsplit("/", 1)[-1]
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _print_report(report: Any) -> None:
    from rich.console import Console

    from sandbox.tables import Column, fitted_table
    from sandbox.runs.cost import cents

    columns = [Column("task", keep=9), Column("status", keep=8), Column("score", True, 8), Column("answer"),
               Column("requests", True, 5), Column("input", True, 4), Column("cached", True, 3),
               Column("repos", True, 2), Column("drop-skipped", True, 2), Column("output", True, 3),
               Column("cost ¢", True, 9)]
    rows = [[r.task_id, r.status, f"{r.score:.2f}", (r.answer or "")[:40], str(r.n_requests), str(r.tokens.input),
             str(r.tokens.cached), str(r.tokens.repos), str(r.tokens.drop_skipped), str(r.tokens.output),
             cents(r.cost_usd)] for r in report.results]
    console = Console()
    console.print(fitted_table(columns, rows, console.width, title="results"))
    s = report.summary
    console.print(
        f"{s['policy']} on {s['suite']}/{s['split']} ({s['agent']} agent, {s['backend']} backend, "
        f"{s['prices']} prices): {s['n_tasks']} tasks, mean score {s['mean_score']:.3f}, "
        f"mean cost {cents(s['mean_cost_usd'])}¢/task, total tokens "
        + ", ".join(f"{k} {v}" for k, v in s["tokens"].items()), markup=False, highlight=False)
    for task_id, reason in s["errors"].items():
        console.print(f"error in {task_id}: {reason}", markup=False, highlight=False)
    if s.get("out_dir"):
        console.print(f"results and trajectories: {s['out_dir']}", markup=False, highlight=False)
