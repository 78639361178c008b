"""Demonstrations of `finance_docs` for the warm start: the reference solver's working and answer.

    demonstrations(64, seed=0, options={"size": "short"})   # from training tasks only
    demonstration(task, options)                            # one task's

The first message is exactly what the environment's `reset` shows. Prompt form: one assistant
turn, the solver's working (each figure as the report shows it, converted to $ millions, then
the formula) and `<answer>...</answer>` in the form the prompt asks for. Files form: first one
`<bash>` turn per file the solution reads, a `grep -F` of the table's header and the rows it
needs (or of the note it needs), each answered by the `<output>` the session prints for it
(computed here; a test replays them in a real session), then the same working and answer.
"""
from __future__ import annotations

import itertools
import shlex

from postrain.sandbox import ExecResult, Status

from ...env.tools import format_answer, format_shell_output, format_tool_call
from .company import NOTES
from .options import FinanceOptions, finance_options
from .prompts import WORK_DIR, files_message, prompt_message
from .render import FILE_NAMES, NOTES_FILE, report_text
from .solver import solve_text
from .tasks import train_tasks
from .units import ANSWER_UNITS


def _greps(reads: tuple[tuple[str, str], ...]) -> list[tuple[str, list[str]]]:
    """(file, fixed-string patterns) for each file the reads touch, in the order first read."""
    by_file: dict[str, list[str]] = {}
    for source, name in reads:
        if source == NOTES:
            by_file.setdefault(NOTES_FILE, []).append(f": {name}.")
        else:
            by_file.setdefault(FILE_NAMES[source], ["| Line item"]).append(f"| {name} |")
    return list(by_file.items())


def grep_fixed(text: str, patterns: list[str]) -> str:
    """What `grep -F -e P1 -e P2 ... FILE` prints for a file holding `text`."""
    return "".join(f"{line}\n" for line in text.splitlines() if any(p in line for p in patterns))


def demonstration(task: dict, options: dict | FinanceOptions | None = None) -> dict:
    """The reference solution of one task as a conversation (module docstring)."""
    options = finance_options(options)
    solution = solve_text(report_text(task["files"]), task["query"])
    unit = ANSWER_UNITS[task["answer"]["unit"]]
    final = "\n".join(solution.steps) + "\n" + format_answer(unit.format(float(solution.value)))
    if options.form == "prompt":
        return {"messages": [{"role": "user", "content": prompt_message(task)},
                             {"role": "assistant", "content": final}]}
    messages = [{"role": "user", "content": files_message(task)}]
    for name, patterns in _greps(solution.reads):
        command = "grep -F " + " ".join(f"-e {shlex.quote(p)}" for p in patterns) + f" {WORK_DIR}/{name}"
        printed = grep_fixed(task["files"][name], patterns)
        result = ExecResult(Status.OK, exit_code=0, stdout=printed.encode())
        messages += [{"role": "assistant", "content": format_tool_call(command, "bash")},
                     {"role": "user", "content": format_shell_output(result, max_chars=options.max_output_chars)}]
    messages.append({"role": "assistant", "content": final})
    return {"messages": messages}


def demonstrations(num: int, seed: int = 0, options: dict | FinanceOptions | None = None) -> list[dict]:
    """`num` demonstrations of training tasks (never the held-out split), in the stream's order."""
    options = finance_options(options)
    return [demonstration(task, options) for task in itertools.islice(train_tasks(seed, options), num)]
