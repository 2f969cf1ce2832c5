"""`akv conformance URL`: check an OpenAI-compatible AKV server from outside, through its HTTP API.

Each check sends real requests and reads only what the API returns, so it runs against our
`akv serve`, upstream's patched SGLang server or any other implementation. A check passes, fails,
or is "not supported" (the server says it does not offer the feature: no /server_info, a
drop_rule type it refuses by name). The command prints one row per check and exits 1 when any
check failed, 2 when the server could not be checked at all (no model listed).
"""
from __future__ import annotations

import json
import shutil
import uuid
from dataclasses import asdict, dataclass
from typing import Any, Callable

import httpx
import typer

from akv_cli.errors import VERDICT, fail
from sandbox.tables import plain_table

PASS, FAIL, UNSUPPORTED = "pass", "fail", "not supported"
DETAIL_KEYS = ("cached_tokens", "drop_skipped_tokens", "repos_tokens")
DROP_RULE_TYPES = ("message_drop", "thinking_drop", "text_drop", "keep_text_drop")


class CheckFailed(Exception):
    """The server answered against the AKV semantics; the message says how."""


class NotSupported(Exception):
    """The server says it does not offer this feature."""


@dataclass(frozen=True)
class Result:
    name: str
    status: str
    detail: str


class Probe:
    """The server under test: its URL, the model to ask for, and a fresh history per use."""

    def __init__(self, url: str, model: str | None, timeout: float) -> None:
        self.http = httpx.Client(base_url=url.rstrip("/"), timeout=timeout)
        self.model = model
        self.features: dict[str, Any] | None = None

    def close(self) -> None:
        self.http.close()

    def chat(self, messages: list[dict[str, Any]], **fields: Any) -> httpx.Response:
        body = {"model": self.model, "messages": messages, "max_tokens": 1, "temperature": 0, **fields}
        return self.http.post("/v1/chat/completions", json=body)

    def ok(self, messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
        """A request that must succeed; its body."""
        response = self.chat(messages, **fields)
        if response.status_code != 200:
            raise CheckFailed(f"HTTP {response.status_code} for a valid request: {response.text[:200]}")
        return response.json()


def fresh_history() -> list[dict[str, Any]]:
    """Upstream's README shape (message 3 drops 1 and 2), made unique so no earlier run is cached."""
    nonce = uuid.uuid4().hex[:8]
    return [
        {"role": "system", "content": f"You are a helpful research assistant (session {nonce})."},
        {"role": "user", "content": "Find the capital of Australia and its population."},
        {"role": "assistant", "content": "The capital of Australia is Canberra, home to about 460,000 people."},
        {"role": "user", "content": "Now tell me about its climate in one sentence."},
    ]


def follow_up(history: list[dict[str, Any]], k: int = 1) -> list[dict[str, Any]]:
    extra = [{"role": "assistant", "content": "Canberra has a mild oceanic climate."},
             {"role": "user", "content": "Thanks. Summarize in three words."},
             {"role": "assistant", "content": "Capital, mild, planned."},
             {"role": "user", "content": "And its founding year?"}]
    return history + extra[: 2 * k]


def details(body: dict[str, Any]) -> dict[str, Any]:
    usage = body.get("usage") or {}
    return usage.get("prompt_tokens_details") or {}


def matched(body: dict[str, Any]) -> int:
    """Prompt tokens found in the cache: read from it, skipped as dropped, or re-rotated."""
    d = details(body)
    return sum(int(d.get(k) or 0) for k in DETAIL_KEYS)


# ---- the checks -----------------------------------------------------------------------------------

def check_models(probe: Probe) -> str:
    response = probe.http.get("/v1/models")
    if response.status_code != 200:
        raise CheckFailed(f"GET /v1/models: HTTP {response.status_code}")
    ids = [card.get("id") for card in response.json().get("data", [])]
    if not ids:
        raise CheckFailed("GET /v1/models lists no model")
    probe.model = probe.model or ids[0]
    return f"serving {', '.join(map(str, ids))}; checking {probe.model}"


def check_server_info(probe: Probe) -> str:
    response = probe.http.get("/server_info")
    if response.status_code == 404:
        raise NotSupported("no /server_info endpoint")
    if response.status_code != 200:
        raise CheckFailed(f"GET /server_info: HTTP {response.status_code}")
    features = response.json().get("akv")
    if features is None:
        raise NotSupported("/server_info has no AKV feature report (`akv`)")
    if not isinstance(features, dict) or not isinstance(features.get("drop_rule_types"), list):
        raise CheckFailed(f"/server_info: `akv` without a drop_rule_types list: {str(features)[:120]}")
    probe.features = features
    return f"drop_rule types: {', '.join(features['drop_rule_types'])}"


def check_usage_details(probe: Probe) -> str:
    body = probe.ok(fresh_history())
    usage, d = body.get("usage") or {}, details(body)
    missing = [k for k in DETAIL_KEYS if not isinstance(d.get(k), int)]
    if missing:
        raise CheckFailed(f"prompt_tokens_details lacks {', '.join(missing)} (zeros must be reported)")
    if "prefilled_tokens" in d:
        if usage["prompt_tokens"] != matched(body) + d["prefilled_tokens"]:
            raise CheckFailed(f"prompt_tokens {usage['prompt_tokens']} != the sum of the details {d}")
        return f"prompt_tokens {usage['prompt_tokens']} = the sum of {d}"
    if usage["prompt_tokens"] < matched(body):
        raise CheckFailed(f"prompt_tokens {usage['prompt_tokens']} < cached + skipped + repositioned {d}")
    return f"cached + skipped + repositioned <= prompt_tokens {usage['prompt_tokens']} (no prefilled_tokens)"


def check_cold_request(probe: Probe) -> str:
    body = probe.ok(follow_up(fresh_history()), drop_message={"3": [1, 2]}, reposition=[3])
    d = details(body)
    if d.get("drop_skipped_tokens") != 0 or d.get("cached_tokens", 0) > body["usage"]["prompt_tokens"] // 2:
        raise CheckFailed(f"a cold request reported {d}; expected no skipped tokens")
    return f"cold: {d}"


def check_repeat_hits(probe: Probe) -> str:
    history, ops = follow_up(fresh_history()), {"drop_message": {"3": [1, 2]}, "reposition": [3]}
    probe.ok(history, **ops)
    body = probe.ok(history, **ops)
    prompt = body["usage"]["prompt_tokens"]
    if matched(body) < 0.9 * prompt:
        raise CheckFailed(f"the same history and operations again found {matched(body)} of {prompt} tokens cached")
    return f"{matched(body)} of {prompt} prompt tokens from the cache"


def check_drop_accounting(probe: Probe) -> str:
    history = fresh_history()
    warm = probe.ok(history)
    without = probe.ok([history[0], history[3]])
    body = probe.ok(follow_up(history), drop_message={"3": [1, 2]})
    dropped = warm["usage"]["prompt_tokens"] - without["usage"]["prompt_tokens"]
    skipped = details(body).get("drop_skipped_tokens", 0)
    if skipped <= 0 or abs(skipped - dropped) > 2 or details(body).get("repos_tokens") != 0:
        raise CheckFailed(f"drop of messages 1 and 2 (about {dropped} tokens) after a warm-up: {details(body)}")
    return f"drop_skipped_tokens {skipped} for messages of about {dropped} tokens; repos_tokens 0"


def check_reposition_accounting(probe: Probe) -> str:
    history = fresh_history()
    probe.ok(history)
    body = probe.ok(follow_up(history), drop_message={"3": [1, 2]}, reposition=[3])
    d = details(body)
    if not d.get("repos_tokens", 0) > 0 or not d.get("drop_skipped_tokens", 0) > 0:
        raise CheckFailed(f"drop + reposition after a warm-up reported {d}; expected repositioned tokens")
    return f"{d}"


def check_cumulative(probe: Probe) -> str:
    history, ops = fresh_history(), {"drop_message": {"3": [1, 2]}, "reposition": [3]}
    first = probe.ok(follow_up(history), **ops)
    longer = probe.ok(follow_up(history, 2), **ops)
    forgetful = probe.ok(follow_up(history, 2), reposition=[3])
    if matched(longer) < first["usage"]["prompt_tokens"] - 2:
        raise CheckFailed(f"extending the history with the same operations reused {matched(longer)} tokens "
                          f"of {first['usage']['prompt_tokens']}")
    if matched(forgetful) >= matched(longer):
        raise CheckFailed("a request that left out the earlier drop reused as much as one that kept it")
    return f"same operations reused {matched(longer)}; without the drop {matched(forgetful)}"


def check_dropped_fact(probe: Probe) -> str:
    word = f"K{uuid.uuid4().int % 900 + 100}"  # short, so that a small model copies it whole
    messages = [{"role": "system", "content": "You repeat facts exactly."},
                {"role": "user", "content": f"The code word is {word}."},
                {"role": "assistant", "content": "Noted."},
                {"role": "user", "content": "What is the code word? Reply with the code word only."}]
    kept = _answer(probe.ok(messages, max_tokens=16))
    dropped = _answer(probe.ok(messages, max_tokens=16, drop_message={"2": [1]}))
    if word not in kept:
        raise CheckFailed(f"with the fact visible the model answered {kept!r}, not {word}")
    if word in dropped:
        raise CheckFailed(f"with the fact dropped the model still answered {dropped!r}")
    return f"kept: {kept!r}; dropped: {dropped!r}"


def _answer(body: dict[str, Any]) -> str:
    return str((body["choices"][0]["message"].get("content") or "")).strip()


BAD_REQUESTS: tuple[tuple[str, dict[str, Any], str], ...] = (
    ("a drop of a future message", {"drop_message": {"1": [3]}}, "drop_message.1[0]"),
    ("a trigger out of range", {"drop_message": {"9": [1]}}, "drop_message.9"),
    ("a message dropped twice", {"drop_message": {"2": [1], "3": [1]}}, "drop_message.3[0]"),
    ("a reposition out of range", {"reposition": [9]}, "reposition[0]"),
    ("drop_message with drop_rule", {"drop_message": {"3": [1]},
                                     "drop_rule": {"type": "message_drop", "drop_messages": {}}}, "drop_rule"),
    ("an unknown drop_rule type", {"drop_rule": {"type": "forget_everything"}}, "drop_rule.type"),
)


def check_errors(probe: Probe) -> str:
    wrong = []
    for what, change, param in BAD_REQUESTS:
        response = probe.chat(fresh_history(), **change)
        error = _error(response)
        named = error.get("param") == param or (error.get("param") is None and param in error.get("message", ""))
        if response.status_code != 400 or not named:
            wrong.append(f"{what}: HTTP {response.status_code} {json.dumps(error)[:120]}")
    if wrong:
        raise CheckFailed("; ".join(wrong))
    return f"{len(BAD_REQUESTS)} bad requests: 400 naming the field"


def _error(response: httpx.Response) -> dict[str, Any]:
    """The error object: OpenAI's {"error": {...}}, or SGLang's flat {"object": "error", "message": ...}."""
    try:
        body = response.json()
    except ValueError:
        return {}
    if not isinstance(body, dict):
        return {}
    error = body.get("error", body)
    return error if isinstance(error, dict) else {}


def drop_rule_body(kind: str, history: list[dict[str, Any]]) -> dict[str, Any]:
    """A valid rule of each type on `history` (the README shape)."""
    if kind == "message_drop":
        return {"type": kind, "drop_messages": {"3": [1]}}
    if kind == "thinking_drop":
        return {"type": kind}
    if kind == "text_drop":
        entries: list[Any] = [None] * len(history)
        entries[2] = {"role": "assistant", "content": "home to about 460,000 people", "occurrence": 1}
        return {"type": kind, "drop_messages": entries}
    kept = [dict(m) for m in history]
    kept[2]["content"] = "The capital of Australia is Canberra"   # a substring of the full content
    return {"type": kind, "full_messages": history, "force": False, "_kept": kept}


def make_drop_rule_check(kind: str) -> Callable[[Probe], str]:
    def check(probe: Probe) -> str:
        history = fresh_history()
        rule = drop_rule_body(kind, history)
        messages = rule.pop("_kept", history)
        response = probe.chat(messages, drop_rule=rule)
        listed = probe.features is not None and kind in probe.features.get("drop_rule_types", [])
        if response.status_code == 200:
            note = "" if listed or probe.features is None else " (but not listed in /server_info)"
            if kind in ("text_drop", "keep_text_drop"):
                return _text_drop_skipped(probe, messages, rule) + note
            return "accepted" + note
        refused_type = _error(response).get("param") in ("drop_rule", "drop_rule.type")
        if response.status_code == 400 and refused_type and not listed:
            raise NotSupported(f"refused: {_error(response).get('message', '')[:100]}")
        raise CheckFailed(f"HTTP {response.status_code} for a valid {kind} rule: {response.text[:160]}")
    return check


def _text_drop_skipped(probe: Probe, messages: list[dict[str, Any]], rule: dict[str, Any]) -> str:
    """The same text-drop request again: the cut tokens are found in the cache and skipped."""
    body = probe.ok(messages, drop_rule=rule)
    skipped, prompt = details(body).get("drop_skipped_tokens", 0), body["usage"]["prompt_tokens"]
    if not 0 < skipped < prompt // 2 or matched(body) < 0.9 * prompt:
        raise CheckFailed(f"the same {rule['type']} again reported {details(body)} of {prompt} prompt tokens; "
                          "expected a cache hit that skips the cut tokens")
    return f"accepted; again: {skipped} cut tokens skipped, {matched(body)} of {prompt} from the cache"


def text_drop_bad_requests(history: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], str]]:
    """Malformed text_drop / keep_text_drop rules on `history`, and the field each must name."""
    def entries(entry: dict[str, Any]) -> list[Any]:
        return [None, None, entry, None]
    return [
        ("a substring that does not occur", entries({"role": "assistant", "content": "Sydney"}),
         "drop_rule.drop_messages[2].content"),
        ("an occurrence beyond the count", entries({"role": "assistant", "content": "Canberra", "occurrence": 2}),
         "drop_rule.drop_messages[2].occurrence"),
        ("an unknown key", entries({"role": "assistant", "content": "Canberra", "colour": "red"}),
         "drop_rule.drop_messages[2].colour"),
        ("entries not aligned with messages", [None], "drop_rule.drop_messages"),
        ("kept messages out of order", [history[3], history[1]], "drop_rule.full_messages"),
    ]


def check_text_drop_errors(probe: Probe) -> str:
    history = fresh_history()
    if probe.features is not None and not {"text_drop", "keep_text_drop"} & set(probe.features["drop_rule_types"]):
        raise NotSupported("the server lists neither text_drop nor keep_text_drop")
    wrong = []
    for what, value, param in text_drop_bad_requests(history):
        if param == "drop_rule.full_messages":
            response = probe.chat(value, drop_rule={"type": "keep_text_drop", "full_messages": history})
        else:
            response = probe.chat(history, drop_rule={"type": "text_drop", "drop_messages": value})
        error = _error(response)
        named = error.get("param") in (None, param)   # a server without params must still answer 400
        if response.status_code != 400 or not named:
            wrong.append(f"{what}: HTTP {response.status_code} {json.dumps(error)[:120]}")
    if wrong:
        raise CheckFailed("; ".join(wrong))
    return f"{len(text_drop_bad_requests(history))} malformed text drops: 400 naming the field"


def check_streaming_usage(probe: Probe) -> str:
    body = {"model": probe.model, "messages": fresh_history(), "max_tokens": 2, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    usage = None
    with probe.http.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise CheckFailed(f"HTTP {response.status_code} for a streamed request")
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                usage = json.loads(line[6:]).get("usage") or usage
    if not usage or not all(isinstance((usage.get("prompt_tokens_details") or {}).get(k), int)
                            for k in DETAIL_KEYS):
        raise CheckFailed(f"the final chunk's usage lacks the AKV details: {usage}")
    return "the last chunk reports usage with the AKV details"


CHECKS: tuple[tuple[str, Callable[[Probe], str]], ...] = (
    ("models", check_models),
    ("server_info features", check_server_info),
    ("usage details add up, zeros reported", check_usage_details),
    ("a cold request skips nothing", check_cold_request),
    ("same history + operations is a cache hit", check_repeat_hits),
    ("drop accounting on a known history", check_drop_accounting),
    ("reposition accounting", check_reposition_accounting),
    ("operations are cumulative", check_cumulative),
    ("a dropped fact is gone, a kept one answers", check_dropped_fact),
    ("documented 400s name the field", check_errors),
    *((f"drop_rule {kind}", make_drop_rule_check(kind)) for kind in DROP_RULE_TYPES),
    ("malformed text drops get 400s", check_text_drop_errors),
    ("streamed usage", check_streaming_usage),
)


def run_checks(url: str, model: str | None = None, timeout: float = 120.0) -> list[Result]:
    """Every check against the server at `url`, in order; a failed `models` check stops the rest."""
    probe, results = Probe(url, model, timeout), []
    try:
        for name, check in CHECKS:
            results.append(_run(name, check, probe))
            if name == "models" and results[-1].status == FAIL:
                break
    finally:
        probe.close()
    return results


def _run(name: str, check: Callable[[Probe], str], probe: Probe) -> Result:
    try:
        return Result(name, PASS, check(probe))
    except NotSupported as err:
        return Result(name, UNSUPPORTED, str(err))
    except CheckFailed as err:
        return Result(name, FAIL, str(err))
    except httpx.HTTPError as err:
        return Result(name, FAIL, f"{type(err).__name__}: {err}")
    except (KeyError, TypeError, ValueError) as err:
        return Result(name, FAIL, f"unexpected response shape ({type(err).__name__}: {err})")


def format_table(results: list[Result], width: int = 80) -> str:
    """One row per check; a long detail wraps under its own column, so no line passes `width`.
    The result column is as wide as the longest result there can be, whichever occur."""
    table = plain_table(["check", "result", "detail"], [[r.name, r.status, r.detail] for r in results],
                        right=[False, False, False], min_widths=[0, max(map(len, (PASS, FAIL, UNSUPPORTED)))],
                        width=width)
    return f"{table}\n{summary_line(results)}"


def summary_line(results: list[Result]) -> str:
    counts = {status: sum(r.status == status for r in results) for status in (PASS, FAIL, UNSUPPORTED)}
    return (f"{len(results)} checks: {counts[PASS]} pass, {counts[FAIL]} fail, "
            f"{counts[UNSUPPORTED]} not supported")


def register(app: typer.Typer) -> None:
    @app.command("conformance")
    def conformance(
        url: str = typer.Argument(..., help="Base URL of the server, e.g. http://127.0.0.1:8000"),
        model: str = typer.Option(None, help="The model to ask for (default: the first of /v1/models)."),
        timeout: float = typer.Option(120.0, help="Seconds to wait for each response."),
        as_json: bool = typer.Option(False, "--json", help="Exactly one JSON object on stdout: every check's "
                                     "name, result and detail."),
    ) -> None:
        """Check an OpenAI-compatible AKV server's drop, reposition and usage semantics (exit 1 on a failure)."""
        results = run_checks(url, model, timeout)
        if as_json:
            typer.echo(json.dumps({"url": url, "checks": [asdict(r) for r in results],
                                   "summary": summary_line(results)}))
        else:
            typer.echo(format_table(results, shutil.get_terminal_size().columns))
        if results[0].status == FAIL:  # no model listed: nothing could be checked
            fail(f"cannot check {url}: {results[0].detail}")
        if any(r.status == FAIL for r in results):
            raise typer.Exit(VERDICT)
