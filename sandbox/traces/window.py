"""The recent traffic of a trace set: its finished conversations, and the latest of them frozen as a window.

A conversation recorded by the proxy has no end marker: it is *finished* once no request has
extended it for `idle_s` seconds. A refiner evolves on a *window*, the latest `size` finished
conversations (by their last change), copied into a trace set of its own: the evolution's suite
is then fixed while the traffic goes on (its version, its resume, the process lanes that open it
by name all see the same traces), and it splits train / held-out as every trace suite does (a hash
of each trace's split key: its metadata's task where it names one, else its id; `suite.split_key`).
A conversation whose content cannot be replayed is left out of the window with the reason.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Iterable, Sequence

from store.records import TraceIndexEntry
from store.repository import Store

from sandbox.traces.model import TraceError, check_trace
from sandbox.traces.records import stored_of, trace_of
from sandbox.traces.suite import split_key, split_of


@dataclass(frozen=True)
class Window:
    """A frozen window: its trace set, the conversations in it by split, those left out and why."""

    name: str
    train: tuple[str, ...]
    heldout: tuple[str, ...]
    left_out: tuple[tuple[str, str], ...]  # (trace id, reason)
    through: datetime | None  # the last change of its newest conversation


def finished(index: Sequence[TraceIndexEntry], idle_s: float, now: datetime) -> list[TraceIndexEntry]:
    """The conversations not extended for `idle_s` seconds by `now`, oldest change first."""
    cutoff = now - timedelta(seconds=idle_s)
    return sorted((e for e in index if e.updated_at <= cutoff), key=lambda e: (e.updated_at, e.trace_id))


def splits(store: Store, set_name: str, ids: Iterable[str]) -> dict[str, str]:
    """The split ("train" or "heldout") of each conversation `ids` of `set_name` that the set holds."""
    return {t.id: split_of(split_key(t)) for t in map(trace_of, store.traces.get(set_name, list(ids)))}


def freeze_window(store: Store, set_name: str, name: str, latest: Sequence[TraceIndexEntry]) -> Window:
    """Copy the conversations `latest` of `set_name` into the new trace set `name`, in one transaction."""
    kept, left_out = [], []
    for trace in map(trace_of, store.traces.get(set_name, [e.trace_id for e in latest])):
        try:
            check_trace(trace, f"trace {trace.id}")
        except TraceError as err:
            left_out.append((trace.id, str(err)))
            continue
        kept.append(trace)
    if kept:
        store.traces.add(name, [stored_of(t) for t in kept])
    sides = [(t.id, split_of(split_key(t))) for t in kept]
    return Window(name, tuple(i for i, s in sides if s == "train"), tuple(i for i, s in sides if s == "heldout"),
                  tuple(left_out), max((e.updated_at for e in latest), default=None))
