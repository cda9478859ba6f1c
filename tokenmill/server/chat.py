"""Chat prompts: messages -> chat template -> token ids, and tool_choice -> a JSON schema.

Templates that render tools themselves (Qwen, Llama 3.1, Hermes, ...) get `tools` and the
assistant `tool_calls` as they expect. A template that ignores tools (SmolLM2's) would leave the
model unaware of them, so for it the server writes Hermes-style tool instructions into the system
message and renders earlier calls and results as `<tool_call>` / `<tool_response>` text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenmill.errors import InvalidRequestError
from tokenmill.server.protocol import ChatCompletionTool, ChatMessage, NamedToolChoice
from tokenmill.server.schema_check import check_schema
from tokenmill.server.validation import clip

_RESERVED_TEMPLATE_KWARGS = {
    "conversation", "messages", "tokenize", "return_dict", "return_tensors", "chat_template",
    "tools", "documents", "add_generation_prompt", "continue_final_message", "padding",
    "truncation", "max_length", "return_assistant_tokens_mask", "tokenizer_kwargs",
}

HERMES_TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file path, or the template text itself."""
    if value is None:
        return None
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError:
        pass
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a readable file nor a Jinja template")


def message_text(message: ChatMessage) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part.text for part in content)


def _arguments_object(arguments: str | dict[str, Any]) -> Any:
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return arguments  # the template gets the text as it was sent


def tool_spec(tool: ChatCompletionTool) -> dict[str, Any]:
    return tool.model_dump(exclude_none=True)


class ChatRenderer:
    """Renders conversations with one tokenizer's (or an override) chat template."""

    def __init__(self, tokenizer: Any, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        if isinstance(self.chat_template, dict):  # some tokenizers carry named templates
            self.chat_template = self.chat_template.get("default") or next(
                iter(self.chat_template.values())
            )

    def template_renders_tools(self, template: str | None = None) -> bool:
        return "tools" in (template or self.chat_template or "")

    def conversation(
        self, messages: list[ChatMessage], tools: list[ChatCompletionTool] | None,
        template: str | None = None,
    ) -> list[dict[str, Any]]:
        native_tools = self.template_renders_tools(template)
        out: list[dict[str, Any]] = []
        for message in messages:
            role = "system" if message.role == "developer" else message.role
            item: dict[str, Any] = {"role": role, "content": message_text(message)}
            if message.name:
                item["name"] = message.name
            tool_calls = getattr(message, "tool_calls", None)
            if message.role == "assistant" and tool_calls:
                if native_tools:
                    item["tool_calls"] = [
                        {
                            "id": call.id, "type": "function",
                            "function": {
                                "name": call.function.name,
                                "arguments": _arguments_object(call.function.arguments),
                            },
                        }
                        for call in tool_calls
                    ]
                else:
                    blocks = [
                        "<tool_call>\n" + json.dumps(
                            {"name": c.function.name,
                             "arguments": _arguments_object(c.function.arguments)},
                            ensure_ascii=False,
                        ) + "\n</tool_call>"
                        for c in tool_calls
                    ]
                    item["content"] = "\n".join(filter(None, [item["content"], *blocks]))
            if message.role == "tool":
                if native_tools:
                    item["tool_call_id"] = getattr(message, "tool_call_id", None)
                else:
                    item = {
                        "role": "user",
                        "content": f"<tool_response>\n{item['content']}\n</tool_response>",
                    }
            out.append(item)
        if tools and not native_tools:
            listing = "\n".join(json.dumps(tool_spec(t), ensure_ascii=False) for t in tools)
            instructions = HERMES_TOOLS_PROMPT.format(tools=listing)
            if out and out[0]["role"] == "system":
                out[0]["content"] = f"{out[0]['content']}\n\n{instructions}".lstrip()
            else:
                out.insert(0, {"role": "system", "content": instructions})
        return out

    def render(
        self, messages: list[ChatMessage], *, tools: list[ChatCompletionTool] | None = None,
        add_generation_prompt: bool = True, continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None, template: str | None = None,
    ) -> str:
        template = template or self.chat_template
        if not template:
            raise InvalidRequestError(
                "this model has no chat template; start the server with --chat-template, or use "
                "/v1/completions"
            )
        conversation = self.conversation(messages, tools, template)
        kwargs = {
            k: v for k, v in (chat_template_kwargs or {}).items()
            if k not in _RESERVED_TEMPLATE_KWARGS and isinstance(k, str) and k.isidentifier()
        }
        native_tools = [tool_spec(t) for t in tools] if tools and "tools" in template else None
        try:
            text = self.tokenizer.apply_chat_template(
                conversation, tools=native_tools, chat_template=template, tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **kwargs,
            )
        except InvalidRequestError:
            raise
        except Exception as exc:  # jinja errors, raise_exception() in templates, bad kwargs
            raise InvalidRequestError(f"the chat template could not render these messages: {exc}") from exc
        if not isinstance(text, str):
            raise InvalidRequestError("the chat template did not render to text")
        return text

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))


# ---------------------------------------------------------------------- tools & schemas


def check_json_schema(schema: Any, what: str) -> None:
    """InvalidRequestError unless `schema` is a usable JSON schema (a large one is checked in a
    process of its own: schema_check.py)."""
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{what} must be a JSON schema object")
    try:
        size = len(json.dumps(schema))
    except (ValueError, TypeError, RecursionError) as exc:
        raise InvalidRequestError(f"{what} is not a valid JSON schema: {type(exc).__name__}") from exc
    problem = check_schema(schema, size)
    if problem is not None:
        raise InvalidRequestError(f"{what} is not a valid JSON schema: {clip(problem)}")


def check_tools(tools: list[ChatCompletionTool]) -> None:
    for tool in tools:
        params = tool.function.parameters
        if params is None:
            continue
        what = f"the parameters of tool {tool.function.name!r}"
        check_json_schema(params, what)
        if params.get("type", "object") != "object":
            raise InvalidRequestError(f"{what} must be a schema of type \"object\"")


def parameters_schema(tool: ChatCompletionTool) -> dict[str, Any]:
    params = tool.function.parameters
    return params if params else {"type": "object", "properties": {}}


def required_tools_schema(tools: list[ChatCompletionTool], parallel: bool) -> dict[str, Any]:
    """What tool_choice "required" constrains the answer to: a list of calls."""
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "parameters": parameters_schema(tool),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema: dict[str, Any] = {
        "type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items},
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


def named_tool(tools: list[ChatCompletionTool], choice: NamedToolChoice) -> ChatCompletionTool:
    for tool in tools:
        if tool.function.name == choice.function.name:
            return tool
    raise InvalidRequestError(
        f"tool_choice names function {choice.function.name!r}, which is not among the tools"
    )
