"""Chat templates: where a model folder keeps them, and rendering them without trusting them.

A chat template is Jinja source from whoever published the model (tokenizer_config.json, the
folder's `chat_template.jinja`, GGUF metadata), so it is untrusted code. It is compiled in
Jinja's `ImmutableSandboxedEnvironment`, as Hugging Face compiles it: attribute access to
internals (`__globals__`, `__class__`, `mro`), calls of unsafe methods and mutation of
the render's arguments raise `SecurityError`, which `render` turns into a `TemplateRefused`
naming the model. The template sees only what Hugging Face templates use: the render's
arguments, `raise_exception`, `strftime_now`, a `tojson` that does not HTML-escape, `dict`,
a `namespace` that refuses underscore names, and loop controls (`break`, `continue`).

Where a folder keeps its templates (transformers' order, tests/actors/models/test_chat_template.py):
`chat_template.jinja` (the default), `additional_chat_templates/<name>.jinja` (named ones, e.g.
`tool_use`), and, only where neither file exists, tokenizer_config.json's `chat_template` (a
string, or a list of `{name, template}`).
"""
from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

from postrain.core.errors import PostrainError

# a message's content is a str, or content parts: text parts as their text, an image as <|image|>
# (the built-in tower's marker, models/vision.py)
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% else %}<|image|>{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DEFAULT = "default"                   # the template rendered unless a named one is asked for
TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"
OPTION_HELP = ("the chat template to render the policy's conversations with instead of the model's own: "
               "'chatml' or the path of a .jinja file; unset: the model's own (a model without one is "
               "refused at load)")


class TemplateRefused(PostrainError, ValueError):
    """A chat template that tried something the sandbox does not allow, or does not compile."""


def folder_templates(folder: str | Path, tokenizer_config: dict) -> dict[str, str]:
    """The chat templates of a Hugging Face folder by name ({} when it has none)."""
    folder = Path(folder)
    templates: dict[str, str] = {}
    if (folder / TEMPLATE_FILE).is_file():
        templates[DEFAULT] = (folder / TEMPLATE_FILE).read_text(encoding="utf-8")
    if (folder / TEMPLATE_DIR).is_dir():
        for path in sorted((folder / TEMPLATE_DIR).glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if templates:
        return templates
    return config_templates(tokenizer_config.get("chat_template"))


def config_templates(value) -> dict[str, str]:
    """tokenizer_config.json's `chat_template` field by name: a string is the default, a list of
    {name, template} names each; anything else holds none."""
    if isinstance(value, str):
        return {DEFAULT: value}
    if isinstance(value, list):
        return {str(entry["name"]): str(entry["template"]) for entry in value
                if isinstance(entry, dict) and "name" in entry and "template" in entry}
    return {}


def render(source: str, model: str, **context) -> str:
    """`source` rendered with `context` in the sandbox; TemplateRefused names `model` when the
    template reaches outside it, does not compile or uses what is undefined (a template's own
    `raise_exception` passes through as jinja2.TemplateError)."""
    import jinja2
    from jinja2.sandbox import SecurityError

    try:
        return compiled(source).render(**context)
    except SecurityError as exc:
        raise TemplateRefused(f"the chat template of {model} tried something a template may not "
                              f"({exc}); it was not run. A template that reaches Python internals "
                              "is a malicious or broken model file: do not use this folder") from None
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateRefused(f"the chat template of {model} does not compile: {exc} "
                              f"(line {exc.lineno})") from None
    except jinja2.UndefinedError as exc:   # also what an unsafe attribute read through a filter gives
        raise TemplateRefused(f"the chat template of {model} does not render: {exc}") from None


@functools.lru_cache(maxsize=16)
def compiled(source: str):
    """`source` compiled once in the sandbox (compiling takes ~3 ms, rendering ~0.1 ms, and a
    warm start renders each demonstration's prefix once per turn)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class Namespace(jinja2.utils.Namespace):
        """`namespace(...)` whose attributes cannot be underscore names (no dunders to reach)."""

        def __init__(*args, **kwargs):
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                Namespace.check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace.check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise SecurityError(f"a namespace attribute may not start with '_' ({name!r})")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now,
                       dict=lambda *args, **kwargs: dict(*args, **kwargs), namespace=Namespace)
    return env.from_string(source)
