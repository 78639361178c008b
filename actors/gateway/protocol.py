"""The OpenAI API's requests as typed records, checked where they are parsed.

`parse_chat(body, ...)` and `parse_completion(body, ...)` turn a request's JSON into a
`ChatCall` / `CompletionCall` (the sampling as `SamplingParams`) or raise `APIError`: the
API's own error (status, type, the field as `param`, a message naming the rule and the
value). Image content parts are checked here too: `parse_chat` takes them where the served
policy reads images (`reads_images`), in user messages, as data URLs (URLs are never fetched);
`check_images` decodes them as `load_image` requires (the service runs it off the event loop). Fields the API defines that the generator cannot honour (`frequency_penalty`,
`logit_bias`, ...) and unknown fields are ignored, as OpenAI-compatible servers do, so
that harnesses which always send them keep working.

Invariant: a parsed call's sampling has already passed `SamplingParams`' own checks, so the
generator never sees a request that it would refuse for its parameters.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from postrain.core.errors import PostrainError

from ..models.images import DATA_URL_PREFIX, ImageInputError, image_bytes, load_image
from ..records import SamplingParams
from ..records.generate import SamplingParamsError

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP_STRINGS = 4
MAX_TOP_LOGPROBS = 20


class APIError(PostrainError):
    """An error the gateway answers with the OpenAI API's JSON error body.

    status: the HTTP status; param: the request field at fault (None: not one field);
    kind: the API's error `type`; retry_after_s: sent as `Retry-After` (429, 503)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None,
                 retry_after_s: float | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind, self.code, self.retry_after_s = kind, code, retry_after_s

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad_request(param: str, message: str) -> APIError:
    """A 400 naming the field: `'<param>': <message>`."""
    return APIError(400, f"'{param}': {message}", param=param)


@dataclass(frozen=True)
class ChatCall:
    """One checked `POST /v1/chat/completions`. messages are plain dicts with a str `content`
    (text parts joined), tool calls' `arguments` kept as the JSON string the API carries; a user
    message that shows images keeps its content parts, `{"type": "text", "text"}` and
    `{"type": "image_url", "image_url": {"url": <a checked data URL>}}`, in order."""

    model: str
    messages: list[dict]
    tools: list[dict]
    tool_choice: str | dict
    sampling: SamplingParams
    logprobs: bool
    top_logprobs: int
    stream: bool
    include_usage: bool

    @property
    def parses_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def image_parts(self) -> list[str]:
        """Where the call's images are, as the API names them (`messages[0].content[1]`), in order."""
        return [f"messages[{i}].content[{j}]" for i, message in enumerate(self.messages)
                if isinstance(message.get("content"), list)
                for j, part in enumerate(message["content"]) if part["type"] == "image_url"]


@dataclass(frozen=True)
class CompletionCall:
    """One checked `POST /v1/completions`: the prompt as text or as token ids (token-in)."""

    model: str
    prompt: str | list[int]
    sampling: SamplingParams
    logprobs: int | None
    stream: bool
    include_usage: bool


def parse_chat(body: dict, models: tuple[str, ...], max_n: int, reads_images: bool = False) -> ChatCall:
    """The checked chat call of a request body; APIError (400, the field named) otherwise.
    reads_images: whether the served policy reads images (it has an image layout); without it an
    image content part is a 400."""
    body = _object(body)
    model = _model(body, models)
    messages = _messages(body.get("messages"), model, reads_images)
    tools = _tools(body.get("tools"))
    tool_choice = _tool_choice(body.get("tool_choice"), tools)
    top_logprobs = _int(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    return ChatCall(model=model, messages=messages, tools=tools, tool_choice=tool_choice,
                    sampling=_sampling(body, max_n), logprobs=bool(_bool(body, "logprobs", False)),
                    top_logprobs=top_logprobs, stream=_bool(body, "stream", False),
                    include_usage=_include_usage(body))


def parse_completion(body: dict, models: tuple[str, ...], max_n: int) -> CompletionCall:
    """The checked completion call of a request body; APIError (400, the field named) otherwise."""
    body = _object(body)
    model = _model(body, models)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]   # a batch of one
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            raise bad_request("prompt", "must be a string or a non-empty list of token ids (ints >= 0); "
                                        "batches of several prompts are not served, send one request each")
    elif not isinstance(prompt, str) or not prompt:
        raise bad_request("prompt", f"is required: a non-empty string or a list of token ids, got {_show(prompt)}")
    logprobs = body.get("logprobs")
    if logprobs is not None and (not isinstance(logprobs, int) or isinstance(logprobs, bool)
                                 or not 0 <= logprobs <= 5):
        raise bad_request("logprobs", f"must be an int in [0, 5] or null, got {_show(logprobs)}")
    if body.get("echo"):
        raise bad_request("echo", "is not supported (the gateway returns only the completion)")
    return CompletionCall(model=model, prompt=prompt, sampling=_sampling(body, max_n, default_max_tokens=16),
                          logprobs=logprobs, stream=_bool(body, "stream", False),
                          include_usage=_include_usage(body))


# --------------------------------------------------------------------------- fields
def _object(body) -> dict:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", param=None)
    return body


def _show(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _model(body: dict, models: tuple[str, ...]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model", f"is required: one of {list(models)}, got {_show(model)}")
    if model not in models:
        raise APIError(400, f"'model': {model!r} is not served here; the models are {list(models)} "
                            f"(GET /v1/models)", param="model", code="model_not_found")
    return model


def _content(value, where: str, allow_none: bool, role: str, model: str, reads_images: bool):
    """A message's content: a string, a list of text parts joined, or (a user message showing
    images) its parts checked, text and images in order."""
    if value is None and allow_none:
        return None
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not all(isinstance(p, dict) for p in value):
        raise bad_request(where, f"must be a string or a list of content parts ({{'type': 'text', 'text': ...}} "
                                 f"or {{'type': 'image_url', 'image_url': {{'url': ...}}}}), got {_show(value)}")
    parts: list[dict] = []
    for j, part in enumerate(value):
        at = f"{where}[{j}]"
        kind = part.get("type")
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise bad_request(f"{at}.text", f"must be a string, got {_show(part.get('text'))}")
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            parts.append({"type": "image_url", "image_url": {"url": _image(part, at, role, model, reads_images)}})
        else:
            raise bad_request(f"{at}.type", f"must be 'text' or 'image_url' (the content parts served), got "
                                            f"{_show(kind)}")
    if all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def _image(part: dict, where: str, role: str, model: str, reads_images: bool) -> str:
    """The data URL of an image content part, checked: the policy reads images, the part is in a
    user message, the URL is inline (its bytes: `check_images`)."""
    if not reads_images:
        raise bad_request(where, f"is an image, but the served model {model!r} reads text only (its config has no "
                                 "vision tower); fix: serve a vision-language policy (e.g. tiny-vl), or send "
                                 "text parts only")
    if role != "user":
        raise bad_request(where, f"is an image in a {role!r} message; images are accepted in 'user' messages "
                                 "only; fix: move the image part to a user message")
    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str) or not url:
        raise bad_request(where, "must be {'type': 'image_url', 'image_url': {'url': 'data:image/png;base64,...'}}, "
                                 f"got {_show(part)}")
    if not url.startswith("data:"):
        raise bad_request(where, f"the image URL {_show(url)} is not a data URL; the gateway never fetches URLs; "
                                 f"fix: inline the image's bytes as a base64 data URL ({DATA_URL_PREFIX}png;base64,...)")
    return url


def check_images(call: ChatCall) -> None:
    """Every image of a chat call decodes as `load_image` requires (a base64 data URL of a whole
    PNG/JPEG/GIF/BMP/WebP file within its pixel cap); else a 400 naming the part. It decodes each
    image, so the service runs it off the event loop."""
    urls = [part["image_url"]["url"] for message in call.messages if isinstance(message.get("content"), list)
            for part in message["content"] if part["type"] == "image_url"]
    for where, url in zip(call.image_parts, urls):
        try:
            load_image(image_bytes(url))
        except ImageInputError as exc:
            raise bad_request(where, str(exc)) from None


def _messages(value, model: str, reads_images: bool) -> list[dict]:
    if value is None:
        raise bad_request("messages", "is required: a non-empty list of {'role', 'content'} messages")
    if not isinstance(value, list) or not value:
        raise bad_request("messages", f"must be a non-empty list of messages, got {_show(value)}")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(where, f"must be an object with 'role' and 'content', got {_show(message)}")
        role = message.get("role")
        if role not in ROLES:
            raise bad_request(f"{where}.role", f"must be one of {list(ROLES)}, got {_show(role)}")
        clean = {"role": role}
        tool_calls = message.get("tool_calls") if role == "assistant" else None
        clean["content"] = _content(message.get("content"), f"{where}.content", role == "assistant", role, model,
                                    reads_images)
        if tool_calls:
            clean["tool_calls"] = _tool_calls(tool_calls, f"{where}.tool_calls")
        elif clean["content"] is None:
            raise bad_request(f"{where}.content", "is required when the message has no tool_calls")
        if role == "tool":
            clean["tool_call_id"] = str(message.get("tool_call_id") or "")
        if message.get("name") is not None:
            clean["name"] = str(message["name"])
        if role == "assistant" and isinstance(message.get("reasoning_content"), str):
            clean["reasoning_content"] = message["reasoning_content"]
        out.append(clean)
    return out


def _tool_calls(value, where: str) -> list[dict]:
    if not isinstance(value, list):
        raise bad_request(where, f"must be a list of tool calls, got {_show(value)}")
    calls = []
    for j, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"{where}[{j}]", "must be {'id', 'type': 'function', 'function': {'name', "
                                               "'arguments'}}")
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments)
        calls.append({"id": str(call.get("id") or f"call_{j}"), "type": "function",
                      "function": {"name": function["name"], "arguments": arguments}})
    return calls


def _tools(value) -> list[dict]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad_request("tools", f"must be a list of {{'type': 'function', 'function': {{...}}}}, got "
                                   f"{_show(value)}")
    for i, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise bad_request(f"tools[{i}]", "must be {'type': 'function', 'function': {'name': ..., "
                                             f"'parameters': {{...}}}}}}, got {_show(tool)}")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise bad_request(f"tools[{i}].function.name", f"is required: a non-empty string, got "
                                                           f"{_show(function.get('name'))}")
        if "parameters" in function and not isinstance(function["parameters"], dict):
            raise bad_request(f"tools[{i}].function.parameters", "must be a JSON Schema object, got "
                                                                 f"{_show(function['parameters'])}")
    return value


def _tool_choice(value, tools: list[dict]) -> str | dict:
    if value is None:
        return "auto" if tools else "none"
    if value in ("none", "auto", "required"):
        return value
    name = value.get("function", {}).get("name") if isinstance(value, dict) else None
    if not isinstance(name, str):
        raise bad_request("tool_choice", f"must be 'none', 'auto', 'required' or {{'type': 'function', "
                                         f"'function': {{'name': ...}}}}, got {_show(value)}")
    if name not in {t["function"]["name"] for t in tools}:
        raise bad_request("tool_choice", f"names the function {name!r}, which is not in 'tools'")
    return value


def _int(body: dict, name: str, default, low: int, high: int | None):
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        rule = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise bad_request(name, f"must be an integer {rule}, got {_show(value)}")
    return value


def _number(body: dict, name: str, low: float, high: float, low_open: bool = False):
    value = body.get(name)
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value <= high and (
        value > low if low_open else value >= low)
    if not ok:
        raise bad_request(name, f"must be a number in {'(' if low_open else '['}{low}, {high}], got {_show(value)}")
    return float(value)


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(name, f"must be true or false, got {_show(value)}")
    return value


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


def _sampling(body: dict, max_n: int, default_max_tokens: int | None = None) -> SamplingParams:
    """SamplingParams of the API's sampling fields (left out: the one table's defaults)."""
    given: dict = {}
    for name in ("max_completion_tokens", "max_tokens"):
        if body.get(name) is not None:
            given["max_new_tokens"] = _int(body, name, None, 1, None)
            break
    else:
        if default_max_tokens is not None:
            given["max_new_tokens"] = default_max_tokens
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0, low_open=True)
    for name, value in (("temperature", temperature), ("top_p", top_p)):
        if value is not None:
            given[name] = value
    given["n"] = _int(body, "n", 1, 1, max_n)
    if body.get("seed") is not None:
        given["seed"] = _int(body, "seed", None, 0, None)
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) \
                or len(stops) > MAX_STOP_STRINGS:
            raise bad_request("stop", f"must be a non-empty string or a list of up to {MAX_STOP_STRINGS}, "
                                      f"got {_show(stop)}")
        given["stop"] = tuple(stops)
    try:
        return SamplingParams(**given)
    except SamplingParamsError as exc:   # a rule of the one table the checks above did not cover
        raise APIError(400, str(exc)) from None
