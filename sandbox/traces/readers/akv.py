"""This project's own JSON Lines (`akv`): `Trace.to_dict()` a line, as `akv traces export` writes
it, read back exactly (id, messages, tools, requests with the policy that served each, actions,
provenance, metadata)."""
from __future__ import annotations

from typing import Any, Mapping

from sandbox.traces.model import Trace, TraceError, TraceRequest
from sandbox.traces.reading import Source

FORMAT = "akv"
_KEYS = {"id", "messages", "requests", "actions"}


def claims(source: Source) -> bool:
    """JSON Lines whose first record has id, messages, requests and actions."""
    first = source.records()[0][1]
    return isinstance(first, Mapping) and _KEYS <= first.keys()


def read(source: Source) -> list[tuple[int, Trace]]:
    return [(number, _trace(f"{source.path}:{number}", record)) for number, record in source.records()]


def _trace(where: str, record: Any) -> Trace:
    expected = "expected a trace record (Trace.to_dict(): id, messages, requests, actions)"
    if not isinstance(record, Mapping):
        raise TraceError(f"{where}: {expected}")
    try:
        if not all(isinstance(r["index"], int) for r in record["requests"]):
            raise TypeError("request indices must be integers")
        requests = tuple(TraceRequest.from_dict(r) for r in record["requests"])
        trace = Trace(record["id"], tuple(record["messages"]), tuple(record.get("tools", ())), requests,
                      record["actions"], dict(record.get("provenance", {})), dict(record.get("metadata", {})))
    except (KeyError, TypeError, AttributeError, ValueError) as error:
        raise TraceError(f"{where}: {expected}; {type(error).__name__}: {error}") from error
    if not all(isinstance(m, Mapping) for m in trace.messages):
        raise TraceError(f"{where}: {expected}; messages must be objects")
    if not isinstance(trace.id, str) or trace.actions not in ("tools", "text"):
        raise TraceError(f"{where}: id {trace.id!r}, actions {trace.actions!r}: "
                         'expected a string id and actions "tools" or "text"')
    stray = sorted({r.index for r in requests} - set(trace.assistant_indices()))
    if stray:
        raise TraceError(f"{where}: requests at {stray} name no assistant message: expected one per assistant message")
    return trace
