"""Task suites by name. Each suite lives in its own sub-package and is imported on demand."""
from __future__ import annotations

import importlib

from sandbox.suite import Suite

_SUITES = {
    "localcomp": ("sandbox.suites.localcomp", "LocalComp"),
    "localswe": ("sandbox.suites.localswe", "LocalSWE"),
}


def suite_names() -> list[str]:
    return sorted(_SUITES)


def get_suite(name: str) -> Suite:
    """The suite called `name`; a ValueError names the known suites otherwise."""
    if name not in _SUITES:
        raise ValueError(f"unknown suite {name!r}: expected one of {', '.join(suite_names())}")
    module, cls = _SUITES[name]
    return getattr(importlib.import_module(module), cls)()
