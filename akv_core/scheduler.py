"""Continuous batching: which requests wait, which run, and when a waiting one is admitted.

The head of the queue is planned against the cache as it is now, and admitted
when its slots (prompt, re-rotated keys, and a reservation of `max_tokens`
decode slots) fit after evicting unlocked least-recently-used leaves. While it
waits for memory, one of the next LOOKAHEAD requests that fits may start
instead, at most MAX_BYPASS times per head (bounded bypass): a small request
does not wait behind a large one, and the large one is not starved. A running
request's slots and locked path are never touched, and its decode reservation
means it never has to wait for a slot again.

A waiting request whose prompt shares at least SHARE_MIN_TOKENS tokens (in the
same state: akv_core.cache.key.shared_prefix) with a running request that is
still computing them, beyond what that one has published, is not admitted yet:
the running one publishes its prompt step by step while it is awaited (and goes
first in the prefill budget), and the waiting one is admitted once the shared
part is in the tree, reusing it instead of computing it again. It waits only
while that prefill is under way (which moves every step), never holds up the
requests behind it, and keeps its place at the head.
"""
from __future__ import annotations

import logging
from collections import deque

from akv_core.cache.key import shared_prefix
from akv_core.cache.kv_cache import KVCache, KVCapacityError
from akv_core.cache.layout import expand
from akv_core.request import ERROR_ENGINE, ERROR_KV_CAPACITY, Request

_log = logging.getLogger(__name__)

# Requests behind a head that waits for memory that admission looks at, and how many of them
# may start before it: a small request need not wait for a large one, which is not starved.
LOOKAHEAD = 8
MAX_BYPASS = 8
# A waiting request waits for a running one's prefill when it would reuse at least this many of
# its tokens: fewer are cheaper to compute again than to wait for.
SHARE_MIN_TOKENS = 64


class Scheduler:
    def __init__(self, cache: KVCache, max_running: int) -> None:
        if max_running < 1:
            raise ValueError(f"max_running must be at least 1, got {max_running}")
        self.cache = cache
        self.max_running = max_running
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def admit(self) -> tuple[list[Request], list[tuple[Request, str, str]]]:
        """Admit what fits now; returns (admitted, refused with the reason and error code).

        A request the pool can never hold is refused with ERROR_KV_CAPACITY; one whose
        planning fails (a bug) with ERROR_ENGINE, without holding up the requests behind it.
        """
        admitted: list[Request] = []
        refused: list[tuple[Request, str, str]] = []
        for request in self.running:
            request.awaited = False
        while self.waiting and len(self.running) < self.max_running:
            request = self._next_admitted(refused)
            if request is None:
                break
            self.waiting.remove(request)
            self.running.append(request)
            admitted.append(request)
        return admitted, refused

    def _next_admitted(self, refused: list[tuple[Request, str, str]]) -> Request | None:
        """Admit the head of the queue if it fits, else the first of the next few that does.

        A later request passes a head that waits for memory at most MAX_BYPASS times; then
        admission is first come, first served until the head is in, so the head is never starved.
        A request that waits for a running prefill it shares (`_sharing_prefill`) is passed
        over; passing a head that waits so does not count as a bypass.
        """
        head_shares = False
        for request in list(self.waiting)[:LOOKAHEAD + 1]:
            head = self.waiting[0]
            if request is not head and head.bypassed >= MAX_BYPASS and not head_shares:
                return None
            source = self._sharing_prefill(request)
            if source is not None:
                source.awaited = True
                head_shares = head_shares or request is head
                continue
            try:
                fits = self._try_admit(request)
            except KVCapacityError as error:
                self.waiting.remove(request)
                refused.append((request, str(error), ERROR_KV_CAPACITY))
                continue
            except Exception as error:   # noqa: BLE001 - one request's bug must not stop the queue
                _log.error("admission failed for a request: %s", error, exc_info=error)
                self.waiting.remove(request)
                refused.append((request, f"engine error: {error}", ERROR_ENGINE))
                continue
            if fits:
                if request is not head and not head_shares:
                    head.bypassed += 1
                return request
        return None

    def _sharing_prefill(self, request: Request) -> Request | None:
        """A running request still computing at least SHARE_MIN_TOKENS of `request`'s prompt that the
        tree does not hold yet (it can publish them as it goes), or None."""
        for other in self.running:
            if not other.prefilling or not other.lease.publishes_parts:
                continue
            shared = min(shared_prefix(request.key, other.key), len(request.key) - 1)
            if shared - other.lease.published_tokens >= SHARE_MIN_TOKENS:
                return other
        return None

    def _try_admit(self, request: Request) -> bool:
        """Give the request its lease and layout if it fits now; False if it must wait.

        Raises KVCapacityError if it can never fit, even with the pool to itself.
        """
        reserve = request.params.max_tokens
        plan = self.cache.plan(request.key, reserve)
        if not self.cache.can_admit(plan, reserve):
            if not self.running:
                self.cache.check_fits(plan, reserve)
            return False   # room comes back when a running request ends (or eviction can free it)
        lease = self.cache.admit(plan, reserve)
        try:
            request.layout = expand(self.cache.tree.path(plan.match.node), lease)
        except Exception:
            self.cache.release(lease, keep_prompt=False)
            raise
        request.lease = lease
        request.usage = plan.usage
        return True

    def remove_waiting(self, request: Request) -> None:
        self.waiting.remove(request)

    def abort(self, request: Request) -> bool:
        """Release a running request without keeping anything; False if it is not running."""
        if request not in self.running:
            return False
        self.running.remove(request)
        self.cache.release(request.lease, keep_prompt=False)
        return True

    def finish(self, request: Request) -> None:
        """Release a running request: its computed prompt stays in the cache, the rest is freed."""
        self.running.remove(request)
        self.cache.release(request.lease, keep_prompt=request.prompt_computed)
