"""`postrain samples RUN_DIR`: what the model said, sample by sample, from the run's samples.jsonl.

    postrain samples runs/default                    # the last step's samples
    postrain samples runs/default --worst            # the whole run, lowest reward first
    postrain samples runs/default --step 3 --worst   # step 3 only, lowest reward first
    postrain samples runs/mix --task chain_sum       # one task of a mixture (its last step)
    postrain samples runs/cad --cause script_error   # the samples whose environment named this cause
    postrain samples runs/default --best --limit 3   # the 3 best of the whole run
    postrain samples runs/default --all --limit 0    # every sample of the run, in order

RUN_DIR/samples.jsonl holds one line per RL sample whose rollout came back (written when its
step is trained, postrain.actors.orchestrator.sample_log): the prompt, each turn's completion
and the tool output the model read next (each text bounded, the cut marked), the reward and
its components, the group-relative advantage, the outcome. Each sample prints as a header
line, then its texts indented under `prompt:`, `completion N:` and `tool output N:`.
`postrain trace RUN_DIR SAMPLE_ID` prints one sample's hops and then the same texts.
"""
from __future__ import annotations

import json
import textwrap
import unicodedata
from pathlib import Path

from postrain.actors.orchestrator.sample_log import SAMPLES_FILE, read_samples
from postrain.core.errors import PostrainError

HELP = "print what the model said: prompts, completions, tool outputs, rewards (samples.jsonl)"
DEFAULT_LIMIT = 8


def add_arguments(parser) -> None:
    parser.add_argument("run_folder", help="the run folder (run_dir/name) holding samples.jsonl")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, default=None,
                       help="only this RL step (1-based); default: every step with --worst/--best, else the last")
    which.add_argument("--all", action="store_true", help="samples of every step")
    order = parser.add_mutually_exclusive_group()
    order.add_argument("--worst", action="store_true", help="lowest reward first, of the whole run unless --step")
    order.add_argument("--best", action="store_true", help="highest reward first, of the whole run unless --step")
    parser.add_argument("--task", default=None, help="only the samples of this task of a mixture (its name)")
    parser.add_argument("--cause", default=None,
                        help="only the samples whose environment named this cause (info['cause'], e.g. the "
                             "CAD task's script_error); with no --step, of every step")
    parser.add_argument("--limit", type=int, default=DEFAULT_LIMIT,
                        help=f"samples to print (default {DEFAULT_LIMIT}; 0: all)")
    parser.add_argument("--json", action="store_true", help="print the chosen lines as JSON, one per line")


class SamplesError(PostrainError, ValueError):
    """No samples.jsonl, or no samples for the step asked."""


def select_samples(rows: list[dict], step: int | None = None, all_steps: bool = False, worst: bool = False,
                   best: bool = False, limit: int = DEFAULT_LIMIT, task: str | None = None,
                   cause: str | None = None) -> list[dict]:
    """The rows of `task` (a mixture's task name; none: every task) and of `cause` (none: any), of
    `step`; without it, of every step when sorting by reward, with `all_steps` or with a cause,
    else of the last step in the file. Sorted by reward (`worst`: ascending, `best`: descending;
    ties keep file order); the first `limit` (0: all). SamplesError when there are no rows, none
    of the task, the cause or the step."""
    if not rows:
        raise SamplesError("no samples yet: a sample is written when its RL step is trained")
    if task is not None:
        tasks = sorted({str(row.get("task")) for row in rows})
        rows = [row for row in rows if row.get("task") == task]
        if not rows:
            raise SamplesError(f"no samples of task {task!r}; tasks with samples: {', '.join(tasks)}")
    if cause is not None:
        causes = sorted({str(row["cause"]) for row in rows if row.get("cause")})
        rows = [row for row in rows if row.get("cause") == cause]
        if not rows:
            raise SamplesError(f"no samples with cause {cause!r}; causes named: {', '.join(causes) or 'none'}")
    if step is not None or not (all_steps or worst or best or cause is not None):
        steps = sorted({row["step"] for row in rows if isinstance(row.get("step"), int)})
        if step is None:
            step = steps[-1] if steps else None
        chosen = [row for row in rows if row.get("step") == step]
        if not chosen:
            known = ", ".join(str(s) for s in steps) or "none"
            raise SamplesError(f"no samples for step {step}; steps with samples: {known}")
        rows = chosen
    if worst or best:
        rows = sorted(rows, key=lambda row: _reward(row), reverse=best)
    return rows if limit <= 0 else rows[:limit]


def _reward(row: dict) -> float:
    reward = row.get("reward")
    return float(reward) if isinstance(reward, (int, float)) else float("nan")


def sample_header(row: dict) -> str:
    """One line: id, step, group, outcome, reward (components), cause, advantage, staleness, tokens."""
    parts = ", ".join(f"{name} {value:.3f}" for name, value in (row.get("components") or {}).items()
                      if isinstance(value, (int, float)))
    reward = f"reward {_reward(row):.3f}" + (f" ({parts})" if parts else "")
    advantage = row.get("advantage")
    words = [f"sample {row.get('sample_id', '?')}", f"step {row.get('step', '?')}",
             f"group {row.get('group', '?')}", str(row.get("outcome", "?")), reward]
    if row.get("cause"):
        words.append(f"cause {row['cause']}")
    if isinstance(advantage, (int, float)):
        words.append(f"advantage {advantage:+.3f}")
    if isinstance(row.get("staleness"), (int, float)):
        words.append(f"staleness {row['staleness']:g}")
    if isinstance(row.get("policy_tokens"), int):
        words.append(f"{row['policy_tokens']} policy tokens")
    return "  ".join(words)


def printable(text: str) -> str:
    """`text` with control characters other than newline and tab escaped (`\\x1b`): a model's
    stray bytes must not drive the terminal."""
    return "".join(c if c in "\n\t" or unicodedata.category(c) != "Cc" else f"\\x{ord(c):02x}" for c in text)


def _block(label: str, text: str) -> list[str]:
    body = textwrap.indent(printable(text).rstrip("\n"), "    ") if text.strip() else "    (empty)"
    return [f"  {label}:", body]


def format_texts(row: dict) -> list[str]:
    """The prompt, then each turn's completion and tool output, each indented under its label."""
    lines = _block("prompt", row.get("prompt", ""))
    turns = row.get("turns") or []
    for n, turn in enumerate(turns, 1):
        lines += _block(f"completion {n}" if len(turns) > 1 else "completion", turn.get("completion", ""))
        if turn.get("tool_output"):
            lines += _block(f"tool output {n}" if len(turns) > 1 else "tool output", turn["tool_output"])
    return lines


def format_sample(row: dict) -> str:
    return "\n".join([sample_header(row), *format_texts(row)])


def load_samples(run_folder: str | Path) -> list[dict]:
    """Every line of RUN_FOLDER/samples.jsonl; SamplesError when there is no such file."""
    path = Path(run_folder) / SAMPLES_FILE
    if not path.exists():
        raise SamplesError(f"no {SAMPLES_FILE} in {run_folder}; pass the run folder (run_dir/name) of a run "
                           "that trained at least one RL step")
    return read_samples(run_folder)


def main(args) -> int:
    try:
        rows = load_samples(args.run_folder)
        chosen = select_samples(rows, step=args.step, all_steps=args.all, worst=args.worst, best=args.best,
                                limit=args.limit, task=args.task, cause=args.cause)
    except SamplesError as exc:
        raise SystemExit(f"postrain samples: {exc}") from None
    if args.json:
        for row in chosen:
            print(json.dumps(row))
        return 0
    print("\n\n".join(format_sample(row) for row in chosen))
    return 0
