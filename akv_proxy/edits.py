"""Text-mode edits for clients that resend their raw history: the edited history, remembered by raw prefix.

In the harness a text policy's edits stick: the history is edited once and grows from there. A
client behind the proxy resends its own unedited history on every call, so the proxy remembers
which edited history it forwarded for each raw history it saw. A new request continues from the
longest raw prefix it knows (its edited form plus the raw messages after it), so its policy sees
what the harness would have kept, each summary is written once, and the edited prefix the
upstream cached last time is the one it gets again.
"""
from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from typing import Any, Mapping, Sequence

Message = dict[str, Any]
CAPACITY = 256  # remembered raw histories; the least recently used is forgotten first


def prefix_digests(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """digests[k] identifies messages[:k] (digests[0] the empty history)."""
    digest = hashlib.sha256(b"akv-proxy-history")
    out = [digest.hexdigest()]
    for message in messages:
        digest.update(json.dumps(message, sort_keys=True, ensure_ascii=False, default=str).encode() + b"\0")
        out.append(digest.copy().hexdigest())
    return out


class EditedHistories:
    """raw-prefix digest -> the edited history forwarded for it; thread-safe, bounded."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self._known: OrderedDict[str, tuple[Message, ...]] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def continue_from(self, raw: Sequence[Message], digests: Sequence[str]) -> list[Message]:
        """The edited form of the longest known prefix of `raw`, followed by the rest of `raw`."""
        with self._lock:
            for k in range(len(raw), 0, -1):
                edited = self._known.get(digests[k])
                if edited is not None:
                    self._known.move_to_end(digests[k])
                    return [*edited, *raw[k:]]
        return list(raw)

    def remember(self, digest: str, edited: Sequence[Message]) -> None:
        with self._lock:
            self._known[digest] = tuple(edited)
            self._known.move_to_end(digest)
            while len(self._known) > self._capacity:
                self._known.popitem(last=False)
