"""A few OpenAI-compatible servers without a router: `--backend URL1,URL2,...`.

Each task is pinned to one server for its whole trajectory, since its prefix cache lives there:
the healthy server with the fewest tasks pinned at that moment (the first such in the list). The
servers are health-checked (`GET /health`, else `GET /v1/models`) when the pool opens, and a
server is checked again whenever it fails. A server that stops answering (a refused or reset
connection, a timeout, an HTTP 5xx) is marked down and its tasks move to the others: the failed
request is sent again to the new server, which prefills the history it has not cached. Every
move rides on the reply (`BackendReply.moves`), and the harness writes it in the task's
trajectory and result. A server marked down is checked again when tasks are pinned, at most
every `recheck_s` seconds, and rejoins once it answers.

This is deliberately not a router: no placement by cached prefix across tasks, no queueing,
no retries of a request the server refused (HTTP 4xx). For a fleet, put SGLang's router in front
of the servers and pass its one URL (docs/server.md, "Many servers").
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx

from akv_core.client import base_url

from sandbox.backends.base import BackendError, BackendReply, BackendRequest, ServerMove, ServerUnavailable
from sandbox.backends.http import HttpBackend

HEALTH_TIMEOUT_S = 5.0


def server_urls(spec: str) -> list[str]:
    """The URLs of `--backend URL` or `URL1,URL2,...`; ValueError naming the first malformed item."""
    items = [item.strip() for item in spec.split(",")]
    if len(items) == 1 and not items[0].startswith(("http://", "https://")):
        raise ValueError(f"unknown backend {spec!r}: expected replay, embedded or an http(s):// URL "
                         "(or several, comma-separated)")
    for n, item in enumerate(items, 1):
        where = f"--backend: server {n} of {len(items)} ({item!r})" if len(items) > 1 else f"--backend ({item!r})"
        problem = _url_problem(item)
        if problem:
            raise ValueError(f"{where}: {problem}")
    seen = set()
    for n, item in enumerate(items, 1):
        key = base_url(item)
        if key in seen:
            raise ValueError(f"--backend: server {n} of {len(items)} ({item!r}) is listed twice")
        seen.add(key)
    return items


def _url_problem(item: str) -> str | None:
    if not item:
        return "empty item: expected http(s)://HOST[:PORT][/v1]"
    parsed = urlparse(item)
    if parsed.scheme not in ("http", "https"):
        return "expected an http:// or https:// URL"
    try:
        parsed.port  # noqa: B018 - raises ValueError for a port that is not a number in range
    except ValueError:
        return "the port must be a number from 0 to 65535"
    if not parsed.hostname:
        return "expected a host after the scheme, e.g. http://127.0.0.1:30000"
    if parsed.query or parsed.fragment:
        return "expected no query or fragment in a server URL"
    return None


@dataclass
class _Server:
    url: str
    backend: HttpBackend
    up: bool = True
    pinned: int = 0
    checked_at: float = field(default_factory=time.monotonic)


class ServerPool:
    """The servers, their health and their pinned tasks; `lane()` serves one task at a time from a thread."""

    parallel = "threads"
    generates = True
    attributes = True  # each server's HttpBackend asks for it; `lacks` checks that every server has it

    def __init__(self, urls: list[str], model: str | None = None, recheck_s: float = 30.0) -> None:
        self.name = ",".join(urls)
        self.recheck_s = recheck_s
        # No client retries: a server that fails is left for another at once.
        self.servers = [_Server(url, HttpBackend(url, model, max_retries=0)) for url in urls]
        self._lock = threading.Lock()
        for server in self.servers:
            server.up = healthy(server.url)
        if not any(s.up for s in self.servers):
            self.close()
            raise ValueError(f"--backend: none of the {len(urls)} servers answers its health check "
                             f"({', '.join(urls)})")
        self._own_lane = ServerLane(self)

    def lane(self) -> ServerLane:
        return ServerLane(self)

    def pin(self, avoid: str | None = None) -> _Server:
        """The healthy server with the fewest pinned tasks (down servers rechecked when due)."""
        with self._lock:
            now = time.monotonic()
            due = [s for s in self.servers if not s.up and now - s.checked_at >= self.recheck_s]
        for server in due:  # outside the lock: a health check may take seconds
            self.mark(server, healthy(server.url))
        with self._lock:
            candidates = [s for s in self.servers if s.up and s.url != avoid]
            if not candidates:
                raise ServerUnavailable(f"no server answers: {', '.join(s.url for s in self.servers)}")
            server = min(candidates, key=lambda s: s.pinned)
            server.pinned += 1
            return server

    def unpin(self, server: _Server) -> None:
        with self._lock:
            server.pinned = max(0, server.pinned - 1)

    def mark(self, server: _Server, up: bool) -> None:
        with self._lock:
            server.up, server.checked_at = up, time.monotonic()

    def lacks(self, feature: str) -> str | None:
        """None when every server lists the AKV feature `feature` (`HttpBackend.lacks`), else the first reason."""
        return next((why for s in self.servers if (why := s.backend.lacks(feature)) is not None), None)

    # ---- one lane of its own, for a run without concurrency --------------------------------
    def start_task(self) -> None:
        self._own_lane.start_task()

    def complete(self, request: BackendRequest) -> BackendReply:
        return self._own_lane.complete(request)

    def close(self) -> None:
        for server in self.servers:
            server.backend.close()


class ServerLane:
    """Serves one task at a time, pinned to one server of the pool; moves the task if the server fails."""

    def __init__(self, pool: ServerPool) -> None:
        self.pool = pool
        self.name, self.generates, self.parallel, self.attributes = pool.name, True, "threads", True
        self.server: _Server | None = None

    def start_task(self) -> None:
        self._release()
        self.server = self.pool.pin()

    def complete(self, request: BackendRequest) -> BackendReply:
        if self.server is None:
            self.server = self.pool.pin()
        moves: list[ServerMove] = []
        while True:
            try:
                reply = self.server.backend.complete(request)
                return BackendReply(reply.message, reply.usage, reply.finish_reason, self.server.url, tuple(moves),
                                    reply.attribution)
            except ServerUnavailable as err:
                failed = self.server
                self.pool.mark(failed, healthy(failed.url))
                self._release()
                try:
                    self.server = self.pool.pin(avoid=failed.url)
                except ServerUnavailable as none_left:
                    raise ServerUnavailable(f"{err}; {none_left}") from err
                moves.append(ServerMove(failed.url, self.server.url, str(err).splitlines()[0]))
                if len(moves) > len(self.pool.servers):
                    raise BackendError(f"the task moved {len(moves)} times without an answer: {err}") from err

    def _release(self) -> None:
        if self.server is not None:
            self.pool.unpin(self.server)
            self.server = None

    def close(self) -> None:
        self._release()


def healthy(url: str) -> bool:
    """The server answers `GET /health` (ours, SGLang's) or, failing that, `GET /v1/models` with 200."""
    root = base_url(url)[: -len("/v1")]
    for path in (f"{root}/health", f"{root}/v1/models"):
        try:
            if httpx.get(path, timeout=HEALTH_TIMEOUT_S).status_code == 200:
                return True
        except httpx.HTTPError:
            return False
    return False
