"""The one tool-call format: plain tags in the assistant's text, so it works in any chat template.

An assistant turn ends in exactly one of:

    <python>
    print(3817 * 29 - 412)
    </python>                      a tool call: run this Python in the sandbox

    <answer>110281</answer>        the final answer

Text before the tag (reasoning) is allowed. The tool's result comes back as the next user turn:

    <output>
    110281
    </output>

with a status line when the run did not end ok (`[error: exit code 1]` and the traceback's tail,
`[timeout: ...]`, `[memory limit exceeded]`, ...). Generators should stop at `STOP_STRINGS`
(the closing tags), so a turn holds one call.

Parsing is forgiving but honest: the first tag in the text wins (a second call in the same turn is
ignored), an unterminated tag takes the rest of the text, Markdown fences inside `<python>` are
stripped; each of those makes `Action.well_formed` False (with the `problem` named) so a format
reward can tell clean turns from repaired ones. Long outputs are cut in the middle (stdout) or
at the front (stderr: the end of a traceback says most) with a marker that says how much went.
"""
from __future__ import annotations

import dataclasses
import re
import signal as _signal

TOOL_OPEN, TOOL_CLOSE = "<python>", "</python>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
OUTPUT_OPEN, OUTPUT_CLOSE = "<output>", "</output>"
STOP_STRINGS = (TOOL_CLOSE, ANSWER_CLOSE)
DEFAULT_MAX_OUTPUT_CHARS = 1200

TOOL_INSTRUCTIONS = (
    "You can run Python. To run code, write it between <python> and </python>; "
    "print what you need to see. The result comes back between <output> and </output>. "
    "When you know the final answer, write it between <answer> and </answer>."
)

_FENCE = re.compile(r"^\s*```[a-zA-Z0-9_+-]*[ \t]*\n(.*?)\n?\s*```\s*$", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class Action:
    """A parsed assistant turn. kind: "tool_call" (content = the code), "answer" (content = the
    answer text, stripped) or "none" (no tag; content = ""). well_formed: exactly one complete,
    non-empty tag pair with nothing but whitespace after it; otherwise `problem` says why."""

    kind: str
    content: str
    well_formed: bool
    problem: str = ""


def parse_action(text: str) -> Action:
    """The first tool call or answer in an assistant turn (see the module docstring)."""
    if not isinstance(text, str):
        raise TypeError(f"an assistant turn is a str, got {type(text).__name__}; fix: decode it first")
    tool_at, answer_at = text.find(TOOL_OPEN), text.find(ANSWER_OPEN)
    if tool_at < 0 and answer_at < 0:
        return Action("none", "", False, f"no {TOOL_OPEN} call and no {ANSWER_OPEN}")
    if answer_at < 0 or 0 <= tool_at < answer_at:
        kind, start, close = "tool_call", tool_at + len(TOOL_OPEN), TOOL_CLOSE
    else:
        kind, start, close = "answer", answer_at + len(ANSWER_OPEN), ANSWER_CLOSE
    end = text.find(close, start)
    problems = []
    if end < 0:
        body, rest = text[start:], ""
        problems.append(f"unterminated: no {close}")
    else:
        body, rest = text[start:end], text[end + len(close):]
    if end < 0 and (TOOL_OPEN in body or ANSWER_OPEN in body):  # closed: a tag in a string is code
        problems.append("a second tag opens inside the first; only the first is used")
        body = body[:min(i for i in (body.find(TOOL_OPEN), body.find(ANSWER_OPEN)) if i >= 0)]
    if rest.strip():
        problems.append(f"text after {close} is ignored")
    if kind == "tool_call":
        body = _strip_newlines(body)
        fenced = _FENCE.match(body)
        if fenced:
            body = fenced.group(1)
            problems.append("Markdown fence inside <python> (stripped)")
    else:
        body = body.strip()
    if not body.strip():
        problems.append(f"empty {kind.replace('_', ' ')}")
    return Action(kind, body, not problems, "; ".join(problems))


def parse_tool_call(text: str) -> str | None:
    """The code of the turn's tool call, or None when the turn's first tag is not one."""
    action = parse_action(text)
    return action.content if action.kind == "tool_call" and action.content.strip() else None


def parse_answer(text: str) -> str | None:
    """The turn's final answer (stripped), or None when the turn's first tag is not one."""
    action = parse_action(text)
    return action.content if action.kind == "answer" else None


def format_tool_call(code: str) -> str:
    return f"{TOOL_OPEN}\n{code.strip(chr(10))}\n{TOOL_CLOSE}"


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


def format_observation(text: str) -> str:
    """Wrap environment feedback that is not a code run (a test summary, a note) the same way."""
    return f"{OUTPUT_OPEN}\n{text.replace(OUTPUT_CLOSE, '</ output>')}\n{OUTPUT_CLOSE}"
