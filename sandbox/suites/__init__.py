"""Task suites by name, found through the entry-point group `akv.suites`.

Every suite, ours included, is registered the same way: a package declares

    [project.entry-points."akv.suites"]
    mysuite = "my_package.suite:MySuite"

and `get_suite("mysuite")` imports `my_package.suite` and calls `MySuite()` on first use. A suite
that fails to import is reported with its name and the error; the others stay usable. Suites
imported from a user's documents (`akv tasks import retrieval`) live in the data folder and are
listed beside them, and so are the trace sets of the store (`akv traces import`, docs/traces.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from importlib import metadata
from typing import Callable

from sandbox.suites.base import Suite

ENTRY_POINT_GROUP = "akv.suites"
SUITE_METHODS = ("build", "version", "tasks", "open", "scripted_agent")


class SuiteLoadError(ValueError):
    """A registered suite that cannot be loaded; the message names the suite, its source and the error."""


@dataclass(frozen=True)
class SuiteEntry:
    """One registered suite: its name, the object path it loads and the distribution that declares it."""

    name: str
    target: str        # "module:attribute"
    distribution: str  # "name version" of the declaring package, "?" when unknown, or where it was imported
    factory: Callable[[], Suite] | None = field(default=None, compare=False, repr=False)  # imported suites

    @property
    def source(self) -> str:
        return f"{self.target} ({self.distribution})"


def suite_entries() -> list[SuiteEntry]:
    """Every registered suite, sorted by name (a name declared twice appears twice)."""
    found = []
    for point in metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(point, "dist", None)
        label = f"{dist.metadata['Name']} {dist.version}" if dist is not None else "?"
        found.append(SuiteEntry(point.name, point.value, label))
    return sorted(found + _imported_entries(), key=lambda e: (e.name, e.distribution))


def _imported_entries() -> list[SuiteEntry]:
    """The retrieval suites imported into the data folder, and the trace sets of the store."""
    return _retrieval_entries() + _trace_entries()


def _retrieval_entries() -> list[SuiteEntry]:
    from akv_core.home import home_path

    home = home_path()
    if not (home / "suites").is_dir():  # nothing imported: skip loading the retrieval code
        return []
    from sandbox.suites.retrieval import RetrievalSuite, imported_names, imported_root

    return [SuiteEntry(name, "sandbox.suites.retrieval:RetrievalSuite", f"imported at {imported_root(home, name)}",
                       partial(RetrievalSuite, name, home)) for name in imported_names(home)]


def _trace_entries() -> list[SuiteEntry]:
    """Trace sets of the store named by AKV_DB, or of the data folder's database when it exists.
    Read only: listing suites never creates, migrates or writes a database (`trace_set_names`)."""
    from sandbox.traces.suite import TraceSuite
    from store.database import default_url, display_url
    from store.errors import StoreError
    from store.traces import trace_set_names

    url = default_url(create_folder=False)
    try:
        names = trace_set_names(url)
    except StoreError as err:
        raise SuiteLoadError(f"the trace sets cannot be listed: {err}") from err
    where = f"trace set in {display_url(url)}"
    return [SuiteEntry(name, "sandbox.traces.suite:TraceSuite", where, partial(TraceSuite, name)) for name in names]


def suite_names() -> list[str]:
    """Names of the registered suites, sorted."""
    return sorted({e.name for e in suite_entries()})


def get_suite(name: str) -> Suite:
    """The suite called `name`; ValueError for an unknown name, SuiteLoadError for one that cannot load."""
    entries = suite_entries()
    if not any(e.target.startswith("sandbox.suites.") and e.factory is None for e in entries):
        raise ValueError(f"unknown suite {name!r}: this project's own suites are not registered under the entry-point "
                         f"group {ENTRY_POINT_GROUP!r} (its installed metadata is stale: run `make setup`)")
    matching = [e for e in entries if e.name == name]
    if not matching:
        raise ValueError(f"unknown suite {name!r}: expected one of {', '.join(suite_names())}")
    if len(matching) > 1:
        raise SuiteLoadError(f"suite {name!r} is registered more than once: "
                             + "; ".join(e.source for e in matching))
    return load_suite(matching[0])


def load_suite(entry: SuiteEntry) -> Suite:
    """Import an entry's object and make the suite; any failure becomes a SuiteLoadError naming it."""
    try:
        factory = entry.factory or metadata.EntryPoint(entry.name, entry.target, ENTRY_POINT_GROUP).load()
        suite = factory()
    except Exception as err:  # noqa: BLE001 - a broken plugin must not take the other suites down
        raise SuiteLoadError(f"suite {entry.name!r} from {entry.source} failed to load: "
                             f"{type(err).__name__}: {err}") from err
    missing = [m for m in SUITE_METHODS if not callable(getattr(suite, m, None))]
    if missing:
        raise SuiteLoadError(f"suite {entry.name!r} from {entry.source} is not a suite: "
                             f"it has no {', '.join(missing)} method")
    if getattr(suite, "name", None) != entry.name:
        raise SuiteLoadError(f"suite {entry.name!r} from {entry.source} calls itself "
                             f"{getattr(suite, 'name', None)!r}; the entry-point name and Suite.name must agree")
    return suite
