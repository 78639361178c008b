"""The one tool-call format: plain tags in the assistant's text, so it works in any chat template.

An assistant turn ends in exactly one of:

    <python>
    print(3817 * 29 - 412)
    </python>                      a tool call: run this Python in the sandbox

    <bash>
    grep -c ERROR app.log
    </bash>                        a tool call: run this shell command line (in the episode's session)

    <answer>110281</answer>        the final answer

An environment declares the tools it offers (`Environment.tools`, by default python alone) and
parses with `parse_action(text, tools)`: a tag of a tool it does not offer is not a call.

Text before the tag (reasoning) is allowed. The tool's result comes back as the next user turn:

    <output>
    110281
    </output>

with a status line when the run did not end ok (`[error: exit code 1]` and the traceback's tail,
`[timeout: ...]`, `[memory limit exceeded]`, ...). A shell command's output (`format_shell_output`)
always ends in its exit status (`[exit status 0]`), since a shell user reads it after every
command. Generators should stop at `STOP_STRINGS` (the closing tags of every tool and of the
answer), so a turn holds one call.

Tools with names and arguments (a verifiers task's toolset) take one more tag, whose body is the
call's arguments as one JSON object (`parse_named_call`):

    <tool name="add">{"a": 2, "b": 3}</tool>

Parsing is forgiving but honest: the first tag in the text wins (a second call in the same turn is
ignored), an unterminated tag takes the rest of the text, Markdown fences inside a tool call are
stripped; each of those makes `Action.well_formed` False (with the `problem` named) so a format
reward can tell clean turns from repaired ones. Long outputs are cut in the middle (stdout) or
at the front (stderr: the end of a traceback says most) with a marker that says how much went.
"""
from __future__ import annotations

import dataclasses
import json
import re
import signal as _signal

TOOL_OPEN, TOOL_CLOSE = "<python>", "</python>"
BASH_OPEN, BASH_CLOSE = "<bash>", "</bash>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
OUTPUT_OPEN, OUTPUT_CLOSE = "<output>", "</output>"
TOOL_TAGS = {"python": (TOOL_OPEN, TOOL_CLOSE), "bash": (BASH_OPEN, BASH_CLOSE)}  # tool -> its tags
DEFAULT_TOOLS = ("python",)
NAMED_CLOSE = "</tool>"
STOP_STRINGS = (TOOL_CLOSE, BASH_CLOSE, ANSWER_CLOSE, NAMED_CLOSE)
DEFAULT_MAX_OUTPUT_CHARS = 1200

TOOL_INSTRUCTIONS = (
    "You can run Python. To run code, write it between <python> and </python>; "
    "print what you need to see. The result comes back between <output> and </output>. "
    "When you know the final answer, write it between <answer> and </answer>."
)

_FENCE = re.compile(r"^\s*```[a-zA-Z0-9_+-]*[ \t]*\n(.*?)\n?\s*```\s*$", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class Action:
    """A parsed assistant turn. kind: "tool_call" (content = the code or command line), "answer"
    (content = the answer text, stripped) or "none" (no tag; content = ""). well_formed: exactly
    one complete, non-empty tag pair with nothing but whitespace after it; otherwise `problem`
    says why. tool: the tool a tool_call calls ("python" or "bash"); other kinds keep "python"."""

    kind: str
    content: str
    well_formed: bool
    problem: str = ""
    tool: str = "python"


def check_tools(tools) -> tuple[str, ...]:
    """`tools` as a tuple of known tool names; a ValueError names an unknown one and the known."""
    tools = (tools,) if isinstance(tools, str) else tuple(tools)
    unknown = [t for t in tools if t not in TOOL_TAGS]
    if unknown or not tools:
        raise ValueError(f"tools must be a non-empty list of {sorted(TOOL_TAGS)}, got {list(tools)}; "
                         f"fix: e.g. tools = ('bash',)")
    return tools


def parse_action(text: str, tools=DEFAULT_TOOLS) -> Action:
    """The first call of an offered tool, or answer, in an assistant turn (see the module docstring)."""
    if not isinstance(text, str):
        raise TypeError(f"an assistant turn is a str, got {type(text).__name__}; fix: decode it first")
    tags = {name: TOOL_TAGS[name] for name in check_tools(tools)}
    opens = [(text.find(open_tag), name) for name, (open_tag, _) in tags.items()]
    opens.append((text.find(ANSWER_OPEN), "answer"))
    found = sorted((at, name) for at, name in opens if at >= 0)
    if not found:
        return Action("none", "", False, _no_call_problem(text, tags))
    at, name = found[0]
    if name == "answer":
        kind, start, close, tool = "answer", at + len(ANSWER_OPEN), ANSWER_CLOSE, "python"
    else:
        kind, start, close, tool = "tool_call", at + len(tags[name][0]), tags[name][1], name
    end = text.find(close, start)
    problems = []
    if end < 0:
        body, rest = text[start:], ""
        problems.append(f"unterminated: no {close}")
    else:
        body, rest = text[start:end], text[end + len(close):]
    inner = [i for i in (body.find(t) for t in [o for o, _ in tags.values()] + [ANSWER_OPEN]) if i >= 0]
    if end < 0 and inner:  # closed: a tag in a string is code
        problems.append("a second tag opens inside the first; only the first is used")
        body = body[:min(inner)]
    if rest.strip():
        problems.append(f"text after {close} is ignored")
    if kind == "tool_call":
        body = _strip_newlines(body)
        fenced = _FENCE.match(body)
        if fenced:
            body = fenced.group(1)
            problems.append(f"Markdown fence inside {tags[tool][0]} (stripped)")
    else:
        body = body.strip()
    if not body.strip():
        problems.append(f"empty {kind.replace('_', ' ')}")
    return Action(kind, body, not problems, "; ".join(problems), tool)


_NAMED_OPEN = re.compile(r"""<tool\s+name\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s>]+))\s*>""")
NAMED_CALL_EXAMPLE = '<tool name="NAME">{"argument": "value"}</tool>'


@dataclasses.dataclass(frozen=True)
class NamedCall:
    """A turn parsed in the named-tool format. name: the called tool (None: the turn calls none);
    arguments: the JSON object of its body (None when it is not one; an empty body is {});
    error: why the call cannot run as written ("" when it can), for the model to read;
    well_formed / problem: as `Action`'s (repairs the parser made, for a format reward)."""

    name: str | None
    arguments: dict | None
    raw_arguments: str
    well_formed: bool
    problem: str = ""
    error: str = ""


def parse_named_call(text: str) -> NamedCall:
    """The first `<tool name="NAME">{json}</tool>` of a turn. A turn without one is a final reply
    (`name` None, no `error`); a `<tool` tag without a name, or a body that is not a JSON object,
    is a call with an `error` that says how to write it."""
    match = _NAMED_OPEN.search(text)
    if match is None:
        if "<tool" in text:
            return NamedCall(None, None, "", False, "a <tool> tag without a name",
                             f"a tool call needs the tool's name: {NAMED_CALL_EXAMPLE}")
        return NamedCall(None, None, "", False, "no <tool name=...> call")
    name = next(group for group in match.groups() if group is not None)
    end = text.find(NAMED_CLOSE, match.end())
    problems = []
    if end < 0:
        body, rest = text[match.end():], ""
        problems.append(f"unterminated: no {NAMED_CLOSE}")
    else:
        body, rest = text[match.end():end], text[end + len(NAMED_CLOSE):]
    if rest.strip():
        problems.append(f"text after {NAMED_CLOSE} is ignored")
    body = body.strip()
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group(1).strip()
        problems.append("Markdown fence inside <tool> (stripped)")
    try:
        arguments = json.loads(body) if body else {}
    except json.JSONDecodeError as exc:
        return NamedCall(name, None, body, False, "; ".join([*problems, "arguments are not JSON"]),
                         f"the arguments of tool {name!r} are not JSON ({exc}); write them as one JSON "
                         f"object: {NAMED_CALL_EXAMPLE}")
    if not isinstance(arguments, dict):
        return NamedCall(name, None, body, False, "; ".join([*problems, "arguments are not an object"]),
                         f"the arguments of tool {name!r} must be a JSON object, got a "
                         f"{type(arguments).__name__}: {NAMED_CALL_EXAMPLE}")
    return NamedCall(name, arguments, body, not problems, "; ".join(problems))


def format_named_call(name: str, arguments: dict) -> str:
    return f'<tool name="{name}">{json.dumps(arguments)}{NAMED_CLOSE}'


def _no_call_problem(text: str, tags: dict) -> str:
    offered = " or ".join(open_tag for open_tag, _ in tags.values())
    problem = f"no {offered} call and no {ANSWER_OPEN}"
    other = [open_tag for name, (open_tag, _) in TOOL_TAGS.items() if name not in tags and open_tag in text]
    if other:
        problem += f" ({', '.join(other)} is not a tool here)"
    return problem


def parse_tool_call(text: str, tools=DEFAULT_TOOLS) -> str | None:
    """The code of the turn's tool call, or None when the turn's first tag is not one."""
    action = parse_action(text, tools)
    return action.content if action.kind == "tool_call" and action.content.strip() else None


def parse_answer(text: str, tools=DEFAULT_TOOLS) -> str | None:
    """The turn's final answer (stripped), or None when the turn's first tag is not one."""
    action = parse_action(text, tools)
    return action.content if action.kind == "answer" else None


def format_tool_call(code: str, tool: str = "python") -> str:
    open_tag, close_tag = TOOL_TAGS[check_tools(tool)[0]]
    return f"{open_tag}\n{code.strip(chr(10))}\n{close_tag}"


def format_answer(answer: str) -> str:
    return f"{ANSWER_OPEN}{answer}{ANSWER_CLOSE}"


def _strip_newlines(body: str) -> str:
    """Drop the line breaks that frame a block, keep the code's own indentation."""
    body = body[1:] if body.startswith("\n") else body
    return body.rstrip()


# --------------------------------------------------------------------------- tool output
def truncate_middle(text: str, max_chars: int) -> str:
    """Keep the head and the tail of `text`, at most `max_chars` of it, with a marker between."""
    if len(text) <= max_chars:
        return text
    keep = max(max_chars, 2)
    head, tail = keep // 2, keep - keep // 2
    return f"{text[:head]}\n[... {len(text) - head - tail} chars cut ...]\n{text[len(text) - tail:]}"


def truncate_head(text: str, max_chars: int) -> str:
    """Keep the last `max_chars` of `text` (where a traceback says the most), with a marker."""
    if len(text) <= max_chars:
        return text
    return f"[... {len(text) - max_chars} chars cut ...]\n{text[len(text) - max_chars:]}"


def _field(result, name: str, default=None):
    if isinstance(result, dict):
        return result.get(name, default)
    return getattr(result, name, default)


def _text(value) -> str:
    if value is None:
        return ""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


def status_line(result) -> str:
    """One bracketed line for a run that did not end ok ("" when it did)."""
    status = _text(getattr(_field(result, "status"), "value", _field(result, "status")))
    if status == "ok":
        return ""
    if status == "nonzero_exit":
        return f"[error: exit code {_field(result, 'exit_code')}]"
    if status == "timeout":
        return "[timeout: the code ran past its time limit]"
    if status == "memory_limit":
        return "[memory limit exceeded]"
    if status == "output_truncated":
        return "[output limit exceeded: the run was stopped]"
    if status == "killed_by_signal":
        signum = _field(result, "signal")
        try:
            name = _signal.Signals(signum).name
        except (ValueError, TypeError):
            name = str(signum)
        return f"[killed by signal {name}]"
    if status == "sandbox_error":
        return f"[sandbox error: {_text(_field(result, 'error')) or 'the sandbox failed'}]"
    return f"[status: {status}]"


def format_tool_output(result, *, max_chars: int = DEFAULT_MAX_OUTPUT_CHARS) -> str:
    """`<output>...</output>` for an ExecResult-like run (an object or the sandbox actor's map).

    ok: the stdout (or "(no output; print() what you want to see)"); otherwise the stdout, then
    the status line, then the tail of stderr. stdout gets at most 2/3 of `max_chars`, cut in the
    middle; stderr the rest, cut at the front. A literal "</output>" in the output is defanged.
    """
    stdout = _text(_field(result, "stdout")).rstrip("\n")
    stderr = _text(_field(result, "stderr")).strip("\n")
    line = status_line(result)
    if not line:
        body = truncate_middle(stdout, max_chars) if stdout else "(no output; print() what you want to see)"
    else:
        parts = [truncate_middle(stdout, (2 * max_chars) // 3)] if stdout else []
        parts.append(line)
        if stderr:
            parts.append(truncate_head(stderr, max(max_chars - sum(map(len, parts)), max_chars // 3)))
        body = "\n".join(parts)
    body = body.replace(OUTPUT_CLOSE, "</ output>")
    return f"{OUTPUT_OPEN}\n{body}\n{OUTPUT_CLOSE}"


def format_shell_output(result, *, max_chars: int = DEFAULT_MAX_OUTPUT_CHARS) -> str:
    """`<output>...</output>` for a shell command's run: what it printed, then its exit status.

    The stdout (at most 2/3 of `max_chars`, cut in the middle), then the stderr (the rest, cut at
    the front), then `[exit status N]` when the command ran to its end (ok or nonzero exit), or the
    status line of `status_line` when it did not (timeout, memory limit, signal, ...). A command
    that printed nothing shows the status line alone. "</output>" in the output is defanged.
    """
    stdout = _text(_field(result, "stdout")).rstrip("\n")
    stderr = _text(_field(result, "stderr")).strip("\n")
    status = _text(getattr(_field(result, "status"), "value", _field(result, "status")))
    if status in ("ok", "nonzero_exit"):
        line = f"[exit status {_field(result, 'exit_code')}]"
    else:
        line = status_line(result)
    parts = [truncate_middle(stdout, (2 * max_chars) // 3)] if stdout else []
    if stderr:
        parts.append(truncate_head(stderr, max(max_chars - sum(map(len, parts)), max_chars // 3)))
    parts.append(line)
    body = "\n".join(parts).replace(OUTPUT_CLOSE, "</ output>")
    return f"{OUTPUT_OPEN}\n{body}\n{OUTPUT_CLOSE}"


def format_observation(text: str) -> str:
    """Wrap environment feedback that is not a code run (a test summary, a note) the same way."""
    return f"{OUTPUT_OPEN}\n{text.replace(OUTPUT_CLOSE, '</ output>')}\n{OUTPUT_CLOSE}"
