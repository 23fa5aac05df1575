"""Request and response bodies of the OpenAI-compatible API, as pydantic models
(streamed chunks: msgspec structs).

Requests accept OpenAI's fields plus documented extensions (``priority``,
``deadline_ms``, ``expected_output_tokens``, ``cache_salt``, ``ignore_eos``,
``min_tokens``, ``top_k``, ``min_p``, ``repetition_penalty``, ``speculative``,
``use_beam_search`` with ``beam_width`` and ``length_penalty`` on completions,
and vLLM's structured outputs: ``structured_outputs`` and the older
``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``);
unknown fields are refused, as OpenAI does, rather than silently ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

# Most samples one request may ask for.
MAX_N = 128

Number = StrictInt | StrictFloat


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class JsonSchemaFormat(_Strict):
    name: StrictStr = Field(min_length=1, max_length=64)
    description: StrictStr | None = None
    # (``schema`` would shadow a pydantic attribute)
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``, and vLLM's ``structural_tag`` (xgrammar's
    ``format``, or the older ``structures`` and ``triggers``)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    format: dict[str, Any] | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[StrictStr] | None = None


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs`` (``core.sampling_params.StructuredOutputsParams``)."""

    json_: dict[str, Any] | StrictStr | None = Field(default=None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None
    structural_tag: dict[str, Any] | StrictStr | None = None
    disable_any_whitespace: StrictBool = False


class _SamplingFields(_Strict):
    """Fields shared by both endpoints."""

    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: Number | None = None
    top_p: Number | None = None
    n: StrictInt = Field(default=1, ge=1, le=MAX_N)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[str, Number] | None = None
    user: StrictStr | None = None
    seed: StrictInt | None = None
    # Extensions
    priority: StrictInt = 0
    deadline_ms: Number | None = Field(default=None, gt=0)
    expected_output_tokens: StrictInt | None = Field(default=None, ge=1)
    cache_salt: StrictStr | None = Field(default=None, min_length=1, max_length=1024)
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = Field(default=0, ge=0)
    top_k: StrictInt | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    speculative: StrictBool = True  # False: no draft tokens for this request
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None


class CompletionRequest(_SamplingFields):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    echo: StrictBool = False
    best_of: StrictInt | None = Field(default=None, ge=1, le=MAX_N)
    suffix: StrictStr | None = None
    # Beam search (vLLM's extension): width ``beam_width``, else ``n``; the
    # best ``n`` hypotheses are returned.
    use_beam_search: StrictBool = False
    beam_width: StrictInt | None = Field(default=None, ge=1, le=MAX_N)
    length_penalty: Number = 1.0


class TextContentPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class FunctionCall(_Strict):
    name: StrictStr
    arguments: StrictStr  # JSON text


class ToolCallIn(_Strict):
    """A call in an assistant message of the conversation."""

    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextContentPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's calls
    tool_call_id: StrictStr | None = None       # a tool's answer: to which call


class FunctionDefinition(_Strict):
    name: StrictStr = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: StrictBool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: StrictStr


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    # Default: "auto" with tools, else "none".
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    add_generation_prompt: StrictBool = True


class TokenizeRequest(_Strict):
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(_Strict):
    model: StrictStr | None = None
    tokens: list[StrictInt]


# ------------------------------------------------------------------ responses
def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # found in the prefix cache, not recomputed


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    # inflight extension: per-request scheduling facts
    inflight: dict[str, Any] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    inflight: dict[str, Any] | None = None


# Streamed chunks are msgspec structs: a stream encodes one per token or so,
# where a pydantic model's validation and dump cost several times the rest of
# the chunk's own work. Fields are encoded in order, None included (as the
# pydantic responses are); pydantic objects inside (logprobs, usage) are
# dumped by ``encode_chunk``'s hook.

class FunctionCallDelta(msgspec.Struct, kw_only=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDeltaOut(msgspec.Struct, kw_only=True):
    """A piece of a streamed call: the first has ``id``, ``type`` and the
    function's name; the rest carry pieces of its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(msgspec.Struct, kw_only=True):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDeltaOut] | None = None


class ChatStreamChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    inflight: dict[str, Any] | None = None


class CompletionStreamChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: Usage | None = None
    inflight: dict[str, Any] | None = None


def _dump_model(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    raise NotImplementedError(f"cannot encode {type(value).__name__}")


_chunk_encoder = msgspec.json.Encoder(enc_hook=_dump_model)


def encode_chunk(chunk: ChatCompletionChunk | CompletionChunk) -> bytes:
    """A chunk as a server-sent event."""
    return b"data: " + _chunk_encoder.encode(chunk) + b"\n\n"


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "inflight"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class BatchCreateRequest(_Strict):
    """``POST /v1/batches``; the values are checked by the batch service."""

    input_file_id: Any
    endpoint: Any
    completion_window: Any
    metadata: Any = None
