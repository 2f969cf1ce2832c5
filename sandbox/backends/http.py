"""A backend for any OpenAI-compatible endpoint (our `akv serve`, upstream AKV, a hosted API).

Requests go through the chat client (`akv_core.client`): AKV fields through `extra_body`, the key
from AKV_API_KEY or OPENAI_API_KEY, an unreachable endpoint or an HTTP 5xx as `ServerUnavailable`.
A request that asks for `attribution` sends `return_attribution: true` and reads the choice's
`attribution` (the llm agent's attention use records); `score_reply` scores a recorded reply with
`continue_final_message` and `prompt_logprobs` (a trace set's likelihood fidelity). `lacks` says
whether the server lists such an AKV feature in its model card, so a run can refuse before it starts.
"""
from __future__ import annotations

from typing import Any, Mapping

from akv_core.attribution import Attribution
from akv_core.client import TIMEOUT_S, ChatClient, ChatError

from sandbox.backends.base import BackendError, BackendReply, BackendRequest
from sandbox.runs.cost import ReportedUsage

USE_RECORDS_FIELD = "evaluation.use_records"  # the setting that asks for attribution


class HttpBackend:
    generates = True
    parallel = "threads"  # the client is thread-safe; the server batches what the lanes send at once
    attributes = True  # sends return_attribution; `lacks("return_attribution")` says whether the server has it

    def __init__(self, url: str, model: str | None = None, timeout_s: float = TIMEOUT_S, max_retries: int = 1) -> None:
        self.name = url
        self.client = ChatClient(url, model, timeout_s, max_retries)
        self._features: dict[str, Any] | None = None

    def start_task(self) -> None:
        """Nothing to reset: the server's cache is shared across tasks, as in production."""

    def lane(self) -> HttpBackend:
        """The backend a lane thread uses: this one (the client is thread-safe)."""
        return self

    def complete(self, request: BackendRequest) -> BackendReply:
        fields, asked = request.api_fields(), request.asks_attribution()
        if asked:
            fields["return_attribution"] = True
        reply = self.client.complete(request.messages, request.max_tokens, request.temperature, request.tools,
                                     request.tool_choice, request.seed, fields)
        return BackendReply(reply.message, ReportedUsage.from_fields(reply.usage), reply.finish_reason,
                            attribution=self._attribution(reply.attribution) if asked else None)

    def score_reply(self, request: BackendRequest, reply: Mapping[str, Any]) -> tuple[float, ...]:
        """Each token's natural-log probability in the recorded assistant message `reply` after the request's
        history under its cache fields (the server's teacher-forced `prompt_logprobs`), end-of-turn token left
        out; ReplyTooLong past the server's context. A keep_text_drop's full history gets the reply too."""
        fields = request.api_fields()
        rule = fields.get("drop_rule")
        if rule is not None and rule.get("type") == "keep_text_drop":
            fields["drop_rule"] = {**rule, "full_messages": [*rule["full_messages"], dict(reply)]}
        return self.client.score_final_message([*request.messages, dict(reply)], request.tools, fields)

    def _attribution(self, found: Mapping[str, Any] | None) -> Attribution:
        """The reply's attribution object read back; BackendError naming the setting that asked for it."""
        if found is None:
            raise BackendError(f"{USE_RECORDS_FIELD}: {self.name} returned no `attribution` for "
                               "return_attribution: true; attention use records need a server that computes it "
                               "(akv serve): use references")
        try:
            return Attribution.from_dict(found)
        except (KeyError, TypeError, ValueError) as err:
            raise BackendError(f"{USE_RECORDS_FIELD}: {self.name} returned an `attribution` in an unknown shape "
                               f"({err!r}); expected {{messages, generation_header, reply, tokens}}") from None

    def lacks(self, feature: str) -> str | None:
        """None when the server's model card lists the AKV feature `feature` (`return_attribution`,
        `prompt_logprobs`; docs/server.md, Endpoints) as true; else why not, one phrase naming the server.
        The card is read once."""
        if self._features is None:
            try:
                self._features = self.client.features()
            except ChatError as err:
                return f"cannot read the model card of {self.name}: {err}"
        if self._features.get(feature) is True:
            return None
        if not self._features:
            return f"{self.name} lists no AKV features in its model card (an `akv serve` lists them)"
        return f"{self.name} does not list {feature} among the AKV features of its model card"

    def close(self) -> None:
        self.client.close()
