"""Traces to and from the store's records (`store.records.StoredTrace`): a trace's metadata is kept
inside its provenance object, under the key `metadata`."""
from __future__ import annotations

import re

from store.records import StoredTrace

from sandbox.traces.model import Trace, TraceRequest

METADATA = "metadata"  # the provenance key that holds a stored trace's metadata (no column of its own)
SET_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")


def check_set_name(name: str, taken: set[str] = frozenset(), option: str = "--name") -> None:
    """ValueError unless `name` can name a trace set: lower-case letters, digits, '-' and '_', and
    not the name of another registered suite (it becomes a suite name). `option` names the flag."""
    if not SET_NAME.match(name):
        raise ValueError(f"{option}: {name!r} is not a trace set name: expected lower-case letters, digits, "
                         "'-' and '_' (at most 64, starting with a letter or digit)")
    if name in taken:
        raise ValueError(f"{option}: {name!r} is already the name of a suite; choose another")


def stored_of(trace: Trace) -> StoredTrace:
    """The store's record of a trace: its metadata rides in the provenance object, under METADATA."""
    provenance = {**trace.provenance, METADATA: dict(trace.metadata)} if trace.metadata else dict(trace.provenance)
    return StoredTrace(trace.id, trace.digest(), tuple(trace.messages), tuple(trace.tools),
                       tuple(r.to_dict() for r in trace.requests), trace.actions, provenance)


def trace_of(stored: StoredTrace) -> Trace:
    requests = tuple(TraceRequest.from_dict(r) for r in stored.requests)
    provenance = dict(stored.provenance)
    metadata = provenance.pop(METADATA, None)
    return Trace(stored.trace_id, tuple(stored.messages), tuple(stored.tools), requests, stored.actions,
                 provenance, dict(metadata) if isinstance(metadata, dict) else {})
