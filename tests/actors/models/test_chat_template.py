"""A model's chat template is untrusted code: rendered sandboxed, read from where transformers reads it.

docs/security.md, "Model files"; actors/models/chat_template.py.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import jinja2
import pytest

from postrain.actors.env.actor import load_tokenizer
from postrain.actors.gateway.templates import render as render_conversation
from postrain.actors.models.chat_template import CHATML_TEMPLATE, TemplateRefused
from postrain.actors.models.tokenizer import Tokenizer, TokenizerError, byte_tokenizer

sys.path.insert(0, str(Path(__file__).parent))
from gguf_files import GEMMA3_TEMPLATE, MISTRAL_TEMPLATE  # noqa: E402  (tests/actors/models/gguf_files.py)

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "<think>hm</think>hi"}, {"role": "user", "content": "bye"}]

# Escapes from the server-side template injection literature, each writing a marker file
# ({marker}) when run by a plain jinja2.Environment; the sandbox must refuse every one.
ESCAPES = {
    "cycler-globals": "{{ cycler.__init__.__globals__.os.system('touch {marker}') }}",
    "joiner-globals": "{{ joiner.__init__.__globals__.os.popen('touch {marker}').read() }}",
    "lipsum-globals": "{{ lipsum.__globals__['os'].system('touch {marker}') }}",
    "subclasses": ("{% for c in ''.__class__.__mro__[1].__subclasses__() %}{% if c.__name__ == 'Popen' %}"
                   "{{ c(['touch', '{marker}']).wait() }}{% endif %}{% endfor %}"),
    "namespace-globals": "{{ namespace.__init__.__globals__.os.system('touch {marker}') }}",
    "attr-filter": "{{ (cycler|attr('__init__')|attr('__globals__'))['os'].system('touch {marker}') }}",
    "format-string": "{{ '{0.__class__.__init__.__globals__[os].system}'.format(cycler) }}{{ ''.__class__ }}",
}


def escape(name: str, marker: Path) -> str:
    return ESCAPES[name].replace("{marker}", str(marker))


@pytest.mark.parametrize("name", sorted(ESCAPES))
def test_a_template_that_reaches_python_internals_is_refused_and_runs_nothing(tmp_path, name):
    marker = tmp_path / "pwned"
    folder = hf_folder(tmp_path / "model", {"chat_template": escape(name, marker)})
    tokenizer = Tokenizer.from_folder(folder)
    with pytest.raises(TemplateRefused, match=f"chat template of {folder}"):
        tokenizer.apply_chat_template(MESSAGES)
    assert not marker.exists()


def test_the_escape_payloads_do_run_outside_the_sandbox(tmp_path):
    """The payloads are real: a plain Environment (how templates were rendered before) runs them."""
    marker = tmp_path / "pwned"
    jinja2.Environment().from_string(escape("cycler-globals", marker)).render()
    assert marker.exists()


def test_a_template_cannot_change_the_conversation_it_renders():
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = "{{ messages.append({'role': 'user', 'content': 'x'}) }}{{ messages|length }}"
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(TemplateRefused):
        tokenizer.apply_chat_template(messages)
    assert messages == [{"role": "user", "content": "hi"}]


def test_namespace_refuses_underscore_names_and_keeps_the_others():
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}"
    assert tokenizer.apply_chat_template(MESSAGES) == "4"
    tokenizer.chat_template = "{% set ns = namespace(__class__=1) %}{{ ns }}"
    with pytest.raises(TemplateRefused, match="may not start with '_'"):
        tokenizer.apply_chat_template(MESSAGES)


QWEN3_LIKE = (  # the constructs Qwen3's template uses: namespace, reversed slices, tojson, string methods
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' %}{%- set ns.multi_step_tool = false %}"
    "{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}{%- set content = message.content %}"
    "{%- if message.role == 'assistant' and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index or message.role != 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content.strip() + '<|im_end|>\\n' }}{%- endif %}"
    "{%- if loop.last %}{% break %}{% endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
LLAMA31_LIKE = (  # Llama 3.1's: the date through strftime_now, raise_exception on a bad role order
    "{{- bos_token }}{%- set date_string = strftime_now('%d %b %Y') %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nToday Date: ' + date_string[:0] + '\\n\\n' }}"
    "{%- for message in messages %}{%- if message.role not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('unknown role ' + message.role) }}{%- endif %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")


TEMPLATES = {"chatml": CHATML_TEMPLATE, "mistral": MISTRAL_TEMPLATE, "gemma3": GEMMA3_TEMPLATE,
             "qwen3-like": QWEN3_LIKE, "llama3.1-like": LLAMA31_LIKE, "smollm2": None}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_every_shipped_and_registry_template_renders_as_it_did_unsandboxed(name):
    """The sandbox changes nothing a real template does: the same text as the plain Environment
    (trim and lstrip blocks, loop controls, the HF helpers) that rendered them before."""
    if name == "smollm2":
        from postrain.actors.gateway.actor import gateway_tokenizer
        tokenizer = gateway_tokenizer("smollm2")    # the packaged GGUF file's own template
    else:
        tokenizer = byte_tokenizer()
        tokenizer.chat_template = TEMPLATES[name]
    plain = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    plain.filters["tojson"] = lambda value, **kw: json.dumps(value, ensure_ascii=False, **kw)
    plain.globals.update(strftime_now=lambda fmt: "", raise_exception=None)
    for generation_prompt in (True, False):
        context = dict(messages=MESSAGES, add_generation_prompt=generation_prompt, tools=TOOLS,
                       bos_token=tokenizer.token(tokenizer.bos_token_id),
                       eos_token=tokenizer.token(tokenizer.eos_token_id))
        before = plain.from_string(tokenizer.chat_template).render(**context)
        assert tokenizer.apply_chat_template(MESSAGES, generation_prompt, tools=TOOLS) == before
        assert "hello" in before


def test_a_templates_own_raise_exception_reaches_the_caller():
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = LLAMA31_LIKE
    with pytest.raises(jinja2.TemplateError, match="unknown role tool"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "3"}])


# ---------------------------------------------------------------- where a folder keeps its template

def hf_folder(folder: Path, tokenizer_config: dict, files: dict[str, str] | None = None) -> Path:
    """A Hugging Face tokenizer folder: the byte tokenizer's tokenizer.json, `tokenizer_config`
    and `files` (relative path -> text)."""
    folder.mkdir(parents=True)
    byte_tokenizer().hf.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<|bos|>", "eos_token": "<|im_end|>", "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, **tokenizer_config}))
    for name, text in (files or {}).items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


ZQX = "{% for m in messages %}ZQX{{ m['content'] }}ZQX{% endfor %}"
LAYOUTS = {  # how a folder can carry its template; each renders ZQX... as transformers does
    "chat_template.jinja": ({}, {"chat_template.jinja": ZQX}),
    "jinja file over config": ({"chat_template": CHATML_TEMPLATE}, {"chat_template.jinja": ZQX}),
    "config string": ({"chat_template": ZQX}, {}),
    "config named list": ({"chat_template": [{"name": "default", "template": ZQX},
                                              {"name": "tool_use", "template": "TOOLS"}]}, {}),
    "named files": ({}, {"chat_template.jinja": ZQX, "additional_chat_templates/tool_use.jinja": "TOOLS"}),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_folder_template_is_read_where_transformers_reads_it(tmp_path, layout):
    from transformers import AutoTokenizer

    config, files = LAYOUTS[layout]
    folder = hf_folder(tmp_path / "model", config, files)
    messages = [{"role": "user", "content": "hello"}]
    ours = load_tokenizer(str(folder)).apply_chat_template(messages, add_generation_prompt=False)
    assert ours == "ZQXhelloZQX"
    reference = AutoTokenizer.from_pretrained(str(folder))
    assert reference.apply_chat_template(messages, tokenize=False) == ours
    if "tool_use" in str(config) + str(files):
        assert render_conversation(load_tokenizer(str(folder)), messages, TOOLS) == "TOOLS"


def test_a_folder_without_a_template_is_refused_at_load_unless_the_config_names_one(tmp_path):
    folder = hf_folder(tmp_path / "model", {})
    with pytest.raises(TokenizerError, match=f"{folder} has no chat template.*chat_template.jinja"):
        load_tokenizer(str(folder))
    chatml = load_tokenizer(str(folder), "chatml").apply_chat_template([{"role": "user", "content": "hi"}])
    assert chatml == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    (tmp_path / "mine.jinja").write_text(ZQX)
    assert load_tokenizer(str(folder), str(tmp_path / "mine.jinja")).apply_chat_template(
        [{"role": "user", "content": "hi"}]) == "ZQXhiZQX"
    with pytest.raises(TokenizerError, match="neither \"chatml\" nor a file"):
        load_tokenizer(str(folder), str(tmp_path / "missing.jinja"))


def test_a_saved_tokenizer_keeps_its_named_templates(tmp_path):
    folder = hf_folder(tmp_path / "model", {}, {"chat_template.jinja": ZQX,
                                                "additional_chat_templates/tool_use.jinja": "TOOLS"})
    Tokenizer.from_folder(folder).save(tmp_path)
    again = Tokenizer.from_folder(tmp_path)
    assert (again.chat_template, again.named_templates) == (ZQX, {"tool_use": "TOOLS"})
