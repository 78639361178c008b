"""Supervised demonstrations in chat form, for the warm start before RL.

A demonstration is `{"messages": [{"role": ..., "content": ...}, ...]}` whose assistant turns use
the exact tool-call format of `postrain.actors.env.tools`, and whose first messages are exactly what
the task's environment `reset` returns, so a model trained on them meets the same text in RL.
Loss goes on the assistant turns only (the trainer's business), except on the character ranges
[start, end) of an assistant message's content listed in its optional `no_loss_spans`.

- `arithmetic_demonstrations(num, seed)`: ask, call Python with the expression
  (`print(3817 * 29 - 412)`), read the `<output>` the sandbox would give, answer.
- `code_demonstrations(seed)`: one per training problem: the reference solution as a `<python>`
  attempt (it passes the visible tests, which ends the episode); `code_demonstration_cycle(num,
  seed)` repeats them to `num` (the `code` task's demonstrations).

`options` (a dict, None or the task's options model) are checked by the task's model, whose
fields hold the defaults (`use_system_prompt`, `include_instructions`, `answer_format`).

Both are deterministic and use training tasks only (never the held-out split). Tool outputs are
made with `format_tool_output` on the result a successful run has (a test checks that the real
sandbox prints the same). `write_jsonl` / `read_jsonl` handle any JSONL of chat demonstrations,
one object per line; `validate_demonstration` says which line and field is wrong.
"""
from __future__ import annotations

import itertools
import json
import os
import random
from typing import Iterable, Iterator

from postrain.sandbox import ExecResult, Status
from postrain.core.errors import PostrainError

from ..env.api import ROLES, EnvironmentContractError, check_options, inline_image_files, validate_content_parts
from ..env.tools import format_answer, format_tool_call, format_tool_output
from .arithmetic import ArithmeticOptions, arithmetic_options, evaluate
from .arithmetic import prompt_messages as arithmetic_prompt
from .arithmetic import train_tasks as arithmetic_train_tasks
from .code import CodeOptions, train_problems
from .code import prompt_messages as code_prompt
from .code import train_tasks as code_train_tasks


class DemonstrationError(PostrainError, ValueError):
    """A demonstration that is not {"messages": [{"role", "content"}, ...]} with an assistant turn."""


def arithmetic_demonstration(task: dict, *, use_system_prompt: bool = True,
                             include_instructions: bool = True, from_memory: bool = False) -> dict:
    """The demonstration for one arithmetic task (a `train_tasks` item); `from_memory`: the
    answer straight away, without the tool, its digits kept out of the loss (`no_loss_spans`):
    the student learns to answer without the tool, not digits it has no way to compute."""
    value = evaluate(task["expression"])
    output = format_tool_output(ExecResult(Status.OK, exit_code=0, stdout=f"{value}\n".encode()))
    messages = arithmetic_prompt(task["question"], use_system_prompt=use_system_prompt,
                                 include_instructions=include_instructions)
    if from_memory:
        answer = format_answer(str(value))
        digits = answer.index(str(value))
        return {"messages": messages + [{"role": "assistant", "content": answer,
                                         "no_loss_spans": [[digits, digits + len(str(value))]]}]}
    messages += [{"role": "assistant", "content": format_tool_call(f"print({task['expression']})")},
                 {"role": "user", "content": output},
                 {"role": "assistant", "content": format_answer(str(value))}]
    return {"messages": messages}


def arithmetic_demonstrations(num: int, seed: int = 0,
                              options: dict | ArithmeticOptions | None = None) -> list[dict]:
    """`num` demonstrations from training problems (seed `seed`; the same knobs as the task).
    With `answer_format = "plain"`: the bare question, then the value as the whole reply. A
    problem with a `*` is answered from memory with probability `mental_products` (a draw
    seeded by `seed`)."""
    options = arithmetic_options(options)
    tasks = itertools.islice(arithmetic_train_tasks(seed, options), num)
    if options.answer_format == "plain":
        return [{"messages": [{"role": "user", "content": t["question"]},
                              {"role": "assistant", "content": str(t["answer"])}]} for t in tasks]
    memory = random.Random(f"arithmetic-mental-{seed}")

    def from_memory(task: dict) -> bool:
        return "*" in task["expression"] and memory.random() < options.mental_products

    return [arithmetic_demonstration(t, use_system_prompt=options.use_system_prompt,
                                     include_instructions=options.include_instructions,
                                     from_memory=from_memory(t)) for t in tasks]


def code_demonstrations(seed: int = 0, options: dict | CodeOptions | None = None) -> list[dict]:
    """One demonstration per training problem, in a seeded order."""
    options = check_options(CodeOptions, options, "task 'code'")
    by_name = {p["name"]: p for p in train_problems()}
    out = []
    for task in itertools.islice(code_train_tasks(seed, options), len(by_name)):
        messages = code_prompt(task, use_system_prompt=options.use_system_prompt)
        messages.append({"role": "assistant",
                         "content": format_tool_call(by_name[task["name"]]["reference"])})
        out.append({"messages": messages})
    return out


def code_demonstration_cycle(num: int, seed: int = 0, options: dict | CodeOptions | None = None) -> list[dict]:
    """`num` code demonstrations: `code_demonstrations(seed, options)` repeated in order."""
    demos = code_demonstrations(seed, options)
    return [demos[i % len(demos)] for i in range(num)]


def validate_demonstration(demo, *, where: str = "demonstration") -> dict:
    if not isinstance(demo, dict) or not isinstance(demo.get("messages"), list) or not demo["messages"]:
        raise DemonstrationError(f"{where}: must be an object with a non-empty 'messages' list, got "
                                 f"{str(demo)[:80]!r}; fix: {{\"messages\": [{{\"role\": \"user\", "
                                 f"\"content\": \"...\"}}, ...]}}")
    for i, m in enumerate(demo["messages"]):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and m.get("role") == "user":     # content parts: text and images
            try:
                validate_content_parts(content, where=f"{where}: messages[{i}]")
            except EnvironmentContractError as exc:
                raise DemonstrationError(str(exc)) from None
        elif not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(content, str):
            raise DemonstrationError(f"{where}: messages[{i}] must have role in {ROLES} and a str "
                                     f"content (a user message may hold content parts: text and images), "
                                     f"got {str(m)[:80]!r}")
        spans = m.get("no_loss_spans", [])
        if spans and (m["role"] != "assistant" or not _are_ranges_in(spans, m["content"])):
            raise DemonstrationError(f"{where}: messages[{i}].no_loss_spans must be a list of "
                                     f"[start, end] character ranges inside an assistant turn's "
                                     f"content ({len(m['content'])} characters), got {spans!r}")
    if not any(m["role"] == "assistant" for m in demo["messages"]):
        raise DemonstrationError(f"{where}: has no assistant turn, so there is nothing to learn; "
                                 f"fix: add {{\"role\": \"assistant\", \"content\": ...}}")
    try:                                   # an image by file:// path: its bytes, read once here
        return {**demo, "messages": inline_image_files(demo["messages"], where=where)}
    except EnvironmentContractError as exc:
        raise DemonstrationError(str(exc)) from None


def _are_ranges_in(spans, content: str) -> bool:
    """`spans` is a list of [start, end] int pairs with 0 <= start < end <= len(content)."""
    return isinstance(spans, list) and all(
        isinstance(s, list) and len(s) == 2 and all(type(x) is int for x in s)
        and 0 <= s[0] < s[1] <= len(content) for s in spans)


def write_jsonl(path: str | os.PathLike, demos: Iterable[dict]) -> int:
    """Write demonstrations, one JSON object per line (validated); returns how many."""
    num = 0
    with open(path, "w", encoding="utf-8") as f:
        for demo in demos:
            validate_demonstration(demo, where=f"demonstration {num}")
            f.write(json.dumps(demo, ensure_ascii=False) + "\n")
            num += 1
    return num


def iter_jsonl(path: str | os.PathLike) -> Iterator[dict]:
    """Demonstrations from a JSONL file (blank lines skipped), each validated; errors name the line."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                demo = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DemonstrationError(f"{path}:{lineno}: not JSON ({exc}); "
                                         f"fix: one object per line") from None
            yield validate_demonstration(demo, where=f"{path}:{lineno}")


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    return list(iter_jsonl(path))
