"""The OpenAI-compatible wire format (pydantic): requests are validated here, once.

Field names and defaults follow OpenAI's API and vLLM's extensions (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, return_token_ids, priority, cache_salt, ...).
Unknown fields are ignored, as vLLM does, so clients written for other servers keep working.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, model_validator

MAX_N = 128
MAX_TOP_LOGPROBS = 20
# The upper bound is the model's vocabulary: app.py writes it into the served OpenAPI schema.
TokenId = Annotated[int, Field(ge=0, json_schema_extra={"x-token-id": True})]
# JSON true or false only: pydantic's lax mode would take "yes", "off", 0 or 1 for a boolean.
Bool = Annotated[bool, Strict()]


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


# ---------------------------------------------------------------------------------- errors


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# -------------------------------------------------------------------------------- messages


class TextContentPart(OpenAIModel):
    type: Literal["text", "input_text"] = "text"
    text: str


class FunctionCall(OpenAIModel):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(OpenAIModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


Content = str | list[TextContentPart]


class SystemMessage(OpenAIModel):
    role: Literal["system", "developer"]
    content: Content
    name: str | None = None


class UserMessage(OpenAIModel):
    role: Literal["user"]
    content: Content
    name: str | None = None


class AssistantMessage(OpenAIModel):
    role: Literal["assistant"]
    content: Content | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None


class ToolMessage(OpenAIModel):
    role: Literal["tool"]
    content: Content
    tool_call_id: str | None = None
    name: str | None = None


ChatMessage = Annotated[
    SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")
]


class FunctionDefinition(OpenAIModel):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: Bool | None = None


class ChatCompletionTool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaFormat(OpenAIModel):
    name: str = "response"
    description: str | None = None
    # "schema" shadows a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: Bool | None = None
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(OpenAIModel):
    include_usage: Bool | None = False
    continuous_usage_stats: Bool | None = False


class _SamplingFields(OpenAIModel):
    """Fields shared by chat and completions requests."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=100)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0, le=100)
    seed: int | None = None  # any integer: mapped into the generator's range
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: Bool = False
    n: int | None = Field(default=1, ge=1, le=MAX_N)
    stream: Bool | None = False
    stream_options: StreamOptions | None = None
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: Bool = False
    skip_special_tokens: Bool = True
    logit_bias: dict[str, float] | None = Field(default=None, max_length=0, description="not supported: only {} or null")
    user: str | None = None
    return_token_ids: Bool | None = False
    priority: int = Field(default=0, description="lower runs first under --scheduling-policy priority")
    cache_salt: str | None = Field(default=None, description='a prefix-cache salt; "refusal:0.5" also sets a steering '
                                   "strength on a server started with --steering")
    steering: dict[str, Any] | None = Field(default=None, description='tokenmill extension: a strength per steered '
                                            'direction, e.g. {"refusal": 0.5} (0 = none, 1 = full ablation); needs a '
                                            "server started with --steering")
    cache_prompt: Bool | None = None  # llama.cpp's flag: accepted and ignored
    response_format: ResponseFormat | None = None
    # vLLM's guided-decoding fields (the older spelling, still sent by many clients)
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = Field(default=None, min_length=1)
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _check_stop(self) -> _SamplingFields:
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > 64:
            raise ValueError("at most 64 stop strings are allowed")
        return self


# ---------------------------------------------------------------------------- chat request


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: Bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ChatCompletionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Bool | None = True
    chat_template: str | None = Field(default=None, description="needs --trust-request-chat-template")
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt set to false")
        if self.tools is not None:
            names = [tool.function.name for tool in self.tools]
            if len(set(names)) != len(names):
                raise ValueError("tool names must be unique")
        return self


# ----------------------------------------------------------------------- completion request


class CompletionRequest(_SamplingFields):
    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    )
    echo: Bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    add_special_tokens: Bool = True

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise ValueError("best_of must equal n (best-of sampling is not supported)")
        return self


# ------------------------------------------------------------------------------- responses


class SpeculativeUsage(BaseModel):
    """tokenmill extension: speculative decoding of the request, summed over its choices."""

    num_drafts: int = 0  # verify steps that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    mean_acceptance_length: float = 1.0  # 1 + accepted / drafts


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None
    speculative: SpeculativeUsage | None = None  # present only when speculative decoding ran


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ResponseToolCall] = Field(default_factory=list)
    refusal: str | None = None


class RefusalInfo(BaseModel):
    """tokenmill extension, with the refusal detector on: whether the response refuses."""

    score: float  # 0..1
    refused: bool  # score >= 0.5
    signal: Literal["direction+phrases", "phrases"]


class ChatCompletionChoice(BaseModel):
    index: int
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    refusal: RefusalInfo | None = None  # only with the refusal detector on


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    refusal: RefusalInfo | None = None  # in the choice's last chunk, with the refusal detector on


class ChatCompletionChunk(BaseModel):
    """One `data:` event of a streamed chat completion (documentation of the stream)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    refusal: RefusalInfo | None = None  # with the refusal detector on (streamed: in the choice's last chunk)


class CompletionResponse(BaseModel):
    """A completion; a streamed one sends the same shape per `data:` event
    (object "text_completion", choices carrying the text delta)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tokenmill"
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# --------------------------------------------------------------------- tokenize/detokenize


class TokenizeCompletionRequest(OpenAIModel):
    model: str | None = None
    prompt: str
    add_special_tokens: Bool = True
    return_token_strs: Bool = False


class TokenizeChatRequest(OpenAIModel):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: Bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatCompletionTool] | None = None
    return_token_strs: Bool = False


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str
