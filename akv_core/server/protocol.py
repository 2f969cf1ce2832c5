"""Wire objects of the OpenAI-compatible chat API, with AKV's fields after OpenAI's.

Field order follows the objects OpenAI's API sends and accepts; AKV extensions
(`drop_message`, `reposition`, `drop_rule`, SGLang's `regex` / `ebnf` and
`lark`, the extra usage counters, `reasoning_content`) come after them so that
clients that print or diff objects see the familiar layout first.
"""
from __future__ import annotations

import time
import typing
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, model_validator

# Fields are strict: "stream": "yes" or "temperature": "1" are type errors naming the field,
# not values pydantic guesses at.
Index = Annotated[StrictInt, Field(ge=0)]
Seed = Annotated[StrictInt, Field(ge=-2**63, le=2**63 - 1)]   # OpenAI's seed is a signed 64-bit integer


# ---------------------------------------------------------------- request


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str = Field(description="JSON-encoded arguments, as OpenAI sends them.")


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


# What a content part this model cannot read is refused with, by its type (OpenAI's part types).
UNREADABLE_PARTS = {"image_url": "images are not supported by this model",
                    "input_audio": "audio input is not supported by this model",
                    "file": "files are not supported by this model"}


class ContentPart(BaseModel):
    """A text part. Any other type is refused here, so that the 400 names the part
    (`messages[0].content[1]`) and says why, rather than that the content is not a string."""

    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _readable(self) -> ContentPart:
        if self.type != "text":
            raise ValueError(UNREADABLE_PARTS.get(self.type, f"content parts of type {self.type!r} are not "
                                                             "supported; send text parts"))
        if self.text is None:
            raise ValueError("a text part needs text")
        return self


class ChatMessage(BaseModel):
    """One message of the history the client sends in full every time.

    Extra keys are ignored on purpose: agents often echo a response message
    back with OpenAI-only fields such as `refusal` or `annotations`.
    """

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _content_present(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: FunctionDefinition


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool = False


class MessageDropRule(BaseModel):
    """`drop_rule` spelled as a rule: the same semantics as `drop_message`."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["message_drop"]
    drop_messages: dict[str, list[Index]]


class ThinkingDropRule(BaseModel):
    """Drop the reasoning part of earlier assistant messages: each message's rendered
    reasoning leaves attention right after that message (positions unchanged)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["thinking_drop"]


class TextDropRule(BaseModel):
    """Drop substrings of messages: `drop_messages` is aligned with `messages`, each entry null
    or `{"role", "content": str | [str], "occurrence": int | [int]}`; the cut tokens leave
    attention after the latest user message (akv_core.cache.text_drop checks the entries)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text_drop"]
    drop_messages: list[dict[str, Any] | None]


class KeepTextDropRule(BaseModel):
    """`messages` is what the client keeps of `full_messages`, the full history: the server
    renders the full history and drops what the kept messages leave out, after its last message.
    `force`: a kept history that is not a projection of the full one is served as sent."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["keep_text_drop"]
    full_messages: list[ChatMessage]
    force: StrictBool = False


DropRule = Annotated[MessageDropRule | ThinkingDropRule | TextDropRule | KeepTextDropRule,
                     Field(discriminator="type")]


class ChatCompletionRequest(BaseModel):
    """POST /v1/chat/completions. Unknown top-level keys are rejected, as OpenAI does,
    so that a misspelt AKV field (say `drop_messages`) is an error, not a silent no-op.

    Every OpenAI field is declared so that clients sending them still work; the hints that
    change nothing here (`IGNORED_FIELDS`) are accepted and ignored (the response names the ones
    sent in `x-akv-ignored-params`), the others are refused unless they ask for the default.
    """

    model_config = ConfigDict(extra="forbid")

    messages: list[ChatMessage]
    model: str
    audio: dict[str, Any] | None = None
    frequency_penalty: StrictFloat | None = None
    function_call: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    logit_bias: dict[str, StrictFloat] | None = None
    logprobs: StrictBool | None = None
    max_completion_tokens: StrictInt | None = None
    max_tokens: StrictInt | None = None
    metadata: dict[str, str] | None = None
    modalities: list[str] | None = None
    moderation: dict[str, Any] | None = None
    n: StrictInt | None = None
    parallel_tool_calls: StrictBool | None = None
    prediction: dict[str, Any] | None = None
    presence_penalty: StrictFloat | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    reasoning_effort: str | None = None
    response_format: dict[str, Any] | None = None
    safety_identifier: str | None = None
    seed: Seed | None = None
    service_tier: str | None = None
    stop: str | list[str] | None = None
    store: StrictBool | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=2.0)
    # "none", "auto", "required" or {"type": "function", "function": {"name": ...}}; checked by
    # akv_core.server.validation, whose 400 says which forms there are.
    tool_choice: str | dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    top_logprobs: StrictInt | None = None
    top_p: StrictFloat | None = Field(default=None, ge=0.0, le=1.0)
    user: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    # AKV extensions
    drop_message: dict[str, list[Index]] | None = Field(
        default=None,
        description='After message K, drop the KV of the listed messages: {"3": [1, 2]}.',
    )
    reposition: list[Index] | None = Field(
        default=None,
        description="After each listed message, compact the retained positions to 0..r-1.",
    )
    drop_rule: DropRule | None = None
    # Constrained decoding as SGLang names it (at most one of these and response_format)
    regex: str | None = Field(default=None, description="The output must match this regex.")
    ebnf: str | None = Field(default=None, description="The output must match this GBNF grammar.")
    lark: str | None = Field(default=None, description="The output must match this Lark grammar "
                             "(llguidance's dialect).")
    # What the model used (AKV) and a final assistant message continued or scored (vLLM's names)
    return_attribution: StrictBool | None = Field(
        default=None, description="Each choice carries `attribution`: the reply's attention mass per history "
        "message (docs/server.md, Attribution).")
    continue_final_message: StrictBool | None = Field(
        default=None, description="The final message is an assistant message that the reply continues.")
    add_generation_prompt: StrictBool | None = Field(
        default=None, description="false with continue_final_message (vLLM's pair); true is the default.")
    prompt_logprobs: StrictInt | None = Field(
        default=None, description="With continue_final_message: `prompt_logprobs` in the response, the final "
        "message's tokens scored with this many alternatives each (0 to 20), null before them.")


# --------------------------------------------------------------- response


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    drop_skipped_tokens: int = 0
    repos_tokens: int = 0
    prefilled_tokens: int = 0
    # Of the reused tokens (cached, repos, drop_skipped): those whose KV came back from retained
    # entries, the KV of an earlier state (before a drop or a reposition) kept after no path read it.
    retained_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobEntry(BaseModel):
    """One generated token in `choices[].logprobs.content`, with its most likely alternatives."""

    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobEntry] | None = None
    refusal: list[TokenLogprobEntry] | None = None


class MessageMassInfo(BaseModel):
    message: int
    mass: float
    visible_tokens: int


class AttributionInfo(BaseModel):
    """A reply's attention over its history (`akv_core.attribution`): per message, the generation
    header, the reply's own tokens; the masses add up to 1."""

    messages: list[MessageMassInfo]
    generation_header: float
    reply: float
    tokens: int


class PromptLogprob(BaseModel):
    """One token's entry in `prompt_logprobs` (vLLM's shape), keyed by its id."""

    logprob: float
    rank: int
    decoded_token: str


class Choice(BaseModel):
    index: int = 0
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str
    attribution: AttributionInfo | None = None   # AKV, with return_attribution


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex[:24]}"


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=completion_id)
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[Choice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    # vLLM's extension: per prompt token, null or {token id: entry}, with prompt_logprobs
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    reasoning_content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    attribution: AttributionInfo | None = None   # on a choice's finish chunk, with return_attribution


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChunkChoice]
    usage: UsageInfo | None = None


class AKVFeatures(BaseModel):
    """Which AKV operations this server implements, for clients (and `akv conformance`) to read."""

    drop_message: bool = True
    reposition: bool = True
    drop_rule_types: list[str] = Field(description="The `drop_rule` types accepted.")
    usage_details: list[str] = Field(description="Counters reported in usage.prompt_tokens_details.")
    streaming_usage: bool = True
    return_attribution: bool = Field(description="Whether `return_attribution` is accepted.")
    prompt_logprobs: bool = Field(description="Whether `continue_final_message` with `prompt_logprobs` scores "
                                  "a final assistant message.")


def akv_features() -> AKVFeatures:
    """Read from the request and usage models themselves, so the report cannot drift from them."""
    union = typing.get_args(typing.get_args(DropRule)[0])
    types = [typing.get_args(rule.model_fields["type"].annotation)[0] for rule in union]
    fields = ChatCompletionRequest.model_fields
    return AKVFeatures(drop_rule_types=types, usage_details=list(PromptTokensDetails.model_fields),
                       return_attribution="return_attribution" in fields,
                       prompt_logprobs={"prompt_logprobs", "continue_final_message"} <= set(fields))


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "akv"
    # AKV extensions: the context length a request must fit in, and the AKV operations served.
    max_model_len: int | None = None
    akv: AKVFeatures | None = None


class CpuKernels(BaseModel):
    """Whether the C kernels (akv_core.kernels.cpu_gemv) run for the served model; where not, why and the fix
    (none where nothing would help: a CPU without AVX2, or AKV_CPU_GEMV=off asked for)."""

    available: bool
    reason: str | None = None
    fix: str | None = None


class ServerInfo(BaseModel):
    """GET /server_info: the served model and the AKV features."""

    model: str
    max_model_len: int | None = None
    # The kernels of the prompts' products on this machine (akv_core.model.prefill), e.g. "bf16 (AVX512-BF16)".
    prefill: str | None = None
    # The kernel of the prompts' causal attention (CausalLM.prefill_attention), e.g. "fp32 flash (cpu_gemv)".
    prefill_attention: str | None = None
    # The C kernels of a model served on the CPU (CausalLM.kernels_refusal); null on another device.
    cpu_kernels: CpuKernels | None = None
    akv: AKVFeatures


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
