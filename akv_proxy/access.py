"""Who may use the proxy, and what it spends on their behalf.

The proxy has two keys that must never be confused: its callers' key (`api_key`: the bearer
token they must send, checked by the server guard shared with `akv serve`) and its own key for
the upstream (`upstream_api_key`: sent on every forwarded request and summary, in place of
whatever the caller sent). A text-mode policy also spends the upstream's tokens on summaries the
caller never asked for; a proxy anyone can reach (a non-loopback address, no `api_key`) refuses
them unless the operator allowed it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn

from akv_core.client import ChatError
from akv_core.server.guard import check_api_key, is_loopback

# Twice the body `akv serve` takes at its longest context (32,768 tokens, 32 MiB): the proxy does
# not know the upstream's context, and a text-mode policy exists to shrink histories past it.
DEFAULT_MAX_BODY_BYTES = 64 << 20
ALLOW_SUMMARIES_FLAG = "--allow-unauthenticated-summaries"


@dataclass(frozen=True)
class ProxyAccess:
    api_key: str | None = None            # callers send it as a bearer token; None: anyone who connects
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    upstream_api_key: str | None = None   # sent upstream as `Authorization: Bearer`; None: no Authorization
    summaries_allowed: bool = True        # False: a summary a text-mode policy needs is a 403

    def __post_init__(self) -> None:
        check_api_key(self.api_key, "api_key")
        check_api_key(self.upstream_api_key, "upstream_api_key")


def summaries_allowed(host: str, api_key: str | None, allow_unauthenticated: bool) -> bool:
    """Whether the proxy bound to `host` may spend the upstream's tokens on summaries: yes for
    authenticated callers (`api_key`) or local ones (loopback), else only when the operator said so."""
    return allow_unauthenticated or api_key is not None or is_loopback(host)


class SummariesRefused(ChatError):
    """A text-mode policy needed a summary, and this proxy does not write them for anyone."""


class RefusedSummaries:
    """The summary client of a proxy that refuses them: any summary request raises."""

    def complete(self, messages: object, max_tokens: int) -> NoReturn:
        raise SummariesRefused(
            "this proxy is reachable beyond loopback without an API key, so it does not spend the upstream's "
            f"tokens on the summaries its text-mode policy writes; the operator can set --api-key, or allow "
            f"them with {ALLOW_SUMMARIES_FLAG}")

    def close(self) -> None:
        """Nothing to close."""
