"""`akv evolve`: run (or resume) a policy evolution, then validate, export and compare."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from akv_cli.errors import fail
from akv_cli.options import DB_HELP, apply_unsafe_no_sandbox, unsafe_no_sandbox_option
from akv_cli.serve import Precision
from akv_cli.tasks import AGENT_MODE_HELP, AgentMode


def register(app: typer.Typer) -> None:
    """Add the evolution command to the root app."""

    @app.command()
    def evolve(
        config: Optional[Path] = typer.Option(None, "--config", help="YAML file of settings (see docs/evolve.md; "
                                                "default: none, the defaults below)."),
        proposer: Optional[str] = typer.Option(None, "--proposer", help="reflect, optuna, llm, mutate or random, or several "
                                               "comma-separated, asked as --schedule says (default: mutate,optuna)."),
        schedule: Optional[str] = typer.Option(None, "--schedule", help="lead (the first proposer until it is "
                                               "spent, then the others in turn) or round-robin (default lead)."),
        suite: Optional[str] = typer.Option(None, "--suite", help="Task suite (default localcomp)."),
        agent: Optional[str] = typer.Option(None, "--agent", help="scripted or llm (default scripted)."),
        agent_mode: Optional[AgentMode] = typer.Option(None, "--agent-mode", help=AGENT_MODE_HELP + " Default tools."),
        backend: Optional[str] = typer.Option(None, "--backend", help="replay, embedded or a server URL "
                                               "(default replay)."),
        precision: Optional[Precision] = typer.Option(None, "--precision", help="The embedded model's weight "
                                                      "precision (--backend embedded only; default float32)."),
        max_candidates: Optional[int] = typer.Option(None, "--max-candidates", help="Candidates to propose "
                                                    "(default 20)."),
        db: Optional[str] = typer.Option(None, "--db", envvar="AKV_DB", help=DB_HELP),
        run_name: Optional[str] = typer.Option(None, "--run-name", help="Name of the run (default: next evolve-NNN)."),
        resume: bool = typer.Option(False, "--resume", help="Continue RUN-NAME (default: the latest unfinished run); "
                                    "a finished run is left as it is."),
        revalidate: bool = typer.Option(False, "--revalidate", help="With --resume: validate a finished run again "
                                        "(a new validation round; earlier rounds are kept)."),
        proposer_endpoint: Optional[str] = typer.Option(None, "--proposer-endpoint",
                                                        help="OpenAI-compatible base URL for --proposer llm, "
                                                        "or 'embedded': the embedded model, served for the run "
                                                        "(default: $AKV_PROPOSER_ENDPOINT, then $OPENAI_BASE_URL)."),
        proposer_model: Optional[str] = typer.Option(None, "--proposer-model", help="Model name for the llm proposer "
                                                     "(default MiniMax-M2.7)."),
        seed: Optional[int] = typer.Option(None, "--seed", help="Seed of proposers and statistics (default 0)."),
        concurrency: Optional[int] = typer.Option(None, "--concurrency", min=1, help="Tasks run at once "
                                                  "(evaluation.concurrency; default 1)."),
        unsafe_no_sandbox: bool = unsafe_no_sandbox_option(),
    ) -> None:
        """Evolve cache policies on the train split, validate the best on held-out, export and compare."""
        from evolve.command import EvolveError, run_command

        apply_unsafe_no_sandbox(unsafe_no_sandbox)

        proposers = [name.strip() for name in proposer.split(",") if name.strip()] if proposer else None
        overrides = {"proposers": proposers or None, "schedule": schedule, "suite": suite, "agent": agent,
                     "agent_mode": agent_mode.value if agent_mode else None,
                     "backend": backend, "precision": precision.value if precision else None,
                     "max_candidates": max_candidates, "db": db, "run_name": run_name,
                     "llm.endpoint": proposer_endpoint, "llm.model": proposer_model, "seed": seed,
                     "evaluation.concurrency": concurrency}
        try:
            run_command(config, overrides, resume, revalidate=revalidate)
        except EvolveError as err:
            fail(str(err), err.exit_code)
