"""The `cad` environment: write a build123d script that builds a part from its spec, graded on the export.

An episode (`CadEnv`): the environment opens a sandbox session (a jail for the episode, with
`memory_mb` for OpenCascade: its import alone maps ~1.2 GB of address space) and shows the
part's spec. Each `<python>` block the model writes is a script run in the session (`run_python`,
the sandbox's interpreter, where build123d is installed; cwd /work). A script that exits 0 having
written /work/part.stl ends the episode and is graded; one that fails, or writes no export, comes
back as its `<output>` with the attempts left, until `max_attempts`. `<answer>` grades whatever
/work/part.stl holds now; a turn without a block ends the episode ungraded (0).

Grading (`grader.py`): the export's bytes copied out of the session, measured in a fresh jail,
judged on the host against the spec's expectations. Reward components: `correct` = 1.0 iff every
check passes (with `partial_credit`, the share of checks passed once the export is a valid solid)
(weight 1.0); `format` = 1.0 if every turn was well-formed (weight `format_weight`, default 0.0).
`info` carries each check, why it failed and the cause: ok, script_error, no_export,
invalid_export, wrong_shape.
"""
from __future__ import annotations

import contextlib
from typing import Any

import trio
from pydantic import Field, field_validator

from postrain.core import Options
from postrain.core.errors import PostrainError

from ...env.api import Environment, Reward, StepResult, check_options
from ...env.tools import format_observation, format_tool_output, parse_action
from ...sandbox.client import is_file_error
from . import grader
from .part import EXPORT_PATH
from .suite import FAMILIES, LEVELS

CLOSE_TIMEOUT_S = 10.0
CAD_INSTRUCTIONS = (
    "You build 3D parts with the Python CAD library build123d (units: millimetres). Write a complete "
    "script that starts with `from build123d import *`, builds the part and exports it with "
    f'`export_stl(part, "{EXPORT_PATH}")`; send it between <python> and </python>. When the script '
    "exits without error and the file exists, the part is graded and the episode ends. Otherwise you "
    "see the script's output and may send a corrected script. To have the file graded as it is, "
    "write <answer>done</answer>."
)


class CadOptions(Options):
    """The task options of `cad` (a config's `task_options`): which variants, the episode's
    limits, and the grader's tolerances."""

    families: list[str] | None = Field(None, description="only parts of these families (none: plate, "
                                       "bracket, box)")
    levels: list[int] | None = Field(None, description="only these difficulty levels, of 1, 2, 3 (none: all)")
    max_attempts: int = Field(3, ge=1, description="scripts run per episode before the export is graded")
    max_turns: int | None = Field(None, ge=1, description="actions per episode; none: max_attempts + 1")
    script_timeout_s: float = Field(60.0, gt=0, description="wall and CPU limit of one script run, "
                                    "seconds (importing build123d takes 3-4 s)")
    memory_mb: int = Field(2048, ge=1536, description="the session's memory cap, MiB (address space per "
                           "process and the jail's cgroup; OpenCascade needs ~1.2 GB of address space)")
    measure_timeout_s: float = Field(30.0, gt=0, description="wall limit of the grader's measuring run, seconds")
    partial_credit: bool = Field(False, description="false: 1 iff every check passes; true: the share "
                                 "of checks passed (0 unless the export is a valid solid)")
    volume_rel_tol: float = Field(0.01, gt=0, lt=1, description="the volume check's relative tolerance")
    bbox_tol_mm: float = Field(0.1, gt=0, description="the bounding box check's tolerance per bound, mm")
    max_output_chars: int = Field(1200, ge=100, description="characters of a script's output the model reads")
    format_weight: float = Field(0.0, description="weight of the `format` reward component (0: logged only)")
    use_system_prompt: bool = Field(True, description="the instructions as a system message "
                                    "(false: prepended to the user message)")

    @field_validator("families")
    @classmethod
    def _known_families(cls, value: list[str] | None) -> list[str] | None:
        unknown = sorted(set(value or ()) - set(FAMILIES))
        if value is not None and (unknown or not value):
            raise ValueError(f"families must name some of {list(FAMILIES)}, got {value}; fix: drop {unknown}")
        return value

    @field_validator("levels")
    @classmethod
    def _known_levels(cls, value: list[int] | None) -> list[int] | None:
        unknown = sorted(set(value or ()) - set(LEVELS))
        if value is not None and (unknown or not value):
            raise ValueError(f"levels must be some of {list(LEVELS)}, got {value}; fix: drop {unknown}")
        return value


def cad_options(options: dict | CadOptions | None) -> CadOptions:
    """`options` checked (a dict, None or a `CadOptions`); TaskOptionsError names a bad one."""
    return check_options(CadOptions, options, "task 'cad'")


def prompt_text(task: dict) -> str:
    return f"{task['description']}\nExport the part as an STL file to {task['export_path']}."


def prompt_messages(task: dict, *, use_system_prompt: bool = True) -> list[dict]:
    if use_system_prompt:
        return [{"role": "system", "content": CAD_INSTRUCTIONS}, {"role": "user", "content": prompt_text(task)}]
    return [{"role": "user", "content": f"{CAD_INSTRUCTIONS}\n\n{prompt_text(task)}"}]


def _status(result) -> str:
    status = result.get("status") if isinstance(result, dict) else getattr(result, "status", None)
    return str(getattr(status, "value", status))


class CadEnv(Environment):
    """Build a part from its spec with a build123d script (one sandbox session per episode).

    Options: `CadOptions` (families, levels, max_attempts, max_turns, script_timeout_s,
    memory_mb, measure_timeout_s, partial_credit, volume_rel_tol, bbox_tol_mm, max_output_chars,
    format_weight, use_system_prompt; defaults there). Needs a sandbox handle with sessions.
    """

    uses_sandbox = True
    tools = ("python",)
    options_model = CadOptions
    options: CadOptions

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        if self.options.max_turns is None:
            self.max_turns = self.options.max_attempts + 1
        self.session: Any = None   # the sandbox session (duck-typed); reset opens it
        self._exit_stack = contextlib.AsyncExitStack()

    async def reset(self, task: dict) -> list[dict]:
        """Open the session. Cancelled: the session may be open; `close` closes it."""
        self.task = task
        self.num_attempts = 0
        self.last_status = ""
        self.all_well_formed = True
        limits = {"memory_mb": self.options.memory_mb, "call_wall_time_s": self.options.script_timeout_s,
                  "call_cpu_time_s": int(self.options.script_timeout_s)}
        self.session = await self._exit_stack.enter_async_context(self.require_sandbox().session(limits=limits))
        # joblib (imported by build123d) warns on every run that the jail has no /dev/shm; not the script's doing
        await self.session.run("export JOBLIB_MULTIPROCESSING=0")
        return prompt_messages(task, use_system_prompt=self.options.use_system_prompt)

    async def step(self, action: str) -> StepResult:
        """Run a script, then grade its export or show its output. Cancelled while a script runs:
        the attempt counts without feedback; the episode should not go on."""
        parsed = parse_action(action, self.tools)
        self.all_well_formed &= parsed.well_formed
        if parsed.kind == "none" or (parsed.kind == "tool_call" and not parsed.content.strip()):
            nothing = grader.missing_export(self.task, "no_export", "no script was sent")
            return self._done(nothing, {"problem": parsed.problem or "empty script"})
        if parsed.kind == "answer":
            return self._done(await self.grade(), {"answer": parsed.content})
        self.num_attempts += 1
        result = await self.session.run_python(parsed.content, timeout_s=self.options.script_timeout_s)
        self.last_status = _status(result)
        verdict = await self.grade() if self.last_status == "ok" else None
        attempts_left = self.options.max_attempts - self.num_attempts
        if (verdict is not None and verdict.cause != "no_export") or attempts_left <= 0:
            return self._done(verdict or await self.grade(), {"tool_status": self.last_status})
        left = (f"{attempts_left} attempt{'s' if attempts_left > 1 else ''} left: send the whole corrected "
                f"script between <python> and </python>.")
        if self.last_status == "ok":
            feedback = format_observation(f"The script ran without error but wrote no {EXPORT_PATH}.\n{left}")
        else:
            feedback = f"{format_tool_output(result, max_chars=self.options.max_output_chars)}\n{left}"
        return StepResult(feedback, False, info={"tool_status": self.last_status})

    async def truncated(self) -> Reward:
        """Out of turns: the export as it is, graded. Cancelled: no reward."""
        return self._reward(await self.grade())

    async def grade(self) -> grader.CadVerdict:
        """The verdict on /work/part.stl: its bytes copied out by the session's agent while no call
        runs, measured in a fresh jail, judged here (grader.py). An export that is not there is the
        policy's failure (no_export, or script_error after a failed run); a session or a sandbox
        that fails raises, so the episode fails as the infrastructure's and is never scored.
        Cancelled: no verdict; the measuring run ends within its limits."""
        try:
            export = await self.session.read_file(EXPORT_PATH)
        except PostrainError as exc:
            if not is_file_error(exc):   # the session or the sandbox failed: not the policy's doing
                raise
            # missing, a directory, a FIFO, too large: the session says which
            cause = "script_error" if self.last_status not in ("", "ok") else "no_export"
            return grader.missing_export(self.task, cause, f"no export at {EXPORT_PATH}: {str(exc)[:200]}")
        code, files = grader.measure_request(export, grader.probe_points(self.task))
        result = await self.require_sandbox().exec(code, files=files, timeout_s=self.options.measure_timeout_s)
        return grader.judge(self.task, grader.read_measurement(result), volume_rel_tol=self.options.volume_rel_tol,
                            bbox_tol_mm=self.options.bbox_tol_mm)

    def _reward(self, verdict: grader.CadVerdict) -> Reward:
        return Reward({"correct": verdict.score(self.options.partial_credit), "format": float(self.all_well_formed)},
                      {"format": self.options.format_weight})

    def _done(self, verdict: grader.CadVerdict, info: dict) -> StepResult:
        return StepResult(None, True, self._reward(verdict),
                          {**info, "cause": verdict.cause, "checks": dict(verdict.checks),
                           "reasons": dict(verdict.reasons), "attempts": self.num_attempts})

    async def close(self) -> None:
        """Close the session (if one opened). Shielded, within CLOSE_TIMEOUT_S, so it runs even in
        a cancelled scope; past that the sandbox's own reaper and limits end the session."""
        with trio.move_on_after(CLOSE_TIMEOUT_S) as scope:
            scope.shield = True
            await self._exit_stack.aclose()
