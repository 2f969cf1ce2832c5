"""`llm.endpoint: embedded`: the embedded model as the llm proposer's endpoint, for the run's lifetime.

The engine loads in this process and serves the OpenAI-compatible API on a free loopback port from
a thread (`akv_core.server`), so the proposer talks to it over HTTP exactly as to any endpoint, the
grammar field included, and the radix cache keeps the system prompt's KV between proposals. It
stops when the command ends. The run stores `embedded`, never the port, so a resume serves again.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from evolve.config import LLMProposerConfig
from evolve.proposers.base import ProposerUnavailable

EMBEDDED = "embedded"
MODEL = "smollm2"
PRECISION = "mixed"  # fp16 decode, bf16 prefill where the CPU has native bf16: the fastest decode (docs/benchmarks.md, Engine)


@contextmanager
def served(config: LLMProposerConfig) -> Iterator[LLMProposerConfig]:
    """`config` with the endpoint and model of the embedded model served on a thread until exit."""
    from akv_core import Engine
    from akv_core.server.app import create_app
    from akv_core.server.runner import serve_in_thread

    try:
        engine = Engine.from_pretrained(MODEL, precision=PRECISION)
    except (FileNotFoundError, ValueError) as err:
        raise ProposerUnavailable(f"llm.endpoint: embedded: cannot load the embedded model {MODEL!r}: {err}") from None
    with serve_in_thread(create_app(engine, MODEL)) as url:
        yield config.model_copy(update={"endpoint": f"{url}/v1", "model": MODEL})
