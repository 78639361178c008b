"""Failures of the user's own code (an environment, a reward function, an agent), as the user sees them.

    reason = drop_reason(exc)            # "environment raised AttributeError: ... at my_env.py:12"
    error = user_error(exc)              # where, and the traceback of the user's frames only
    errors = EnvironmentErrors(0.5, show=print)
    errors.record(exc)                   # the first failure is shown at once, traceback included
    errors.check(reasons, 64, "samples of step 3")   # raises EnvironmentErrorStop when one dominates

Design in a paragraph: a failing environment fails its sample alone, and a run goes on without
it; that is right for a rare failure and wrong for a bug in the user's code, which fails nearly
every sample and leaves a run that "trains" on nothing. So the first failure is shown at once,
with the traceback trimmed to the user's frames (the frames of postrain and of the event loop it
runs their code on are left out: they say nothing about the bug), and a step, an evaluation or a
`postrain eval` in which more than a fraction of the samples failed with one and the same reason
(the reason line, which the ledger counts too) stops with `EnvironmentErrorStop`: one line naming
the error, the user's file:line and the count.

Across the wire (the environment actor to the orchestrator) a failure is an `EnvironmentFailure`
whose message is the reason, then its detail (the lines of an EnvironmentFailure's reason after
its first: a judge's reply) and the user's traceback on the lines after it: `reported_failure`
makes it on one end and `failure_of` reads it on the other.
"""
from __future__ import annotations

import dataclasses
import sysconfig
import traceback
from collections import Counter
from pathlib import Path
from typing import Callable

from postrain.core.errors import PostrainError, RemoteError

from ..records.reward import EnvironmentContractError
from .api import EnvironmentFailure

# Top-level modules whose frames are never the user's: postrain's, and the event loops and threads
# through which it calls the user's code.
PLUMBING_MODULES = frozenset({"postrain", "trio", "anyio", "outcome", "asyncio", "concurrent", "threading"})
# Where installed libraries live: a frame there is not the user's line (`UserError.where`).
LIBRARY_DIRS = tuple(sorted({sysconfig.get_path(key) for key in ("stdlib", "platstdlib", "purelib",
                                                                   "platlib")}))
DEFAULT_MAX_ERROR_FRACTION = 0.5   # one error failing more than half of a step's samples stops it
MAX_FRAMES = 20    # user frames shown at most (the innermost ones; a deep recursion is cut)
MAX_REASON_CHARS = 300


class EnvironmentErrorStop(PostrainError, RuntimeError):
    """Most samples of a step (or of an evaluation) failed with one environment error: a bug to fix
    in the user's environment, reward function or agent, not bad luck to train through."""


@dataclasses.dataclass(frozen=True)
class UserError:
    """The user's exception behind a failure: `where`, their innermost line ("my_env.py:12"), and
    `traceback`, their frames only, then the exception's line."""

    where: str
    traceback: str


def user_error(exc: BaseException | None) -> UserError | None:
    """The user's part of `exc`: the first exception of its cause chain that postrain did not raise
    (a failure raised `from` the user's error), when any of its frames is the user's; else None (a
    timeout, a contract error, postrain's own failure)."""
    while isinstance(exc, PostrainError):
        exc = exc.__cause__
    if exc is None:
        return None
    frames = [(frame, line) for frame, line in traceback.walk_tb(exc.__traceback__)
              if frame.f_globals.get("__name__", "").partition(".")[0] not in PLUMBING_MODULES]
    if not frames:
        return None
    own = [(frame, line) for frame, line in frames if not frame.f_code.co_filename.startswith(LIBRARY_DIRS)]
    frame, line = (own or frames)[-1]
    return UserError(f"{Path(frame.f_code.co_filename).name}:{line}", format_user_traceback(exc, frames))


def format_user_traceback(exc: BaseException, frames: list) -> str:
    """`exc`'s traceback over `frames` ((frame, line) pairs, outermost first), the innermost
    MAX_FRAMES of them, then its exception line."""
    shown = frames[-MAX_FRAMES:]
    cut = f"  [... {len(frames) - len(shown)} earlier frames]\n" if len(frames) > len(shown) else ""
    text = ("Traceback (most recent call last; postrain's frames left out):\n" + cut
            + "".join(traceback.StackSummary.extract(iter(shown)).format())
            + "".join(traceback.format_exception_only(type(exc), exc)))
    return text.rstrip("\n")


def drop_reason(exc: BaseException) -> str:
    """The one line a caller records when it drops a sample because of `exc`, ending in the user's
    file:line when their code raised. An EnvironmentFailure's reason line is the first line of its
    `reason` (a judge's failure names its cause there, the reply it refused on the next line:
    `failure_detail`), so the samples failed by one cause count under one line."""
    if isinstance(exc, EnvironmentFailure):
        reason = exc.reason.partition("\n")[0]
    elif isinstance(exc, EnvironmentContractError):
        reason = f"environment contract: {exc}"
    else:
        reason = f"environment raised {type(exc).__name__}: {exc}"
    reason = " ".join(reason[:MAX_REASON_CHARS].split())   # one line
    error = user_error(exc)
    return f"{reason} at {error.where}" if error is not None else reason


def failure_detail(exc: BaseException) -> str:
    """What follows the reason line: the lines of an EnvironmentFailure's `reason` after its first
    (e.g. the judge's reply), then the user's traceback; "" when there is neither."""
    detail = exc.reason.partition("\n")[2].strip("\n") if isinstance(exc, EnvironmentFailure) else ""
    error = user_error(exc)
    return "\n".join(part for part in (detail, error.traceback if error is not None else "") if part)


def reported_failure(exc: EnvironmentFailure | EnvironmentContractError) -> EnvironmentFailure:
    """The failure as it crosses the wire: an EnvironmentFailure whose message is `drop_reason(exc)`,
    then its detail and the user's traceback on the lines after it (`failure_of` reads it back)."""
    reason, detail = drop_reason(exc), failure_detail(exc)
    return EnvironmentFailure(f"{reason}\n{detail}" if detail else reason)


def failure_of(exc: BaseException) -> tuple[str, str] | None:
    """(reason, what follows it: the failure's detail and the user's traceback, or "") when the
    environment failed the sample: here (an EnvironmentFailure or a contract error) or in the
    environment actor we asked (its `reported_failure`); None for any other failure (an actor
    that died, a generator's error)."""
    if isinstance(exc, RemoteError):
        if exc.error_type != EnvironmentFailure.__name__:
            return None
        reason, _, user_traceback = exc.remote_message.partition("\n")
        return reason, user_traceback
    if isinstance(exc, (EnvironmentFailure, EnvironmentContractError)):
        return drop_reason(exc), failure_detail(exc)
    return None


class EnvironmentErrors:
    """The environment's failures of one run or one `postrain eval` (module docstring): `record`
    shows the first at once through `show` (one call per line); `check` stops a step whose
    samples fail mostly by one reason."""

    def __init__(self, max_fraction: float, show: Callable[[str], None]):
        self.max_fraction = max_fraction   # stop when one reason fails more than this fraction of a step
        self.show = show
        self.num_failures = 0              # failures recorded so far; the first was shown

    def record(self, exc: BaseException) -> str | None:
        """The reason when the environment failed the sample (`failure_of`), shown at once when it
        is the first; None when `exc` is not the environment's failure."""
        failure = failure_of(exc)
        if failure is None:
            return None
        reason, user_traceback = failure
        if self.num_failures == 0:
            self.show(f"the first environment failure (shown once; a step or an evaluation that fails mostly "
                      f"by one error stops): {reason}")
            for line in user_traceback.splitlines():
                self.show(line)
        self.num_failures += 1
        return reason

    def check(self, reasons: list[str], num_samples: int, what: str) -> None:
        """Raise EnvironmentErrorStop when more than `max_fraction` of `num_samples` failed with one
        of `reasons` (those `record` gave for them); `what` names them ("samples of step 3")."""
        if not reasons:
            return
        reason, count = Counter(reasons).most_common(1)[0]
        if count > self.max_fraction * num_samples:
            raise EnvironmentErrorStop(f"{reason} in {count} of {num_samples} {what}; fix your environment "
                                       "(docs/environments.md)")
