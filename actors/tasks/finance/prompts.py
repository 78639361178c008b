"""What the policy reads first in a `finance_docs` episode, in each form (demonstrations use the
same text, so a warm-started model meets it again in RL).

- prompt form: one user message: the whole report (`render.report_text`), the question, and the
  answer rules (`ANSWER_RULES`).
- files form: one user message: where the report's files are (/work, listed by name), how to run
  a shell command, the question and the answer rules. The files are laid into the episode's
  sandbox session by the environment.
"""
from __future__ import annotations

from .render import report_text

WORK_DIR = "/work"
ANSWER_RULES = (
    "Work it out briefly, then write the final answer once, between <answer> and </answer>: one number "
    "with its unit, for example <answer>12.5%</answer>, <answer>$1,234.5 million</answer> or "
    "<answer>1.85</answer>. A number without a unit word (%, thousand, million, billion, days) is read in the "
    "unit the question asks for, with or without a $.")


def prompt_message(task: dict) -> str:
    """The prompt form's first (and only) user message."""
    return (f"Below is a company's annual report.\n\n{report_text(task['files'])}\n"
            f"Question: {task['question']}\n\n{ANSWER_RULES}")


def files_message(task: dict) -> str:
    """The files form's first user message."""
    names = ", ".join(task["files"])
    return (f"A company's annual report is in the folder {WORK_DIR}, one file per part: {names}. Read what you "
            f"need with shell commands: write one command line between <bash> and </bash> (for example "
            f"<bash>cat {WORK_DIR}/notes.md</bash>); its output comes back between <output> and </output>.\n\n"
            f"Question: {task['question']}\n\n{ANSWER_RULES}")
