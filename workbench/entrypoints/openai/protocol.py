"""Pydantic models of the OpenAI-compatible API's requests: every field of vLLM's
CompletionRequest and ChatCompletionRequest, each honoured or rejected with a 400 "... is not
supported" (the table: docs/serving_fields.md). Responses: responses.py.

Types are strict (``"n": true``, ``"max_tokens": 1.5`` or ``"5"`` are 400s naming the field;
an integer is accepted where a number is expected) and floats must be finite. Cross-field
rules (vLLM's) raise :class:`FieldError`, which the server answers 400 with ``param`` set.
Fields nobody declares are accepted and named in one warning per request (vLLM's behaviour).
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from workbench.config import StructuredOutputsConfig
from workbench.engine.input_processor import check_cache_salt
from workbench.entrypoints.openai.tool_parsers.tool_choice_parsers import (
    NO_PARAMETERS,
    required_tools_schema,
)
from workbench.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
    check_logprobs,
)
from workbench.structured_output.backends import grammar_key

logger = logging.getLogger("workbench.entrypoints.openai")


class FieldError(ValueError):
    """A request field breaks a rule; ``field`` is answered as the error's ``param``."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def unsupported(field: str, what: str | None = None) -> FieldError:
    return FieldError(field, f"{what or field} is not supported by this server.")


def logprobs_rule(field: str, value: int | None, max_logprobs: int | None = None,
                  vocab_size: int | None = None) -> None:
    """:func:`~workbench.sampling_params.check_logprobs` for a request field (FieldError)."""
    try:
        check_logprobs(field, value, max_logprobs, vocab_size)
    except ValueError as exc:
        raise FieldError(field, str(exc)) from None


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    def unknown_fields(self) -> list[str]:
        """Fields the request sent that no model declares (logged once, then ignored);
        a nested object's are named ``outer.inner``."""
        names = list(self.model_extra or {})
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, OpenAIModel) and not isinstance(value, ChatMessage):
                names += [f"{name}.{inner}" for inner in value.unknown_fields()]
        return sorted(names)


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaResponseFormat(OpenAIModel):
    """OpenAI's ``response_format.json_schema``: the schema under ``schema`` (vLLM's alias)."""

    model_config = ConfigDict(populate_by_name=True)
    name: str
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(OpenAIModel):
    """OpenAI's response_format, with vLLM's ``structural_tag`` type: xgrammar's form
    (``format``) or vLLM's older one (``structures`` of begin / schema / end, ``triggers``)."""

    type: str
    json_schema: Optional[JsonSchemaResponseFormat] = None
    format: Optional[Any] = None
    structures: Optional[list[dict[str, Any]]] = None
    triggers: Optional[list[str]] = None

    @model_validator(mode="after")
    def _type_rules(self):
        if self.type not in ("text", "json_object", "json_schema", "structural_tag"):
            raise FieldError("response_format", "response_format.type must be 'text', "
                             "'json_object', 'json_schema' or 'structural_tag', got "
                             f"{self.type!r}.")
        if self.type == "json_schema" and self.json_schema is None:
            raise FieldError("response_format", "When response_format type is 'json_schema', "
                             "the 'json_schema' field must be provided.")
        if self.type == "structural_tag" and self.format is None and (
                self.structures is None or self.triggers is None):
            raise FieldError("response_format", "When response_format type is "
                             "'structural_tag', 'format' (or 'structures' and 'triggers') "
                             "must be provided.")
        return self

    def structural_tag(self) -> str:
        """The structural tag as vLLM passes it on: this object dumped as JSON."""
        body = {"type": self.type, **({"format": self.format} if self.format is not None else
                                      {"structures": self.structures,
                                       "triggers": self.triggers})}
        return json.dumps({**body, **(self.model_extra or {})})


class StructuredOutputsRequest(OpenAIModel):
    """vLLM's ``structured_outputs`` field (StructuredOutputsParams): at most one constraint
    here; ``response_format`` may supply it (vLLM merges the two, response_format winning)."""

    model_config = ConfigDict(populate_by_name=True)
    json_: Union[str, dict[str, Any], None] = Field(default=None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: Optional[str] = None
    structural_tag: Optional[str] = None

    def constraint_fields(self) -> dict[str, Any]:
        """The set fields, by StructuredOutputsParams' names."""
        values = {"json": self.json_, "regex": self.regex, "choice": self.choice,
                  "grammar": self.grammar, "json_object": self.json_object,
                  "structural_tag": self.structural_tag,
                  "whitespace_pattern": self.whitespace_pattern}
        flags = {name: getattr(self, name) for name in (
            "disable_fallback", "disable_any_whitespace", "disable_additional_properties")}
        return {**{k: v for k, v in values.items() if v is not None}, **flags}


#: The older request fields vLLM still maps onto structured_outputs (deprecated there).
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar", "structural_tag": "structural_tag",
                 "guided_whitespace_pattern": "whitespace_pattern"}
CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class _CommonFields(OpenAIModel):
    """Fields of both endpoints: OpenAI's, then vLLM's extra sampling and serving fields."""

    model: Optional[str] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    n: int = 1
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stream: Optional[bool] = False  # null: False, as vLLM
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    user: Optional[str] = None  # OpenAI's end-user id; vLLM does not use it either
    response_format: Optional[ResponseFormat] = None
    # vLLM's extra sampling parameters
    best_of: Optional[int] = None
    use_beam_search: bool = False
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    length_penalty: float = 1.0
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Optional[int] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    prompt_logprobs: Optional[int] = None
    # vLLM's extra serving parameters
    priority: int = 0
    request_id: Optional[str] = None
    return_tokens_as_token_ids: Optional[bool] = False
    return_token_ids: Optional[bool] = None  # token ids beside the text (vLLM)
    cache_salt: Optional[str] = Field(default=None, min_length=1, max_length=1024)
    structured_outputs: Optional[StructuredOutputsRequest] = None
    guided_json: Union[str, dict[str, Any], None] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_decoding_backend: Optional[str] = None
    guided_whitespace_pattern: Optional[str] = None
    structural_tag: Optional[str] = None
    # vLLM fields this server rejects when set (see check_supported)
    logits_processors: Any = None
    kv_transfer_params: Optional[dict[str, Any]] = None
    vllm_xargs: Optional[dict[str, Any]] = None  # SamplingParams.extra_args (vLLM)

    @model_validator(mode="after")
    def _cross_field_rules(self):
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options",
                             "Stream options can only be defined when `stream=True`.")
        if self.n < 1:
            raise FieldError("n", f"n must be at least 1, got {self.n}.")
        if self.best_of is not None and self.best_of < self.n:
            raise FieldError("best_of", f"best_of must be greater than or equal to n, got "
                                        f"n={self.n} and best_of={self.best_of}.")
        if self.prompt_logprobs is not None and self.stream:
            raise FieldError("prompt_logprobs",
                             "`prompt_logprobs` are not available when `stream=True`.")
        try:
            check_cache_salt(self.cache_salt)
        except ValueError as exc:
            raise FieldError("cache_salt", str(exc)) from None
        return self

    def check_supported(self, *, kv_transfer: bool = False) -> None:
        """Raise FieldError for a set field this server cannot honour (vLLM honours it with
        features the workbench does not have: beam search; KV transfer without a connector,
        ``kv_transfer``: the engine has one)."""
        if self.best_of is not None and self.best_of != self.n:
            raise FieldError("best_of", "best_of > n is not supported by this server.")
        if self.use_beam_search and self.prompt_logprobs is not None:
            raise FieldError("prompt_logprobs", "prompt_logprobs are not supported with beam "
                                                "search by this server.")
        if self.logits_processors is not None:
            raise unsupported("logits_processors", "Per-request logits_processors (as in "
                              "vLLM V1; the server's --logits-processors with vllm_xargs, or "
                              "SamplingParams.logits_processors offline)")
        if self.kv_transfer_params and not kv_transfer:
            raise unsupported("kv_transfer_params", "kv_transfer_params without a KV connector "
                              "(--kv-transfer-config)")

    def structured_outputs_params(self, config: StructuredOutputsConfig | None = None
                                  ) -> StructuredOutputsParams | None:
        """The request's constraint, as vLLM builds it: ``structured_outputs`` (else the
        deprecated ``guided_*`` fields), overridden by a ``response_format`` of type
        json_object / json_schema / structural_tag; parsed by the grammar compiler of the
        backend ``config`` chooses, so a bad one is a FieldError naming the field that set it,
        with the compiler's message."""
        config = config or StructuredOutputsConfig()
        backend = self.guided_decoding_backend
        if backend not in (None, "auto", config.backend):
            raise FieldError("guided_decoding_backend", "Request-level structured output "
                             "backend selection is not supported: this server's backend is "
                             f"{config.backend}, got {backend!r}.")
        fields, field = {}, "structured_outputs"
        if self.structured_outputs is not None:
            fields = self.structured_outputs.constraint_fields()
        else:
            guided = {k: v for k, v in GUIDED_FIELDS.items() if getattr(self, k) is not None}
            if guided:
                logger.warning("The guided_* fields are deprecated (as in vLLM); use "
                               "structured_outputs. Got %s.", sorted(guided))
                field = next(iter(guided))
                fields = {kind: getattr(self, name) for name, kind in guided.items()}
        rf = self.response_format
        if rf is not None and rf.type != "text":
            field = "response_format"
            if rf.type == "json_object":
                fields = {**fields, "json_object": True}
            elif rf.type == "json_schema":
                fields = {**fields, "json": rf.json_schema.json_schema}
            else:
                fields = {**fields, "structural_tag": rf.structural_tag()}
        if not any(k in fields for k in CONSTRAINT_KINDS):
            if fields and any(fields.values()):
                raise FieldError(field, "You must use one kind of structured outputs "
                                        f"constraint but none are specified: {fields}")
            return None
        try:
            params = StructuredOutputsParams(**fields)
            grammar_key(params, config)
        except ValueError as exc:
            raise FieldError(field, f"{field}: {exc}") from None
        return params

    def sampling_params(self, *, max_tokens: int | None, logprobs: int | None,
                        defaults: dict[str, Any],
                        structured_outputs_config: StructuredOutputsConfig | None = None
                        ) -> SamplingParams:
        """SamplingParams of this request: fields it left None take ``defaults`` (the model's
        generation config), then SamplingParams' own (raises its ValueError on bad values).
        The output kind follows ``stream``, as vLLM's: DELTA streaming, else FINAL_ONLY."""
        optional = {
            name: getattr(self, name) if getattr(self, name) is not None else defaults.get(name)
            for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                         "frequency_penalty", "repetition_penalty")
        }
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            structured_outputs=self.structured_outputs_params(structured_outputs_config),
            extra_args=({**(self.vllm_xargs or {}), "kv_transfer_params": self.kv_transfer_params}
                        if self.kv_transfer_params else self.vllm_xargs),
            **{k: v for k, v in optional.items() if v is not None},
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage_stats(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


TokenId = Annotated[int, Field(ge=0)]
PromptInput = Union[str, list[str], list[TokenId], list[list[TokenId]]]


class CompletionRequest(_CommonFields):
    """POST /v1/completions. ``prompt``: a text, a list of token ids, or a list of either
    (one choice per prompt and sample: prompt i, sample j -> index ``i * n + j``)."""

    prompt: Optional[PromptInput] = None
    prompt_embeds: Any = None
    echo: Optional[bool] = False
    logprobs: Optional[int] = None
    max_tokens: Optional[int] = 16  # null is 16 too (vLLM's normalize_null_max_tokens)
    suffix: Optional[str] = None
    add_special_tokens: bool = True

    @model_validator(mode="before")
    @classmethod
    def _null_max_tokens(cls, data: Any) -> Any:
        if isinstance(data, dict) and "max_tokens" in data and data["max_tokens"] is None:
            data = {**data, "max_tokens": cls.model_fields["max_tokens"].default}
        return data

    @model_validator(mode="after")
    def _completion_rules(self):
        if self.prompt_embeds is not None:
            raise unsupported("prompt_embeds")
        if self.prompt is None or self.prompt == "":
            raise FieldError("prompt",
                             "Either prompt or prompt_embeds must be provided and non-empty.")
        logprobs_rule("logprobs", self.logprobs)
        if self.max_tokens is not None and self.max_tokens < 0:
            raise FieldError("max_tokens", f"max_tokens must be at least 0, got "
                                           f"{self.max_tokens}.")
        if self.max_tokens == 0 and not self.echo:
            raise FieldError("max_tokens", "max_tokens must be at least 1 (0 only with "
                                           "echo: the prompt alone), got 0.")
        return self

    max_tokens_field: ClassVar[str] = "max_tokens"

    def check_supported(self, **kw) -> None:
        super().check_supported(**kw)
        if self.suffix is not None:
            raise unsupported("suffix")
        if self.use_beam_search and self.stream:  # vLLM's completions rule
            raise FieldError("stream", "Streaming is not currently supported with beam search")
        if self.use_beam_search and self.logprobs is not None:
            raise FieldError("logprobs", "logprobs are not supported with beam search by this "
                                         "server.")

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts of this request, one per choice group (``[]`` is one empty prompt of
        token ids, which the input processor refuses as vLLM's does)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [p]  # one prompt of token ids
        return list(p)


class ContentPart(OpenAIModel):
    type: str
    text: Optional[str] = None


class FunctionDefinition(OpenAIModel):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ChatCompletionToolsParam(OpenAIModel):
    """A tool: ``{"type": "function", "function": {name, description, parameters}}``."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatMessage(OpenAIModel):
    """A message; fields beyond role/content (name, tool_calls, ...) reach the template."""

    role: str
    content: Union[str, list[ContentPart], None] = None

    def for_template(self, index: int) -> dict[str, Any]:
        """The message as the chat template sees it: content parts joined into one text; an
        assistant's ``tool_calls`` with their JSON ``arguments`` parsed (as vLLM hands them
        to templates, which index them)."""
        content = self.content
        if isinstance(content, list):
            for part in content:
                if part.type != "text":
                    raise FieldError("messages", f"messages[{index}]: content parts of type "
                                                 f"{part.type!r} are not supported by this "
                                                 "server (text only).")
            content = "\n".join(part.text or "" for part in content)
        message = {**(self.model_extra or {}), "role": self.role, "content": content or ""}
        calls = message.get("tool_calls")
        if self.role == "assistant" and isinstance(calls, list):
            message["tool_calls"] = [self._parsed_call(index, call) for call in calls]
        return message

    @staticmethod
    def _parsed_call(index: int, call: Any) -> Any:
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if not isinstance(arguments, str):
            return call
        try:
            parsed = json.loads(arguments)
        except ValueError:
            raise FieldError("messages", f"messages[{index}]: tool_calls arguments must be "
                                         f"JSON text, got {arguments!r}.") from None
        return {**call, "function": {**function, "arguments": parsed}}


class ChatCompletionRequest(_CommonFields):
    """POST /v1/chat/completions. ``max_completion_tokens`` wins over ``max_tokens``; with
    neither, the rest of the context is the limit."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    tools: Optional[list[ChatCompletionToolsParam]] = None
    tool_choice: Union[str, dict[str, Any], None] = "none"  # tools without it: "auto"
    parallel_tool_calls: Optional[bool] = None
    reasoning_effort: Optional[Literal["none", "low", "medium", "high"]] = None
    include_reasoning: bool = True
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: Optional[list[dict[str, str]]] = None
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    mm_processor_kwargs: Optional[dict[str, Any]] = None

    @model_validator(mode="before")
    @classmethod
    def _null_n(cls, data: Any) -> Any:
        """vLLM's chat ``n`` is nullable: null is its default, 1."""
        if isinstance(data, dict) and "n" in data and data["n"] is None:
            data = {**data, "n": 1}
        return data

    @model_validator(mode="before")
    @classmethod
    def _tool_usage(cls, data: Any) -> Any:
        """vLLM's ``check_tool_usage``: tools without ``tool_choice`` mean "auto"; a named
        choice must name one of the tools."""
        if not isinstance(data, dict):
            return data
        if data.get("tools") == []:
            raise FieldError("tools", "`tools` must not be an empty array. Either provide at "
                                      "least one tool or omit the field entirely.")
        if "tool_choice" not in data and data.get("tools"):
            data = {**data, "tool_choice": "auto"}
        choice = data.get("tool_choice")
        if choice is None or choice == "none":
            return data
        if data.get("tools") is None:
            raise FieldError("tool_choice", "When using `tool_choice`, `tools` must be set.")
        if choice not in ("auto", "required") and not isinstance(choice, dict):
            raise FieldError("tool_choice", f"Invalid value for `tool_choice`: {choice}! Only "
                                            'named tools, "none", "auto" or "required" are '
                                            "supported.")
        if isinstance(choice, dict):
            usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
            function = choice.get("function")
            if not isinstance(function, dict):
                raise FieldError("tool_choice", f"Invalid value for `function`: `{function}` "
                                                f"in `tool_choice`! {usage}")
            if "name" not in function:
                raise FieldError("tool_choice", "Expected field `name` in `function` in "
                                                f"`tool_choice`! {usage}")
            name = function["name"]
            if not isinstance(name, str) or not name:
                raise FieldError("tool_choice", f"Invalid `name` in `function`: `{name}` in "
                                                f"`tool_choice`! {usage}")
            names = [t.get("function", {}).get("name") for t in data["tools"]
                     if isinstance(t, dict) and isinstance(t.get("function"), dict)]
            if name not in names:
                raise FieldError("tool_choice", "The tool specified in `tool_choice` does not "
                                                "match any of the specified `tools`")
        return data

    @model_validator(mode="after")
    def _chat_rules(self):
        k = self.top_logprobs
        logprobs_rule("top_logprobs", k)
        if k is not None and k != 0 and not self.logprobs:
            raise FieldError("top_logprobs",
                             "when using `top_logprobs`, `logprobs` must be set to true.")
        for name in ("max_tokens", "max_completion_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise FieldError(name, f"{name} must be at least 1, got {getattr(self, name)}.")
        if self.add_generation_prompt and self.continue_final_message:
            raise FieldError("continue_final_message", "Cannot set both "
                             "`continue_final_message` and `add_generation_prompt` to True.")
        so = self.structured_outputs
        constrained = so is not None and any(
            k in so.constraint_fields() for k in ("json", "regex", "choice", "grammar",
                                                  "json_object"))
        if self.named_tool is not None and (constrained or any(
                getattr(self, name) is not None for name in GUIDED_FIELDS)):
            raise FieldError("tool_choice", "You can only either use constraints or tools, "
                                            "not both.")
        return self

    def check_supported(self, **kw) -> None:
        super().check_supported(**kw)
        if self.mm_processor_kwargs:
            raise unsupported("mm_processor_kwargs", "mm_processor_kwargs (multimodal input)")
        if self.use_beam_search and self.logprobs:
            raise FieldError("logprobs", "logprobs are not supported with beam search by this "
                                         "server.")

    @property
    def max_tokens_field(self) -> str:
        """The field that set the limit, as errors name it."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def named_tool(self) -> str | None:
        """The function a named ``tool_choice`` forces, else None."""
        if isinstance(self.tool_choice, dict):
            return self.tool_choice["function"]["name"]
        return None

    def tool_schema(self) -> dict[str, Any] | None:
        """vLLM's ``_get_json_schema_from_tool``: the schema ``tool_choice`` imposes on the
        reply ("required": an array of calls, at most one with ``parallel_tool_calls``
        false; named: that function's ``parameters``)."""
        functions = [t.function.model_dump(exclude_none=True) for t in self.tools or []]
        if self.named_tool is not None:
            function = next(f for f in functions if f["name"] == self.named_tool)
            return function.get("parameters") or NO_PARAMETERS
        if self.tool_choice == "required":
            try:
                schema = required_tools_schema(functions)
            except ValueError as exc:
                raise FieldError("tools", str(exc)) from None
            if self.parallel_tool_calls is False:
                schema["maxItems"] = 1
            return schema
        return None

    def structured_outputs_params(self, config: StructuredOutputsConfig | None = None
                                  ) -> StructuredOutputsParams | None:
        """As the common fields', except that a schema from ``tool_choice`` wins (vLLM);
        ``structured_outputs``' flags (``disable_any_whitespace``...) still apply to it."""
        schema = self.tool_schema()
        if schema is None:
            return super().structured_outputs_params(config)
        flags = {}
        if self.structured_outputs is not None:
            flags = {k: v for k, v in self.structured_outputs.constraint_fields().items()
                     if k.startswith("disable_")}
        try:
            params = StructuredOutputsParams(json=schema, **flags)
            grammar_key(params, config or StructuredOutputsConfig())
        except ValueError as exc:
            raise FieldError("tools", f"tools: {exc}") from None
        return params

    def template_kwargs(self) -> dict[str, Any]:
        """What the chat template receives besides the messages, merged as vLLM V1 does
        (vllm/entrypoints/openai/chat_completion/protocol.py ``build_chat_params`` and
        ``OpenAIServing._preprocess_chat``, with vllm/renderers/params.py ``merge_kwargs``):
        ``tools`` are a default that ``chat_template_kwargs`` may replace; the request's own
        ``documents`` and ``reasoning_effort``, when set, win over the same keys there (as
        ``add_generation_prompt`` and ``continue_final_message`` do: see ``render_chat``)."""
        kwargs: dict[str, Any] = {}
        if self.tools:
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in self.tools]
        kwargs.update(self.chat_template_kwargs or {})
        if self.documents:
            kwargs["documents"] = self.documents
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
        return kwargs


class TokenizeRequest(OpenAIModel):
    """POST /tokenize: a text (``add_special_tokens`` as the completions API) or a chat."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[ChatCompletionToolsParam]] = None  # rendered, as vLLM's


class DetokenizeRequest(OpenAIModel):
    model: Optional[str] = None
    tokens: list[int]
