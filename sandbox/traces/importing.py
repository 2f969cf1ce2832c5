"""`akv traces import`: files read one at a time into a trace set's records, under ids that never
collide by accident.

Streaming: `TraceImport.records()` reads a file, yields the store records of its traces and only then
reads the next, so an import holds one file's traces at a time (the store writes each record and
lets it go, `store.traces.TraceStore.add`): memory is bounded by the largest file, not the total
(a file of many runs, a JSON Lines log or a tau-bench array, is read whole).
An error in any file raises inside the store's one transaction, so nothing is imported.

Ids (`--id-from`, `IdOptions`):
- `field` (the file's own id: `instance_id`, `id`, a session id, ...; each reader's docstring says
  which): a trace whose id the set (or an earlier file of the import) holds with other content is
  refused;
- `path`: every trace's id is its *path id*: the file's folder and name without its format suffix
  (`runs-b/astropy__astropy-12907`), followed by `/<own id>` for a file of several traces;
- `auto` (the default): the own id, unless a trace of another file holds it with other content
  (two run folders of one benchmark): then the path id, and a note says so. A trace the set holds
  under the same id from the same file (the same folder and name) with other content is a real
  conflict (the run changed since its import) and is refused, and so is a path id taken too.
`--id-prefix P` puts P before every id (after the rule above). A trace with the same id and the same
content as one held is the same run: unchanged, whichever file it comes from.

Each stored trace's provenance gets `path`, the folder and name of its file (the key of "the same
file" above), unless its reader kept one (an `akv` export's traces keep their origin).

Warnings: a trace that has no tool result once its text actions are in tool-call form gives one
line: tool-based policies have nothing to drop in it, and a text-action agent the detector missed
can be named with `--actions text`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from store.records import StoredTrace

from sandbox.traces.actions import as_tool_calls
from sandbox.traces.formats import Located, read_located
from sandbox.traces.model import Trace, TraceError
from sandbox.traces.reading import file_stem
from sandbox.traces.records import stored_of
from sandbox.traces.suite import split_key

ID_SOURCES = ("auto", "path", "field")
MAX_ID = 200  # the store's trace_id column


@dataclass(frozen=True)
class IdOptions:
    """How imported traces are named (module docstring)."""

    source: str = "auto"
    prefix: str = ""


@dataclass
class ImportReport:
    """What an import did, filled in as `TraceImport.records()` is consumed."""

    traces: int = 0
    requests: int = 0
    ids: list[str] = field(default_factory=list)
    split_keys: list[str] = field(default_factory=list)  # per trace, what decides its split (`suite.split_key`)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


class TraceImport:
    """The traces of `files` as store records, for the set whose held traces are `held`
    (id -> (digest, provenance), `TraceStore.held`)."""

    def __init__(self, files: Sequence[Path], held: Mapping[str, tuple[str, Mapping[str, Any]]],
                 format: str | None = None, actions: str | None = None, ids: IdOptions = IdOptions()) -> None:
        if ids.source not in ID_SOURCES:
            raise ValueError(f"--id-from: {ids.source!r}: expected one of {', '.join(ID_SOURCES)}")
        self.files, self.format, self.actions, self.ids = list(files), format, actions, ids
        self.held = {trace_id: (digest, provenance.get("path")) for trace_id, (digest, provenance) in held.items()}
        self.report = ImportReport()

    def records(self) -> Iterator[StoredTrace]:
        """Every trace of every file, in order, as a store record under its final id."""
        for path in self.files:
            located = read_located(path, self.format, self.actions)
            for item in located:
                trace = self._named(path, item, several=len(located) > 1)
                self._count(path, item.line, trace)
                yield stored_of(trace)

    def _named(self, path: Path, item: Located, several: bool) -> Trace:
        trace = item.trace
        source = str(trace.provenance.get("path") or source_of(path))
        where = f"{path}:{item.line}"
        own = self.ids.prefix + trace.id
        by_path = self.ids.prefix + path_id(path, trace.id if several else None)
        digest = trace.digest()
        chosen = by_path if self.ids.source == "path" else own
        held = self.held.get(chosen)
        if held is not None and held[0] != digest and self.ids.source == "auto" and held[1] != source:
            origin = held[1] or "an earlier import"
            self.report.notes.append(f"{where}: trace id {own!r} is another run's (from {origin}); imported as "
                                     f"{by_path!r}")
            chosen, held = by_path, self.held.get(by_path)
        if held is not None and held[0] != digest:
            origin = "the same file" if held[1] == source else (held[1] or "an earlier import")
            raise TraceError(f"{where}: trace {chosen!r} is already in the set with other content, from {origin}: "
                             "expected a new run; --id-prefix P names this import's traces apart, or delete the set "
                             "first if the run changed")
        if len(chosen) > MAX_ID:
            raise TraceError(f"{where}: trace id {chosen[:40]!r}... has {len(chosen)} characters: expected at most "
                             f"{MAX_ID} (a shorter --id-prefix, or --id-from field)")
        self.held[chosen] = (digest, source)
        return replace(trace, id=chosen, provenance={**trace.provenance, "path": source})

    def _count(self, path: Path, line: int, trace: Trace) -> None:
        self.report.traces += 1
        self.report.requests += len(trace.requests)
        self.report.ids.append(trace.id)
        self.report.split_keys.append(split_key(trace))
        if not any(m.get("role") == "tool" for m in as_tool_calls(trace).messages):
            self.report.warnings.append(
                f"{path}:{line}: trace {trace.id!r} has no tool results: tool-based policies have nothing to drop "
                "in it (if its agent acts in text, --actions text reads it so)")


def source_of(path: Path) -> str:
    """The file's folder and name, `runs-b/x.traj.json`: what tells two run folders' files apart."""
    parent = path.resolve().parent.name
    return f"{parent}/{path.name}" if parent else path.name


def path_id(path: Path, own: str | None) -> str:
    """The path id of a trace: the file's folder and stem, then `/<own id>` for a file of several."""
    parent = path.resolve().parent.name
    base = f"{parent}/{file_stem(path)}" if parent else file_stem(path)
    return f"{base}/{own}" if own is not None else base
