"""The upstream server: requests forwarded as bytes, every failure turned into a bounded, named error.

A connection that cannot be made is a 502 with the reason; an upstream that stops answering is a
504 after the read timeout; nothing waits forever. Upstream replies, errors included, come back
with their own status and body.

The caller's headers go upstream except those of one hop and the caller's credentials
(`Authorization`, `Cookie`): those were meant for the proxy. The upstream gets the proxy's own
key instead, when it has one.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any, Mapping
from urllib.parse import urlparse

import httpx

# Headers that describe one hop, not the message: never copied across the proxy.
HOP_HEADERS = frozenset({"host", "connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
                         "proxy-authorization", "proxy-connection", "content-length", "accept-encoding",
                         "content-encoding"})
# The caller's credentials for the proxy: never passed on to the upstream.
CALLER_CREDENTIALS = frozenset({"authorization", "cookie"})
CONNECT_TIMEOUT_S = 10.0


class UpstreamError(Exception):
    """The upstream could not be reached or did not answer in time."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def upstream_root(url: str) -> str:
    """The server root requests are forwarded under: `http://host:port` from it or from its `/v1` URL."""
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"--upstream: expected an http(s):// URL of an OpenAI-compatible server, got {url!r}")
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def forwarded_headers(headers: Mapping[str, str], api_key: str | None = None) -> dict[str, str]:
    """The headers sent upstream: the caller's, less one hop's and its credentials, plus `api_key`."""
    out = {k: v for k, v in headers.items() if k.lower() not in HOP_HEADERS | CALLER_CREDENTIALS}
    out["accept-encoding"] = "identity"  # bytes pass through as they are; nothing to re-encode
    if api_key is not None:
        out["authorization"] = f"Bearer {api_key}"
    return out


class Upstream:
    def __init__(self, url: str, timeout_s: float, api_key: str | None = None) -> None:
        self.root = upstream_root(url)
        self.timeout_s = timeout_s
        self.api_key = api_key
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=min(CONNECT_TIMEOUT_S, timeout_s)))

    async def send(self, method: str, path: str, headers: Mapping[str, str], content: bytes,
                   query: str = "") -> httpx.Response:
        """The upstream's response, its body not read yet (stream it or `aread()` it); UpstreamError otherwise."""
        url = self.root + path + (f"?{query}" if query else "")
        request = self.client.build_request(method, url, headers=forwarded_headers(headers, self.api_key),
                                           content=content)
        try:
            return await self.client.send(request, stream=True)
        except httpx.HTTPError as err:
            raise self.error(err) from None

    def error(self, err: httpx.HTTPError) -> UpstreamError:
        """A transport failure as the error a client gets."""
        if isinstance(err, httpx.ConnectTimeout):
            return UpstreamError(502, "upstream_unreachable", f"upstream {self.root} did not accept a connection "
                                 f"within {min(CONNECT_TIMEOUT_S, self.timeout_s):g} s")
        if isinstance(err, httpx.TimeoutException):
            return UpstreamError(504, "upstream_timeout", f"upstream {self.root} did not answer within "
                                 f"{self.timeout_s:g} s")
        if isinstance(err, httpx.ConnectError):
            return UpstreamError(502, "upstream_unreachable", f"upstream {self.root} is unreachable: {err}")
        return UpstreamError(502, "upstream_failed", f"upstream {self.root} failed: {type(err).__name__}: {err}")

    async def relay(self, response: httpx.Response, on_error: Callable[[UpstreamError], None],
                    on_line: Callable[[bytes], None]) -> AsyncIterator[bytes]:
        """A streamed body chunk by chunk; a failure mid-stream ends it with an SSE error event.

        `on_line` sees each complete line (the usage chunk is read from it for the metrics).
        """
        pending = b""
        try:
            async for chunk in response.aiter_raw():
                yield chunk
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    on_line(line)
        except httpx.HTTPError as err:
            failure = self.error(err)
            on_error(failure)
            yield f"data: {json.dumps(error_body(failure))}\n\ndata: [DONE]\n\n".encode()
        finally:
            await response.aclose()

    async def close(self) -> None:
        await self.client.aclose()


def error_body(failure: UpstreamError) -> dict[str, Any]:
    return {"error": {"message": failure.message, "type": "upstream_error", "param": None, "code": failure.code}}


# Headers the proxy's own HTTP server writes on every response: the upstream's copies are dropped,
# or the client would get each twice.
OWN_RESPONSE_HEADERS = frozenset({"date", "server"})


def response_headers(response: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k.lower() not in HOP_HEADERS | OWN_RESPONSE_HEADERS}
